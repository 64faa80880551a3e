"""Attack 22: the state's own mount-back after a failed step in the unmounted window drops both
copy tags (HEAD_COPY_BEGUN_TAG and HEAD_COPIED_TAG) and mounts the XFS from the LV again.

Without a tag, the next apply's facts read "no tag, a tail that is neither zeros nor the head":
stage ``unclear`` ("an init by an earlier version of the formula was cut off"), refused, with a
manual dd (zero the tail, or copy it over the head) chosen by ``xfs_repair -n`` of a filesystem
HANA has mounted. The tail is the formula's own, known-stale copy: the BEGUN tag, which says
exactly "cryptsetup never wrote the header, the head is authoritative", is what was true.

Real image (mkfs.xfs), real dd, the host module's own reads; lvchange keeps the tags in a list,
mount/umount flip a flag, cryptsetup and systemd are scripted."""

import os
import shutil
import subprocess
from unittest.mock import MagicMock

import pytest
from hana_storage_core import inplace

from tests.support.real_commands import real_run_all
from tests.unit.test_inplace import LUKS, PVS, SEGMENTS, states
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

MIB = 1 << 20
PLAIN = 320 * MIB  # mkfs.xfs wants 300 MB at least
ROOM = inplace.header_room(2, 64 * 1024, 4 * MIB)
SHIFT = inplace.data_shift(ROOM)


OK = {"retcode": 0, "stdout": "", "stderr": ""}


class Lab:
    """One LV image, its LVM tags, whether the XFS is mounted from it, and scripted commands."""

    def __init__(self, host_module, monkeypatch, tmp_path, image, tags=None):
        self.module, self.monkeypatch, self.tmp_path, self.image = host_module, monkeypatch, tmp_path, image
        self.tags = list(tags if tags is not None else [inplace.plain_tag(PLAIN)])
        self.mounted = True
        self.ran = []
        self.hooks = {}  # program -> callable(argv) returning a run_all answer (or raising)
        host_module.__salt__ = {"cmd.run_all": real_run_all}
        monkeypatch.setattr(host_module, "_sysfs", dict)
        monkeypatch.setattr(host_module, "block_bytes", lambda path: os.path.getsize(path))
        monkeypatch.setattr(host_module, "mounted_at", lambda mountpoint: None)
        monkeypatch.setattr(host_module, "_unit_active", lambda unit: False)
        real_run = host_module._run
        monkeypatch.setattr(
            host_module,
            "_run",
            lambda argv: (",".join(self.tags), None) if argv[0] == "lvs" else real_run(argv),
        )

    def lvchange(self, argv):
        words = iter(argv[1:])
        for word in words:
            if word == "--deltag":
                tag = next(words)
                if tag in self.tags:
                    self.tags.remove(tag)
            elif word == "--addtag":
                tag = next(words)
                if tag not in self.tags:
                    self.tags.append(tag)
        return OK

    def run_all(self, argv, **kwargs):
        self.ran.append(list(argv))
        hook = self.hooks.get(argv[0])
        if hook is not None:
            answer = hook(argv)
            if answer is not None:
                return answer
        if argv[0] == "lvchange":
            return self.lvchange(argv)
        if argv[0] == "umount":
            self.mounted = False
            return OK
        if argv[0] == "mount":
            self.mounted = True
            return OK
        if argv[0] in ("cryptsetup", "systemd-run", "systemctl"):
            return OK
        return real_run_all(argv, **kwargs)

    def facts(self):
        facts = self.module.in_place_facts(str(self.image), "hana_data", "/hana/data", SHIFT)
        if self.mounted:
            facts["mounted_from"] = "device"
        return facts

    def apply(self, test=False):
        facts = self.facts()
        host = {
            "hana_storage_host.in_place_facts": MagicMock(return_value=facts),
            "hana_storage_host.lv_room": MagicMock(return_value={"segments": SEGMENTS, "pvs": PVS}),
            "hana_storage_host.block_bytes": lambda path: os.path.getsize(path),
            "hana_storage_host.tail_state": self.module.tail_state,
            "hana_storage_host.signatures": self.module.signatures,
            "hana_storage_host.luks_header": MagicMock(return_value={"uuid": "u-1"}),
            "cmd.run_all": self.run_all,
        }
        self.monkeypatch.setattr(states, "__salt__", host, raising=False)
        self.monkeypatch.setattr(states, "__opts__", {"test": test}, raising=False)
        self.monkeypatch.setattr(states, "__context__", {}, raising=False)
        self.monkeypatch.setattr(states, "SCRATCH", str(self.tmp_path / "scratch"))
        self.monkeypatch.setattr(states, "_ramfs", lambda directory: os.makedirs(directory, exist_ok=True))
        ret = states.encrypted_in_place(
            "hana_data", str(self.image), "/hana/data", "/k", LUKS, 2, 64, ["noatime"]
        )
        return ret, facts

    def head(self):
        with open(self.image, "rb") as handle:
            return handle.read(SHIFT)

    def tail(self):
        with open(self.image, "rb") as handle:
            handle.seek(os.path.getsize(self.image) - SHIFT)
            return handle.read(SHIFT)

    def write(self, offset, data):
        with open(self.image, "r+b") as handle:
            handle.seek(offset)
            handle.write(data)


def make_image(tmp_path, plain=PLAIN, room=ROOM):
    """An LV image of ``plain`` bytes grown by ``room`` (zeroed), an XFS, and HANA's bytes in
    its first 16 MiB (beyond the XFS's own first blocks)."""
    for tool in ("mkfs.xfs", "blkid"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")
    image = tmp_path / "lv.img"
    subprocess.run(["truncate", "-s", str(plain + room), str(image)], check=True)
    subprocess.run(["mkfs.xfs", "-q", "-s", "size=4096", "-d", f"size={plain}", str(image)], check=True)
    with open(image, "r+b") as handle:
        handle.seek(4 * MIB)
        handle.write(os.urandom(12 * MIB))
    return image


@pytest.fixture
def lab(module, monkeypatch, tmp_path):  # noqa: F811
    return Lab(module, monkeypatch, tmp_path, make_image(tmp_path))


def hana_writes(lab):
    """HANA, running on the XFS mounted back, writes into the volume's first 16 MiB."""
    assert lab.mounted
    lab.write(6 * MIB, os.urandom(64 * 1024))


def test_after_a_failed_init_and_the_mount_back_the_next_apply_is_not_refused(lab):
    """HOLE (fixed; an init that fails for any reason - a key file cryptsetup rejects, Argon2 memory,
    an option the host's cryptsetup lacks - turns the volume into a refusal: after the state's
    own mount-back drops both copy tags, HANA writes to its first 16 MiB, the tail is a stale
    copy with no tag, and every later apply says "unclear: an init by an earlier version of the
    formula was cut off", asks for HANA to be stopped, xfs_repair -n and a hand-made dd that
    either zeroes the tail or copies a stale tail over the live head; the encryption never goes
    on by itself). Fix: on the mount-back after a step that left the head intact, replace the
    copy tags with HEAD_COPY_BEGUN_TAG (the head is authoritative, cryptsetup never wrote it),
    or zero the tail, instead of deleting every tag."""
    lab.hooks["cryptsetup"] = lambda argv: {"retcode": 1, "stdout": "", "stderr": "Argon2 out of memory"}
    ret, facts = lab.apply()
    assert facts["tail"] == "zero" and inplace.stage(facts)[0] == "plain"
    assert ret["result"] is False and "mounted back" in ret["comment"], ret["comment"]
    assert lab.mounted and lab.tail() == lab.head()  # the copy was made, the head is intact
    hana_writes(lab)
    lab.hooks.pop("cryptsetup")  # the admin fixed the cause
    again, facts = lab.apply()
    assert again["result"] is True, (inplace.stage(facts), lab.tags, again["comment"])


def test_after_a_copy_cut_by_an_io_error_and_the_mount_back_the_next_apply_is_not_refused(lab):
    """HOLE (fixed; a dd that fails part-way - an I/O error on the room's PV, a multipath hiccup -
    leaves a part copy in the tail; the mount-back drops the BEGUN tag that said "cryptsetup never
    ran, the head is intact", so the next apply, with nothing else changed, refuses the volume as
    "unclear" and hands the admin a choice between zeroing the tail and copying a torn tail over
    the intact head - the very data loss this change set out to remove). Fix: keep (or set)
    HEAD_COPY_BEGUN_TAG on the mount-back after a step in _BEFORE_THE_HEADER; drop only
    HEAD_COPIED_TAG."""

    def cut_dd(argv):
        if argv[0] == "dd" and argv[1] == f"if={lab.image}":
            lab.write(os.path.getsize(lab.image) - SHIFT, lab.head()[: 5 * MIB])
            return {"retcode": 1, "stdout": "", "stderr": "dd: error writing: Input/output error"}
        return None

    lab.hooks["dd"] = cut_dd
    ret, _ = lab.apply()
    assert ret["result"] is False and "mounted back" in ret["comment"], ret["comment"]
    lab.hooks.clear()
    again, facts = lab.apply()
    assert again["result"] is True, (inplace.stage(facts), lab.tags, again["comment"])


def test_the_mount_back_after_a_failed_copy_leaves_the_head_as_it_was(lab):
    """CLOSED. A copy that fails leaves the head as it was, and the XFS is mounted back."""
    before = lab.head()
    lab.hooks["dd"] = lambda argv: (
        {"retcode": 1, "stdout": "", "stderr": "I/O error"} if argv[1] == f"if={lab.image}" else None
    )
    ret, _ = lab.apply()
    assert ret["result"] is False and lab.mounted, ret["comment"]
    assert lab.head() == before


def test_a_failed_init_that_wrote_the_header_part_way_keeps_the_lv_unmounted_and_tagged(lab):
    """CLOSED. cryptsetup failing after it wrote part of the header (the XFS superblock still
    there, the rest of the head not): the head no longer matches the copy, the LV stays
    unmounted and keeps its COPIED tag, and the next apply says to copy the tail back."""
    head = lab.head()

    def torn_init(argv):
        lab.write(os.path.getsize(lab.image) - SHIFT, lab.head())
        lab.write(MIB, bytes(4 * MIB))
        return {"retcode": 1, "stdout": "", "stderr": "Failed to write"}

    lab.hooks["cryptsetup"] = torn_init
    ret, _ = lab.apply()
    assert ret["result"] is False and "stays unmounted" in ret["comment"], ret["comment"]
    assert not lab.mounted and inplace.HEAD_COPIED_TAG in lab.tags
    lab.hooks.clear()
    again, facts = lab.apply()
    assert inplace.stage(facts)[0] == "torn" and "copy them back" in again["comment"], again["comment"]
    assert lab.tail() == head
