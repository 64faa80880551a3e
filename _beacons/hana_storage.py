"""
Compliance beacon for encrypted SAP HANA storage.

Watches the kernel and audits only what it touches:

* block-device uevents (pyroute2 ``UeventSocket``, kernel group): an add/remove/change of a
  device in a HANA volume's stack (``cryptsetup refresh``, ``dmsetup reload``, a disk going)
  re-audits that volume;
* mount-table changes (the kernel flags ``/proc/self/mountinfo`` with POLLPRI; a mount sends no
  uevent): a HANA mountpoint mounted, unmounted or remounted re-audits that volume;
* a second audit of the same volumes a couple of seconds after such an event, for changes that
  complete after the event (a LUKS2 header written after the table reload);
* a full audit every ``full_audit_interval`` seconds, the safety net for lost events. It runs in
  a thread of its own, so a kernel event is audited in the tick it arrives in, not after a full
  audit of every device; what a tick audited meanwhile is newer than the full audit's view of it.

An idle tick polls two file descriptors and returns: no subprocess, no device read.

Events (``salt/beacon/<minion>/hana_storage/<event>``), never with key material:

``violation``
    A finding appeared: rule, severity, volume, mountpoint, device, expected, actual,
    remediation (auto|manual), message; plus key, trigger (uevent|mount|full), ts, since (when
    this occurrence was first reported: the ts, unless another beacon instance of this minion
    reported it first) and sig.
``resolved``
    A finding cleared; the same fields as the violation it ends (since: of the occurrence ended).
``audit``
    After each full audit: compliant, per-volume compliance and failing rules, findings, by_rule,
    open (finding key: severity), since (finding key: the since of its violation event), seconds,
    ts, sig. The master's triage reconciles from it: an open finding whose violation it never
    handled (a reaction Salt lost, a master that was down) is acted on now.
``error``
    The audit could not run (invalid pillar, dmsetup failing ...): message, ts, sig. Once per
    distinct message.

A finding is reported when it appears and when it clears, never again while unchanged, also
across a new loader (``saltutil.refresh_pillar``, ``refresh_modules``, any ``pkg`` state) and a
minion restart: what the beacon has reported (the open findings and the ``since`` of each) is
kept in ``<cachedir>/hana_storage/beacon-memory.json`` (0600, replaced atomically, under a lock)
and read back when the beacon's ``__context__`` is new. The file holds findings as reported
(rules, devices, messages), never key material. Each beacon instance (master connection and
beacon name) keeps its own record in it; an occurrence another instance already reported keeps
that instance's ``since``. Violation and resolved events carry the occurrence's ``since`` too.
``close()`` (Salt calls it before it replaces the beacon loader, and during a state run with
``disable_during_state_run``) releases the uevent socket and the mountinfo descriptor.
``sig`` is the minion's RSA signature (PKCS#1 v1.5, SHA-224) over the minion id, the event and
its data, so the master can tell which minion really sent it (Salt lets any minion fire any tag).

.. code-block:: yaml

    beacons:
      hana_storage:
        - interval: 1                  # seconds between ticks: a drift waits for the next one
        - full_audit_interval: 300     # seconds between full audits
        - uevents: true                # react to kernel events between full audits
        - disable_during_state_run: true
"""

import contextlib
import contextvars
import errno
import fcntl
import json
import logging
import os
import select
import socket
import stat
import sys
import threading
import time

import salt.loader
import salt.utils.beacons
import salt.utils.platform

try:
    from pyroute2 import UeventSocket
    from pyroute2.netlink.uevent import MONITOR_GROUP_KERNEL

    HAS_PYROUTE2 = True
except ImportError:
    HAS_PYROUTE2 = False

log = logging.getLogger(__name__)

__virtualname__ = "hana_storage"

DEFAULTS = {"interval": 1, "full_audit_interval": 300, "uevents": True}
# Keys Salt itself reads from any beacon's configuration.
SALT_KEYS = {"interval", "disable_during_state_run", "run_once", "beacon_module", "enabled"}
CONTEXT = "hana_storage.beacon"
SETTLE_SECONDS = 2  # after a kernel event, audit its volumes once more this much later
RETRY_SECONDS = 30  # a failed full audit is tried again this soon, not a full interval later
DRAIN_LIMIT = 10000  # datagrams read per tick at most; more waiting counts as lost (a full audit)
# The beacon's memory on disk (see the module doc): <cachedir>/MEMORY_DIR/MEMORY_FILE.
MEMORY_DIR = "hana_storage"
MEMORY_FILE = "beacon-memory.json"
MEMORY_LOCK = "beacon-memory.lock"  # flock'ed; never replaced, unlike the file it guards
MEMORY_VERSION = 1
MEMORY_MAX_BYTES = 16 << 20
MEMORY_LOCK_SECONDS = 2  # a save waits this long for another instance's, then gives up (logged)
MEMORY_REFRESH_SECONDS = 3600  # an unchanged record is rewritten this often (its "written" time)
MEMORY_EXPIRE_SECONDS = 7 * 86400  # another instance's record not written for this long is dropped


def __virtual__():
    if not salt.utils.platform.is_linux():
        return False, "the hana_storage beacon watches Linux block devices"
    return __virtualname__


def validate(config):
    """
    Validate the beacon configuration.
    """
    if not isinstance(config, list):
        return False, "Configuration for the hana_storage beacon must be a list, e.g. [{interval: 1}]"
    if not all(isinstance(item, dict) for item in config):
        return False, "Each hana_storage beacon setting must be a mapping, e.g. - full_audit_interval: 300"
    config = salt.utils.beacons.list_to_dict(config)
    unknown = sorted(set(config) - set(DEFAULTS) - SALT_KEYS)
    if unknown:
        return False, f"hana_storage beacon: unknown setting(s) {', '.join(unknown)}; known: " + ", ".join(
            sorted(set(DEFAULTS) | SALT_KEYS)
        )
    settings = {**DEFAULTS, **config}
    for key, low in (("interval", 1), ("full_audit_interval", 10)):
        value = settings[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            return (
                False,
                f"hana_storage beacon: {key} must be an integer of at least {low} (seconds), got {value!r}",
            )
    if settings["full_audit_interval"] < settings["interval"]:
        return False, "hana_storage beacon: full_audit_interval must not be shorter than interval"
    if not isinstance(settings["uevents"], bool):
        return False, f"hana_storage beacon: uevents must be true or false, got {settings['uevents']!r}"
    if settings["uevents"] and not HAS_PYROUTE2:
        return False, "hana_storage beacon: uevents: true needs the pyroute2 Python package on the minion"
    return True, "Valid beacon configuration"


def _uevent_socket():
    """(pyroute2's uevent parser, a datagram socket bound to the kernel's uevent group).

    pyroute2 binds in a thread of its own: its sync API runs an asyncio loop, which cannot nest in
    the minion's running one, and it keeps the socket (and that loop) per thread. So that thread
    takes a duplicate of the bound socket and closes pyroute2's object, loop and all, itself:
    nothing of pyroute2 is left open but the parser, and closing the duplicate closes the socket.
    """
    made = {}

    def make():
        try:
            uevents = UeventSocket()
            try:
                uevents.bind(groups=MONITOR_GROUP_KERNEL)
                bound = uevents.asyncore.socket
                made["socket"] = socket.socket(fileno=os.dup(bound.fileno()))
                made["marshal"] = uevents.marshal
            finally:
                uevents.close()
        except Exception as error:  # noqa: BLE001 - handed to the caller below
            made["error"] = error
            if "socket" in made:
                made.pop("socket").close()

    thread = threading.Thread(target=make, name="hana_storage-uevents")
    thread.start()
    thread.join()
    if "error" in made:
        raise OSError(f"cannot bind a uevent socket: {made['error']}")
    if made["socket"].getsockname()[1] != MONITOR_GROUP_KERNEL:
        name = made["socket"].getsockname()
        made["socket"].close()
        raise OSError(f"uevent socket bound to {name}, not the kernel group")
    return made["marshal"], made["socket"]


class KernelWatch:
    """Block uevents and mount-table changes, read without ever blocking.

    pyroute2 binds the uevent socket (kernel group) and parses each datagram; the datagrams are
    read here with MSG_DONTWAIT, because UeventSocket.get() waits for the next event.
    """

    def __init__(self, uevents):
        self.marshal, self.socket = _uevent_socket() if uevents else (None, None)
        try:
            self.mountinfo = open("/proc/self/mountinfo", "rb")  # noqa: SIM115 - kept open across ticks
        except OSError:
            self.close()
            raise
        self.poller = select.poll()
        self.poller.register(self.mountinfo, select.POLLPRI | select.POLLERR)

    def drain(self):
        """(kernel names of block devices that changed, mount table changed?, events lost?).

        ENOBUFS: the kernel dropped uevents nobody read in time (the socket's buffer was full). It
        is reported once, by the next read; what was queued after the loss is read (and dropped:
        the full audit a loss starts covers every device) until the socket is empty.
        """
        devices, lost, reads = set(), False, 0
        while self.socket is not None:
            if reads >= DRAIN_LIMIT:
                lost = True  # events keep coming faster than a tick reads them: audit everything
                log.warning("hana_storage beacon: over %d uevents in one tick; a full audit follows", reads)
                break
            reads += 1
            try:
                datagram = self.socket.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as error:
                if error.errno != errno.ENOBUFS:
                    raise
                if not lost:
                    log.warning("hana_storage beacon: uevents lost (ENOBUFS); a full audit follows")
                lost = True
                continue
            if lost:
                continue
            for message in self.marshal.parse(datagram):
                name = core.events.uevent_device(message)
                if name:
                    devices.add(name)
        mounts_changed = bool(self.poller.poll(0))
        if mounts_changed:
            self.mountinfo.seek(0)
            self.mountinfo.read()  # re-arms the notification
        return devices, mounts_changed, lost

    def close(self):
        """Release the uevent socket and the mountinfo descriptor (more than once is fine)."""
        if self.socket is not None:
            self.socket.close()
        mountinfo = getattr(self, "mountinfo", None)
        if mountinfo is not None:
            mountinfo.close()


core = None  # hana_storage_core, once _load_core has imported it


def _load_core():
    """Import the formula's package (hana_storage_core). The beacon loader, unlike the loaders of
    execution modules, states, runners and engines, puts no utils directory on sys.path: the
    one Salt synced ``_utils`` to is put there for the import only, as those loaders do (left
    there, Salt's own salt/utils would shadow third-party packages in every later import)."""
    global core
    added = [
        directory
        for directory in salt.loader.utils(__opts__).module_dirs
        if os.path.isdir(os.path.join(directory, "hana_storage_core")) and directory not in sys.path
    ]
    sys.path[:0] = added
    try:
        import hana_storage_core  # noqa: PLC0415 - needs the directories above

        core = hana_storage_core.fresh()
    finally:
        for directory in added:
            sys.path.remove(directory)
    return core


def _state():
    return __context__.setdefault(
        CONTEXT,
        {
            "known": {},  # finding key -> finding, as last reported
            "since": {},  # finding key -> wall time the occurrence was first reported
            "ended": {},  # finding key -> the since of an occurrence this instance saw clear
            "instance": None,  # this beacon's name in the memory file; None: memory not read yet
            "saved": None,  # (what was last written, wall time): an unchanged record is not rewritten
            "memory_error": None,  # the last problem with the memory file (logged once)
            "next_full": None,  # monotonic time the next full audit is due (None: now)
            "full": None,  # the FullAudit running, if one is
            "watch": None,
            "watched": {},  # volume -> kernel names of its stack and disks
            "mountpoints": {},  # volume -> mountpoint
            "mounts": {},  # mountpoint -> (dev, options) as last seen
            "error": None,
            "settle": None,  # (volumes, trigger, when): the re-audit after a kernel event
        },
    )


def _sign(state, tag, data):
    """The minion's signature over (id, tag, data) with ``minion.pem`` (core.signing); None when
    the minion has no key (masterless)."""
    path = os.path.join(__opts__["pki_dir"], "minion.pem")
    if not os.path.exists(path):
        return None
    return core.signing.sign(path, core.events.signed_bytes(__opts__["id"], tag, data))


def _emit(state, events):
    for event in events:
        event["sig"] = _sign(state, event["tag"], event)
    return events


def _read_mounts():
    """The mount table, for change detection only (the audit judges the mounts itself).

    Bytes, so a mount point that is not UTF-8 breaks nothing; a line that does not parse is left
    out with a warning (once per distinct problem): the HANA mountpoint it may hold then reads as
    changed, and the audit of that volume says what is wrong.
    """
    with open("/proc/self/mountinfo", "rb") as handle:
        raw = handle.read()
    malformed = []
    mounts = core.tab.parse_mountinfo(raw, malformed=malformed)
    warned = __context__.setdefault("hana_storage.mountinfo_warned", set())
    for entry in malformed:
        if entry["error"] not in warned and len(warned) < 100:
            warned.add(entry["error"])
            log.warning("hana_storage beacon: %s; the line is left out", entry["error"])
    return mounts


# ---- the beacon's memory on disk -------------------------------------------------------------


class MemoryProblem(Exception):
    """The memory file cannot be used: it is logged, and the beacon goes on with what it holds."""


def _instance(config):
    """This beacon instance's name in the memory file: its master connection and beacon name.

    Hot multi-master in a Salt without a single beacon leader runs one beacon per master
    connection in one minion, each reporting to its own master: each keeps its own record.
    """
    master = __opts__.get("master") or ""
    if isinstance(master, (list, tuple)):
        master = ",".join(str(m) for m in master)
    return f"{master}|{config.get('_beacon_name') or __virtualname__}"


@contextlib.contextmanager
def _memory_dir():
    """A descriptor of <cachedir>/hana_storage, made 0700 if missing, refused unless it is ours
    alone (a directory, not a symlink, owned by this user, writable by nobody else)."""
    cachedir = __opts__.get("cachedir")
    if not cachedir:
        raise MemoryProblem("the minion has no cachedir")
    path = os.path.join(cachedir, MEMORY_DIR)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise MemoryProblem(f"{path}: {error.strerror}") from None
    try:
        info = os.fstat(descriptor)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise MemoryProblem(
                f"{path} is not this user's alone (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
            )
        yield descriptor, path
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def _memory_lock(directory, path):
    """The memory's lock, held exclusively (every instance and process of this minion)."""
    descriptor = os.open(
        MEMORY_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=directory
    )
    try:
        deadline = time.monotonic() + MEMORY_LOCK_SECONDS
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise MemoryProblem(
                        f"{path}/{MEMORY_LOCK} held for over {MEMORY_LOCK_SECONDS} s by another process"
                    ) from None
                time.sleep(0.02)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _read_memory(directory, path):
    """The memory file's content: {"version", "instances": {instance: record}}; an empty one when
    there is none. A file that is not this user's regular 0600 file, or that does not parse, is
    MemoryProblem (the next save replaces it)."""
    where = f"{path}/{MEMORY_FILE}"
    try:
        descriptor = os.open(MEMORY_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except FileNotFoundError:
        return {"version": MEMORY_VERSION, "instances": {}}
    except OSError as error:  # ELOOP: a symlink
        raise MemoryProblem(f"{where}: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise MemoryProblem(
                f"{where} ignored: not a regular file of this user with mode 0600 "
                f"(owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
            )
        raw = handle.read(MEMORY_MAX_BYTES + 1)
    if len(raw) > MEMORY_MAX_BYTES:
        raise MemoryProblem(f"{where} ignored: larger than {MEMORY_MAX_BYTES} bytes")
    try:
        content = json.loads(raw.decode("utf-8"))
    except ValueError as error:
        raise MemoryProblem(f"{where} ignored: not JSON ({error})") from None
    if not isinstance(content, dict) or content.get("version") != MEMORY_VERSION:
        raise MemoryProblem(f"{where} ignored: not a version {MEMORY_VERSION} beacon memory")
    instances = content.get("instances")
    if not isinstance(instances, dict):
        raise MemoryProblem(f"{where} ignored: no instances")
    records = {name: _record(raw) for name, raw in instances.items() if isinstance(name, str)}
    return {"version": MEMORY_VERSION, "instances": {k: v for k, v in records.items() if v}}


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _record(raw):
    """One instance's record, cleaned: {known, since, ended, written}; None if it is no record.

    A finding is kept only with its own key and the since of its occurrence: one without a since
    would be reported again (a new occurrence), never given a made-up time.
    """
    if not isinstance(raw, dict) or not _number(raw.get("written")):
        return None
    key = core.events.finding_key
    since = raw.get("since") if isinstance(raw.get("since"), dict) else {}
    known = {}
    for name, finding in (raw.get("known") if isinstance(raw.get("known"), dict) else {}).items():
        try:
            ours = isinstance(finding, dict) and key(finding) == name
        except (KeyError, TypeError):
            ours = False
        if ours and _number(since.get(name)):
            known[name] = finding
    ended = raw.get("ended") if isinstance(raw.get("ended"), dict) else {}
    return {
        "known": known,
        "since": {k: since[k] for k in known},
        "ended": {k: v for k, v in ended.items() if isinstance(k, str) and _number(v)},
        "written": raw["written"],
    }


def _write_memory(directory, content):
    """Replace the memory file whole (0600, core.files) in the directory held open as ``directory``."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str).encode()
    core.files.replace_file(MEMORY_FILE, text, mode=0o600, dir_fd=directory)


def _memory_failed(state, error):
    message = str(error)
    if message != state.get("memory_error"):
        state["memory_error"] = message
        log.warning("hana_storage beacon: memory file: %s; going on with the memory of this process", message)


def _restore(state):
    """A new context: what this instance had reported, from the memory file, if it is usable."""
    try:
        with _memory_dir() as (directory, path), _memory_lock(directory, path):
            record = _read_memory(directory, path)["instances"].get(state["instance"])
    except (MemoryProblem, OSError) as error:
        _memory_failed(state, error)
        return
    if record:
        state.update(known=record["known"], since=record["since"], ended=record["ended"])
        state["saved"] = (_core(state), record["written"])
        log.info("hana_storage beacon: %d open finding(s) remembered from %s", len(record["known"]), path)


def _core(state):
    """What the memory file keeps of this instance, as comparable text."""
    known = state["known"]
    since = state.setdefault("since", {})
    ended = state.setdefault("ended", {})
    return json.dumps(
        {"known": known, "since": {k: since[k] for k in known if k in since}, "ended": ended},
        sort_keys=True,
        default=str,
    )


def _remember(state, fresh, wall, force=False):
    """Give each fresh finding key its since, and write this instance's record if it changed.

    ``fresh``: keys of findings that appeared to this instance. An occurrence another instance
    (another master connection) has open, and this one did not see end, keeps that instance's
    since: the first time any instance saw it. Otherwise it starts now. Without a usable memory
    file, since is now and the beacon goes on with what this process holds.
    """
    since, ended = state.setdefault("since", {}), state.setdefault("ended", {})
    saved = state.get("saved")
    if not fresh and not force and saved and saved[0] == _core(state):
        if wall - saved[1] < MEMORY_REFRESH_SECONDS:
            return
    if state.get("instance") is None:
        since.update((k, since.get(k, wall)) for k in fresh)
        return
    try:
        with _memory_dir() as (directory, path), _memory_lock(directory, path):
            try:
                others = _read_memory(directory, path)["instances"]
            except MemoryProblem as error:
                _memory_failed(state, error)  # replaced below by a good one
                others = {}
            others = {
                name: record
                for name, record in others.items()
                if name != state["instance"] and wall - record["written"] < MEMORY_EXPIRE_SECONDS
            }
            for key in fresh:
                seen = [
                    record["since"][key]
                    for record in others.values()
                    if key in record["known"] and record["since"][key] != ended.get(key)
                ]
                since[key] = min(seen) if seen else wall
            held = {(key, record["since"][key]) for record in others.values() for key in record["known"]}
            for key in [k for k, first in ended.items() if (k, first) not in held]:
                del ended[key]  # no instance holds that occurrence any more
            core = _core(state)
            mine = dict(json.loads(core), written=wall)
            _write_memory(
                directory, {"version": MEMORY_VERSION, "instances": {**others, state["instance"]: mine}}
            )
            state["saved"] = (core, wall)
            state["memory_error"] = None
    except (MemoryProblem, OSError, ValueError) as error:
        _memory_failed(state, error)
        since.update((k, since.get(k, wall)) for k in fresh)


class FullAudit:
    """A full audit in a thread of its own, so that a kernel event is audited while it runs.

    A full audit reads every device of every volume, which takes seconds on a large host (and
    on the lab's emulated one); run in the tick, a drift that came meanwhile waited for it. The
    thread only calls the read-only audit and keeps what it returned: the ticks alone touch the
    beacon's state. A volume that a tick audits while this one runs is newer there, and this
    audit's result for it is dropped (``newer``): it may have read the volume before the change
    the tick reported, and would otherwise report it resolved.
    """

    def __init__(self, audit, record=None):
        # the baseline for mount-table changes, read before the audit: a change while it runs
        # is then seen by the next tick, never folded unseen into the baseline
        self.mounts = _read_mounts()
        self.newer = {}  # volume -> its entry in the tick's report (None: no longer in the pillar)
        self.report = self.error = self.seconds = None
        self._start(audit, record)

    def _start(self, audit, record):
        # the loader's context goes with the call (Salt keeps it in contextvars)
        self.thread = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self.run, audit, record),
            name="hana_storage-full-audit",
            daemon=True,  # never holds up a minion that stops
        )
        self.thread.start()

    def run(self, audit, record=None):
        """The audit; then ``record`` (hana_storage.scap_record) keeps it for SCAP scans (it takes
        the audit from the loader's context: no report is passed)."""
        started = time.monotonic()
        try:
            self.report = audit(volumes=None)
        except Exception as error:  # noqa: BLE001 - the tick that collects it reports it
            self.error = error
        self.seconds = time.monotonic() - started
        if record is not None and self.report is not None:
            try:
                record()
            except Exception as error:  # noqa: BLE001 - SCAP's status goes stale; the beacon goes on
                log.error("hana_storage beacon: the audit was not recorded for SCAP: %s", error)

    def done(self):
        return not self.thread.is_alive()


def beacon(config):
    """
    Audit HANA storage on kernel events and periodically; report findings as they appear and clear.

    .. code-block:: yaml

        beacons:
          hana_storage:
            - interval: 1
            - full_audit_interval: 300
    """
    if core is None:
        _load_core()
    config = {**DEFAULTS, **salt.utils.beacons.list_to_dict(config)}
    state = _state()
    if state.get("instance") is None:  # a new context: a new loader, or a restarted minion
        state["instance"] = _instance(config)
        _restore(state)
    try:
        if state["watch"] is None:
            state["watch"] = KernelWatch(config["uevents"] and HAS_PYROUTE2)
        devices, mounts_changed, lost = state["watch"].drain()
    except OSError as error:
        log.error("hana_storage beacon: cannot watch kernel events (%s); full audits only", error)
        devices, mounts_changed, lost = set(), False, True
        if state["watch"] is not None:
            state["watch"].close()  # a socket that failed once fails on every tick: not read again
        state["watch"] = KernelWatch(False)
    now = time.monotonic()
    if lost:
        state["next_full"] = None  # due now, or as soon as the one running ends
    full = state.get("full")  # .get: a context kept from a beacon without threads
    if full is None and (state["next_full"] is None or now >= state["next_full"]):
        state["full"] = full = FullAudit(
            __salt__["hana_storage.audit"], __salt__.get("hana_storage.scap_record")
        )
        state["next_full"] = now + config["full_audit_interval"]
    out = []
    scope, trigger = _kernel_scope(state, devices, mounts_changed, now)
    if scope:
        out += _audit_volumes(state, scope, trigger)
    if full is not None and full.done():
        state["full"] = None
        out += _finish_full(state, full, now, config["full_audit_interval"])
    return _emit(state, out)


def _kernel_scope(state, devices, mounts_changed, now):
    """(volumes to audit in this tick, trigger): those a kernel event touched, else the volumes
    of the settle pass when it is due; an empty scope on an idle tick."""
    scope = set(core.events.affected_volumes(devices, state["watched"]))
    if mounts_changed:
        view = core.events.mount_view(_read_mounts(), set(state["mountpoints"].values()))
        changed = set(core.events.changed_mountpoints(state["mounts"], view))
        scope |= {v for v, point in state["mountpoints"].items() if point in changed}
        state["mounts"] = view
    trigger = "uevent" if devices else "mount"
    settle = state["settle"]
    if scope:
        # audit again once things settle: a tool may write the LUKS header after the table
        # reload that raised the uevent (cryptsetup refresh --persistent does)
        state["settle"] = (scope | (settle[0] if settle else set()), trigger, now + SETTLE_SECONDS)
        return scope, trigger
    if settle and now >= settle[2]:
        state["settle"] = None
        return settle[0], settle[1]
    return set(), trigger


def close(config):
    """
    Release what the beacon holds open and write its memory; Salt calls this before it replaces
    the beacon loader (a module or pillar refresh) and on each tick of a state run when
    ``disable_during_state_run`` is set. The memory in ``__context__`` stays: the next tick opens
    a new watch and, having missed what happened meanwhile, audits everything. A full audit
    still running is left to finish on its own; what it finds is not used.
    """
    if core is None:
        _load_core()
    state = __context__.get(CONTEXT)
    if not state:
        return
    watch, state["watch"] = state.get("watch"), None
    if watch is not None:
        try:
            watch.close()
        except OSError as error:
            log.debug("hana_storage beacon: closing the kernel watch: %s", error)
    state["next_full"] = None
    state["full"] = None
    state["settle"] = None
    if state.get("instance") is not None:
        _remember(state, [], time.time())


def _failed(state, error, trigger):
    """The error event of a failed audit, once per distinct message."""
    message = str(error)
    if message == state["error"]:
        return []
    state["error"] = message
    log.error("hana_storage beacon: audit failed: %s", message)
    return [{"tag": "error", "message": message, "trigger": trigger, "ts": time.time()}]


def _watched(volumes):
    """What later uevents map to: each volume's stack and pillar disks (kernel names)."""
    return {n: sorted(set(v["stack"]) | set(v["disks"])) for n, v in volumes.items()}


def _audit_volumes(state, scope, trigger):
    """Audit the volumes a kernel event touched, now: the events of what appeared and cleared."""
    try:
        report = __salt__["hana_storage.audit"](volumes=sorted(scope))
    except Exception as error:  # noqa: BLE001 - a beacon must never take the minion down
        return _failed(state, error, trigger)
    state["error"] = None
    if state.get("full") is not None:
        state["full"].newer.update({name: report["volumes"].get(name) for name in scope})
    state["watched"].update(_watched(report["volumes"]))
    return _findings_events(state, report["findings"], scope, trigger)


def _finish_full(state, full, now, full_interval):
    """The events of a full audit that has ended: its findings, less those of the volumes a tick
    audited while it ran (newer), then the audit event of every open finding."""
    if full.error is not None:
        if state["next_full"] is not None:
            # until a full audit succeeds, uevents map to nothing: try again soon
            state["next_full"] = min(state["next_full"], now + min(RETRY_SECONDS, full_interval))
        return _failed(state, full.error, "full")
    state["error"] = None
    report, newer = full.report, full.newer
    volumes = {n: v for n, v in {**report["volumes"], **newer}.items() if v is not None}
    state["watched"] = _watched(volumes)
    state["mountpoints"] = {n: v["mountpoint"] for n, v in volumes.items()}
    state["mounts"] = core.events.mount_view(full.mounts, set(state["mountpoints"].values()))
    scope = ({f["volume"] for f in state["known"].values()} | set(report["volumes"])) - set(newer)
    findings = [f for f in report["findings"] if f["volume"] not in newer]
    out = _findings_events(state, findings, scope, "full")
    current = list(state["known"].values())
    summary = {"compliant": not current, "findings": current, "volumes": volumes}
    out.append(core.events.audit_event(summary, "full", full.seconds, time.time(), state["since"]))
    return out


def _findings_events(state, findings, scope, trigger):
    """Violation and resolved events of an audit of ``scope`` (a set of volumes), against what
    was reported before; records each occurrence's since (see _remember)."""
    state["known"], appeared, cleared = core.events.diff_findings(state["known"], findings, scope)
    wall = time.time()
    key = core.events.finding_key
    since = state.setdefault("since", {})  # a context kept from a beacon before this field
    ended = state.setdefault("ended", {})
    over = {}
    for finding in cleared:
        if key(finding) in since:
            over[key(finding)] = ended[key(finding)] = since.pop(key(finding))
    # an appeared finding (or one a context from before the field lacks): its occurrence's since
    fresh = [key(f) for f in state["known"].values() if key(f) not in since]
    _remember(state, fresh, wall, force=bool(cleared))
    out = [
        dict(core.events.finding_event("violation", f, trigger, wall), since=since[key(f)]) for f in appeared
    ]
    out += [
        dict(core.events.finding_event("resolved", f, trigger, wall), since=over.get(key(f))) for f in cleared
    ]
    return out
