"""The host module's fact gathering decides on facts and exit codes, never on the text of a
command's messages."""

import importlib.util

import hana_storage_dm as dm
import pytest
from salt.exceptions import CommandExecutionError

from tests.conftest import REPO


@pytest.fixture
def module(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("host_module", REPO / "_modules" / "hana_storage_host.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__utils__ = {"hana_storage_dm.parse_tables": dm.parse_tables}
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

    import hana_storage_luks as luks

    module.__utils__["hana_storage_luks.parse_header"] = luks.parse_header
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

    import hana_storage_luks as luks

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
