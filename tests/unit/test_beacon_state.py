"""The beacon's memory across loaders and restarts, its close(), lost uevents, and the mount table.

The beacon module is loaded with Salt's dunders filled in by hand (as tests/unit/test_events.py
does); the kernel parts that can be real here are: the uevent socket of this host's kernel, its
mount table, the memory file in a real directory. The real minion daemon is in
tests/integration/test_beacon_memory.py.
"""

import errno
import fcntl
import importlib.util
import io
import itertools
import json
import logging
import os
import socket
import stat
import threading
import time

import pytest
from hana_storage_core import events as events
from hana_storage_core import rules as rules
from hana_storage_core import tab as tab

from tests.conftest import REPO
from tests.unit.conftest import full_audits_in_the_tick

COUNTER = itertools.count()
CONFIG = [{"full_audit_interval": 3600}, {"uevents": False}, {"_beacon_name": "hana_storage"}]


def finding(rule="HANA-PERF-002", volume="data", device="/dev/mapper/hana_data"):
    severity, remediation = rules.RULES[rule].severity, rules.RULES[rule].remediation
    return {
        "rule": rule,
        "severity": severity,
        "volume": volume,
        "mountpoint": f"/hana/{volume}",
        "device": device,
        "expected": ["no_read_workqueue"],
        "actual": [],
        "remediation": remediation,
        "message": "m",
    }


class Host:
    """What hana_storage.audit reports on the simulated host: every beacon instance audits it.

    ``gate``: when set, a full audit reads the host, then waits for the gate before it returns
    (a slow full audit that read a volume before it changed)."""

    def __init__(self):
        self.findings = []
        self.gate = None

    def audit(self, volumes=None):
        findings = [f for f in self.findings if volumes is None or f["volume"] in volumes]
        if volumes is None and self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        return {
            "compliant": not findings,
            "findings": [dict(f) for f in findings],
            "volumes": {
                "data": {
                    "mountpoint": "/hana/data",
                    "stack": ["dm-1", "dm-0", "vda"],
                    "disks": ["vda"],
                    "compliant": not findings,
                    "rules": sorted({f["rule"] for f in findings}),
                }
            },
        }


class Watch:
    """A kernel watch that reports what the test queues; remembers being closed."""

    def __init__(self):
        self.queued, self.closed = [], False

    def drain(self):
        return self.queued.pop(0) if self.queued else (set(), False, False)

    def close(self):
        self.closed = True


@pytest.fixture
def host():
    return Host()


@pytest.fixture
def minion(tmp_path, host):
    """start(master=...) -> a beacon module in a new loader (a fresh __context__) of the same minion."""
    cachedir = tmp_path / "cache"
    cachedir.mkdir()

    def start(master="salt-a", watch=True, threads=False):
        spec = importlib.util.spec_from_file_location(
            f"beacon_state_{next(COUNTER)}", REPO / "_beacons" / "hana_storage.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.core = importlib.import_module("hana_storage_core")  # what its first tick imports
        module.__context__ = {}
        module.__opts__ = {
            "id": "db1",
            "pki_dir": str(tmp_path),
            "cachedir": str(cachedir),
            "master": master,
        }
        module.__salt__ = {"hana_storage.audit": host.audit}
        module.real_read_mounts, module._read_mounts = module._read_mounts, lambda: []
        if watch:
            module.watch = Watch()
            module._state()["watch"] = module.watch
        return module if threads else full_audits_in_the_tick(module)

    start.memory = cachedir / "hana_storage" / "beacon-memory.json"
    return start


def tags(out):
    return [(e["tag"], e.get("key")) for e in out]


KEY = events.finding_key(finding())


# ---- the memory survives a new loader and a restart ---------------------------------------------


def test_an_open_finding_is_not_reported_again_by_a_new_loader(minion, host):
    """Regression (issue 13, item 11): the memory lived in __context__ only, and every refresh or
    restart sent each open finding again as a new violation with a new ts."""
    host.findings = [finding()]
    first = minion()
    out = {e["tag"]: e for e in first.beacon(CONFIG)}
    violation = out["violation"]
    assert violation["ts"] == out["audit"]["since"][KEY]

    again = minion()  # saltutil.refresh_pillar / refresh_modules / a restarted minion
    out = again.beacon(CONFIG)
    assert [e["tag"] for e in out] == ["audit"]  # no second violation
    assert out[0]["since"] == {KEY: violation["ts"]}  # the same occurrence
    assert violation["since"] == violation["ts"]  # and the violation names it


def test_a_finding_that_cleared_while_down_is_resolved_with_its_since(minion, host):
    host.findings = [finding()]
    first = minion()
    violation = first.beacon(CONFIG)[0]
    host.findings = []  # fixed while the minion was down
    later = minion()
    out = later.beacon(CONFIG)
    assert [e["tag"] for e in out] == ["resolved", "audit"]
    assert out[0]["key"] == KEY and out[0]["since"] == violation["ts"]
    host.findings = [finding()]  # and back: a new occurrence
    later._state()["next_full"] = None
    out = {e["tag"]: e for e in later.beacon(CONFIG)}
    assert out["violation"]["since"] == out["violation"]["ts"] > violation["ts"]


def test_no_memory_is_written_or_read_on_an_idle_tick(minion, host, monkeypatch):
    beacon = minion()
    beacon.beacon(CONFIG)
    calls = []
    monkeypatch.setattr(beacon.core.beacon_memory, "memory_dir", lambda cachedir: calls.append(1))
    for _ in range(5):
        assert beacon.beacon(CONFIG) == []
    assert calls == []


def test_the_memory_file_is_root_only_atomic_and_holds_findings_only(minion, host):
    host.findings = [finding()]
    beacon = minion()
    beacon.beacon(CONFIG)
    path = minion.memory
    directory = os.stat(path.parent)
    info = os.lstat(path)
    assert stat.S_IMODE(directory.st_mode) == 0o700 and directory.st_uid == os.geteuid()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert sorted(p.name for p in path.parent.iterdir()) == ["beacon-memory.json", "beacon-memory.lock"]
    content = json.loads(path.read_text())
    record = content["instances"]["salt-a|hana_storage"]
    assert content["version"] == 1 and set(record) == {"known", "since", "ended", "written"}
    assert record["known"] == {KEY: finding()} and list(record["since"]) == [KEY]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(minion, host, monkeypatch, caplog):
    host.findings = [finding()]
    beacon = minion()
    beacon.beacon(CONFIG)
    before = minion.memory.read_bytes()

    def broken_rename(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(beacon.os, "rename", broken_rename)
    host.findings = [finding(), finding("HANA-PERF-003")]
    beacon.watch.queued.append(({"dm-0"}, False, False))
    with caplog.at_level(logging.WARNING):
        out = beacon.beacon(CONFIG)
    assert [e["rule"] for e in out] == ["HANA-PERF-003"]  # reported all the same
    assert "memory file: [Errno 5] Input/output error" in caplog.text
    assert minion.memory.read_bytes() == before
    assert sorted(p.name for p in minion.memory.parent.iterdir()) == [
        "beacon-memory.json",
        "beacon-memory.lock",
    ]


# ---- a memory file that cannot be trusted is ignored, never a crash ----------------------------------


def garbage(path):
    path.write_bytes(b"\x00{not json")


def wrong_version(path):
    path.write_text(json.dumps({"version": 99, "instances": {}}))


def foreign_owner(path):
    os.chown(path, 1, 1)


def world_writable(path):
    path.chmod(0o666)


def symlink(path):
    target = path.with_name("elsewhere.json")
    path.rename(target)
    path.symlink_to(target)


def bad_entries(path):
    content = json.loads(path.read_text())
    record = content["instances"]["salt-a|hana_storage"]
    record["known"]["x|y|z"] = finding()  # a key that is not the finding's own
    record["since"].pop(KEY)  # the real one loses its since: it is an occurrence without a time
    path.write_text(json.dumps(content))
    path.chmod(0o600)


@pytest.mark.parametrize(
    "spoil,logged",
    [
        (garbage, "ignored: not JSON"),
        (wrong_version, "not a version 1 beacon memory"),
        (foreign_owner, "not a regular file of this user with mode 0600 (owner uid 1"),
        (world_writable, "mode 0666"),
        (symlink, "Too many levels of symbolic links"),
        (bad_entries, None),
    ],
    ids=lambda v: getattr(v, "__name__", None) or str(v)[:20],
)
def test_an_untrusted_memory_file_is_ignored_with_a_log_line(minion, host, caplog, spoil, logged):
    if spoil is foreign_owner and os.geteuid() != 0:
        pytest.skip("chown needs root")
    host.findings = [finding()]
    first = minion()
    first.beacon(CONFIG)
    spoil(minion.memory)
    again = minion()
    with caplog.at_level(logging.WARNING):
        out = again.beacon(CONFIG)  # no crash: the finding is reported again, as a new occurrence
    assert [e["tag"] for e in out] == ["violation", "audit"]
    if logged:
        assert logged in caplog.text
    # and the next save replaced the file with a good one (through no symlink)
    assert not minion.memory.is_symlink() and stat.S_IMODE(minion.memory.stat().st_mode) == 0o600
    record = json.loads(minion.memory.read_text())["instances"]["salt-a|hana_storage"]
    assert record["since"] == {KEY: out[0]["ts"]}


def test_a_directory_others_can_write_is_not_used(minion, host, caplog):
    minion.memory.parent.mkdir(mode=0o700)
    minion.memory.parent.chmod(0o777)
    host.findings = [finding()]
    with caplog.at_level(logging.WARNING):
        assert [e["tag"] for e in minion().beacon(CONFIG)] == ["violation", "audit"]
    assert "is not this user's alone" in caplog.text and "mode 0777" in caplog.text
    assert not minion.memory.exists()


def test_a_lock_held_elsewhere_delays_nothing_for_long(minion, host, monkeypatch, caplog):
    beacon = minion()
    monkeypatch.setattr(beacon.core.beacon_memory, "MEMORY_LOCK_SECONDS", 0.2)
    minion.memory.parent.mkdir(mode=0o700)
    holder = os.open(minion.memory.with_name("beacon-memory.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        host.findings = [finding()]
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            out = beacon.beacon(CONFIG)
        assert time.monotonic() - started < 2
        assert [e["tag"] for e in out] == ["violation", "audit"]
        assert out[0]["since"] == out[0]["ts"]
        assert "held for over 0.2 s by another process" in caplog.text
    finally:
        os.close(holder)


# ---- two instances in one minion (hot multi-master without a beacon leader) ---------------------------


def test_two_instances_keep_their_own_findings_and_share_the_first_since(minion, host):
    a, b = minion(master="salt-a"), minion(master="salt-b")
    a.beacon(CONFIG), b.beacon(CONFIG)  # both compliant
    host.findings = [finding()]
    for beacon in (a, b):
        beacon.watch.queued.append(({"dm-0"}, False, False))
    (va,) = a.beacon(CONFIG)
    time.sleep(0.01)
    (vb,) = b.beacon(CONFIG)
    assert va["tag"] == vb["tag"] == "violation"  # each tells its own master, once
    assert vb["since"] == va["since"] == va["ts"] < vb["ts"]  # one occurrence: the first since
    # a restart of both: nobody reports it again
    a2, b2 = minion(master="salt-a"), minion(master="salt-b")
    assert [e["since"] for e in a2.beacon(CONFIG) + b2.beacon(CONFIG)] == [{KEY: va["ts"]}] * 2
    # A sees it clear and come back before B notices: for A that is a new occurrence
    host.findings = []
    a2.watch.queued.append(({"dm-0"}, False, False))
    assert [e["tag"] for e in a2.beacon(CONFIG)] == ["resolved"]
    host.findings = [finding()]
    a2.watch.queued.append(({"dm-0"}, False, False))
    time.sleep(0.01)
    (again,) = a2.beacon(CONFIG)
    assert again["tag"] == "violation" and again["since"] == again["ts"] > va["ts"]
    records = json.loads(minion.memory.read_text())["instances"]
    assert set(records) == {"salt-a|hana_storage", "salt-b|hana_storage"}
    assert records["salt-b|hana_storage"]["since"] == {KEY: va["ts"]}


def test_a_record_not_written_for_a_week_is_dropped(minion, host, monkeypatch):
    host.findings = [finding()]
    old = minion(master="gone")
    old.beacon(CONFIG)
    content = json.loads(minion.memory.read_text())
    content["instances"]["gone|hana_storage"]["written"] -= 8 * 86400
    minion.memory.write_text(json.dumps(content))
    fresh = minion(master="salt-a")
    (violation, _audit) = fresh.beacon(CONFIG)
    assert violation["since"] == violation["ts"]  # not the stale record's
    assert list(json.loads(minion.memory.read_text())["instances"]) == ["salt-a|hana_storage"]


# ---- close() ------------------------------------------------------------------------------------


def test_close_releases_the_watch_writes_the_memory_and_the_next_tick_audits_all(minion, host):
    beacon = minion()
    beacon.beacon(CONFIG)
    host.findings = [finding()]
    beacon._state()["saved"] = None
    watch = beacon.watch
    beacon.close(CONFIG)  # what Salt does before a new loader, or during a state run
    assert watch.closed and beacon._state()["watch"] is None
    assert json.loads(minion.memory.read_text())["instances"]["salt-a|hana_storage"]["known"] == {}
    out = beacon.beacon(CONFIG)  # a new (real, mount-only) watch, and a full audit
    assert [e["tag"] for e in out] == ["violation", "audit"]
    assert beacon._state()["watch"] is not watch
    beacon.close(CONFIG)
    beacon.close(CONFIG)  # twice is fine


def open_descriptors():
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            found[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return found


def test_close_leaves_no_descriptor_open_on_this_host(minion, host):
    """The real KernelWatch (uevent socket via pyroute2, /proc/self/mountinfo), ticked and closed
    ten times as ten loaders would: nothing stays open (pyroute2's own loop included)."""
    pytest.importorskip("pyroute2")
    before = open_descriptors()
    for _ in range(10):
        beacon = minion(watch=False)
        try:
            beacon.beacon([{"full_audit_interval": 3600}, {"uevents": True}])
        except OSError as error:
            pytest.skip(f"no uevent socket here: {error}")
        assert isinstance(beacon._state()["watch"], beacon.core.kernel_watch.KernelWatch)
        beacon.close([])
    left = {k: v for k, v in open_descriptors().items() if k not in before}
    assert left == {}


# ---- lost uevents (ENOBUFS) ---------------------------------------------------------------------


class Datagrams:
    """A socket whose recv() returns or raises what the test lists, then would block."""

    def __init__(self, *items):
        self.items = list(items)

    def recv(self, size, flags):
        assert flags & socket.MSG_DONTWAIT
        if not self.items:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self):
        pass


class Marshal:
    def parse(self, datagram):
        return [{"ACTION": "change", "SUBSYSTEM": "block", "DEVNAME": datagram.decode()}]


def watch_over(beacon, sock):
    watch = beacon.core.kernel_watch.KernelWatch(False)
    watch.socket, watch.marshal = sock, Marshal()
    return watch


ENOBUFS = OSError(errno.ENOBUFS, "No buffer space available")


def test_lost_uevents_start_a_full_audit_instead_of_crashing(minion, host, caplog):
    """Regression (issue 13, item 9): ENOBUFS on the first read left `datagram` unbound and the
    tick died with UnboundLocalError instead of the full audit its log line promised."""
    beacon = minion(watch=False)
    beacon.beacon(CONFIG)  # the first full audit
    beacon._state()["watch"] = watch_over(beacon, Datagrams(ENOBUFS, b"dm-0", b"vda"))
    with caplog.at_level(logging.WARNING):
        out = beacon.beacon(CONFIG)
    assert [e["tag"] for e in out] == ["audit"] and out[0]["trigger"] == "full"
    assert "uevents lost (ENOBUFS); a full audit follows" in caplog.text
    beacon.close(CONFIG)


def test_drain_reads_on_after_a_loss_and_stops_when_empty(minion):
    beacon = minion(watch=False)
    watch = watch_over(beacon, Datagrams(b"dm-1", ENOBUFS, b"dm-2", ENOBUFS, b"dm-3"))
    assert watch.drain() == ({"dm-1"}, False, True)  # what came after the loss: the full audit's
    assert watch.drain() == (set(), False, False)
    watch.close()


def test_drain_is_bounded_when_events_never_stop(minion, monkeypatch):
    beacon = minion(watch=False)
    monkeypatch.setattr(beacon.core.kernel_watch, "DRAIN_LIMIT", 50)

    class Endless(Datagrams):
        def recv(self, size, flags):
            return b"dm-9"

    watch = watch_over(beacon, Endless())
    assert watch.drain() == ({"dm-9"}, False, True)
    watch.close()


def test_drain_survives_enobufs_on_this_hosts_uevent_socket(minion):
    """The real kernel: the watch's uevent socket shrunk to a minimal buffer, twenty `change`
    uevents written to a block device: the kernel drops what does not fit and reports ENOBUFS."""
    pytest.importorskip("pyroute2")
    devices = sorted(os.listdir("/sys/class/block")) if os.path.isdir("/sys/class/block") else []
    if not devices or not os.access(f"/sys/class/block/{devices[0]}/uevent", os.W_OK):
        pytest.skip("no writable block device uevent file here")
    control = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)  # NETLINK_KOBJECT_UEVENT
    control.bind((0, 1))
    beacon = minion(watch=False)
    watch = beacon.core.kernel_watch.KernelWatch(True)
    try:
        watch.drain()
        watch.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's minimum
        for _ in range(20):
            with open(f"/sys/class/block/{devices[0]}/uevent", "w") as handle:
                handle.write("change")
        control.settimeout(1)
        try:
            control.recv(65536)
        except TimeoutError:
            pytest.skip("no uevents reach this network namespace (a container)")
        time.sleep(0.2)
        _devices, _, lost = watch.drain()
        assert lost is True
        assert watch.drain() == (set(), False, False)  # the socket is usable again
    finally:
        watch.close()
        control.close()


# ---- the mount table as the beacon reads it ------------------------------------------------------


def test_the_beacon_reads_a_mount_table_with_odd_lines(minion, monkeypatch, caplog):
    """An empty source, a path that is not UTF-8 and a line that does not parse: the table is read,
    the bad line is named in the log once, the HANA mount is there."""
    beacon = minion()
    table = (
        b"25 23 0:23 / /run rw,relatime - tmpfs  rw\n"
        b"26 23 0:24 / /mnt/x\xffy rw - tmpfs tmpfs rw\n"
        b"27 23 0:25 / /garbled\n"
        b"40 23 253:1 / /hana/data rw,noatime - xfs /dev/mapper/hana_data rw,logbsize=256k\n"
    )
    monkeypatch.setattr(beacon.core.kernel_watch, "open", lambda *a, **k: io.BytesIO(table), raising=False)
    with caplog.at_level(logging.WARNING):
        mounts = beacon.real_read_mounts()
        beacon.real_read_mounts()
    assert [m["mountpoint"] for m in mounts] == ["/run", "/mnt/x\\xffy", "/hana/data"]
    assert caplog.text.count("mountinfo line 3 ('27 23 0:25 / /garbled')") == 1
    view = events.mount_view(mounts, {"/hana/data"})
    assert view == {"/hana/data": ("253:1", ("rw", "noatime", "rw", "logbsize=256k"))}


def test_events_are_signed_with_the_minions_key_on_every_salt_line(minion, host, tmp_path):
    """Regression (issue 14): the beacon loaded its key with PrivateKey.from_file, which only Salt
    3008 has; on 3006 and 3007 the first tick raised and no event ever reached the master."""
    import base64

    import salt.crypt

    from tests.support.keys import write_keypair

    _, pub = write_keypair(tmp_path, "minion")
    host.findings = [finding()]
    out = minion().beacon(CONFIG)
    assert out
    for event in out:
        message = events.signed_bytes("db1", event["tag"], event)
        assert salt.crypt.verify_signature(
            str(pub), message, base64.b64decode(event["sig"]), algorithm=salt.crypt.PKCS1v15_SHA224
        ), event["tag"]


# ---- the full audit runs beside the ticks ---------------------------------------------------------


def collect_full(beacon, config=CONFIG):
    """Wait for the running full audit, then tick: what that tick reports."""
    beacon._state()["full"].thread.join(10)
    return beacon.beacon(config)


def full_audit(beacon, config=CONFIG):
    """Tick, and once more after the full audit it started (or that runs) ended: all they report.
    A full audit of the simulated host may end within the tick that starts it."""
    out = beacon.beacon(config)
    if beacon._state()["full"] is not None:
        out += collect_full(beacon, config)
    return out


@pytest.fixture
def slow_full(minion, host):
    """A beacon with real full-audit threads past its first full audit, and a second full audit
    running that read the host compliant and waits for ``host.gate``."""
    beacon = minion(threads=True)
    assert tags(full_audit(beacon)) == [("audit", None)]
    host.gate = threading.Event()
    beacon._state()["next_full"] = None
    assert beacon.beacon(CONFIG) == []
    full = beacon._state()["full"]
    time.sleep(0.05)
    assert full is not None and not full.done()
    gate = host.gate
    yield beacon
    gate.set()


def test_a_drift_while_a_full_audit_runs_is_reported_in_that_tick(slow_full, host):
    """Regression (issue 17, point 5): the full audit ran in the tick, so a drift that came while
    it ran waited for it (seconds on a large host), and the drift p95 missed 2 s."""
    host.findings = [finding()]
    slow_full.watch.queued.append(({"dm-0"}, False, False))
    out = slow_full.beacon(CONFIG)
    assert tags(out) == [("violation", KEY)] and out[0]["trigger"] == "uevent"
    assert not slow_full._state()["full"].done()


def test_a_full_audit_older_than_a_ticks_audit_does_not_undo_it(slow_full, host):
    """The full audit read the volume before the drift: its compliant view of that volume is
    dropped, so no resolved event follows the violation, and the audit lists the finding."""
    host.findings = [finding()]
    slow_full.watch.queued.append(({"dm-0"}, False, False))
    violation = slow_full.beacon(CONFIG)[0]
    host.gate.set()
    out = collect_full(slow_full)
    assert tags(out) == [("audit", None)]
    assert out[0]["open"] == {KEY: finding()["severity"]} and out[0]["since"] == {KEY: violation["since"]}
    assert out[0]["volumes"]["data"]["rules"] == ["HANA-PERF-002"] and not out[0]["compliant"]
    assert slow_full.beacon(CONFIG) == []


def test_a_full_audit_still_reports_what_cleared_on_volumes_no_tick_audited(slow_full, host):
    slow_full._state()["known"][KEY] = finding()  # open before this full audit read the host
    slow_full._state()["since"][KEY] = 1.0
    host.gate.set()
    out = collect_full(slow_full)
    assert tags(out) == [("resolved", KEY), ("audit", None)] and out[0]["since"] == 1.0


def test_close_drops_a_running_full_audit_and_the_next_tick_starts_anew(slow_full, host):
    running = slow_full._state()["full"]
    slow_full.close(CONFIG)
    host.gate.set()
    running.thread.join(10)
    host.gate = None
    host.findings = [finding()]
    assert tags(full_audit(slow_full)) == [("violation", KEY), ("audit", None)]  # a new one


def test_uevents_lost_while_a_full_audit_runs_start_another_after_it(slow_full, host):
    slow_full.watch.queued.append((set(), False, True))
    assert slow_full.beacon(CONFIG) == []  # one at a time
    host.gate.set()
    assert tags(collect_full(slow_full)) == [("audit", None)]
    host.gate = None
    assert tags(full_audit(slow_full)) == [("audit", None)]  # due at once


def test_a_full_audit_that_fails_in_its_thread_is_reported_and_retried_soon(minion, host):
    beacon = minion(threads=True)

    def broken(volumes=None):
        raise TimeoutError("File client timed out after 180 seconds")

    beacon.__salt__["hana_storage.audit"] = broken
    out = full_audit(beacon)
    assert tags(out) == [("error", None)] and out[0]["trigger"] == "full"
    assert beacon._state()["next_full"] - time.monotonic() <= beacon.RETRY_SECONDS
