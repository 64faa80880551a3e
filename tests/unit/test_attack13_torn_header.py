"""Attacks on 8d9ba3c: a LUKS header no copy of which is readable counts as the formula's killed
luksFormat while a format mark names the UUID its primary binary header claims (unchecked).

The mark is what makes that safe, and a mark can outlive its luksFormat: the job killed after
cryptsetup returned and before the mark was unlinked, or killed while cryptsetup runs (its child
finishes anyway; _states/hana_storage.py ``_probes`` says so). It is forgotten only by a later
real run's probe that parses the header's keyslots; a test=True run, the audit and the beacon
never forget it, and a header the native parser does not read is never seen with a keyslot.

8d9ba3c takes ``"error" in header`` (any failure of ``parse_header``) for "no copy readable" and
a UUID the binary header names for the formula's: under such a stale mark a complete header with
its keyslots, damaged since (restorable from a header backup: the keyslot area is intact) or
merely unreadable for an I/O error, is formatted again, and the same run's header_backed_up then
replaces the backup of the old header (the formatted change makes it "this run's own change",
HANA-KEY-007) - the one way back to the data is gone.

What a killed luksFormat leaves is narrower: cryptsetup zeroes the header areas, then writes the
primary copy (binary header without checksum, JSON area, binary header with checksum) and only
then the secondary copy. No readable copy therefore means: a primary that does not verify and a
secondary area that still reads all zero.
"""

import contextlib
import importlib.util
import os
import struct

import pytest
from hana_storage_core import luks, safety
from salt.exceptions import CommandExecutionError

from tests.conftest import REPO
from tests.support.fake_block import os_with_block_device
from tests.unit.conftest import cryptsetup

UUID = "5b7e0c1a-2d3f-4e5a-8b6c-7d8e9f0a1b2c"
DEVICE = "/dev/vdm"
CRYPTO = [{"type": "crypto_LUKS", "usage": "crypto"}]
VOLUME = {"encryption": "below_lvm", "lv_dm_name": "vg_hana_extra-lv_hana_extra", "vg": "vg_hana_extra",
          "crypt": [{"name": "hana_extra_0"}], "may_format": []}  # fmt: skip


@pytest.fixture
def formatted(tmp_path, keyfile):
    """The bytes of a complete LUKS2 header the formula made (--uuid UUID, one keyslot)."""
    image = tmp_path / "vdm.img"
    with open(image, "wb") as handle:
        handle.truncate(24 << 20)
    cryptsetup("luksFormat", "-q", "--type", "luks2", "--uuid", UUID, "--pbkdf", "pbkdf2",
               "--pbkdf-force-iterations", "1000", "--key-file", str(keyfile), str(image))  # fmt: skip
    data = bytearray(image.read_bytes())
    assert luks.parse_header(luks.reader_for(data))["keyslots"]
    return data


def hdr_size(data):
    return struct.unpack_from(">Q", data, 8)[0]


def host_over(tmp_path, monkeypatch, data, stale_mark=True, unreadable=None):
    """The host module probing DEVICE, a closed block device holding ``data`` (blkid: crypto_LUKS,
    no holder, not mounted). ``stale_mark``: the header mark of UUID is still there (a job killed
    after luksFormat). ``unreadable``: (start, end) of bytes that fail to read (EIO)."""
    spec = importlib.util.spec_from_file_location("host_attack13", REPO / "_modules" / "hana_storage_host.py")
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    host.__opts__ = {"cachedir": str(tmp_path / "cache"), "test": False}
    host.__salt__ = {"cmd.run_all": lambda *a, **k: {"retcode": 1, "stdout": "", "stderr": "no"}}
    sysfs = tmp_path / "sys"
    (sysfs / "vdm" / "holders").mkdir(parents=True)
    monkeypatch.setattr(host, "SYSFS_BLOCK", str(sysfs))
    if stale_mark:
        mark = host.format_marker(UUID)
        os.makedirs(os.path.dirname(mark), exist_ok=True)
        with open(mark, "w") as handle:
            handle.write(DEVICE)

    @contextlib.contextmanager
    def reader(path, shown=None):
        assert path == DEVICE

        def read(offset, size):
            if unreadable and offset < unreadable[1] and offset + size > unreadable[0]:
                raise CommandExecutionError(f"cannot read {path}: Input/output error")
            return bytes(data[offset : offset + size])

        yield read

    monkeypatch.setattr(host, "os", os_with_block_device(DEVICE, 252, 192))
    monkeypatch.setattr(host, "_reader", reader)
    monkeypatch.setattr(host, "_kernel_name", lambda path: "vdm")
    monkeypatch.setattr(host, "_mounts", lambda: [])
    monkeypatch.setattr(host, "_blkid", lambda path: (CRYPTO, None))
    return host


def verdicts(probe):
    return (
        safety.disk_verdict(VOLUME, probe)["verdict"],
        safety.layer_verdict("luks", probe, may_wipe=False)["verdict"],
    )


def stray_write(data):
    """Something else writes over 4 KiB .. 32 KiB (a misdirected dd, a tool that keeps its
    metadata there): both JSON areas and the secondary binary header go, the primary binary
    header (magic, UUID) and the keyslot area after 32 KiB stay. luksHeaderRestore from a
    backup brings every byte of data back."""
    data[luks.BINARY_HEADER_SIZE : 2 * hdr_size(data)] = b"\xa5" * (
        2 * hdr_size(data) - luks.BINARY_HEADER_SIZE
    )


def rot_both_json_areas(data):
    """Both copies lose a sector of their JSON area (bit rot, a bad write): both checksums fail,
    both binary headers (their magic and UUID) are intact."""
    for copy in (0, hdr_size(data)):
        start = copy + luks.BINARY_HEADER_SIZE + 512
        data[start : start + 512] = b"\x00\xff" * 256


@pytest.mark.parametrize("damage", [stray_write, rot_both_json_areas], ids=["stray-write", "both-json-rot"])
def test_a_complete_header_damaged_under_a_stale_mark_is_not_formatted(
    tmp_path, monkeypatch, formatted, damage, keyfile
):
    """Attack: the formula's luksFormat of UUID completes (keyslot and all), the job is killed
    before it unlinks the mark (or while cryptsetup, its child, goes on to finish). The volume
    is finished by hand or by an apply whose probe never parsed the header (test=True, the
    audit), and holds data. Then both header copies are damaged while the primary binary header
    and the keyslot area survive.

    Impact: the next apply's guard calls it ``unfinished_luks`` and luksFormats it, with no
    allow_format; header_backed_up then replaces the backup that would have restored it. Before
    8d9ba3c it was refused (LUKS header unreadable).

    Expected: refused. A secondary area that does not read zero was written: a luksFormat
    writes it only after its primary copy is complete, so this header was once whole."""
    damage(formatted)
    host = host_over(tmp_path, monkeypatch, formatted)
    probe = host.probe([DEVICE], key_file=str(keyfile))[DEVICE]
    assert probe["luks"].get("error")
    assert not safety.unfinished_luks(probe), probe["luks"]
    assert verdicts(probe) == ("refuse", "refuse")


def test_an_io_error_on_a_readable_header_with_a_keyslot_under_a_stale_mark_is_not_formatted(
    tmp_path, monkeypatch, formatted, keyfile
):
    """Attack: as above, stale mark; the header is whole and its primary copy verifies, with a
    keyslot the key opens. A sector of the secondary copy reads EIO (a failing path, a bad
    sector). ``parse_header`` raises CommandExecutionError, so ``_header_of`` answers
    {"error": "cannot read ..."}: 8d9ba3c's ``"error" in header`` takes that for "no copy
    readable", reads the UUID from the primary and finds the mark.

    Impact: a readable LUKS volume with a keyslot (the key never tried: an error header is not
    tested) is formatted again.

    Expected: only a primary that does not verify (cut short) counts; here it verifies, so the
    device is refused as before (the read failed, key not tried)."""
    size = hdr_size(formatted)
    host = host_over(tmp_path, monkeypatch, formatted, unreadable=(size, size + 512))
    probe = host.probe([DEVICE], key_file=str(keyfile))[DEVICE]
    assert "cannot read" in probe["luks"]["error"]
    assert not safety.unfinished_luks(probe), probe["luks"]
    assert verdicts(probe) == ("refuse", "refuse")


def torn_as_cryptsetup_leaves_it(data, json_written):
    """What a luksFormat killed inside its first header write leaves: the header areas zeroed,
    the primary binary header written without its checksum, the JSON area written or not yet,
    the secondary copy not yet (cryptsetup's hdr_write_disk: binary header, JSON area, binary
    header with checksum; primary before secondary)."""
    size = hdr_size(data)
    data[448:512] = bytes(64)  # checksum not written yet
    if not json_written:
        data[luks.BINARY_HEADER_SIZE : size] = bytes(size - luks.BINARY_HEADER_SIZE)
    data[size : 2 * size] = bytes(size)


@pytest.mark.parametrize("json_written", [False, True], ids=["before-json", "before-checksum"])
def test_the_formulas_torn_format_is_still_formatted_again(
    tmp_path, monkeypatch, formatted, json_written, keyfile
):
    """What 8d9ba3c is for, kept by the fix: the kill lands inside the primary header write,
    its mark is there: formatted again without leave. Without the mark: refused."""
    torn_as_cryptsetup_leaves_it(formatted, json_written)
    probe = host_over(tmp_path, monkeypatch, formatted).probe([DEVICE], key_file=str(keyfile))[DEVICE]
    assert probe["luks"]["uuid"] == UUID and probe["luks"]["format_began"] is True
    assert verdicts(probe) == ("use", "create")
    unmarked = tmp_path / "unmarked"
    unmarked.mkdir()
    monkeypatch.undo()
    probe = host_over(unmarked, monkeypatch, formatted, stale_mark=False).probe([DEVICE])[DEVICE]
    assert verdicts(probe) == ("refuse", "refuse")


def test_holds_a_header_whose_secondary_copy_is_intact_is_never_unfinished(tmp_path, monkeypatch, formatted):
    """Holds (no hole): the primary copy damaged, the secondary intact: parse_header reads it
    (degraded, one keyslot), no error, no format_began; the stale mark is not consulted."""
    formatted[luks.BINARY_HEADER_SIZE + 512 : luks.BINARY_HEADER_SIZE + 1024] = bytes(512)
    probe = host_over(tmp_path, monkeypatch, formatted).probe([DEVICE])[DEVICE]
    assert probe["luks"] == {"version": 2, "uuid": UUID, "keyslots": 1, "reencryption": False}
    assert not safety.unfinished_luks(probe)
    assert verdicts(probe) == ("refuse", "refuse")  # key_not_tested: no key file given


def test_holds_a_luks1_header_names_no_uuid(make_luks):
    """Holds: claimed_uuid reads LUKS2 only; a damaged LUKS1 header stays damage."""
    data = bytearray(make_luks(type="luks1", kdf="pbkdf2").read_bytes())
    assert luks.claimed_uuid(bytes(data[: luks.BINARY_HEADER_SIZE])) is None


# ---- the lab's detached calls (lab/guest_caller.py) ------------------------------------------


class Exited(Exception):  # noqa: N818 - os._exit, caught
    def __init__(self, code):
        super().__init__(code)
        self.code = code


@pytest.mark.parametrize("raised", [SystemExit(3)], ids=["SystemExit"])  # KeyboardInterrupt: the same
def test_a_detached_child_ends_in_os_exit_whatever_the_call_raises(tmp_path, monkeypatch, raised):
    """Regression in 8d9ba3c: ``detach`` moved its ``finally: os._exit(code)`` from the call to
    the reply's write. A call that raises what ``except Exception`` does not catch (SystemExit -
    salt's SaltSystemExit is one -, KeyboardInterrupt) now unwinds the forked child out of
    ``detach`` into the server's loop and interpreter exit: the parent's atexit handlers run in
    the child, no reply is left, and the exit code is not the one os._exit would give.

    Expected: the child always ends in os._exit, and leaves a reply saying what it raised."""
    import sys

    sys.path.insert(0, str(REPO / "lab"))
    guest_caller = pytest.importorskip("guest_caller")

    def exit_(code):
        raise Exited(code)

    def call(caller, line):
        raise raised

    monkeypatch.setattr(guest_caller.os, "fork", lambda: 0)
    monkeypatch.setattr(guest_caller.os, "setsid", lambda: None)
    monkeypatch.setattr(guest_caller.os, "_exit", exit_)
    monkeypatch.setattr(guest_caller, "call", call)
    with pytest.raises(Exited) as ended:
        guest_caller.detach(None, "state.apply hana.storage", str(tmp_path))
    assert ended.value.code == 1
    assert (tmp_path / f"detached.{os.getpid()}.json").exists()
