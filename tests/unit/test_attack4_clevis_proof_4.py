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

from tests.unit.test_readiness import host, stand_in  # noqa: F401 - fixture


def test_clevis_does_not_outlive_a_cryptsetup_that_could_not_be_started(host, monkeypatch):
    stand_in(host, "sleep 30\nprintf SECRET\n")
    stand_in(host, "cat >/dev/null\n", "cryptsetup")
    real_popen = subprocess.Popen
    started = []

    def popen(argv, **kwargs):
        if argv[0] == "cryptsetup":
            raise BlockingIOError(11, "Resource temporarily unavailable")  # fork: EAGAIN
        started.append(real_popen(argv, **kwargs))
        return started[-1]

    monkeypatch.setattr(host.subprocess, "Popen", popen)
    with host.core.files.memory_copy(__file__, 64) as copy:
        verdict = host._clevis_pass(copy, "1", 10)
    assert verdict[0] is None and "cannot start cryptsetup" in verdict[1], verdict
    (clevis,) = started
    try:
        # the defect: clevis still running, or an unreaped zombie, after the call returned
        assert clevis.returncode is not None and not os.path.exists(f"/proc/{clevis.pid}"), verdict
    finally:
        if clevis.returncode is None:
            os.killpg(clevis.pid, 9)
            clevis.wait()
