# ruff: noqa: F811 - the host module fixture imported from tests/unit/test_module_facts.py is a parameter here
"""Attack 23: the block-wise verdict on an earlier version's cut init (no copy tags: stage
``unclear``, tail "partial" or "other") and the advice it gives, followed to the letter on real
XFS images with real dd (and real cryptsetup where its bytes matter).

"partial" claims: every block where the room differs from the head is zeros, so the copy was
cut and the head is as it was. "other" claims: the room holds data where the head differs, so the
header write was cut and the room is the only copy. Both rest on two assumptions: a cut write
leaves each 4 KiB block whole, and a header write never lands where the head was zeros."""

import os
import re
import shutil
import subprocess

import pytest
from hana_storage_core import inplace

from tests.unit.test_attack22_advice import CHEAP, follow, room_saves  # noqa: F401 - a fixture
from tests.unit.test_attack22_mount_back import PLAIN, ROOM, SHIFT, Lab, make_image
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

MIB = 1 << 20


def legacy(module, monkeypatch, tmp_path, image):
    """The earlier version's LV: grown, its plain size tagged, no copy tags; not mounted."""
    lab = Lab(module, monkeypatch, tmp_path, image, [inplace.plain_tag(PLAIN)])
    lab.mounted = False
    return lab


# ---- a cut write is whole in 512-byte sectors, not 4 KiB blocks ----------------------------------


def test_a_copy_cut_inside_a_4k_block_reads_as_a_header_write_and_its_advice_zeroes_the_head(
    module, monkeypatch, tmp_path
):
    """HOLE (fixed; data loss by advice: on a device with 512-byte logical sectors - most SAN LUNs (512e),
    and any XFS made with 512-byte sectors - a power cut is atomic per 512-byte sector, not per
    4 KiB: cryptsetup's 16 MiB O_DIRECT copy of an earlier version's init cut 5 MiB + 1536 bytes
    in leaves one tail block that is 1536 bytes of the head and 2560 bytes of zeros. tail_state
    (COPY_BLOCK = 4096, "what a cut write leaves whole") calls that block "data where the head
    differs": "other", "the header write was cut off, copy them back". The copy back writes the
    zeros of the room the copy never reached over the head's last 11 MiB: HANA's data, gone -
    the very regression the head copy set out to remove). Fix: judge at the device's logical
    sector size (512 bytes, queue/logical_block_size): a cut copy leaves every 512-byte sector
    either the head's or zeros; or compare at 512 bytes always (a whole 4 KiB block is eight
    whole sectors)."""
    lab = legacy(module, monkeypatch, tmp_path, make_image(tmp_path))
    before = lab.head()
    cut = 5 * MIB + 3 * 512
    lab.write(os.path.getsize(lab.image) - SHIFT, before[:cut])  # the copy, cut mid-block
    ret, facts = lab.apply()
    assert inplace.stage(facts)[0] == "unclear" and ret["result"] is False, facts
    follow(ret["comment"], lab)  # the refusal's instructions, to the letter
    assert lab.head() == before, f"the head's data is gone ({facts['tail']}: {ret['comment'][:300]})"


def test_a_copy_cut_on_a_4k_boundary_reads_partial_and_its_advice_keeps_the_head(
    module, monkeypatch, tmp_path
):
    """CLOSED. The same copy cut on a 4 KiB boundary, with zero blocks in the head (XFS free space)
    as well: "partial", the advice saves the room and has the copy made again, and the next apply
    goes on."""
    image = make_image(tmp_path)
    lab = legacy(module, monkeypatch, tmp_path, image)
    lab.write(9 * MIB, bytes(MIB))  # a MiB of zeros in the head, copied as zeros
    before = lab.head()
    lab.write(os.path.getsize(image) - SHIFT, before[: 10 * MIB])
    ret, facts = lab.apply()
    assert facts["tail"] == "partial" and inplace.stage(facts)[0] == "unclear", facts
    follow(ret["comment"], lab)  # the room saved, the copy tagged to be made again
    assert lab.head() == before and inplace.HEAD_COPY_BEGUN_TAG in lab.tags
    again, _ = lab.apply()
    assert again["result"] is True and lab.head() == before == lab.tail(), again["comment"]


# ---- a header write over zeros reads as a cut copy -------------------------------------------------


def _xfs_with_a_zeroed_file(tmp_path, image):
    """An XFS (mkfs.xfs -p) whose root holds a 10 MiB file of HANA's whose fifth MiB is zeros
    written as data (a database's zero-filled pages): its data in the volume's first 16 MiB.
    Returns the file's offset on the LV and its content."""
    content = bytearray(os.urandom(10 * MIB))
    content[4 * MIB : 5 * MIB] = bytes(MIB)
    data = tmp_path / "hana.dat"
    data.write_bytes(bytes(content))
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
    assert (start + count) * 4096 <= SHIFT, bmap
    return start * 4096, bytes(content)


def test_a_header_write_landed_only_over_zero_blocks_reads_as_a_cut_copy_and_the_only_copy_is_zeroed(
    module, monkeypatch, tmp_path
):
    """HOLE (fixed; data loss by advice: an earlier version's init, cryptsetup's own copy complete, its
    header write (one 16 MiB write, split into bios) cut by a power cut after one bio landed: the
    MiB of the keyslot area (random bytes) over a MiB of the head that held zeros - a data file's
    zero-filled pages, as here, or zeroed XFS metadata. Every block where head and room differ has
    zeros in the room (the copy of those zeros), so tail_state says "partial": "the copy was cut
    off and the first bytes are as they were. Zero the room". That zeroes the only copy; the file
    keeps a MiB of keyslot noise where its zeros were, and nothing says so). A differing block
    whose room is zeros is a cut copy OR a header write over zeros: the content cannot tell.
    Fix: never advise destroying the room outright: have the admin save it first (dd of=<file>
    on another device) and check the head's differing blocks (they are the header's if they match
    the LUKS2 keyslot area, e.g. `cryptsetup luksDump` of a head with a header); or advise, for
    "partial", copying back only the room's non-zero blocks (a no-op for a cut copy) and keep it."""
    for tool in ("cryptsetup", "mkfs.xfs", "xfs_db", "blkid"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")
    image, key, work = tmp_path / "lv.img", tmp_path / "k.key", tmp_path / "work"
    work.mkdir()
    key.write_bytes(os.urandom(64))
    offset, content = _xfs_with_a_zeroed_file(tmp_path, image)
    zeros = offset + 4 * MIB
    with open(image, "rb") as handle:
        head = handle.read(SHIFT)
    # the earlier version's init, for real: cryptsetup's copy into the room, then its header
    argv = inplace.reencrypt_init(str(image), "hana_data", str(key), CHEAP, ROOM, 4096)[:-1]
    done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with open(image, "r+b") as handle:
        header = handle.read(SHIFT)
        handle.seek(0)
        handle.write(head)  # the power cut: of the header write, only one MiB landed...
        handle.seek(zeros)
        handle.write(header[zeros : zeros + MIB])  # ...the one over the file's zeros
    assert header[zeros : zeros + MIB].strip(b"\0")  # the keyslot area is random bytes
    lab = legacy(module, monkeypatch, tmp_path, image)
    ret, facts = lab.apply()
    assert inplace.stage(facts)[0] == "unclear", facts
    follow(ret["comment"], lab)  # the refusal's instructions, to the letter
    with open(image, "rb") as handle:
        handle.seek(offset)
        in_head = handle.read(len(content))
    in_tail = lab.tail()[offset : offset + len(content)]
    assert content in (in_head, in_tail), f"HANA's file is changed in both halves ({facts['tail']})"


def test_a_real_init_cut_in_its_header_write_over_data_reads_other_and_the_copy_back_restores_it(
    module, monkeypatch, tmp_path
):
    """CLOSED. The same cut header write landing over the file's random data: "other", and the
    copy back the refusal names first restores the head byte for byte."""
    for tool in ("cryptsetup", "mkfs.xfs", "xfs_db", "blkid"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")
    image, key, work = tmp_path / "lv.img", tmp_path / "k.key", tmp_path / "work"
    work.mkdir()
    key.write_bytes(os.urandom(64))
    offset, _ = _xfs_with_a_zeroed_file(tmp_path, image)
    with open(image, "rb") as handle:
        head = handle.read(SHIFT)
    argv = inplace.reencrypt_init(str(image), "hana_data", str(key), CHEAP, ROOM, 4096)[:-1]
    done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    landed = offset + MIB  # the file's random data
    with open(image, "r+b") as handle:
        header = handle.read(SHIFT)
        handle.seek(0)
        handle.write(head)
        handle.seek(landed)
        handle.write(header[landed : landed + MIB])
    lab = legacy(module, monkeypatch, tmp_path, image)
    ret, facts = lab.apply()
    assert facts["tail"] == "other", facts
    follow(ret["comment"], lab)
    assert lab.head() == head


def test_cryptsetups_own_copy_with_an_odd_room_lands_on_the_tail_the_state_compares(tmp_path):
    """CLOSED. A 33 MiB room (three stripes on 1 MiB extents): cryptsetup's init copies exactly
    data_shift(room) = 16.5 MiB to the device's last 16.5 MiB, the bytes tail_state and the
    advice's dd name."""
    if not shutil.which("cryptsetup"):
        pytest.skip("cryptsetup not installed")
    room = inplace.header_room(3, 64 * 1024, MIB)
    shift = inplace.data_shift(room)
    assert room == 33 * MIB
    image, key, work = tmp_path / "odd.img", tmp_path / "k.key", tmp_path / "work"
    work.mkdir()
    key.write_bytes(os.urandom(64))
    head = os.urandom(shift + MIB)
    with open(image, "wb") as handle:
        handle.write(head)
        handle.truncate(64 * MIB + room)
    argv = inplace.reencrypt_init(str(image), "hana_data", str(key), CHEAP, room, 4096)[:-1]
    done = subprocess.run(argv, cwd=work, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with open(image, "rb") as handle:
        handle.seek(64 * MIB + room - shift)
        assert handle.read() == head[:shift]


# ---- the advice on a volume mounted right now ---------------------------------------------------


def test_unclear_advice_on_a_mounted_lv_leads_with_a_copy_back_that_writes_the_rooms_zeros_over_hana(
    module, monkeypatch, tmp_path
):
    """HOLE (fixed; data loss by advice: an earlier version's init cut in cryptsetup's own copy (5 of 16
    MiB copied, the head intact); the boot mounts the XFS from the LV by its UUID (/etc/fstab) and
    HANA runs; its writes (and the mount's own superblock and log writes) change blocks the copy
    had reached, so the room is "other". The formula is upgraded and applied: the XFS is mounted
    from the LV right now (facts: mounted_from == "device") - a head that mounts and runs HANA is
    the XFS's own, not a torn header - yet the refusal says "stop HANA and unmount it. Then: the
    header write was cut off ... copy them back (dd ...)". Done to the letter, that dd writes the
    room's 11 MiB of zeros and 5 MiB of stale copy over HANA's live head. The alternative ("only if
    the XFS was mounted since ... zero the room instead") comes last, though the state knows it
    was). Fix: when the XFS is mounted from the LV, never name the copy back: the head is the
    newest; advise zeroing the room (the only safe choice), or tag the copy to be made again."""
    lab = Lab(module, monkeypatch, tmp_path, make_image(tmp_path), [inplace.plain_tag(PLAIN)])
    lab.write(os.path.getsize(lab.image) - SHIFT, lab.head()[: 5 * MIB])  # cryptsetup's cut copy
    assert lab.mounted  # the boot mounted it; HANA writes
    lab.write(4 * MIB + 256 * 1024, os.urandom(64 * 1024))  # where the copy had reached
    live = lab.head()
    ret, facts = lab.apply()
    assert facts["mounted_from"] == "device" and inplace.stage(facts)[0] == "unclear", facts
    lab.mounted = False  # "stop HANA and unmount it before anything else"
    follow(ret["comment"], lab)  # "Then:" what it names
    assert lab.head() == live, f"HANA's live head was overwritten ({ret['comment'][:400]})"
