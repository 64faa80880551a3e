"""Attack 4 on the Clevis proofs (254c4ba): when starting the second child (cryptsetup) fails with
anything but FileNotFoundError - fork's EAGAIN under a pids cgroup limit (a Salt minion's
TasksMax), EMFILE, ENOMEM, EACCES - the clevis child already started is neither killed nor
reaped: ``_clevis_child`` only cleans up for FileNotFoundError, the OSError goes up to
``clevis_opens`` / ``_clevis_unlocks`` (which report "does not open" and go on), and clevis
runs on - asking Tang and the TPM, its stdout a pipe whose read end this process still holds -
then stays a zombie.

The stand-in clevis and cryptsetup are on PATH as in tests/unit/test_readiness.py; the failure to
start the second child is the one thing given (Popen raising as fork does when the host is out
of processes)."""

# ruff: noqa: F811

import os
import subprocess
import time

import pytest

from tests.unit.test_readiness import host, stand_in  # noqa: F401 - fixture


def test_clevis_does_not_outlive_a_cryptsetup_that_could_not_be_started(host, tmp_path, monkeypatch):
    pid_file = tmp_path / "clevis.pid"
    stand_in(host, f"echo $$ >{pid_file}\nsleep 30\nprintf SECRET\n")
    stand_in(host, "cat >/dev/null\n", "cryptsetup")
    real_popen = subprocess.Popen

    def popen(argv, **kwargs):
        if argv[0] == "cryptsetup":
            raise BlockingIOError(11, "Resource temporarily unavailable")  # fork: EAGAIN
        return real_popen(argv, **kwargs)

    monkeypatch.setattr(host.subprocess, "Popen", popen)
    with host.core.files.memory_copy(__file__, 64) as copy:
        try:
            verdict = host._clevis_pass(copy, "1", 10)
        except OSError as error:  # what clevis_opens and _clevis_unlocks catch
            verdict = error
    deadline = time.monotonic() + 5
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the stand-in clevis never ran"
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    time.sleep(0.5)
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = None  # killed and reaped
    try:
        # the defect: clevis still running (S) or an unreaped zombie (Z) after the call returned
        assert state is None, f"clevis {pid} left in state {state} after {verdict!r}"
    finally:
        if state is not None:
            os.killpg(pid, 9)
            with pytest.raises(ChildProcessError):
                for _ in range(100):
                    os.waitpid(pid, 0)
