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
* a full audit every ``full_audit_interval`` seconds, the safety net for lost events.

An idle tick polls two file descriptors and returns: no subprocess, no device read.

Events (``salt/beacon/<minion>/hana_storage/<event>``), never with key material:

``violation``
    A finding appeared: rule, severity, volume, mountpoint, device, expected, actual,
    remediation (auto|manual), message; plus key, trigger (uevent|mount|full), ts and sig.
``resolved``
    A finding cleared; the same fields as the violation it ends.
``audit``
    After each full audit: compliant, per-volume compliance and failing rules, findings, by_rule,
    open (finding key: severity), since (finding key: the ts of its violation event), seconds,
    ts, sig. The master's triage reconciles from it: an open finding whose violation it never
    handled (a reaction Salt lost, a master that was down) is acted on now.
``error``
    The audit could not run (invalid pillar, dmsetup failing ...): message, ts, sig. Once per
    distinct message.

A finding is reported when it appears and when it clears, never again while unchanged.
``sig`` is the minion's RSA signature (PKCS#1 v1.5, SHA-224) over the minion id, the event and
its data, so the master can tell which minion really sent it (Salt lets any minion fire any tag).

.. code-block:: yaml

    beacons:
      hana_storage:
        - interval: 10                 # seconds between ticks
        - full_audit_interval: 300     # seconds between full audits
        - uevents: true                # react to kernel events between full audits
        - disable_during_state_run: true
"""

import base64
import errno
import logging
import os
import select
import socket
import threading
import time

import salt.crypt
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

DEFAULTS = {"interval": 10, "full_audit_interval": 300, "uevents": True}
# Keys Salt itself reads from any beacon's configuration.
SALT_KEYS = {"interval", "disable_during_state_run", "run_once", "beacon_module", "enabled"}
CONTEXT = "hana_storage.beacon"
SIGNING = salt.crypt.PKCS1v15_SHA224
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
        return False, "Configuration for the hana_storage beacon must be a list, e.g. [{interval: 10}]"
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
    """(pyroute2 UeventSocket bound to the kernel group, its bound datagram socket).

    Made in a thread of its own: pyroute2's sync API runs an asyncio loop, which cannot nest in
    the minion's running one. The socket object is taken in that thread too: pyroute2 keeps it
    per thread, and another thread asking for it gets a fresh, unbound one.
    """
    made = {}

    def make():
        try:
            uevents = UeventSocket()
            uevents.bind(groups=MONITOR_GROUP_KERNEL)
            made["uevents"], made["socket"] = uevents, uevents.asyncore.socket
        except Exception as error:  # noqa: BLE001 - handed to the caller below
            made["error"] = error

    thread = threading.Thread(target=make, name="hana_storage-uevents")
    thread.start()
    thread.join()
    if "error" in made:
        raise OSError(f"cannot bind a uevent socket: {made['error']}")
    if made["socket"].getsockname()[1] != MONITOR_GROUP_KERNEL:
        raise OSError(f"uevent socket bound to {made['socket'].getsockname()}, not the kernel group")
    return made["uevents"], made["socket"]


class KernelWatch:
    """Block uevents and mount-table changes, read without ever blocking.

    pyroute2 binds the uevent socket (kernel group) and parses each datagram; the datagrams are
    read here with MSG_DONTWAIT, because UeventSocket.get() waits for the next event.
    """

    def __init__(self, uevents):
        self.uevents, self.socket = _uevent_socket() if uevents else (None, None)
        self.mountinfo = open("/proc/self/mountinfo", "rb")  # noqa: SIM115 - kept open across ticks
        self.poller = select.poll()
        self.poller.register(self.mountinfo, select.POLLPRI | select.POLLERR)

    def drain(self):
        """(kernel names of block devices that changed, mount table changed?, events lost?)."""
        devices, lost = set(), False
        while self.uevents is not None:
            try:
                datagram = self.socket.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as error:
                if error.errno != errno.ENOBUFS:
                    raise
                lost = True  # the kernel dropped events nobody read in time
                log.warning("hana_storage beacon: uevents lost; a full audit follows")
            for message in self.uevents.marshal.parse(datagram):
                name = _events("uevent_device")(message)
                if name:
                    devices.add(name)
        mounts_changed = bool(self.poller.poll(0))
        if mounts_changed:
            self.mountinfo.seek(0)
            self.mountinfo.read()  # re-arms the notification
        return devices, mounts_changed, lost

    def close(self):
        if self.socket is not None:
            self.socket.close()
        self.mountinfo.close()


def _utils():
    """The formula's pure code: the beacon loader packs no __utils__, so the beacon loads them once."""
    if "hana_storage.utils" not in __context__:
        __context__["hana_storage.utils"] = salt.loader.utils(__opts__)
    return __context__["hana_storage.utils"]


def _events(name):
    return _utils()[f"hana_storage_events.{name}"]


def _state():
    return __context__.setdefault(
        CONTEXT,
        {
            "known": {},  # finding key -> finding, as last reported
            "since": {},  # finding key -> wall time of its violation event
            "next_full": None,  # monotonic time the next full audit is due (None: now)
            "watch": None,
            "watched": {},  # volume -> kernel names of its stack and disks
            "mountpoints": {},  # volume -> mountpoint
            "mounts": {},  # mountpoint -> (dev, options) as last seen
            "error": None,
            "key": None,
            "settle": None,  # (volumes, trigger, when): the re-audit after a kernel event
        },
    )


def _sign(state, tag, data):
    """The minion's signature over (id, tag, data); None when the minion has no key (masterless)."""
    if state["key"] is None:
        path = os.path.join(__opts__["pki_dir"], "minion.pem")
        state["key"] = salt.crypt.PrivateKey.from_file(path) if os.path.exists(path) else False
    if not state["key"]:
        return None
    message = _events("signed_bytes")(__opts__["id"], tag, data)
    return base64.b64encode(state["key"].sign(message, SIGNING)).decode()


def _emit(state, events):
    for event in events:
        event["sig"] = _sign(state, event["tag"], event)
    return events


def _read_mounts():
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        return _utils()["hana_storage_tab.parse_mountinfo"](handle.read())


def beacon(config):
    """
    Audit HANA storage on kernel events and periodically; report findings as they appear and clear.

    .. code-block:: yaml

        beacons:
          hana_storage:
            - interval: 10
            - full_audit_interval: 300
    """
    config = {**DEFAULTS, **salt.utils.beacons.list_to_dict(config)}
    state = _state()
    try:
        if state["watch"] is None:
            state["watch"] = KernelWatch(config["uevents"] and HAS_PYROUTE2)
        devices, mounts_changed, lost = state["watch"].drain()
    except OSError as error:
        log.error("hana_storage beacon: cannot watch kernel events (%s); full audits only", error)
        devices, mounts_changed, lost = set(), False, True
        state["watch"] = state["watch"] or KernelWatch(False)
    now = time.monotonic()
    full = lost or state["next_full"] is None or now >= state["next_full"]
    scope, trigger = None, "full"
    settle = state["settle"]
    if not full:
        scope = set(_events("affected_volumes")(devices, state["watched"]))
        if mounts_changed:
            view = _events("mount_view")(_read_mounts(), set(state["mountpoints"].values()))
            changed = set(_events("changed_mountpoints")(state["mounts"], view))
            scope |= {v for v, point in state["mountpoints"].items() if point in changed}
            state["mounts"] = view
        trigger = "uevent" if devices else "mount"
        if scope:
            # audit again once things settle: a tool may write the LUKS header after the
            # table reload that raised the uevent (cryptsetup refresh --persistent does)
            state["settle"] = (scope | (settle[0] if settle else set()), trigger, now + SETTLE_SECONDS)
        elif settle and now >= settle[2]:
            scope, trigger = settle[:2]
            state["settle"] = None
        else:
            return []  # the idle tick: nothing happened that touches a HANA volume
    else:
        state["settle"] = None
    return _emit(state, _audit(state, scope, trigger, now, config["full_audit_interval"]))


def _audit(state, scope, trigger, now, full_interval):
    started = time.monotonic()
    try:
        report = __salt__["hana_storage.audit"](volumes=sorted(scope) if scope is not None else None)
    except Exception as error:  # noqa: BLE001 - a beacon must never take the minion down
        message = str(error)
        if scope is None:
            # until a full audit succeeds, uevents map to nothing: try again soon
            state["next_full"] = now + min(RETRY_SECONDS, full_interval)
        if message == state["error"]:
            return []
        state["error"] = message
        log.error("hana_storage beacon: audit failed: %s", message)
        return [{"tag": "error", "message": message, "trigger": trigger, "ts": time.time()}]
    state["error"] = None
    # what later uevents map to: each audited volume's stack and pillar disks (kernel names)
    watched = {n: sorted(set(v["stack"]) | set(v["disks"])) for n, v in report["volumes"].items()}
    mountpoints = {n: v["mountpoint"] for n, v in report["volumes"].items()}
    if scope is None:
        state["watched"], state["mountpoints"] = watched, mountpoints
        state["mounts"] = _events("mount_view")(_read_mounts(), set(mountpoints.values()))
    else:
        state["watched"].update(watched)
    state["known"], appeared, cleared = _events("diff_findings")(state["known"], report["findings"], scope)
    wall = time.time()
    key = _events("finding_key")
    since = state.setdefault("since", {})  # a context kept from a beacon before this field
    for finding in cleared:
        since.pop(key(finding), None)
    for finding in report["findings"]:  # an appeared one: the ts of the violation sent below
        since.setdefault(key(finding), wall)
    out = [_events("finding_event")("violation", f, trigger, wall) for f in appeared]
    out += [_events("finding_event")("resolved", f, trigger, wall) for f in cleared]
    if scope is None:
        state["next_full"] = now + full_interval
        seconds = time.monotonic() - started
        out.append(_events("audit_event")(report, trigger, seconds, wall, since))
    return out
