"""Attack 4 on the Clevis proofs (254c4ba): on a timeout of the second child, ``_kill_all``
SIGKILLs the process group of the first child, which ``communicate`` has already reaped.

When clevis luks pass has answered and cryptsetup then gives no answer in time (a KDF on a busy
host, the 0.1 s floor of what is left of the deadline), ``_clevis_child`` calls ``_kill_all``,
which runs ``os.killpg(clevis_pid, SIGKILL)`` for the clevis child that exited and was waited for
seconds earlier. Its pid (and so that process group id) is free by then: any process that got the
number meanwhile and leads its group (a service, a job of a shell, anything started with setsid)
is killed, with root's rights in a Salt minion. Before 254c4ba only a child still unreaped (its
pid held) was ever killed.

Here the reuse is made certain rather than waited for: once clevis is reaped the test sets
/proc/sys/kernel/ns_last_pid so that an innocent ``sleep`` in a session of its own gets clevis's
old pid. Stand-in clevis and cryptsetup on PATH, as tests/unit/test_readiness.py."""

# ruff: noqa: F811

import os
import subprocess
import threading
import time

import pytest

from tests.unit.test_readiness import host, stand_in  # noqa: F401 - fixture

LAST_PID = "/proc/sys/kernel/ns_last_pid"


def innocent_gets_pid_of(pid_file, got):
    """Wait for the stand-in clevis to be reaped, then start a session leader with its pid."""
    deadline = time.monotonic() + 5
    while not pid_file.exists() or not pid_file.read_text().strip():
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    pid = int(pid_file.read_text())
    while os.path.exists(f"/proc/{pid}"):  # a zombie keeps its /proc entry until it is reaped
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
    with open(LAST_PID, "w", encoding="ascii") as handle:
        handle.write(str(pid - 1))
    got["pid"] = pid
    got["innocent"] = subprocess.Popen(["sleep", "300"], start_new_session=True)  # noqa: S607


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(LAST_PID, os.W_OK), reason="needs root (ns_last_pid)")
def test_a_cryptsetup_timeout_does_not_kill_whatever_got_clevis_s_old_pid(host, tmp_path):
    pid_file = tmp_path / "clevis.pid"
    stand_in(host, f"echo $$ >{pid_file}\nprintf SECRET\n")
    stand_in(host, "cat >/dev/null\nexec sleep 300\n", "cryptsetup")  # clevis answered; cryptsetup hangs
    for _attempt in range(10):  # another process on the host may take the pid first: try again
        pid_file.unlink(missing_ok=True)
        got = {}
        watcher = threading.Thread(target=innocent_gets_pid_of, args=(pid_file, got))
        watcher.start()
        with host.core.files.memory_copy(__file__, 64) as copy:
            code, said = host._clevis_pass(copy, "1", 3)
        watcher.join()
        assert code is None and "no answer" in said, (code, said)
        innocent = got.get("innocent")
        if innocent is None:
            continue
        if innocent.pid != got["pid"]:
            innocent.kill()
            innocent.wait()
            continue
        try:
            time.sleep(0.2)
            # the defect: SIGKILL for a process group that was not clevis's any more
            assert innocent.poll() is None, (
                f"pid {innocent.pid}, not clevis's any more, was killed ({innocent.returncode})"
            )
        finally:
            if innocent.poll() is None:
                innocent.kill()
            innocent.wait()
        return
    pytest.skip("the pid could not be handed on (a busy host took it each time)")
