"""The host module's fact gathering decides on facts and exit codes, never on the text of a
command's messages."""

import copy
import importlib.util

import pytest
from hana_storage_core import lvm as lvm
from salt.exceptions import CommandExecutionError

from tests.conftest import REPO
from tests.unit.test_audit import recorded_facts


@pytest.fixture
def module(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("host_module", REPO / "_modules" / "hana_storage_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.runs = []
    module.driver = tmp_path / "device-mapper"
    monkeypatch.setattr(module, "DM_DRIVER", str(module.driver))
    return module


def answer(module, monkeypatch, stdout, error=None):
    def run(argv):
        module.runs.append(argv)
        return (None, error) if error else (stdout, None)

    monkeypatch.setattr(module, "_run", run)


def test_a_kernel_without_device_mapper_has_no_tables_and_runs_nothing(module, monkeypatch):
    answer(module, monkeypatch, "")
    assert module.dm_tables() == {} and module.runs == []


def test_a_failing_dmsetup_is_an_error_whatever_it_says(module, monkeypatch):
    """Regression (issue 15): a failure whose message mentioned "device-mapper" was taken for "no
    devices", so an audit saw no crypt device at all on a host whose dmsetup broke."""
    module.driver.touch()
    answer(
        module,
        monkeypatch,
        None,
        "dmsetup exited 1: Failure to communicate with kernel device-mapper driver.",
    )
    with pytest.raises(CommandExecutionError, match="dmsetup table failed"):
        module.dm_tables()


def test_unreadable_dmsetup_output_is_a_clear_error(module, monkeypatch):
    module.driver.touch()
    answer(module, monkeypatch, "this is not a table\n")
    with pytest.raises(CommandExecutionError, match="output unreadable: line 1"):
        module.dm_tables()


def test_no_devices_is_an_empty_table(module, monkeypatch):
    module.driver.touch()
    answer(module, monkeypatch, "No devices found\n")
    assert module.dm_tables() == {} and module.runs == [["dmsetup", "table"]]


def test_key_slots_names_the_keyslots_a_key_opens_on_a_real_header_without_writing_it(
    module, make_luks, keyfile, tmp_path
):
    """The rotation's proof: which keyslot each key opens, tried by the real cryptsetup on an
    in-memory copy of the header; the image is not changed by a byte."""
    import hashlib
    import subprocess

    from hana_storage_core import luks as luks

    module.__salt__ = {
        "cmd.run_all": lambda argv, **kwargs: {
            "retcode": (done := subprocess.run(argv, capture_output=True, text=True)).returncode,
            "stdout": done.stdout,
            "stderr": done.stderr,
        }
    }
    image, new, other = make_luks(kdf="pbkdf2"), tmp_path / "new.key", tmp_path / "other.key"
    new.write_bytes(b"n" * 64)
    other.write_bytes(b"o" * 64)
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    subprocess.run(
        ["cryptsetup", "-q", "luksAddKey", *cheap, "--key-file", str(keyfile), str(image), str(new)],
        check=True,
    )
    before = hashlib.sha256(image.read_bytes()).hexdigest()
    assert module.key_slots(str(image), str(keyfile)) == {"keyslots": [0], "error": None}
    assert module.key_slots(str(image), str(new)) == {"keyslots": [1], "error": None}
    assert module.key_slots(str(image), str(other)) == {"keyslots": [], "error": None}
    assert hashlib.sha256(image.read_bytes()).hexdigest() == before
    not_luks = tmp_path / "blank.img"
    not_luks.write_bytes(bytes(1 << 20))
    got = module.key_slots(str(not_luks), str(keyfile))
    assert got["keyslots"] == [] and got["error"].startswith("no readable LUKS header")


def test_the_guards_key_test_takes_the_key_or_the_previous_key(module, make_luks, keyfile, tmp_path):
    """Mid-rotation a device opens with one of two keys: either makes it the volume's own; only
    a refusal by both is "no key opens it"."""
    import subprocess

    from hana_storage_core import luks as luks

    module.__salt__ = {
        "cmd.run_all": lambda argv, **kwargs: {
            "retcode": (done := subprocess.run(argv, capture_output=True, text=True)).returncode,
            "stdout": done.stdout,
            "stderr": done.stderr,
        }
    }
    image, other = make_luks(kdf="pbkdf2"), tmp_path / "other.key"
    other.write_bytes(b"o" * 64)
    header = luks.parse_header(luks.reader_for(image.read_bytes()))
    assert module._keys_test(str(image), header, [str(other), str(keyfile)]) == (True, None)
    assert module._keys_test(str(image), header, [str(other)]) == (False, None)
    opens, error = module._keys_test(str(image), header, [str(other), str(tmp_path / "missing.key")])
    assert opens is None and "cryptsetup exited" in error  # a failed test is no "no"


def lab_devices():
    return recorded_facts()["devices"]


def test_the_lvm_report_key_ignores_a_crypt_tables_drift_and_sees_every_lv_or_device_change():
    devices = lab_devices()
    key = lvm.report_key(devices)
    crypt = next(n for n, d in devices.items() if d["kind"] == "crypt")
    lv = next(n for n, d in devices.items() if d["kind"] == "lv")
    disk = next(n for n, d in devices.items() if d["kind"] == "disk")
    drifted = copy.deepcopy(devices)
    drifted[crypt]["table"][0]["flags"] = []
    assert lvm.report_key(drifted) == key
    changes = {
        "an LV's table": lambda d: d[lv]["table"][0].update(stripes=1),
        "a PV gone": lambda d: d.pop(disk),
        "a device come": lambda d: d.update(vdz=dict(d[disk], name="vdz", dev="254:99")),
        "an LV renamed": lambda d: d[lv].update(dm_name="vg_a-renamed"),
    }
    for what, change in changes.items():
        changed = copy.deepcopy(devices)
        change(changed)
        assert lvm.report_key(changed) != key, what


@pytest.fixture
def lvm_module(module, monkeypatch):
    module.__context__ = {}
    module.reads = []

    def read():
        module.reads.append(1)
        return [{"report": len(module.reads)}]

    monkeypatch.setattr(module, "_read_lvm_segments", read)
    return module


def test_a_scoped_audit_reuses_the_lvm_report_only_while_no_lv_or_device_changed(lvm_module):
    """`lvs` was half of every scoped audit's time (the drift's p95 over 2 s, issue 17): a
    report is reused while its key holds, and read again the moment it does not."""
    devices = lab_devices()
    first = lvm_module._lvm_segments(devices, reuse=True)
    assert lvm_module._lvm_segments(devices, reuse=True) is first and len(lvm_module.reads) == 1
    lv = next(n for n, d in devices.items() if d["kind"] == "lv")
    extended = copy.deepcopy(devices)
    extended[lv]["table"].append(dict(extended[lv]["table"][0], start=10**9))
    assert lvm_module._lvm_segments(extended, reuse=True) == [{"report": 2}]
    assert lvm_module._lvm_segments(extended, reuse=True) == [{"report": 2}]
    assert len(lvm_module.reads) == 2


def test_a_full_audit_reads_the_lvm_report_and_the_scoped_audits_after_it_take_that(lvm_module):
    devices = lab_devices()
    lvm_module._lvm_segments(devices, reuse=True)
    assert lvm_module._lvm_segments(devices) == [{"report": 2}]
    assert lvm_module._lvm_segments(devices, reuse=True) == [{"report": 2}]
    assert lvm_module._lvm_segments() == [{"report": 3}]  # inspect: no tree, read, not kept
    assert lvm_module._lvm_segments(devices, reuse=True) == [{"report": 2}]


def test_a_failed_lvm_report_is_never_reused(lvm_module, monkeypatch):
    monkeypatch.setattr(
        lvm_module, "_read_lvm_segments", lambda: lvm_module.reads.append(1) or {"error": "x"}
    )
    devices = lab_devices()
    assert lvm_module._lvm_segments(devices, reuse=True) == {"error": "x"}
    assert lvm_module._lvm_segments(devices, reuse=True) == {"error": "x"}
    assert len(lvm_module.reads) == 2


def test_a_directory_is_judged_by_where_it_leads(module, monkeypatch, tmp_path):
    """A header backup directory named on the root file system but linked onto a HANA volume (or a
    RAM disk) is where its link leads: path_facts resolves what exists and keeps the rest."""
    volume = tmp_path / "hana" / "shared"
    volume.mkdir(parents=True)
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "headers").symlink_to(volume)
    mounts = [
        {"mountpoint": "/", "fstype": "ext4"},
        {"mountpoint": str(volume), "fstype": "xfs"},
    ]
    monkeypatch.setattr(module, "_mounts", lambda: mounts)
    asked = str(tmp_path / "var" / "headers" / "luks")
    assert module.path_facts([asked, "relative"]) == {asked: {"realpath": f"{volume}/luks", "fstype": "xfs"}}


def test_the_previous_key_is_tried_once_per_header_and_key_file(module, monkeypatch, tmp_path):
    """A rotation's previous key is tried (a KDF run per keyslot) only on its volume's devices, and
    again only when the header or the key file changed."""
    key = tmp_path / "old.key"
    key.write_bytes(b"o" * 64)
    tries = []
    monkeypatch.setattr(
        module, "key_slots", lambda device, key_file: tries.append(device) or {"keyslots": [0], "error": None}
    )
    monkeypatch.setattr(module.core.stack, "backing_device", lambda device: device["slaves"][0])
    module.__context__ = {}
    plan = {"volumes": {
        "data": {"key": {"previous": {"file": str(key)}}, "crypt": [{"name": "hana_data"}]},
        "log": {"key": {"previous": None}, "crypt": [{"name": "hana_log"}]},
    }}  # fmt: skip
    devices = {
        "dm-1": {"kind": "crypt", "dm_name": "hana_data", "slaves": ["dm-0"]},
        "dm-3": {"kind": "crypt", "dm_name": "hana_log", "slaves": ["vdc"]},
    }
    headers = {"dm-0": {"fingerprint": "a"}, "vdc": {"fingerprint": "b"}}
    assert module._previous_key_facts(plan, devices, headers) == {"dm-0": {"keyslots": [0], "error": None}}
    module._previous_key_facts(plan, devices, headers)
    assert tries == ["/dev/dm-0"]
    headers["dm-0"] = {"fingerprint": "changed"}
    module._previous_key_facts(plan, devices, headers)
    assert tries == ["/dev/dm-0", "/dev/dm-0"]
    key.unlink()
    assert module._previous_key_facts(plan, devices, headers)["dm-0"]["error"].endswith(
        "No such file or directory"
    )


def test_the_loader_modules_import_the_formulas_code_never_through_utils():
    """One way to the formula's code: hana_storage_core, imported (Salt's utils loader hands out
    functions only, and a name looked up in __utils__ is not one a tool can follow)."""
    text = "".join(
        p.read_text()
        for d in ("_modules", "_states", "_beacons", "_runners", "_engines")
        for p in (REPO / d).glob("*.py")
    )
    assert "__utils__[" not in text and '_util("' not in text


def test_the_hosts_ram_is_what_cryptsetup_measures_and_an_odd_meminfo_is_an_error(module, monkeypatch):
    """cryptsetup reads the RAM as sysconf's physical pages; /proc/meminfo's MemTotal is the same."""
    import os

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 1024
    assert module.boot_facts()["memory"] == {"total_kib": pages}
    real_read = module._read
    for text in ("", "MemTotal: lots kB\n", "MemTotal:\n"):
        monkeypatch.setattr(
            module, "_read", lambda path, text=text: text if path == "/proc/meminfo" else real_read(path)
        )
        assert "error" in module.boot_facts()["memory"], text
