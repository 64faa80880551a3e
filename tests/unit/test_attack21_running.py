"""Attack 21 on what the audit (and the beacon, each tick) now asks the host while a crypt's
re-encryption stack exists: hana_storage_host._reencryptions_running (8f6cd3c), i.e.
_unit_active and _reencrypt_running's scan of /proc. Tests whose docstring starts with "HOLE"
fail on 3deadb9."""

import os
import signal
import subprocess
import time

from hana_storage_core import inplace

from tests.unit.test_attack20_running import NAME, block_node, stand_in, stop
from tests.unit.test_attack20_running import host as host20

host = host20


def dm(name):
    return {"dm_name": name}


def test_systemctl_and_proc_are_asked_only_while_a_stack_of_the_plans_crypt_exists(monkeypatch):
    """Held: no stack device, no question; one of hana_log_0's asks for hana_log_0 only."""
    asked, scanned = [], []
    monkeypatch.setattr(host, "_unit_active", lambda unit: asked.append(unit) or False)
    monkeypatch.setattr(host, "_reencrypt_running", lambda name, device: scanned.append(name) or False)
    plan = {"volumes": {"log": {"crypt": [{"name": "hana_log_0", "device": "/dev/vdc"},
                                          {"name": "hana_log_1", "device": "/dev/vdd"}]}}}  # fmt: skip
    devices = {
        "dm-2": dm("hana_log_0"),
        "dm-3": dm("hana_log_1"),
        "vdc": {"dm_name": None},
        "dm-9": dm("x-overlay"),
    }
    assert host._reencryptions_running(plan, devices) == {}
    assert asked == scanned == []
    devices["dm-8"] = dm("hana_log_0-hotzone-forward")
    assert host._reencryptions_running(plan, devices) == {"hana_log_0": False}
    assert asked == [inplace.unit_name("hana_log_0")] and scanned == ["hana_log_0"]


def test_a_stopped_hand_re_encryption_reads_as_running(tmp_path):
    """HOLE (fixed, medium) [a frozen volume no finding names]: a hand `cryptsetup reencrypt` stopped with
    Ctrl-Z (SIGSTOP/SIGTSTP: an admin's terminal) while its hotzone is suspended holds the LUN's
    I/O until it is continued, maybe never. _reencrypt_running matches its argv and says True, so
    facts["reencrypting"] is True and _health_rules leaves the suspended hotzone out of
    HANA-LAYOUT-004 (and _xfs_rules skips HANA-LAYOUT-003): the audit and the beacon stay silent
    while HANA stalls. The same holds for a unit whose cryptsetup is stopped or stuck ("active"
    is all _unit_active asks). Fix: a stopped process (/proc/<pid>/stat state T/t) does not run;
    and time-bound the exemption (a hotzone suspended across two samples a few seconds apart, or
    longer than the hotzone's ~1 s, is the finding whatever runs)."""
    device = block_node(tmp_path / "lv")
    proc = stand_in(["reencrypt", "--resume-only", str(device)])
    try:
        assert host._reencrypt_running(NAME, str(device)) is True  # running: seen
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30  # the signal lands when the scheduler says: a loaded CI is slow
        while time.monotonic() < deadline:
            with open(f"/proc/{proc.pid}/stat") as handle:
                if handle.read().rsplit(")", 1)[1].split()[0] in "Tt":
                    break
            time.sleep(0.01)
        assert host._reencrypt_running(NAME, str(device)) is False
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


def test_words_that_name_no_device_are_stat_ed_under_the_hand_runs_directory(tmp_path, monkeypatch):
    """HOLE (fixed, medium) [the audit and the beacon hang]: since 8f6cd3c every argv word of a hand
    `cryptsetup reencrypt` that does not start with '-' and is not a file option's value is
    os.stat()-ed as /proc/<pid>/cwd/<word>: the action word `reencrypt` itself, and the values of
    --hotzone-size, --resilience, --progress-frequency, --active-name ... And before the device word
    is ever compared (pairwise order: `reencrypt` comes first). An admin who started the
    re-encryption from a home directory on NFS (common) whose server is gone: the stat blocks,
    and with it _reencryptions_running in every audit and beacon tick (asked exactly while the
    stack exists and the unit is not the one running it) and reencrypt_facts in every apply.
    Fix: compare positional words only (skip the action word and every option's value), and
    resolve a relative word against the cwd only when it contains no NUL and the cwd is on a
    local filesystem, or after checking `arg in names` for every word first."""
    device = block_node(tmp_path / "lv")
    seen = []
    real = host._block_number
    monkeypatch.setattr(host, "_block_number", lambda path: seen.append(path) or real(path))
    proc = stand_in(
        ["reencrypt", "--resilience", "checksum", "--hotzone-size", "4M", str(device)], cwd=tmp_path
    )
    try:
        assert host._reencrypt_running(NAME, str(device)) is True
    finally:
        stop(proc)
    under_cwd = [p for p in seen if p.startswith(f"/proc/{proc.pid}/cwd")]
    assert under_cwd == [], under_cwd


def test_every_processs_cmdline_is_read_while_a_stack_exists(tmp_path, monkeypatch):
    """HOLE (fixed, medium, not provable here) [the beacon hangs exactly when it should fire]:
    _reencrypt_running reads /proc/<pid>/cmdline of every process on the host. The kernel reads
    cmdline from the process's memory under its mmap lock (access_remote_vm): a process with a
    thread stuck in a page fault on a file of the frozen volume (HANA's mmap'ed data/log files)
    and another thread waiting to mmap/munmap makes that read block (the known `ps` hang). The
    audit asks this precisely while a killed cryptsetup's hotzone is frozen (stack left, unit
    not active): the beacon that should raise HANA-LAYOUT-004 hangs in the facts instead.
    Fix: filter on /proc/<pid>/comm (task->comm, no mm lock) == b"cryptsetup\\n" first and read
    the cmdline of those only (then also check /proc/<pid>/stat's state)."""
    device = block_node(tmp_path / "lv")
    other = subprocess.Popen(["sleep", "30"])
    opened = []
    real_open = open

    def recording_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(host, "open", recording_open, raising=False)
    try:
        host._reencrypt_running(NAME, str(device))
    finally:
        stop(other)
    assert f"/proc/{other.pid}/cmdline" not in opened
