"""A luksFormat killed while it writes the header itself: the primary binary header (with the
LUKS magic and the UUID the formula gave it) is on the disk, its JSON area and the secondary
copy are not, so no copy is readable. Found in the VM tier under load (tests/vm/test_enforce.py,
an apply SIGKILLed right after the LUKS magic appeared): every later apply refused the device
("LUKS header unreadable ... key not tried") although the formula's own format mark, made before
luksFormat ran, named that header's UUID. Such a header is the formula's unfinished format, as
one without a keyslot is; without the mark it stays damage."""

import pytest
from hana_storage_core import luks, safety

from tests.conftest import REPO
from tests.unit.conftest import cryptsetup

UUID = "0d2c4c6e-8f51-4f43-a1b6-7a0e3a4f9b21"


@pytest.fixture
def torn(tmp_path, keyfile):
    """A LUKS2 image whose header was cut short as it was written: the primary binary header
    kept, the rest of both copies zero (as a kill before their writes leaves them)."""
    image = tmp_path / "vdm.img"
    image.write_bytes(b"")
    image.touch()
    with open(image, "r+b") as handle:
        handle.truncate(24 << 20)
    cryptsetup("luksFormat", "-q", "--type", "luks2", "--uuid", UUID, "--pbkdf", "pbkdf2",
               "--pbkdf-force-iterations", "1000", "--key-file", str(keyfile), str(image))  # fmt: skip
    data = bytearray(image.read_bytes())
    hdr_size = int.from_bytes(data[8:16], "big")
    data[luks.BINARY_HEADER_SIZE : 2 * hdr_size] = bytes(2 * hdr_size - luks.BINARY_HEADER_SIZE)
    image.write_bytes(bytes(data))
    return image


def reader(path):
    data = path.read_bytes()
    return lambda offset, size: data[offset : offset + size]


def test_no_copy_of_a_torn_header_is_readable_but_it_names_its_uuid(torn):
    with pytest.raises(luks.LuksError, match="no readable LUKS2 header copy"):
        luks.parse_header(reader(torn))
    assert luks.claimed_uuid(torn.read_bytes()[: luks.BINARY_HEADER_SIZE]) == UUID


@pytest.mark.parametrize(
    "first", [b"", bytes(4096), b"SKUL\xba\xbe" + bytes(4090), b"LUKS\xba\xbe\x00\x01" + bytes(4088)]
)
def test_anything_but_a_luks2_primary_header_names_no_uuid(first):
    assert luks.claimed_uuid(first) is None


def test_the_host_reads_the_uuid_a_torn_header_claims(torn, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("host_module", REPO / "_modules" / "hana_storage_host.py")
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    monkeypatch.setattr(host, "_reader", lambda path, shown=None: _open_reader(torn))
    assert host._claimed_uuid_of("vdm") == UUID


def _open_reader(path):
    import contextlib

    @contextlib.contextmanager
    def opened():
        yield reader(path)

    return opened()


def probe(format_began):
    luks_fact = {"error": "no readable LUKS2 header copy", "uuid": UUID}
    if format_began is not None:
        luks_fact["format_began"] = format_began
    return {
        "device": "/dev/vdm",
        "exists": True,
        "block": True,
        "signatures": [{"type": "crypto_LUKS", "usage": "crypto"}],
        "luks": luks_fact,
        "key_opens": None,
        "key_error": "LUKS header unreadable",
        "holders": [],
        "mountpoints": [],
    }


VOLUME = {"encryption": "below_lvm", "lv_dm_name": "vg_hana_extra-lv_hana_extra", "vg": "vg_hana_extra",
          "crypt": [{"name": "hana_extra_0"}], "may_format": []}  # fmt: skip


def test_a_torn_header_under_the_formulas_mark_is_its_unfinished_format():
    assert safety.unfinished_luks(probe(True))
    assert safety.disk_verdict(VOLUME, probe(True))["verdict"] == "use"
    assert safety.layer_verdict("luks", probe(True), may_wipe=False)["verdict"] == "create"


@pytest.mark.parametrize("format_began", [False, None], ids=["no-mark", "no-uuid"])
def test_a_torn_header_without_the_mark_is_damage_and_refused(format_began):
    assert not safety.unfinished_luks(probe(format_began))
    assert safety.disk_verdict(VOLUME, probe(format_began))["verdict"] == "refuse"
    assert safety.layer_verdict("luks", probe(format_began), may_wipe=False)["verdict"] == "refuse"
