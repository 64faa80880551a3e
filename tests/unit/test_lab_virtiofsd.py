"""lab/bin/virtiofsd: the host's directories virtme-ng shares with the lab guest over virtio-fs
through QEMU 7.2's C daemon. A read-only share stays read-only (the C daemon has none of its
own), a share it cannot serve leaves no pid file (virtme-ng then uses 9p), and the pid file
names the daemon virtme-ng stops."""

import os
import pathlib
import shutil
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO

WRAPPER = REPO / "lab" / "bin" / "virtiofsd"
C_DAEMON = pathlib.Path("/usr/lib/qemu/virtiofsd")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not C_DAEMON.exists() or not shutil.which("unshare"),
    reason="needs root, unshare and QEMU's C virtiofsd (the lab's host)",
)


def start(tmp_path, shared, *options, env=None):
    sock = tmp_path / "fs.sock"
    proc = subprocess.Popen(
        [WRAPPER, "--syslog", *options, "--socket-path", sock, "--shared-dir", shared, "--sandbox", "none"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    pid_file = pathlib.Path(f"{sock}.pid")
    deadline = time.monotonic() + 10
    while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, sock, pid_file


def stop(proc, pid_file):
    if pid_file.exists():
        os.kill(int(pid_file.read_text()), signal.SIGTERM)  # what virtme-ng does at its exit
    proc.wait(timeout=10)


def visible_mounts(pid, under):
    """{mount point: options} of the mounts a process sees under a path (the top one of a stack)."""
    top = {}
    for line in pathlib.Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == under or fields[4].startswith(f"{under}/"):
            top[fields[4]] = fields[5]
    return top


def test_it_announces_read_only_shares_so_virtme_ng_asks_for_them():
    out = subprocess.run([WRAPPER, "--help"], capture_output=True, text=True, check=True).stdout
    assert "--readonly" in out


def test_a_read_only_share_of_the_root_is_read_only_in_every_mount_the_guest_reaches(tmp_path):
    proc, sock, pid_file = start(tmp_path, "/", "--readonly", "--cache", "always")
    try:
        assert pid_file.exists() and sock.is_socket(), "the daemon did not start"
        pid = int(pid_file.read_text())
        assert pathlib.Path(f"/proc/{pid}/exe").resolve() == C_DAEMON
        source = next(
            a for a in pathlib.Path(f"/proc/{pid}/cmdline").read_text().split("\0") if "source=" in a
        )
        view = source.split("source=")[1].split(",")[0]
        mounts = visible_mounts(pid, view)
        assert view in mounts and len(mounts) > 1, mounts  # the root and its submounts (/proc, /dev ...)
        assert {m: o for m, o in mounts.items() if o.split(",")[0] != "ro"} == {}
        assert visible_mounts(os.getpid(), view) == {}, "the view leaked into the host's namespace"
    finally:
        stop(proc, pid_file)
    assert not pathlib.Path(view).exists(), "the view's directory stayed"


def test_a_read_write_share_is_served_from_the_directory(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    proc, sock, pid_file = start(tmp_path, shared, "--cache", "auto")
    try:
        assert pid_file.exists() and sock.is_socket()
        cmdline = pathlib.Path(f"/proc/{int(pid_file.read_text())}/cmdline").read_text()
        assert f"source={shared},cache=auto" in cmdline
    finally:
        stop(proc, pid_file)


def test_a_share_it_cannot_serve_leaves_no_pid_file_so_virtme_ng_falls_back_to_9p(tmp_path):
    proc, _, pid_file = start(tmp_path, tmp_path / "missing", "--readonly")
    assert proc.wait(timeout=10) != 0
    assert not pid_file.exists()


def test_a_comma_in_a_path_passes_the_daemon_no_options(tmp_path):
    """-o source=<view>,...: a TMPDIR of "/x,timeout=0" made it source=/x, served read-write."""
    (tmp_path / "t").mkdir()
    tmpdir = tmp_path / "t,timeout=0"
    tmpdir.mkdir()
    proc, _, pid_file = start(tmp_path, "/", "--readonly", env=dict(os.environ, TMPDIR=str(tmpdir)))
    try:
        assert proc.wait(timeout=10) != 0
        assert not pid_file.exists()
    finally:
        stop(proc, pid_file)
    proc, _, pid_file = start(tmp_path, tmpdir)
    assert proc.wait(timeout=10) != 0
    assert not pid_file.exists()
