"""The formula's states through Salt's loader dunders (pytest-salt-factories'
``configure_loader_modules``), with the execution module's answers given: test=True, refuse and
apply branches that otherwise run only in the VM tier."""

import importlib.util
import os
from unittest.mock import MagicMock

import hana_storage_commands as commands
import hana_storage_pillar as pillar
import hana_storage_safety as safety
import hana_storage_tab as tab
import pytest

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("hana_storage_state", REPO / "_states" / "hana_storage.py")
states = importlib.util.module_from_spec(spec)
spec.loader.exec_module(states)

UTILS = {
    f"hana_storage_{module.__name__.rsplit('_', 1)[-1]}.{name}": getattr(module, name)
    for module in (commands, pillar, safety, tab)
    for name in dir(module)
    if not name.startswith("_")
}
DEV = "253:4"


@pytest.fixture
def salt_functions():
    return {
        "mount.set_fstab": MagicMock(return_value="present"),
        "mount.remount": MagicMock(return_value=True),
        "mount.mount": MagicMock(return_value=True),
        "hana_storage_host.xfs_superblock": MagicMock(return_value={"uuid": "1234-abcd"}),
        "hana_storage_host.probe": MagicMock(),
        "cmd.run_all": MagicMock(return_value={"retcode": 0, "stdout": "", "stderr": ""}),
    }


@pytest.fixture
def configure_loader_modules(salt_functions):
    return {states: {"__salt__": salt_functions, "__utils__": UTILS, "__opts__": {"test": False}}}


def live(options, super_options):
    return {"dev": DEV, "source": "/dev/mapper/hana_data", "fstype": "xfs", "options": options,
            "super_options": super_options}  # fmt: skip


@pytest.fixture
def mounted_at_data(monkeypatch):
    monkeypatch.setattr(
        states, "_live_mount", lambda name: live(["rw", "noatime", "nodiratime"], ["rw", "logbsize=256k"])
    )
    monkeypatch.setattr(states, "_dev_of", lambda path: DEV)
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)


@pytest.mark.parametrize(
    "userspace", [["nofail"], ["_netdev"], ["defaults"], ["x-systemd.device-timeout=30"]]
)
def test_mounted_compares_only_what_the_kernel_shows(salt_functions, mounted_at_data, userspace):
    options = ["noatime", "nodiratime", "logbsize=256k", *userspace]
    ret = states.mounted("/hana/data", "/dev/mapper/hana_data", options, options)
    assert ret["result"] is True and ret["changes"] == {}, ret
    salt_functions["mount.remount"].assert_not_called()


def test_mounted_remounts_for_a_kernel_option_that_is_missing(salt_functions, mounted_at_data):
    options = ["noatime", "nodiratime", "logbsize=256k", "nofail", "inode64"]
    ret = states.mounted("/hana/data", "/dev/mapper/hana_data", options, options)
    assert (
        ret["changes"]["mounted"]["options"] == options
        and "remount /hana/data with inode64" in ret["comment"]
    )
    salt_functions["mount.remount"].assert_called_once()


def test_mounted_never_displaces_a_foreign_mount(salt_functions, monkeypatch, mounted_at_data):
    monkeypatch.setattr(states, "_dev_of", lambda path: "8:16")
    ret = states.mounted("/hana/data", "/dev/mapper/hana_data", ["noatime"], ["noatime"])
    assert ret["result"] is False and "not touching it" in ret["comment"]
    salt_functions["mount.mount"].assert_not_called() and salt_functions["mount.remount"].assert_not_called()


def test_key_file_behind_a_symlink_into_a_users_directory_is_refused(tmp_path):
    users = tmp_path / "sidadm"
    users.mkdir()
    target = users / "target"
    target.write_text("not a key")
    target.chmod(0o644)
    os.chown(users, 1000, 1000)
    os.chown(target, 1000, 1000)
    link = tmp_path / "linked.key"
    link.symlink_to(target)
    ret = states.key_present(str(link), "keyfile")
    assert ret["result"] is False and "can be changed by users other than root" in ret["comment"], ret
    info = target.stat()
    assert (info.st_mode & 0o777, info.st_uid) == (0o644, 1000)


def test_key_file_mode_is_fixed_through_a_descriptor(tmp_path):
    key = tmp_path / "hana.key"
    key.write_bytes(b"k" * 64)
    key.chmod(0o644)
    ret = states.key_present(str(key), "keyfile")
    assert ret["result"] is True and ret["changes"]["mode"] == {"old": "0644", "new": "0400"}
    assert key.stat().st_mode & 0o777 == 0o400
    assert states.key_present(str(key), "keyfile")["changes"] == {}


def test_key_file_fix_in_test_mode_changes_nothing(tmp_path, configure_loader_modules):
    key = tmp_path / "hana.key"
    key.write_bytes(b"k")
    key.chmod(0o640)
    states.__opts__["test"] = True
    try:
        ret = states.key_present(str(key), "keyfile")
    finally:
        states.__opts__["test"] = False
    assert ret["result"] is None and ret["changes"] == {} and key.stat().st_mode & 0o777 == 0o640


def probe(device, **facts):
    return {"device": device, "exists": True, "block": True, "signatures": [], "pttype": None, "pv_vg": None,
            "luks": None, "key_opens": None, "key_error": None, "holders": [], "mountpoints": [], "data_at": None,
            "xfs": None, **facts}  # fmt: skip


def test_pv_safe_refuses_what_a_key_opens_inside_a_luks_device(salt_functions, monkeypatch):
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)
    inner = "/dev/mapper/hana_log_0"
    salt_functions["hana_storage_host.probe"].return_value = {
        inner: probe(inner, signatures=[{"type": "xfs", "usage": "filesystem"}])
    }
    ret = states.pv_safe(inner, "vg_hana_log")
    assert ret["result"] is False and "carries a xfs signature" in ret["comment"] and ret["changes"] == {}
    salt_functions["hana_storage_host.probe"].return_value = {inner: probe(inner)}
    assert states.pv_safe(inner, "vg_hana_log")["result"] is True
    # built: a PV of the volume's VG, held by the volume's LV (the second apply)
    built = probe(inner, signatures=[{"type": "LVM2_member", "usage": "raid"}], pv_vg="vg_hana_log",
                  holders=["vg_hana_log-lv_hana_log"])  # fmt: skip
    salt_functions["hana_storage_host.probe"].return_value = {inner: built}
    assert states.pv_safe(inner, "vg_hana_log", "vg_hana_log-lv_hana_log")["result"] is True
    assert states.pv_safe(inner, "vg_hana_log")["result"] is False  # held by an LV not its own


def test_pv_safe_in_test_mode_waits_for_the_device(monkeypatch, configure_loader_modules):
    monkeypatch.setattr(states.os.path, "exists", lambda path: False)
    states.__opts__["test"] = True
    try:
        ret = states.pv_safe("/dev/mapper/hana_log_0", "vg_hana_log")
    finally:
        states.__opts__["test"] = False
    assert ret["result"] is None and "once it is opened" in ret["comment"]


@pytest.mark.parametrize(
    "facts,force",
    [
        ({"signatures": [{"type": "xfs", "usage": "filesystem"}], "xfs": {"inprogress": True}}, True),
        ({}, False),
    ],
)
def test_mkfs_is_forced_only_over_an_interrupted_mkfs(salt_functions, monkeypatch, facts, force):
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)
    device = "/dev/mapper/hana_data"
    salt_functions["hana_storage_host.probe"].return_value = {device: probe(device, **facts)}
    ret = states.formatted(device, stripe_kib=256, stripes=4)
    argv = salt_functions["cmd.run_all"].call_args.args[0]
    assert ret["result"] is True and argv[0] == "mkfs.xfs" and ("-f" in argv) is force
