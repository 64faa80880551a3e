"""Kill a detached apply in the lab guest right after a step (the VM tier's interrupted applies).

    guest_watch.py snapshot PATH...                  what PATH... hold now, one line each
    guest_watch.py kill PID changed SNAPSHOT PATH... once PATH... differ from SNAPSHOT's lines
    guest_watch.py argv OUT STOP                     every process's argv, one line per process
                                                     and poll, into OUT until the file STOP exists
    guest_watch.py kill PID holds TEST...            once every TEST holds:
        luks:DEV    DEV starts with the LUKS magic       pv:DEV     `pvs DEV` lists it
        exists:PATH PATH exists                          xfs:DEV    DEV holds a finished XFS

A PATH is a block device (a LUKS2 header's sequence number, which changes with each keyslot
change, once both copies of the header carry it: cryptsetup writes one copy after the other, and
a kill between them is not after a step - the next command repairs the torn copy, and a kill in
that repair would hit the same point on every apply; any other device: its first 4 KiB), a file
(its inode, size and mtime: a rewrite, or a rename over it, changes them; 16 MiB header backups
are not read each poll), or a directory (each file in it but the
``*.new`` a step writes before renaming it into place: the rename is the step, and a kill at the
temporary file's first byte would hit the same point on every apply). ``kill`` polls every 20 ms, then
SIGKILLs PID's process group (the apply and its children) and prints KILLED, or ENDED when the
apply ended first. One process reading a few blocks, where a shell loop forked about ten
programs per poll: under emulation that took a whole vCPU from the apply it watched.
"""

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time

POLL_SECONDS = 0.02
XFS_INPROGRESS = 126  # sb_inprogress in the on-disk superblock: 1 while mkfs.xfs writes
# a LUKS header's copies (hana_storage_core.luks reads them whole; this one process polls every
# 20 ms in an emulated guest, so it imports nothing of the formula's)
LUKS_PRIMARY, LUKS_SECONDARY = b"LUKS\xba\xbe", b"SKUL\xba\xbe"


def head(path, size, offset=0):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return b""
    try:
        return os.pread(fd, size, offset)
    except OSError:
        return b""
    finally:
        os.close(fd)


def state_of(path):
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if not n.endswith(".new"))
        return " ".join(f"{n}={state_of(os.path.join(path, n))}" for n in names)
    try:
        info = os.stat(path)
    except OSError:
        return "-"
    if stat.S_ISBLK(info.st_mode):
        return device_state(path)
    return f"{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"


WRITING = ":writing"


def device_state(path):
    """A LUKS2 header's sequence number, WRITING appended while its copies differ; else a hash
    of the device's first 4 KiB."""
    first = head(path, 4096)
    if first[:8] != LUKS_PRIMARY + b"\x00\x02":
        return hashlib.sha256(first).hexdigest()[:16]
    seqid = int.from_bytes(first[16:24], "big")
    second = head(path, 24, int.from_bytes(first[8:16], "big"))
    both = second[:6] == LUKS_SECONDARY and int.from_bytes(second[16:24], "big") == seqid
    return f"luks2:{seqid}" + ("" if both else WRITING)


def changed(before, paths):
    """Whether PATHS differ from the snapshot BEFORE, with no LUKS2 header half written."""
    now = snapshot(paths)
    return now != before and WRITING not in now


def snapshot(paths):
    return "".join(f"{path} {state_of(path)}\n" for path in paths)


def holds(test):
    kind, _, path = test.partition(":")
    if kind == "exists":
        return os.path.exists(path)
    block = head(path, 4096)
    if kind == "luks":
        return block[:6] == LUKS_PRIMARY
    if kind == "pv":  # pvs (a second of CPU under emulation) only once the label is written
        labelled = any(block[n * 512 : n * 512 + 8] == b"LABELONE" for n in range(4))
        return labelled and subprocess.run(["pvs", path], capture_output=True).returncode == 0
    if kind == "xfs":
        return block[:4] == b"XFSB" and block[XFS_INPROGRESS] == 0
    raise SystemExit(f"unknown test {test!r}: luks:, pv:, exists: or xfs:")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is an apply that ended: its parent (the Salt server) reaps it when idle
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_when(pid, done):
    while not done():
        if not alive(pid):
            print("ENDED")
            return
        time.sleep(POLL_SECONDS)
    if not alive(pid):  # its last step was the one watched for, and it ended before this poll
        print("ENDED")
        return
    try:
        os.killpg(pid, signal.SIGKILL)
        print("KILLED")
    except ProcessLookupError:
        print("ENDED")


ARGV_POLL_SECONDS = 0.1


def argvs():
    """The argv of every process but the kernel's threads (an empty cmdline), one line each."""
    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    raw = cmdline.read()
            except OSError:  # ended meanwhile
                continue
            if raw:
                lines.append(raw.replace(b"\0", b" ").decode(errors="replace").strip())
    return lines


def sample_argv(out, stop):
    """What the tests search for key material in argv. In one process: the shell loop it replaced
    (cat, tr and sleep each poll) kept a whole vCPU of the emulated guest busy."""
    with open(out, "a") as handle:
        while not os.path.exists(stop):
            handle.write("\n".join(argvs()) + "\n")
            handle.flush()
            time.sleep(ARGV_POLL_SECONDS)


def main(argv):
    if argv[:1] == ["snapshot"]:
        sys.stdout.write(snapshot(argv[1:]))
    elif argv[:1] == ["argv"] and len(argv) == 3:
        sample_argv(argv[1], argv[2])
    elif argv[:1] == ["kill"] and len(argv) > 3 and argv[2] == "changed":
        pid, before, paths = int(argv[1]), open(argv[3]).read(), argv[4:]  # noqa: SIM115
        kill_when(pid, lambda: changed(before, paths))
    elif argv[:1] == ["kill"] and len(argv) > 3 and argv[2] == "holds":
        pid, tests = int(argv[1]), argv[3:]
        kill_when(pid, lambda: all(holds(test) for test in tests))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
