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
