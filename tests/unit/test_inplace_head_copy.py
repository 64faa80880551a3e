# ruff: noqa: F811 - pytest fixtures imported from tests/unit/test_inplace.py are parameters here
"""The encryption in place copies the LV's first bytes into its room itself, before cryptsetup
runs, and tags the copy begun and complete (inplace.HEAD_COPIED_TAG): a power cut in the middle
of a copy is then told from one in the middle of cryptsetup's header write.

Regression: cryptsetup's init copies the head into the room in one O_DIRECT write and then writes
the header over the head. A power cut in the middle of that copy left a tail that was part copy,
part zeros, with the head intact; the state called it "torn" and told the admin to copy the tail
back over the head (dd ... skip=... count=16), which zeroes the part of the volume's first 16 MiB
the copy had not reached. Real images, real dd, the host module's own reads."""

import os
import re
import shutil
import subprocess
from unittest.mock import MagicMock

import pytest
from hana_storage_core import inplace

from tests.support.real_commands import real_run_all as _real_run_all
from tests.unit.test_inplace import (  # noqa: F401 - fixtures
    HOST_FACTS,
    LUKS,
    PVS,
    SEGMENTS,
    configure_loader_modules,
    host,
    opts,
    scratch,
    states,
)
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

MIB = 1 << 20
PLAIN = 320 * MIB  # mkfs.xfs wants 300 MB at least
ROOM = inplace.header_room(2, 64 * 1024, 4 * MIB)
SHIFT = inplace.data_shift(ROOM)


@pytest.fixture
def grown(tmp_path):
    """An LV image grown by the room (zeroed), an XFS and HANA's bytes in its first 16 MiB."""
    if not shutil.which("mkfs.xfs"):
        pytest.skip("mkfs.xfs not installed")
    image = tmp_path / "lv.img"
    subprocess.run(["truncate", "-s", str(PLAIN + ROOM), str(image)], check=True)
    subprocess.run(["mkfs.xfs", "-q", "-s", "size=4096", "-d", f"size={PLAIN}", str(image)], check=True)
    with open(image, "r+b") as handle:
        handle.seek(4 * MIB)
        handle.write(os.urandom(12 * MIB))
        handle.seek(0)
        head = handle.read(SHIFT)
    return image, head


def _cut_copy(image, head, mib):
    """The power cut ``mib`` MiB into a copy of the head into the room."""
    with open(image, "r+b") as handle:
        handle.seek(PLAIN + ROOM - SHIFT)
        handle.write(head[: mib * MIB])


def _tail(image):
    with open(image, "rb") as handle:
        handle.seek(PLAIN + ROOM - SHIFT)
        return handle.read(SHIFT)


@pytest.fixture
def real(module, monkeypatch):  # noqa: F811
    """The host module reading the image for real (blkid, the superblock, the tail), the LV's tags
    as ``real.tags`` says; not mounted, no unit, no device-mapper."""
    module.__salt__ = {"cmd.run_all": _real_run_all}
    module.tags = [inplace.plain_tag(PLAIN)]
    monkeypatch.setattr(module, "_sysfs", dict)
    monkeypatch.setattr(module, "block_bytes", lambda path: os.path.getsize(path))
    monkeypatch.setattr(module, "mounted_at", lambda mountpoint: None)
    monkeypatch.setattr(module, "_unit_active", lambda unit: False)
    real_run = module._run
    monkeypatch.setattr(
        module, "_run", lambda argv: (",".join(module.tags), None) if argv[0] == "lvs" else real_run(argv)
    )
    return module


def _apply(real, monkeypatch, tmp_path, image):
    """The state on the image with the host's real reads; every command runs for real but
    cryptsetup and systemd (no device-mapper here), which succeed without doing anything."""
    ran = []

    def run_all(argv, **kwargs):
        ran.append(argv)
        if argv[0] in ("cryptsetup", "systemd-run", "systemctl", "mount", "umount", "lvchange"):
            return {"retcode": 0, "stdout": "", "stderr": ""}
        return _real_run_all(argv, **kwargs)

    facts = real.in_place_facts(str(image), "hana_data", "/hana/data", SHIFT)
    host = {
        "hana_storage_host.in_place_facts": MagicMock(return_value=facts),
        "hana_storage_host.lv_room": MagicMock(return_value={"segments": SEGMENTS, "pvs": PVS}),
        "hana_storage_host.block_bytes": lambda path: os.path.getsize(path),
        "hana_storage_host.tail_state": real.tail_state,
        "hana_storage_host.signatures": MagicMock(return_value=([{"type": "xfs"}], None)),
        "cmd.run_all": run_all,
    }
    monkeypatch.setattr(states, "__salt__", host, raising=False)
    monkeypatch.setattr(states, "__opts__", {"test": False}, raising=False)
    monkeypatch.setattr(states, "__context__", {}, raising=False)
    monkeypatch.setattr(states, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(states, "_ramfs", lambda directory: os.makedirs(directory, exist_ok=True))
    ret = states.encrypted_in_place("hana_data", str(image), "/hana/data", "/k", LUKS, 2, 64, ["noatime"])
    return ret, ran, facts


def test_a_power_cut_in_the_middle_of_the_copy_goes_on_and_the_head_is_copied_whole(
    grown, real, monkeypatch, tmp_path
):
    image, head = grown
    _cut_copy(image, head, 5)
    real.tags.append(inplace.HEAD_COPY_BEGUN_TAG)
    ret, ran, facts = _apply(real, monkeypatch, tmp_path, image)
    assert (facts["tail"], facts["head_copy"]) == ("partial", "begun")
    assert ret["result"] is True, ret["comment"]
    assert ret["changes"]["encrypting"]["from"] == "plain"
    programs = [argv[0] for argv in ran]
    assert programs.index("dd") < programs.index("cryptsetup")  # the copy, then the init
    with open(image, "rb") as handle:
        assert handle.read(SHIFT) == head  # the head untouched...
    assert _tail(image) == head  # ...and copied whole


def test_without_a_tag_a_cut_copy_is_refused_and_the_copy_made_again_as_it_says(
    grown, real, monkeypatch, tmp_path
):
    """An init of the formula before this copy (cryptsetup made it, no tags): the tail part copy,
    part zeros. Refused: every sector where the room differs from the head is zeros, so the head
    is whole; the advice saves the room and has the copy made again, never copying the room over
    the head."""
    image, head = grown
    _cut_copy(image, head, 5)
    monkeypatch.setattr(states, "ROOM_SAVE_DIR", str(tmp_path))
    ret, ran, facts = _apply(real, monkeypatch, tmp_path, image)
    assert facts["tail"] == "partial" and ret["result"] is False, ret["comment"]
    assert ran == [] or all(argv[0] in ("blkid", "xfs_db") for argv in ran), ran
    save, retag = [text.split() for text in re.findall(r"\(((?:dd|lvchange) [^)]*)\)", ret["comment"])]
    assert save[1] == f"if={image}" and save[2].startswith(f"of={tmp_path}/"), save
    assert subprocess.run(save, capture_output=True).returncode == 0
    assert retag[:5] == [
        "lvchange",
        "--deltag",
        inplace.HEAD_COPIED_TAG,
        "--addtag",
        inplace.HEAD_COPY_BEGUN_TAG,
    ]
    real.tags.append(inplace.HEAD_COPY_BEGUN_TAG)
    again, _, facts = _apply(real, monkeypatch, tmp_path, image)
    assert facts["head_copy"] == "begun" and again["result"] is True, again["comment"]
    with open(image, "rb") as handle:
        assert handle.read(SHIFT) == head
    assert _tail(image) == head


def test_a_header_write_cut_after_a_complete_copy_is_refused_with_the_copy_back(
    grown, real, monkeypatch, tmp_path
):
    image, head = grown
    _cut_copy(image, head, SHIFT // MIB)
    with open(image, "r+b") as handle:  # part of the header area landed, the first block did not
        handle.seek(MIB)
        handle.write(bytes(4 * MIB))
    real.tags.append(inplace.HEAD_COPIED_TAG)
    ret, ran, _ = _apply(real, monkeypatch, tmp_path, image)
    assert ret["result"] is False and "copy them back (dd if=" in ret["comment"], ret["comment"]
    assert not [argv for argv in ran if argv[0] in ("dd", "cryptsetup")], ran
    assert _tail(image) == head


@pytest.mark.parametrize("mounted_from,copied", [(None, False), ("device", True)])
def test_a_copy_that_matches_is_made_again_unless_it_was_read_unmounted(host, mounted_from, copied):
    """Read while the XFS is mounted, a matching copy says nothing of what HANA writes until the
    unmount: it is made again after it."""
    host["hana_storage_host.in_place_facts"].return_value = dict(
        HOST_FACTS,
        lv_tags=[inplace.plain_tag(512 * MIB), inplace.HEAD_COPY_BEGUN_TAG, inplace.HEAD_COPIED_TAG],
        head_copy="copied",
        tail="copy",
        device_bytes=544 * MIB,
        mounted_from=mounted_from,
    )
    ret = states.encrypted_in_place(
        "hana_data", "/dev/vg_hana_data/lv_hana_data", "/hana/data", "/k", LUKS, 2, 64, ["noatime"]
    )
    assert ret["result"] is True, ret
    ran = [c.args[0][0] for c in host["cmd.run_all"].call_args_list]
    assert ("dd" in ran[: ran.index("cryptsetup")]) is copied, ran


@pytest.mark.parametrize("failing", ["dd", "lvchange"])
def test_a_copy_that_fails_after_the_unmount_mounts_the_lv_back(host, failing):
    """Before cryptsetup, the head is as it was: mounted back at once (the begun tag stays, so
    the next run copies again; no LVM write stands between the failure and the mount)."""
    calls = []

    def run_all(argv, **kwargs):
        calls.append(argv)
        copying = (
            argv[1] != "if=/dev/zero"
            if argv[0] == "dd"
            else argv[-3:-1] == ["--addtag", inplace.HEAD_COPIED_TAG]
        )
        bad = argv[0] == failing and copying
        return {"retcode": 1 if bad else 0, "stdout": "", "stderr": "I/O error" if bad else ""}

    host["cmd.run_all"].side_effect = run_all
    ret = states.encrypted_in_place(
        "hana_data", "/dev/vg_hana_data/lv_hana_data", "/hana/data", "/k", LUKS, 2, 64, ["noatime"]
    )
    assert ret["result"] is False and "mounted back" in ret["comment"], ret["comment"]
    programs = [a[0] for a in calls]
    failed = max(i for i, a in enumerate(calls) if a[0] == failing)
    assert programs[failed + 1 :] == ["mount"], programs
    assert "cryptsetup" not in programs


@pytest.mark.parametrize("held,mounted", [("copy", True), ("other", False)])
def test_after_a_failed_init_the_lv_is_mounted_back_only_while_its_head_matches_the_copy(host, held, mounted):
    host["cmd.run_all"].side_effect = lambda argv, **kw: {
        "retcode": 1 if argv[0] == "cryptsetup" else 0,
        "stdout": "",
        "stderr": "Failed to write" if argv[0] == "cryptsetup" else "",
    }
    host["hana_storage_host.tail_state"].side_effect = ["copy", held]  # the verify, then the check
    ret = states.encrypted_in_place(
        "hana_data", "/dev/vg_hana_data/lv_hana_data", "/hana/data", "/k", LUKS, 2, 64, ["noatime"]
    )
    assert ret["result"] is False
    ran = [c.args[0][0] for c in host["cmd.run_all"].call_args_list]
    after_init = ran[ran.index("cryptsetup") + 1 :]
    assert ("mount" in after_init) is mounted, (after_init, ret["comment"])
    assert ("stays unmounted" in ret["comment"]) is not mounted, ret["comment"]


def test_a_failed_drop_of_the_tags_after_the_init_is_said_and_leaves_no_stray_key(host):
    """The init ended: tags left on a LUKS2 LV decide nothing (the next run that opens it drops
    them), so the run goes on, says so, and returns only Salt's keys."""
    host["cmd.run_all"].side_effect = lambda argv, **kw: {
        "retcode": 5 if argv[0] == "lvchange" and "--deltag" in argv and "--addtag" not in argv else 0,
        "stdout": "",
        "stderr": "VG is partial",
    }
    ret = states.encrypted_in_place(
        "hana_data", "/dev/vg_hana_data/lv_hana_data", "/hana/data", "/k", LUKS, 2, 64, ["noatime"]
    )
    assert ret["result"] is True and "its copy's LVM tags stay: VG is partial" in ret["comment"], ret
    assert set(ret) == {"name", "changes", "result", "comment"}, ret
