"""lab/guest_watch.py, which kills the VM tier's interrupted applies right after a step: its
snapshot sees each kind of change, its tests read the real formats, and it kills the whole
process group of a running apply or reports one that ended first."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "lab"))
import guest_watch  # noqa: E402


def test_a_snapshot_changes_with_a_file_a_directory_entry_or_a_device_block(tmp_path):
    crypttab, keys = tmp_path / "crypttab", tmp_path / "keys"
    keys.mkdir()
    crypttab.write_text("hana_data UUID=1 /k1 luks\n")
    paths = [str(crypttab), str(keys), str(tmp_path / "absent")]
    before = guest_watch.snapshot(paths)
    assert guest_watch.snapshot(paths) == before
    crypttab.write_text("hana_data UUID=1 /etc/k2 luks\n")  # in place: its size tells
    assert guest_watch.snapshot(paths) != before
    before = guest_watch.snapshot(paths)
    (keys / "hana.key").write_bytes(b"k")
    assert guest_watch.snapshot(paths) != before


def test_a_temporary_file_is_not_a_step_its_rename_is(tmp_path):
    """A header backup is written to <name>.new and renamed into place once proven. A kill as the
    .new appeared hit the same point on every apply, so a rotation never got past its backup."""
    backups = tmp_path / "luks-headers"
    backups.mkdir()
    before = guest_watch.snapshot([str(backups)])
    new = backups / "hana_data.luks-header.new"
    new.write_bytes(b"half a header")
    assert guest_watch.snapshot([str(backups)]) == before
    new.rename(backups / "hana_data.luks-header")
    assert guest_watch.snapshot([str(backups)]) != before


def test_the_tests_read_the_formats_they_name(tmp_path):
    device = tmp_path / "vdm"
    device.write_bytes(bytes(8192))
    assert not guest_watch.holds(f"luks:{device}") and not guest_watch.holds(f"xfs:{device}")
    device.write_bytes(b"LUKS\xba\xbe\x00\x02" + bytes(8184))
    assert guest_watch.holds(f"luks:{device}")
    assert guest_watch.holds(f"exists:{device}") and not guest_watch.holds(f"exists:{tmp_path}/none")
    with pytest.raises(SystemExit, match="unknown test"):
        guest_watch.holds(f"ext4:{device}")


@pytest.mark.skipif(not shutil.which("mkfs.xfs"), reason="mkfs.xfs (xfsprogs) is not installed")
def test_xfs_counts_only_once_mkfs_finished(tmp_path):
    image = tmp_path / "xfs.img"
    subprocess.run(["truncate", "-s", "300M", str(image)], check=True)
    subprocess.run(["mkfs.xfs", "-q", str(image)], check=True)
    assert guest_watch.holds(f"xfs:{image}")
    with open(image, "r+b") as handle:  # sb_inprogress, as mkfs.xfs leaves it while it writes
        handle.seek(guest_watch.XFS_INPROGRESS)
        handle.write(b"\x01")
    assert not guest_watch.holds(f"xfs:{image}")


def watch(*argv):
    return subprocess.run(
        [sys.executable, str(REPO / "lab" / "guest_watch.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()


def test_it_kills_the_apply_and_its_children_once_the_step_is_done(tmp_path):
    flag = tmp_path / "step-done"
    apply = subprocess.Popen(["sh", "-c", f"sleep 1; touch {flag}; sleep 60 & wait"], start_new_session=True)
    assert watch("kill", str(apply.pid), "holds", f"exists:{flag}") == "KILLED"
    assert apply.wait(timeout=10) == -9


def test_an_apply_that_ends_first_is_reported_not_killed(tmp_path):
    apply = subprocess.Popen(["sh", "-c", "sleep 0.5"], start_new_session=True)
    snapshot = tmp_path / "before"
    snapshot.write_text(guest_watch.snapshot([str(tmp_path / "x")]))
    # not reaped until wait(): a zombie, as an ended apply is until the lab's Salt server reaps it
    assert watch("kill", str(apply.pid), "changed", str(snapshot), str(tmp_path / "x")) == "ENDED"
    apply.wait()


def test_argv_sampling_sees_a_running_process_and_stops_on_its_file(tmp_path):
    marker = "hana-storage-argv-marker-0123"
    sleeper = subprocess.Popen(["sh", "-c", "sleep 30", marker])
    out, stop = tmp_path / "cmdlines.txt", tmp_path / "stop"
    sampler = subprocess.Popen(
        [sys.executable, str(REPO / "lab" / "guest_watch.py"), "argv", str(out), str(stop)]
    )
    try:
        deadline = time.monotonic() + 30
        while marker not in (out.read_text() if out.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"sh -c sleep 30 {marker}" in out.read_text()
        stop.write_text("")
        assert sampler.wait(timeout=10) == 0
    finally:
        sleeper.kill()
        sampler.kill()


@pytest.mark.skipif(not shutil.which("cryptsetup"), reason="cryptsetup is not installed")
def test_a_luks2_header_counts_as_changed_once_both_its_copies_are_written(tmp_path):
    """The rotation's kills landed between cryptsetup's writes of the two header copies; the next
    command's repair of the torn copy then changed the first 4 KiB again, and under load each
    apply was killed inside that repair, never reaching its next step (CI, 2026-11-29: 16 applies,
    7 of them killed with no step taken). A header is a step once both copies carry its number."""
    image, key = tmp_path / "vdc", tmp_path / "key"
    image.write_bytes(bytes(32 << 20))
    key.write_bytes(os.urandom(64))
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    subprocess.run(
        ["cryptsetup", "luksFormat", "-q", "--type", "luks2", *cheap, "--key-file", str(key), str(image)],
        check=True,
    )
    before = guest_watch.device_state(str(image))
    assert before.startswith("luks2:") and guest_watch.WRITING not in before
    size = int.from_bytes(guest_watch.head(str(image), 8, 8), "big")
    secondary = guest_watch.head(str(image), size, size)
    subprocess.run(
        ["cryptsetup", "luksAddKey", "-q", *cheap, "--key-file", str(key), str(image), str(key)], check=True
    )
    after = guest_watch.device_state(str(image))
    assert after != before and guest_watch.WRITING not in after
    with open(image, "r+b") as handle:  # the primary written, the secondary not yet
        handle.seek(size)
        handle.write(secondary)
    assert guest_watch.device_state(str(image)) == after + guest_watch.WRITING
