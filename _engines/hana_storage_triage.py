"""
Triage at fleet rates: the reactor hands each hana_storage violation or audit event to this
engine over a datagram socket, and the engine runs the triage runner's code on it in a pool of
threads, without a runner job per event.

A runner job per reaction is what bounds Salt's reactor: each one gets a job id, its own
``salt/run/<jid>/new`` and ``ret`` events and a runner call through the reactor's thread pool,
which held one master near 40 events/s while its bus carried over 300 (bench/test_fleet.py
measures both designs in one run). The reactor stays the entry point a site wires in
(``reactor/triage.sls``): it hands the event over here, and starts the triage runner job as
before when this engine is not running or its backlog is full. Both paths run the same
``hana_storage.triage`` and claim each occurrence atomically, so whichever path an event takes,
no occurrence is acted on twice. The outcome of every triage is fired as
``hana/storage/triaged`` (signed by the master) on either path.

An event that may lead to a remediation (a violation of an auto rule in the master's rule
table, or an audit event listing one) goes to a pool of its own: its thread waits for the
minion's ``hana_storage.remediate``, seconds per minion, and must not hold up the alerts behind
it. Which pool an event goes to is all the engine takes from it; triage verifies the sender's
signature and decides, as it does for a runner job.

With hot masters sharing a store, an occurrence the other master is acting on is ``held`` by its
lease: the engine triages that event again when the lease runs out, so if that master died
before finishing, this one takes the occurrence over within a lease. (A runner job leaves it to
the minion's next audit event.)

The engine also sees triage's outbox through. Each ``hana/storage/alert`` and ``.../remediation``
event its master's bus carries is confirmed ``settle`` seconds later (``confirm_each`` says why),
and leaves the outbox. Any minion can fire those tags, so an event is held for that only once the
master's signature on it verifies, and at most ``core.limits.MAX_UNCONFIRMED`` are held. Every REDELIVER_EVERY seconds the engine
puts on its bus again what is overdue: the events of actions whose master died before a bus
carried them (``hana_storage.redeliver``).

The socket is ``<sock_dir>/hana_storage_triage.sock``, mode 0600 (the master's user
only; the reactor runs in the master).

.. code-block:: yaml

    engines:
      - hana_storage_triage:
          workers: 4                # threads for events that can only alert
          remediation_workers: 16   # threads waiting for a minion's remediate
          backlog: 20000            # events held (about 2 KB each); beyond it the reactor starts runner jobs
          settle: 30                # seconds from seeing an outcome event on the bus to confirming it
                                    # (at most half of hana_storage:lease)
"""

import concurrent.futures
import contextlib
import heapq
import itertools
import json
import logging
import os
import socket
import threading
import time

import hana_storage_core as core  # the loader puts its utils directories on sys.path while loading this
import salt.utils.event

core = core.fresh()  # after a saltutil.sync, the files it brought, not those this process imported first

log = logging.getLogger(__name__)

__virtualname__ = "hana_storage_triage"

SOCKET_NAME = "hana_storage_triage.sock"  # reactor/triage.sls sends to it (tests/unit/test_triage_engine.py)
MAX_DATAGRAM = 4 * 1024 * 1024  # an audit event listing every open finding of a large host
BUFFER = 8 * 1024 * 1024  # the kernel's receive buffer: a burst waits here, not in the reactor


def __virtual__():
    return __virtualname__


class MalformedEvent(ValueError):
    """A datagram that is not {"tag": str, "data": dict} in JSON."""


def parse(payload):
    """(tag, data) of a datagram; MalformedEvent for anything else."""
    try:
        event = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as error:
        raise MalformedEvent(f"not JSON: {error}") from None
    if not isinstance(event, dict) or not isinstance(event.get("tag"), str):
        raise MalformedEvent("no tag")
    if not isinstance(event.get("data"), dict):
        raise MalformedEvent("no data mapping")
    return event["tag"], event["data"]


@contextlib.contextmanager
def bound(path):
    """A datagram socket bound at ``path`` (0600), removed again on exit."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a socket left by a master that died
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        yield sock
    finally:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def may_remediate(tag, data, auto):
    """Whether triage may start a remediation for this event (``auto``: the master's auto rules):
    a violation of an auto rule, or an audit event listing an open finding of one."""
    if tag.endswith("/violation"):
        rule = data.get("rule")
        return isinstance(rule, str) and rule in auto
    since = data.get("since")
    keys = since if isinstance(since, dict) else ()
    return any(isinstance(key, str) and key.split("|", 1)[0] in auto for key in keys)


def held_for(result):
    """Seconds until the occurrences triage found held by another claim's lease may be claimed
    again (the longest of them), or None when it found none held."""
    results = result.get("findings", [result]) if isinstance(result, dict) else []
    waits = [
        r["retry_in"]
        for r in results
        if isinstance(r, dict) and r.get("action") == "held" and isinstance(r.get("retry_in"), int | float)
    ]
    return max(waits) if waits else None


class Later:
    """Runs calls after their delay, all from one thread (a burst may park thousands)."""

    def __init__(self):
        self._due, self._order, self._wake = [], itertools.count(), threading.Condition()
        threading.Thread(target=self._run, name="hana_storage_triage-later", daemon=True).start()

    def call(self, delay, function, *args):
        with self._wake:
            heapq.heappush(self._due, (time.monotonic() + delay, next(self._order), function, args))
            self._wake.notify()

    def _run(self):
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._wake.wait(self._due[0][0] - time.monotonic() if self._due else None)
                _when, _order, function, args = heapq.heappop(self._due)
            function(*args)


RETRY_MARGIN = 0.2  # seconds after a lease runs out: the store's clock and ours differ a little
REPORT_INTERVAL = 60  # seconds: at most one log line per cause of an outbox event not held
OUTBOX_TAGS = ("hana/storage/alert", "hana/storage/remediation")  # what triage's outbox holds
REDELIVER_EVERY = 5  # seconds between two looks for overdue outbox events


def _safely(function, *args):
    """``function(*args)``, a failure logged: one event or round must not stop the engine."""
    try:
        function(*args)
    except Exception:  # noqa: BLE001 - logged; the next event or round tries again
        log.exception("hana_storage_triage: %s failed", getattr(function, "__name__", function))


def _forever(function, *args, pause=REDELIVER_EVERY):
    """A thread of the engine: ``function`` again ``pause`` seconds after each return or failure."""
    while True:
        _safely(function, *args)
        time.sleep(pause)


def follow_bus(later, delivered, settle, verify):
    """Confirm the outbox events the master's bus carries (``confirm_each``), until it fails.
    Runs in a thread of its own: the runner functions it calls come from ``start`` (a thread has
    no loader context, so ``__runners__`` cannot be read there on Salt 3006)."""
    with salt.utils.event.get_master_event(__opts__, __opts__["sock_dir"], listen=True) as bus:
        events = bus.iter_events(tag="hana/storage/", full=True, auto_reconnect=True)
        confirm_each(events, later, delivered, settle, verify)


class Batch:
    """Outbox events seen within a tenth of ``settle``, confirmed together by one call of ``later``
    (one scheduled call per batch, not per event): [(tag, data, event_id)]."""

    def __init__(self, first, closes):
        self.closes, self.events, self.closed = closes, [first], False
        self.lock = threading.Lock()

    def add(self, event, now):
        """False when the batch takes no more events: its time is up, or it is being confirmed."""
        with self.lock:
            if self.closed or now >= self.closes:
                return False
            self.events.append(event)
            return True

    def take(self):
        with self.lock:
            self.closed = True
            return list(self.events)


def confirm_each(events, later, delivered, settle, verify=None, waiting=None):
    """``delivered(tag, data)`` for each outbox event among ``events`` ({"tag", "data"}), ``settle``
    seconds after it passed (``later``); it checks the master's signature again.

    Why wait: the master's publisher sends each event to its subscribers in turn, and holds what a
    subscriber has not read yet. When the master dies, what it held for a subscriber that lagged
    is lost for that one. An event its master dies within ``settle`` seconds of is put on a bus
    again (with its event_id): a repeat for the subscribers that had it, not a loss for those
    that lagged less than ``settle``.

    What waits is bounded: any minion can fire an outbox tag, so an event is held only once
    ``verify(tag, data)`` (the runner's ``verify_master``) finds no problem with it, each event_id
    once, and at most ``waiting`` (MAX_UNCONFIRMED) at a time. What is not held is logged at most
    once per cause and REPORT_INTERVAL, with the number held back since. An event the engine does
    not confirm stays in the outbox and is sent again when due: a repeat, never a loss."""
    waiting = core.limits.waiting(core.limits.MAX_UNCONFIRMED) if waiting is None else waiting
    reports, window, batch = core.limits.reports(REPORT_INTERVAL), float(settle) / 10, None
    for event in events:
        if not (isinstance(event, dict) and event.get("tag") in OUTBOX_TAGS):
            continue
        tag, data = event["tag"], event.get("data")
        event_id = data.get("event_id") if isinstance(data, dict) else None
        if not isinstance(event_id, str):
            continue  # confirms nothing: the outbox holds each event under its event_id
        problem = verify(tag, data) if verify else None
        if problem:
            _not_held(reports, "forged", "%s not confirmed: %s", tag, problem.get("reason"))
            continue
        entered = waiting.enter(event_id)
        if entered == "full":
            _not_held(
                reports,
                "full",
                "%s not confirmed: %d outbox events wait to be confirmed already (%d refused in all); "
                "it is sent again when due",
                tag,
                waiting.most,
                waiting.refused,
            )
            continue
        if entered != "entered":
            continue  # its event_id waits already: a repeat
        now = time.monotonic()
        if batch is None or not batch.add((tag, data, event_id), now):
            batch = Batch((tag, data, event_id), now + window)
            later.call(settle + window, _confirm_batch, delivered, waiting, batch)


def _confirm_batch(delivered, waiting, batch):
    for tag, data, event_id in batch.take():
        _safely(delivered, tag, data)
        waiting.leave(event_id)


def _not_held(reports, cause, message, *args):
    """Log why an outbox event is not held, at most once per ``cause`` and REPORT_INTERVAL."""
    held_back = reports.due(cause)
    if held_back is not None:
        more = f" ({held_back} more since the last report)" if held_back else ""
        log.warning("hana_storage_triage: " + message + "%s", *args, more)


def settle_within(settle, lease):
    """``settle``, or half the lease when that is shorter: an event must be confirmed before it
    is due to be sent again (``lease`` seconds after it was decided)."""
    return float(settle) if lease is None else min(float(settle), float(lease) / 2)


def _triage(triage, tag, data, again):
    """Triage one event; ``again(delay)`` when it found an occurrence held by another claim."""
    try:
        wait = held_for(triage(tag, data))
    except Exception:  # noqa: BLE001 - one event's failure must not stop the engine
        log.exception("hana_storage_triage: triage of %s failed", tag)
        return
    if wait is not None:
        again(wait + RETRY_MARGIN)


def start(workers=4, remediation_workers=16, backlog=20000, settle=30):
    """
    Receive the reactor's hand-offs and triage them until the master stops.
    """
    path = os.path.join(__opts__["sock_dir"], SOCKET_NAME)
    triage = __runners__["hana_storage.triage"]
    auto = set(core.rules.auto_rules())
    slots = threading.BoundedSemaphore(int(backlog))
    later = Later()
    settle = settle_within(settle, (__opts__.get("hana_storage") or {}).get("lease"))
    for name, args in (
        (
            "confirm",
            (
                follow_bus,
                later,
                __runners__["hana_storage.delivered"],
                settle,
                __runners__["hana_storage.verify_master"],
            ),
        ),
        ("redeliver", (__runners__["hana_storage.redeliver"],)),
    ):
        threading.Thread(target=_forever, args=args, name=f"hana_storage_triage-{name}", daemon=True).start()

    def submit(pool, tag, data):
        def again(delay):
            later.call(delay, submit, pool, tag, data)

        return pool.submit(_triage, triage, tag, data, again)

    with (
        bound(path) as sock,
        concurrent.futures.ThreadPoolExecutor(int(workers)) as alerts,
        concurrent.futures.ThreadPoolExecutor(int(remediation_workers)) as remediations,
    ):
        log.info("hana_storage_triage: triaging hand-offs on %s", path)
        while True:
            slots.acquire()  # a full backlog stops reading: the socket fills, the reactor falls back
            payload = sock.recv(MAX_DATAGRAM)
            try:
                tag, data = parse(payload)
            except MalformedEvent as error:
                log.warning("hana_storage_triage: dropped a malformed hand-off: %s", error)
                slots.release()
                continue
            pool = remediations if may_remediate(tag, data, auto) else alerts
            submit(pool, tag, data).add_done_callback(lambda _done: slots.release())
