"""Attack 17: a power cut while ``cryptsetup reencrypt --encrypt --init-only`` writes its header.

What the real cryptsetup 2.6 does (strace of the state's own command line on a file): it builds
the new header in ``LUKS2-temp-<uuid>.new`` in its working directory, then (1) copies the
volume's first 16 MiB (the data offset) to the last 16 MiB of the device (the header's room),
then (2) writes the whole 16 MiB header area at offset 0 in ONE O_DIRECT write, fsyncs, and
unlinks the temp file. A SIGKILL at any syscall leaves either the untouched head (with or without
the tail copy) or the complete header (checked with ``strace -e inject=...:signal=KILL:when=N`` at
each of the 40 writes/fsyncs): SIGKILL is safe. A power cut is not: the kernel splits the 16 MiB
write into many bios that the disk (or the array's cache) may persist in any order before the
fsync. When the first bio (the LUKS2 header copies, the first 512 KiB) is lost and later ones
landed, the volume's first 16 MiB are the XFS superblock (intact: blkid still says ``xfs``) over
15.5 MiB of keyslot area, and the only copy of those 15.5 MiB is the tail. The next apply's facts
then say ``plain``, and the state runs the init again, which copies the torn head over the tail:
the volume's first 16 MiB (AG 0 headers, root inodes, HANA's data there) are gone for good. The
README claims "a crash or a power cut at any moment loses nothing".
"""

import hashlib
import os
import shutil
import subprocess
from unittest.mock import MagicMock

import pytest
from hana_storage_core import inplace

from tests.support.real_commands import real_run_all as _real_run_all
from tests.unit.test_inplace import LUKS, PVS, SEGMENTS, states
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

MIB = 1 << 20
PLAIN = 320 * MIB  # mkfs.xfs wants 300 MB at least
ROOM = inplace.header_room(2, 64 * 1024, 4 * MIB)  # 32 MiB, as the state computes it for SEGMENTS/PVS
CHEAP = dict(LUKS, pbkdf={"type": "pbkdf2", "force_iterations": 1000})


def _tools():
    for tool in ("cryptsetup", "mkfs.xfs", "blkid"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")


def _init_argv(image, key):
    """The state's own init command line, without the name (no device-mapper needed)."""
    argv = inplace.reencrypt_init(str(image), "hana_data", str(key), CHEAP, ROOM, 4096)
    return argv[:-1]


def _block_sums(data, block=4096):
    return [hashlib.sha256(data[i : i + block]).digest() for i in range(0, len(data), block)]


@pytest.fixture
def torn(tmp_path):
    """An LV of PLAIN bytes grown by ROOM (tagged), its XFS and data; the init run for real;
    then the power cut: the header write's first 512 KiB never reached the disk."""
    _tools()
    image, key, work = tmp_path / "lv.img", tmp_path / "k.key", tmp_path / "work"
    work.mkdir()
    key.write_bytes(os.urandom(64))
    key.chmod(0o400)
    subprocess.run(["truncate", "-s", str(PLAIN + ROOM), str(image)], check=True)
    subprocess.run(["mkfs.xfs", "-q", "-s", "size=4096", "-d", f"size={PLAIN}", str(image)], check=True)
    with open(image, "r+b") as handle:  # HANA's bytes in the volume's first 16 MiB
        handle.seek(4 * MIB)
        handle.write(os.urandom(12 * MIB))
    with open(image, "rb") as handle:
        head = handle.read(16 * MIB)
    done = subprocess.run(_init_argv(image, key), cwd=work, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with open(image, "rb") as handle:
        handle.seek(PLAIN + ROOM - 16 * MIB)
        assert handle.read(16 * MIB) == head  # the first 16 MiB now live in the tail only...
    with open(image, "r+b") as handle:
        handle.write(head[: 512 * 1024])  # ...and the power cut kept the old first 512 KiB
    return image, key, head


def _host_facts(module, monkeypatch, image):  # noqa: F811 - the fixture's module
    """in_place_facts on the image, as the host module reads it: blkid and the XFS superblock
    for real; no device-mapper, no unit, not mounted; the LV's tags from the first run (its size
    before, and the state's own copy of the head complete: the init runs only after it)."""
    module.__salt__ = {"cmd.run_all": _real_run_all}
    monkeypatch.setattr(module, "_sysfs", dict)
    monkeypatch.setattr(module, "block_bytes", lambda path: os.path.getsize(path))
    monkeypatch.setattr(module, "mounted_at", lambda mountpoint: None)
    monkeypatch.setattr(module, "_unit_active", lambda unit: False)
    real_run = module._run
    monkeypatch.setattr(
        module,
        "_run",
        lambda argv: (
            (f"  {inplace.plain_tag(PLAIN)},{inplace.HEAD_COPIED_TAG}\n", None)
            if argv[0] == "lvs"
            else real_run(argv)
        ),
    )
    return module.in_place_facts(str(image), "hana_data", "/hana/data", inplace.data_shift(ROOM))


def test_a_power_cut_in_the_header_write_then_an_apply_destroys_the_first_16_mib(
    torn,
    module,  # noqa: F811
    monkeypatch,
    tmp_path,
):
    """HOLE (data loss). Impact: after a power cut that tore the header write (superblock
    still XFS), the next apply sees ``plain`` and runs ``cryptsetup reencrypt --init-only``
    again, which moves the torn head over the tail, the only copy of the volume's first
    16 MiB. Fix: before an init on an LV whose tag says it was already grown (a previous run
    may have got into the init), compare the LV's first 16 MiB with its last 16 MiB (the moved
    first segment): if the tail is a copy the head no longer matches, refuse and name the
    repair (copy the tail back over the head); or zero the room after lvextend and refuse
    whenever it is not zero and differs from the head. README: no "loses nothing" claim
    for power cuts in the init without that."""
    image, key, head = torn
    facts = _host_facts(module, monkeypatch, image)
    assert facts["signature"] == "xfs"  # blkid: the torn head still reads as the XFS
    assert inplace.stage(facts)[0] == "torn"  # the tail is a copy the head no longer matches

    ran = MagicMock(return_value={"retcode": 0, "stdout": "", "stderr": ""})
    host = {
        "hana_storage_host.in_place_facts": MagicMock(return_value=facts),
        "hana_storage_host.lv_room": MagicMock(return_value={"segments": SEGMENTS, "pvs": PVS}),
        "cmd.run_all": ran,
    }
    monkeypatch.setattr(states, "__salt__", host, raising=False)
    monkeypatch.setattr(states, "__opts__", {"test": False}, raising=False)
    monkeypatch.setattr(states, "__context__", {}, raising=False)
    monkeypatch.setattr(states, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(states, "_ramfs", lambda directory: os.makedirs(directory, exist_ok=True))
    ret = states.encrypted_in_place(
        "hana_data", str(image), "/hana/data", str(key), CHEAP, 2, 64, ["noatime"]
    )
    inits = [c.args[0] for c in ran.call_args_list if c.args[0][:2] == ["cryptsetup", "reencrypt"]]
    lost = 0.0
    if inits:  # what that command does to the volume, for real (without the name: no dm here)
        work = tmp_path / "again"
        work.mkdir()
        subprocess.run(inits[0][:-1], cwd=work, capture_output=True, check=False)
        with open(image, "rb") as handle:
            handle.seek(PLAIN + ROOM - 16 * MIB)
            tail = handle.read(16 * MIB)
        lost = sum(a != b for a, b in zip(_block_sums(tail), _block_sums(head), strict=True)) * 4096 / MIB
    assert not inits, (
        f"the state ran the init again on a torn header ({ret['comment'][:160]}): {lost} MiB of "
        "the volume's first 16 MiB now exist nowhere"
    )
