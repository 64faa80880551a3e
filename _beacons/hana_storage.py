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

import contextvars
import importlib.util
import logging
import os
import sys
import threading
import time

import salt.loader
import salt.utils.beacons
import salt.utils.platform

log = logging.getLogger(__name__)

# the kernel watch imports pyroute2 when it binds; validate only needs to know it is there
HAS_PYROUTE2 = importlib.util.find_spec("pyroute2") is not None

__virtualname__ = "hana_storage"

DEFAULTS = {"interval": 1, "full_audit_interval": 300, "uevents": True}
# Keys Salt itself reads from any beacon's configuration.
SALT_KEYS = {"interval", "disable_during_state_run", "run_once", "beacon_module", "enabled"}
CONTEXT = "hana_storage.beacon"
SETTLE_SECONDS = 2  # after a kernel event, audit its volumes once more this much later
RETRY_SECONDS = 30  # a failed full audit is tried again this soon, not a full interval later


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
    """The mount table, for change detection (core.kernel_watch.read_mounts)."""
    return core.kernel_watch.read_mounts(__context__.setdefault("hana_storage.mountinfo_warned", set()))


# ---- the beacon's memory on disk -------------------------------------------------------------


def _instance(config):
    """This beacon instance's name in the memory file: its master connection and beacon name.

    Hot multi-master in a Salt without a single beacon leader runs one beacon per master
    connection in one minion, each reporting to its own master: each keeps its own record.
    """
    master = __opts__.get("master") or ""
    if isinstance(master, (list, tuple)):
        master = ",".join(str(m) for m in master)
    return f"{master}|{config.get('_beacon_name') or __virtualname__}"


def _remember(state, fresh, wall, force=False):
    """Each fresh finding's since, and this instance's record written if it changed
    (core.beacon_memory)."""
    core.beacon_memory.remember(state, __opts__.get("cachedir"), fresh, wall, force=force)


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
        core.beacon_memory.restore(state, __opts__.get("cachedir"))
    try:
        if state["watch"] is None:
            state["watch"] = core.kernel_watch.KernelWatch(config["uevents"] and HAS_PYROUTE2)
        devices, mounts_changed, lost = state["watch"].drain()
    except OSError as error:
        log.error("hana_storage beacon: cannot watch kernel events (%s); full audits only", error)
        devices, mounts_changed, lost = set(), False, True
        if state["watch"] is not None:
            state["watch"].close()  # a socket that failed once fails on every tick: not read again
        state["watch"] = core.kernel_watch.KernelWatch(False)
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
