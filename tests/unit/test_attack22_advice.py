# ruff: noqa: F811 - the host module fixture imported from tests/unit/test_module_facts.py is a parameter here
"""Attack 22: what the refusals of a cut init (stages ``torn`` and ``unclear``) tell the admin
to do, followed to the letter on real images with real dd, cryptsetup and xfs_repair."""

import os
import re
import shutil
import subprocess
from unittest.mock import MagicMock

import pytest
from hana_storage_core import inplace

from tests.unit.test_attack22_mount_back import (
    PLAIN,
    ROOM,
    SHIFT,
    Lab,
    make_image,
)
from tests.unit.test_inplace import HOST_FACTS, LUKS, SEGMENTS, states
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

MIB = 1 << 20
CHEAP = dict(LUKS, pbkdf={"type": "pbkdf2", "force_iterations": 1000})


def advised(comment):
    """The commands a refusal says to run, in order, as argv lists: those before its "Only if"
    (the alternatives for another story)."""
    first = comment.split("Only if")[0]
    return [text.split() for text in re.findall(r"\(((?:dd|lvchange) [^)]*)\)", first)]


def run_advice(argv, lab=None):
    if argv[0] == "lvchange":  # the lab keeps the LV's tags
        lab.lvchange(argv)
        return
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, (argv, done.stderr)


def follow(comment, lab=None):
    """Every command a refusal says to run, to the letter."""
    for argv in advised(comment):
        run_advice(argv, lab)


@pytest.fixture(autouse=True)
def room_saves(monkeypatch, tmp_path):
    """Where the refusals have the room saved: not root's home."""
    monkeypatch.setattr(states, "ROOM_SAVE_DIR", str(tmp_path))


def apply_with(monkeypatch, tmp_path, facts, device, stripes=2, extent=4 * MIB):
    pvs = [
        {"pv": d, "free": 100, "extent_bytes": extent, "allocatable": True} for d in ("/dev/vda", "/dev/vdb")
    ]
    host = {
        "hana_storage_host.in_place_facts": MagicMock(return_value=facts),
        "hana_storage_host.lv_room": MagicMock(return_value={"segments": SEGMENTS, "pvs": pvs}),
        "cmd.run_all": MagicMock(return_value={"retcode": 0, "stdout": "", "stderr": ""}),
    }
    monkeypatch.setattr(states, "__salt__", host, raising=False)
    monkeypatch.setattr(states, "__opts__", {"test": False}, raising=False)
    monkeypatch.setattr(states, "__context__", {}, raising=False)
    monkeypatch.setattr(states, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(states, "_ramfs", lambda directory: os.makedirs(directory, exist_ok=True))
    ret = states.encrypted_in_place("hana_data", device, "/hana/data", "/k", LUKS, stripes, 64, ["noatime"])
    return ret, host


# ---- unclear: xfs_repair -n does not read HANA's data --------------------------------------------


def _protofile_xfs(tmp_path, image):
    """An XFS whose root directory holds a 10 MiB file of HANA's, made by mkfs.xfs itself: its
    data lands in AG 0, inside the volume's first 16 MiB."""
    data = tmp_path / "hana.dat"
    data.write_bytes(os.urandom(10 * MIB))
    proto = tmp_path / "proto"
    proto.write_text(f"/dev/null\n0 0\nd--755 0 0\ndata ---644 0 0 {data}\n$\n")
    subprocess.run(["truncate", "-s", str(PLAIN + ROOM), str(image)], check=True)
    subprocess.run(
        ["mkfs.xfs", "-q", "-s", "size=4096", "-d", f"size={PLAIN}", "-p", str(proto), str(image)],
        check=True,
    )
    bmap = subprocess.run(
        ["xfs_db", "-r", "-c", "path /data", "-c", "bmap", str(image)], capture_output=True, text=True
    ).stdout
    start, count = map(int, re.search(r"startblock (\d+) \(0/\d+\) count (\d+)", bmap).groups())
    assert (start + count) * 4096 <= SHIFT, bmap  # the file's data is in the first 16 MiB
    return start * 4096, data.read_bytes()


def test_unclear_advice_on_a_clean_xfs_repair_zeroes_the_only_copy_of_hanas_file_data(
    module, monkeypatch, tmp_path
):
    """HOLE (fixed; data loss by advice: an init of the earlier formula version cut in its header write,
    the header's first bio lost - the superblock, AG 0 headers and root inodes (the first 512 KiB)
    intact, the rest of the first 16 MiB the LUKS2 keyslot area. xfs_repair -n checks metadata
    only and says clean (exit 0); the advice then reads "the copy was cut off and the head is
    intact: zero the last 16 MiB", and that dd destroys the only copy of the HANA file data that
    lived in the first 16 MiB). Fix: tell the halves apart by content, block by block, in the
    formula: a cut copy leaves every tail block either zeros or equal to the head's (the head
    untouched); a cut header write leaves a complete tail and a head whose differing blocks hold
    the header. Never send an admin to a metadata check to decide about data."""
    for tool in ("cryptsetup", "mkfs.xfs", "xfs_repair", "xfs_db", "blkid"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")
    image, key, work = tmp_path / "lv.img", tmp_path / "k.key", tmp_path / "work"
    work.mkdir()
    key.write_bytes(os.urandom(64))
    offset, data = _protofile_xfs(tmp_path, image)
    with open(image, "rb") as handle:
        head = handle.read(SHIFT)
    # the earlier version's init: cryptsetup's own copy and header write, for real
    argv = inplace.reencrypt_init(str(image), "hana_data", str(key), CHEAP, ROOM, 4096)[:-1]
    done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with open(image, "r+b") as handle:
        handle.write(head[: 512 * 1024])  # the power cut: the header's first bio never landed
    lab = Lab(module, monkeypatch, tmp_path, image)  # the earlier version's tags: no copy tags
    lab.mounted = False
    ret, facts = lab.apply()
    assert inplace.stage(facts)[0] == "unclear", facts
    assert subprocess.run(["xfs_repair", "-n", str(image)], capture_output=True).returncode == 0
    follow(ret["comment"], lab)  # what the refusal says to do
    with open(image, "rb") as handle:
        handle.seek(offset)
        in_head = handle.read(len(data))
    in_tail = lab.tail()[offset : offset + len(data)]
    assert data in (in_head, in_tail), "HANA's file data is gone from both halves"


# ---- torn: the copy back, to the letter ---------------------------------------------------------


def test_torn_advice_on_a_mounted_xfs_says_to_unmount_before_the_dd(monkeypatch, tmp_path):
    """HOLE (fixed; data loss by advice: the XFS is mounted from the LV right now - a boot mounted it by
    its UUID from /etc/fstab after a power cut between the copy's COPIED tag and cryptsetup, and
    HANA runs; the refusal's first instruction is "copy them back (dd ... of=<the LV>)", a raw
    write of 16 MiB of old bytes under a live XFS's superblock, AG headers and inodes). The state
    knows it is mounted (mounted_from == "device"). Fix: when the LV is mounted, say so first:
    the head is live (the state's own mount-back drops the tags, so only a boot or an admin
    mounted it since the copy): stop HANA, unmount, and never copy the tail back while mounted;
    better, do not offer the copy back at all then."""
    facts = dict(
        HOST_FACTS,
        mounted_from="device",
        device_bytes=PLAIN + ROOM,
        lv_tags=[inplace.plain_tag(PLAIN), inplace.HEAD_COPIED_TAG],
        head_copy="copied",
        tail="other",
    )
    ret, _ = apply_with(monkeypatch, tmp_path, facts, "/dev/vg_hana_data/lv_hana_data")
    assert ret["result"] is False and "copy them back" in ret["comment"], ret["comment"]
    comment = ret["comment"]
    before = comment[: comment.index("dd if=")]
    assert "unmount" in before or "umount" in before, comment


def test_torn_advice_to_remove_the_copy_tag_leads_to_the_next_refusal(module, monkeypatch, tmp_path):
    """HOLE (fixed; an advice loop that ends in a data-losing choice: the torn refusal says "if the XFS
    was mounted since the copy and HANA wrote to it, remove the copy's tag (lvchange --deltag
    COPIED) and apply again". Done to the letter, the next apply finds no tag and a tail that is
    not the head: "unclear", refused again, now asking to pick by xfs_repair -n between zeroing the
    tail and copying the (stale) tail over HANA's live head). Fix: advise replacing the tag with
    HEAD_COPY_BEGUN_TAG (lvchange --deltag COPIED --addtag BEGUN: the head is the truth, the tail
    a stale copy the next apply makes again), or zeroing the tail with the tag removed."""
    lab = Lab(module, monkeypatch, tmp_path, make_image(tmp_path), [inplace.plain_tag(PLAIN)])
    lab.write(os.path.getsize(lab.image) - SHIFT, lab.head())  # the state's copy, tagged complete
    lab.tags.append(inplace.HEAD_COPIED_TAG)
    lab.write(6 * MIB, os.urandom(64 * 1024))  # a boot mounted it by fstab, HANA wrote
    ret, facts = lab.apply()
    assert inplace.stage(facts)[0] == "torn", facts
    untag = re.search(r"\((lvchange --deltag [^)]*)\)", ret["comment"]).group(1).split()
    lab.lvchange(untag)  # the advice, to the letter
    again, facts = lab.apply()
    assert again["result"] is True, (inplace.stage(facts), lab.tags, again["comment"])


def _odd_room_image(tmp_path, plain, room):
    """A bare LV image (no XFS needed: the facts are given) whose init was cut in the header
    write: the tail holds the head's first data_shift(room) bytes, the head the header's junk."""
    shift = inplace.data_shift(room)
    image = tmp_path / "odd.img"
    head = os.urandom(shift)
    with open(image, "wb") as handle:
        handle.write(head + os.urandom(plain - shift) + bytes(room - shift) + head)
    with open(image, "r+b") as handle:
        handle.write(os.urandom(shift))  # the header write, landed in part
    return image, head


def test_torn_advice_with_a_room_of_odd_mib_copies_back_the_wrong_bytes(monkeypatch, tmp_path):
    """HOLE (fixed; data loss by advice: three stripes on 1 MiB extents (a VG not made by the formula)
    give a 33 MiB room, a data shift of 16.5 MiB. The refusal's copy back says bs=1M skip=<MiB>
    count=16: it reads from 16 MiB before the end, 512 KiB into the copy, and writes it at
    offset 0: the volume's first 16 MiB come back shifted by 512 KiB and its last 512 KiB of the
    head not at all). Fix: name the copy in bytes (iflag=skip_bytes,count_bytes skip=<size -
    shift> count=<shift>), from the same numbers _head_copy's dd uses; the zeroing likewise."""
    plain, room = 64 * MIB, inplace.header_room(3, 64 * 1024, MIB)
    assert room == 33 * MIB
    image, head = _odd_room_image(tmp_path, plain, room)
    facts = dict(
        HOST_FACTS,
        mounted_from=None,
        device_bytes=plain + room,
        lv_tags=[inplace.plain_tag(plain), inplace.HEAD_COPIED_TAG],
        head_copy="copied",
        tail="other",
    )
    ret, _ = apply_with(monkeypatch, tmp_path, facts, str(image), stripes=3, extent=MIB)
    assert ret["result"] is False and "copy them back" in ret["comment"], ret["comment"]
    run_advice(advised(ret["comment"])[0])
    with open(image, "rb") as handle:
        assert handle.read(len(head)) == head, "the copy back did not bring the head back"


def test_torn_advice_with_the_usual_room_brings_the_head_back_exactly(monkeypatch, tmp_path):
    """CLOSED. With a 32 MiB room the copy back named restores the head byte for byte."""
    plain = 64 * MIB
    image, head = _odd_room_image(tmp_path, plain, ROOM)
    facts = dict(
        HOST_FACTS,
        mounted_from=None,
        device_bytes=plain + ROOM,
        lv_tags=[inplace.plain_tag(plain), inplace.HEAD_COPIED_TAG],
        head_copy="copied",
        tail="other",
    )
    ret, _ = apply_with(monkeypatch, tmp_path, facts, str(image))
    run_advice(advised(ret["comment"])[0])
    with open(image, "rb") as handle:
        assert handle.read(len(head)) == head
