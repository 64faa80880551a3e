"""
Fleet side of the HANA storage formula: the fleet compliance report, and the triage the reactor
runs for each ``salt/beacon/<minion>/hana_storage/violation`` event and each ``.../audit`` event
that lists open findings.

Any minion can put any tag and data on the master's bus, so triage trusts nothing in an event:

* the sender is the minion whose accepted key verifies the event's signature (the beacon signs
  every event); an unsigned, forged or stale event is rejected and reported;
* whether a rule may be fixed automatically comes from the master's own rule table;
* the fix runs on that minion only (``hana_storage.remediate``, target type ``list``: an id is never
  a pattern), and the minion re-audits before fixing anything;
* one remediation per finding (minion, rule, volume, device) per cooldown, however many events
  arrive; a manual finding is alerted at each occurrence; never two actions for one occurrence
  of a finding (triage's store, ``core.store``: files under
  the master's cachedir, or Redis shared by hot masters; it holds across the reactor's threads,
  module reloads and master restarts);
* what an action decided is never lost with its master: the alert or remediation event goes
  into the store's outbox in the change that records the action, and is sent again (with its
  ``event_id``) when no bus carried it within ``lease`` seconds (``redeliver``);
* events are edges, and Salt's reactor can lose one (its worker pool drops a reaction whose
  runner client fails to start, logging it at debug level only); the minion's ``audit`` event
  after each full audit lists every open finding with the time it was first reported, and
  triage acts on each occurrence it has not handled: a lost reaction, a finding deferred by
  the cooldown, or one raised while the master was down is handled within one full-audit
  interval;
* only a verified fix counts: a remediation is ``fixed`` when the minion's ``remediate`` lists
  the rule as fixed and its re-audit after the fix no longer finds it. Anything else (skipped by
  the minion's policy, failed, still open, no return, the call failed) is reported as
  ``failed`` or ``not-fixed`` with a reason code, alerted, and the occurrence released, so the
  first event after the cooldown acts on it again.

The reactor hands each event to the ``hana_storage_triage`` engine, which calls ``triage`` in its
own threads, or starts ``triage`` as a runner job when that engine is not running; either way
the outcome is fired as ``hana/storage/triaged`` (the event's tag, when triage began, and what
``triage`` returned).

Salt reserves no tag prefix for the master: a minion can put ``hana/storage/alert`` on the bus
(``event.send`` with a ``preload``). So every event triage fires (``hana/storage/alert``,
``hana/storage/remediation``, ``hana/storage/rejected``, ``hana/storage/triaged``) carries
``ts`` and ``sig``, the master's
signature over ``core.events.master_signed_bytes`` made with ``<pki_dir>/master.pem``;
``verify_master`` checks one with ``<pki_dir>/master.pub`` (the exporter engine does, for every
event it counts), and so should any other consumer: ``salt-run hana_storage.verify_master``.

Master configuration (``conf/master.d/hana-storage.conf``)::

    hana_storage:
      cooldown: 300          # seconds between two remediations of one finding
      max_event_age: 600     # seconds: an older (or replayed) event is rejected
      require_signature: true
      max_event_bytes: 262144  # and the other limits of DEFAULTS: what one minion may cost triage
"""

import contextlib
import json
import logging
import math
import os
import threading
import time
import uuid

import hana_storage_core as core  # the loader puts its utils directories on sys.path while loading this
import salt.client
import salt.utils.event
import salt.utils.sdb
import salt.utils.verify
from cryptography.hazmat.primitives import serialization
from salt.exceptions import CommandExecutionError

core = core.fresh()  # after a saltutil.sync, the files it brought, not those this process imported first

log = logging.getLogger(__name__)

__virtualname__ = "hana_storage"

DEFAULTS = {
    "cooldown": 300,
    "max_event_age": 600,
    "require_signature": True,
    "report_timeout": 120,
    # a minion's boot readiness check waits up to 4 x 30 s (hana_storage_host CLEVIS_WAITS x
    # CLEVIS_TIMEOUT) for Tang servers that do not answer
    "readiness_timeout": 180,
    "lease": 60,
    "store": {"driver": "local"},
    # what one minion may cost triage (README, "Events"); each a positive number
    "max_event_bytes": 262144,  # a larger event is rejected (too_large) before its signature is checked
    "max_audit_findings": 1000,  # open findings triaged from one audit event; the rest are counted
    "event_burst": 200,  # events of one claimed minion triaged at once (a token bucket) ...
    "event_rate": 5,  # ... and per second after that; beyond it: dropped unverified (rate_limited)
    "report_interval": 60,  # seconds: at most one log line and hana/storage/rejected per minion
}
LIMITS = (  # each a positive, finite number; a bad one is logged and its default used
    "max_event_bytes",
    "max_audit_findings",
    "event_burst",
    "event_rate",
    "report_interval",
    "max_event_age",
)
# seconds Salt's LocalClient waits: whole ones (it replaces any other number with the master's
# `timeout`, 5 s by default)
TIMEOUTS = ("report_timeout", "readiness_timeout")
ALERT_TAG = "hana/storage/alert"
REMEDIATION_TAG = "hana/storage/remediation"
REJECTED_TAG = "hana/storage/rejected"
TRIAGED_TAG = "hana/storage/triaged"
READINESS_TAG = "hana/storage/readiness"
FACTS = ("rule", "volume", "mountpoint", "device", "message")  # what alerts and remediations name
FIRE_ATTEMPTS = 5
# What triage reports of a remediation, per rule: "fixed" (verified by the minion's re-audit) and
# "absent" (the minion's audit found nothing to fix: fixed meanwhile, e.g. by the fix of another
# rule) are done; "not-fixed" and "failed" are alerted.
DONE = ("fixed", "absent")


def __virtual__():
    return __virtualname__


def _config():
    config = {**DEFAULTS, **(__opts__.get("hana_storage") or {})}
    for name in (*LIMITS, *TIMEOUTS):
        value = config[name]
        if not _positive(value) or (name in TIMEOUTS and not isinstance(value, int)):
            if (name, repr(value)) not in _BAD_LIMITS:
                _BAD_LIMITS.add((name, repr(value)))
                log.error(
                    "hana_storage: %s %r is not a positive, finite number (a whole one for a timeout): %s used",
                    name,
                    value,
                    DEFAULTS[name],
                )
            config[name] = DEFAULTS[name]
    return config


_BAD_LIMITS = set()  # (name, value) of the limits already logged as invalid


def _positive(value):
    """Whether ``value`` is a positive, finite number (not a bool, not NaN)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < math.inf


def _seconds(timeout, default):
    """What Salt's LocalClient is given to wait: the caller's ``timeout`` in whole seconds (Salt
    replaces any other number with 5 s), else ``default``."""
    if timeout is None:
        return default
    if not _positive(timeout):
        raise CommandExecutionError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return math.ceil(timeout)


_LIMITERS, _LIMITERS_LOCK = {}, threading.Lock()


def _limiters(config):
    """(the token buckets, the reports) of this process for the configured limits: kept between
    events (the triage engine's runner module lives as long as the master)."""
    ident = (config["event_rate"], config["event_burst"], config["report_interval"])
    with _LIMITERS_LOCK:
        if ident not in _LIMITERS:
            _LIMITERS[ident] = (
                core.limits.buckets(config["event_rate"], config["event_burst"]),
                core.limits.reports(config["report_interval"]),
            )
        return _LIMITERS[ident]


_PUBLISHERS = threading.local()  # one connection to the master's bus per thread, kept between events


def _send(tag, data):
    """One try: False when the bus did not take the event.

    Each thread keeps its connection to the bus: opening one per event (a new event object, its
    IO loop and socket) was what capped triage. A connection that failed once is dropped, so the
    next try opens a new one. Salt's fire_event returns False when it cannot connect and raises
    when the send fails; the reactor would only record either in a job return nobody reads.
    """
    bus = getattr(_PUBLISHERS, "bus", None)
    try:
        if bus is None:
            bus = _PUBLISHERS.bus = salt.utils.event.get_master_event(
                __opts__, __opts__["sock_dir"], listen=False
            )
        if bus.fire_event(data, tag, timeout=5000):
            return True
    except Exception as exc:  # noqa: BLE001 - any failure is one failed try
        log.debug("hana_storage: putting %s on the bus failed: %s", tag, exc)
    _PUBLISHERS.bus = None
    if bus is not None:
        with contextlib.suppress(Exception):
            bus.destroy()
    return False


def _master_signature(tag, data):
    """The master's signature (base64) over an event it fires: the one place master events are
    signed, with ``<pki_dir>/master.pem`` (core.signing)."""
    passphrase = salt.utils.sdb.sdb_get(__opts__.get("key_pass"), __opts__)
    pem = os.path.join(__opts__["pki_dir"], "master.pem")
    return core.signing.sign(pem, core.events.master_signed_bytes(tag, data), passphrase)


def _master_key():
    """The master's private key, ``<pki_dir>/master.pem`` (kept loaded by Salt until it changes)."""
    passphrase = salt.utils.sdb.sdb_get(__opts__.get("key_pass"), __opts__)
    return core.signing.private_key(os.path.join(__opts__["pki_dir"], "master.pem"), passphrase)


def _cluster():
    """(the MAC key of triage's Redis store, its default key prefix) for this master's cluster: hot
    masters share master.pem and master.pub, as Salt requires, and so share both; another
    cluster has others. Neither is ever logged or put in an event."""
    store_error = core.store.failures()
    try:
        der = _master_key().private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        with open(os.path.join(__opts__["pki_dir"], "master.pub"), "rb") as pub:
            public = pub.read()
    except Exception as exc:  # noqa: BLE001 - the store is not opened, and triage says why
        raise store_error(
            f"the redis store's key cannot be made from the master's key pair: {type(exc).__name__}"
        ) from None
    return core.store.mac_key(der), core.store.cluster_prefix(public)


def verify_master(tag, data):
    """
    Whether an event under ``hana/storage/`` comes from this master's triage: ``None`` when its
    ``sig`` verifies with the master's public key (``<pki_dir>/master.pub``) and it is fresh
    (``ts`` within ``max_event_age``), else ``{"code": "forged_master_event", "reason"}``.

    The one place master events are verified; the exporter engine calls it for every
    ``hana/storage/*`` event, and any other consumer should.

    CLI Example:

    .. code-block:: bash

        salt-run hana_storage.verify_master tag=hana/storage/alert data='{...}'
    """
    signature = data.get("sig") if isinstance(data, dict) else None
    if not isinstance(signature, str) or not signature:
        return {"code": "forged_master_event", "reason": "unsigned: the master signs every event it fires"}
    message = core.events.master_signed_bytes(tag, data)
    if not core.signing.verifies(os.path.join(__opts__["pki_dir"], "master.pub"), message, signature):
        return {
            "code": "forged_master_event",
            "reason": "the signature does not verify with the master's key",
        }
    ts, max_age = data.get("ts"), _config()["max_event_age"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or abs(time.time() - ts) > max_age:
        return {"code": "forged_master_event", "reason": f"replayed: ts {ts!r} is not within {max_age} s"}
    return None


def _fire(tag, data):
    """Put an event on the master's bus, signed by the master (``ts``, ``sig``), retrying: a busy
    master refuses a connection now and then. False when it never left, or could not be signed."""
    try:
        # exactly what travels: the signature covers the data as consumers will decode it
        data = json.loads(json.dumps({**data, "ts": time.time()}, default=str))
        data["sig"] = _master_signature(tag, data)
    except Exception as exc:  # noqa: BLE001 - an unsigned event would be rejected by every consumer
        log.error("hana_storage: %s not fired: signing it with the master's key failed: %s", tag, exc)
        return False
    for attempt in range(FIRE_ATTEMPTS):
        if attempt:
            time.sleep(0.25 * 2**attempt)  # between tries only
        if _send(tag, data):
            return True
    log.error("hana_storage: %s could not be put on the master's event bus", tag)
    return False


# What Salt's targeting reads as a list (",") or a glob ("*", "?", "[...]"), and whitespace: an id
# with any of them is never one minion's id to triage, whatever its accepted key says.
TARGET_CHARACTERS = frozenset(",*?[]")


def _sender_problem(minion):
    """Why ``minion`` (the id a tag names) cannot be a sender, or None: no id, an id that is a
    target rather than an id (``bad_minion_id``), or no accepted key (``unknown_minion``)."""
    if not minion:
        return {"code": "unknown_minion", "reason": "the tag names no minion id"}
    if (
        TARGET_CHARACTERS.intersection(minion)
        or any(c.isspace() for c in minion)
        or not salt.utils.verify.valid_id(__opts__, minion)
    ):
        return {"code": "bad_minion_id", "reason": f"{minion[:100]!r} is not a valid minion id"}
    if not os.path.isfile(_accepted_key(minion)):
        return {"code": "unknown_minion", "reason": f"no accepted key for minion {minion!r}"}
    return None


def _accepted_key(minion):
    return os.path.join(__opts__["pki_dir"], "minions", minion)


def verify(tag, data):
    """
    Who sent a hana_storage beacon event: ``None`` when the minion named in the tag signed it
    with its accepted key and it is fresh, else ``{"code", "reason"}`` (code: bad_minion_id,
    unknown_minion, unsigned, bad_signature, stale).

    CLI Example:

    .. code-block:: bash

        salt-run hana_storage.verify tag=salt/beacon/db1/hana_storage/violation data='{...}'
    """
    minion, event = core.events.minion_of_tag(tag)
    return _sender_problem(minion) or _signature_problem(minion, event, data)


def _signature_problem(minion, event, data):
    """verify() for a sender with an accepted key: the signature and the age."""
    config = _config()
    pub = _accepted_key(minion)
    signature = data.get("sig") if isinstance(data, dict) else None
    if not signature:
        if config["require_signature"]:
            return {"code": "unsigned", "reason": "unsigned event"}
        return None
    message = core.events.signed_bytes(minion, event, data)
    if not core.signing.verifies(pub, message, signature):
        return {"code": "bad_signature", "reason": f"the signature does not verify with {minion!r}'s key"}
    ts = data.get("ts")
    age = time.time() - (ts if isinstance(ts, int | float) and not isinstance(ts, bool) else 0)
    if abs(age) > config["max_event_age"]:
        return {
            "code": "stale",
            "reason": f"event is {age:.0f} s old (max_event_age {config['max_event_age']})",
        }
    return None


def _store():
    """The store triage keeps its records in (``hana_storage:store``; local files by default).
    A Redis URL may be an ``sdb://`` reference, so its password need not be in the master's
    configuration."""
    config = _config()
    settings = dict(config.get("store") or {})
    if isinstance(settings.get("url"), str) and settings["url"].startswith("sdb://"):
        settings["url"] = salt.utils.sdb.sdb_get(settings["url"], __opts__)
    # the cluster's key and prefix made here, in the runner, where __opts__ names the pki_dir
    cluster = _cluster() if settings.get("driver") == "redis" else None
    return core.store.open_store(
        settings, __opts__["cachedir"], redeliver=float(config["lease"]), cluster=cluster
    )


# Who holds a claim: this process and this load of the module, after the master's id (_owner).
# Only ever compared with itself (renew, complete, release); the id makes a lease readable.
OWNER = f"{os.getpid()}/{uuid.uuid4().hex[:8]}"


def _claim(minion, rule, key, since, alert=None):
    """What to do about one occurrence of a finding: ``key`` first reported at ``since``.

    "act" (this master holds it under a lease until it completes or releases it), "duplicate"
    (handled already: a repeated event, the other master's, or a reconciled one), "held" (another
    claim's lease runs: its master is acting on it) or "cooldown" (a remediation of this finding
    within the cooldown: not recorded, so the minion's next audit event brings it back). A manual
    finding (``alert``) has no cooldown: each occurrence is alerted.

    With an ``alert`` (a manual rule's), acting is alerting: the same change of the store records
    the occurrence handled and adds the alert to the outbox, which is then delivered. A master
    that dies can neither lose the alert nor leave the occurrence to be alerted again.
    """
    config, claim, complete = _config(), core.store.claim, core.store.complete
    tally_name = core.store.tally_name
    lease, owner = float(config["lease"]), _owner()
    events = [_outbox_event(ALERT_TAG, alert)] if alert else []

    def decide(record, now):
        verdict = claim(record, now, key, since, 0 if alert else config["cooldown"], owner, lease)
        if alert and verdict["verdict"] == "act":
            complete(record, key, since, owner)
        return verdict

    def acted(verdict):
        return alert and verdict["verdict"] == "act"

    verdict = _store().update(
        minion,
        rule,
        decide,
        tally=lambda verdict: tally_name("alerted", rule) if acted(verdict) else None,
        outbox=lambda verdict: events if acted(verdict) else (),
        journal=lambda _verdict: {"key": key, "master": owner},
    )
    if acted(verdict):
        _deliver(events)
    return verdict


def _owner():
    return f"{__opts__.get('id') or 'master'}/{OWNER}"


def _complete(minion, rule, key, since, action, events):
    """Record the occurrence as handled, tally ``action`` (the metrics every master shares) and
    add ``events`` to the outbox, in one change of the store."""
    complete, tally_name = core.store.complete, core.store.tally_name
    return _recorded(
        minion,
        rule,
        lambda record, _now: complete(record, key, since, _owner()),
        tally=lambda first: tally_name(action, rule) if first else None,
        events=events,
        key=key,
    )


def _release(minion, rule, key, action, events):
    """Give up the occurrence _claim holds, keeping its cooldown (the first event after it acts
    again), tally ``action`` and add ``events`` to the outbox, in one change of the store."""
    release, tally_name = core.store.release, core.store.tally_name
    return _recorded(
        minion,
        rule,
        lambda record, _now: release(record, key, _owner(), True),
        tally=lambda released: tally_name(action, rule) if released else None,
        events=events,
        key=key,
    )


def _recorded(minion, rule, change, tally, events, key):
    """Record what was done (in the journal too: the finding ``key``, this master) and deliver
    its events. When the store cannot take it, the events go on the bus all the same, and the
    claim stays until its lease runs out and the occurrence is triaged again then: acted on twice
    rather than forgotten."""
    try:
        result = _store().update(
            minion,
            rule,
            change,
            tally=tally,
            outbox=lambda _result: events,
            journal=lambda _result: {"key": key, "master": _owner()},
        )
    except core.store.failures() as error:
        log.error("hana_storage: %s on %s was handled but not recorded: %s", rule, minion, error)
        _deliver(events, recorded=False)
        return None
    _deliver(events)
    return result


def _outbox_event(tag, data):
    """An event an action puts out, as the outbox holds it: its ``event_id`` travels in its data,
    the same on every delivery."""
    return {"event_id": uuid.uuid4().hex, "tag": tag, "data": data}


def _deliver(events, recorded=True, again=False):
    """Put an action's events on the bus now. Those the store holds (``recorded``) leave its
    outbox once a bus has carried them: the triage engine confirms each it sees on its master's
    bus. A fire the bus took confirms the event at once without the engine, and for an event
    sent ``again``: sending it once more is the recovery, and a confirmation that lags (or an
    engine that cannot follow its bus) must not send it again every lease. One the bus refused
    stays, and is put on a bus again when it is due (``redeliver``)."""
    fired = [
        event["event_id"]
        for event in events
        if _fire(event["tag"], {**event["data"], "event_id": event["event_id"]})
    ]
    if recorded and fired and (again or not _engine_running()):
        try:
            _store().confirm(fired)
        except core.store.failures() as error:  # put on the bus again when due: a repeat, not a loss
            log.warning("hana_storage: delivered events not confirmed in the store: %s", error)


ENGINE_SOCKET = "hana_storage_triage.sock"  # bound while the triage engine runs (_engines/)


def _engine_running():
    sock_dir = __opts__.get("sock_dir")
    return bool(sock_dir) and os.path.exists(os.path.join(sock_dir, ENGINE_SOCKET))


def delivered(tag, data):
    """
    Confirm that this master's bus carried an event of triage's outbox (``hana/storage/alert`` or
    ``.../remediation`` with an ``event_id``): it leaves the outbox. True when confirmed; an
    event the master did not sign (``verify_master``) confirms nothing. The triage engine calls
    this for each such event it sees on its master's bus.
    """
    event_id = data.get("event_id") if isinstance(data, dict) else None
    if tag not in (ALERT_TAG, REMEDIATION_TAG) or not isinstance(event_id, str) or verify_master(tag, data):
        return False
    _store().confirm([event_id])
    return True


def redeliver(limit=500):
    """
    Put triage's overdue events on this master's bus again: what an action decided and no bus
    carried within ``lease`` seconds (its master died first, or its bus refused it). Each keeps
    its ``event_id``. Returns how many were put on the bus. The triage engine runs this every few
    seconds; a site without the engine can schedule it.

    CLI Example:

    .. code-block:: bash

        salt-run hana_storage.redeliver
    """
    events = _store().overdue(int(limit))
    if events:
        log.warning("hana_storage: putting %d overdue triage events on the bus again", len(events))
        _deliver(events, again=True)
    return len(events)


@contextlib.contextmanager
def _renewing(minion, held):
    """Renew the leases of ``held`` [(rule, key)] every third of the lease while the block runs
    (a remediation waits for the minion for longer than a lease), so another master takes
    the occurrences over only when this one stops renewing them: it died."""
    # The thread is handed the store and the owner, not the loader's dunders: Salt keeps those
    # in contextvars, and in the triage engine's threads even a copied context left them None
    # there (every renewal failed, in the VM tier's master logs).
    lease, renew = float(_config()["lease"]), core.store.renew
    store, owner = _store(), _owner()
    stop = threading.Event()

    def renew_all():
        while not stop.wait(lease / 3):
            for rule, key in held:
                try:
                    store.update(minion, rule, lambda record, now, k=key: renew(record, now, k, owner, lease))
                except Exception as exc:  # noqa: BLE001 - the next round tries again; the lease says how long
                    log.warning("hana_storage: renewing the lease of %s on %s failed: %s", key, minion, exc)

    renewer = threading.Thread(target=renew_all, name="hana_storage-lease", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()


def _violation_finding(data):
    """The finding a violation event reports, with the occurrence it is (key, since)."""
    finding = {k: data.get(k) for k in FACTS}
    key = data.get("key")
    finding["key"] = key if isinstance(key, str) and key else core.events.finding_key(finding)
    # the occurrence's first report (the beacon's since: the same on every master connection);
    # a beacon from before the field sends only ts, which is its since
    since = data.get("since")
    numeric = isinstance(since, (int, float)) and not isinstance(since, bool)
    finding["since"] = since if numeric else data.get("ts")
    return finding


def triage(tag, data):
    """
    Decide what to do about a beacon event (the reactor calls this; see the module doc).

    A ``violation`` event is one finding; an ``audit`` event lists every open finding with the
    time its violation was first reported, and each occurrence not handled yet (its reaction
    lost, or deferred by the cooldown) is handled now. The same occurrence is never acted on
    twice.

    Returns ``{"action": "remediated"|"remediation-failed"|"alerted"|"cooldown"|
    "duplicate"|"rejected"|"ignored", ...}`` for a violation, and
    ``{"action": "reconciled", "minion": ..., "findings": [one such result per open finding]}``
    for an audit event. A remediation's result names ``result`` (fixed, absent, not-fixed,
    failed) and ``reason`` (a code: verified, not_found, manual_rule, not_allowed, not_mounted,
    no_fix, skipped, still_open, fix_failed, no_return, call_failed); a remediation
    that is not fixed or absent is ``remediation-failed``, alerted and released.

    CLI Example (what the reactor does):

    .. code-block:: bash

        salt-run hana_storage.triage tag=salt/beacon/db1/hana_storage/violation data='{...}'
    """
    began = time.time()
    result, report = _triage(tag, data)
    if report:
        _fire(TRIAGED_TAG, {"tag": tag, "began": began, "result": result})
    return result


def _triage(tag, data):
    """(what triage returned, whether to report it): a rejection is reported once per claimed
    minion and ``report_interval``, so that a flood of forged events costs the master no signed
    event and no log line each.

    The checks run cheapest first: the id and its accepted key (a stat), the sender's token bucket
    (an accepted id's own; every other claim shares one), the event's size, then the signature."""
    minion, event = core.events.minion_of_tag(tag)
    if event not in ("violation", "audit") or not isinstance(data, dict):
        return {"action": "ignored", "reason": "not a hana_storage violation or audit event"}, True
    config = _config()
    buckets, reports = _limiters(config)
    problem = _sender_problem(minion)
    sender = core.limits.unknown() if problem else minion
    if not buckets.allow(sender):
        problem = {
            "code": "rate_limited",
            "reason": f"more than {config['event_burst']} events at once, or {config['event_rate']} per second, "
            f"from {sender!r}: dropped unverified",
        }
    elif problem is None:
        size = len(json.dumps(data, default=str))
        if size > config["max_event_bytes"]:
            problem = {
                "code": "too_large",
                "reason": f"{size} bytes (max_event_bytes {config['max_event_bytes']})",
            }
        else:
            problem = _signature_problem(minion, event, data)
    if problem:
        return _rejected(reports, tag, minion, sender, problem, data)
    if event == "violation":
        return _handle(minion, [_violation_finding(data)], event)[0], True
    findings, most = core.events.open_findings(data), int(config["max_audit_findings"])
    result = {"action": "reconciled", "minion": minion, "findings": _handle(minion, findings[:most], event)}
    if len(findings) > most:
        result["dropped"] = len(findings) - most
        if reports.due((minion, "max_audit_findings")) is not None:
            log.warning(
                "hana_storage: %s's audit event listed %d more open findings than max_audit_findings (%d): "
                "not triaged now",
                minion,
                result["dropped"],
                most,
            )
    return result, True


def _rejected(reports, tag, minion, sender, problem, data):
    """The result of a rejected event, reported (a log line, a signed hana/storage/rejected and a
    hana/storage/triaged) only when ``sender`` was not reported within ``report_interval``; the
    report counts what was held back since (``held_back``)."""
    result = {"action": "rejected", "minion": minion, **problem}
    held_back = reports.due(sender)
    if held_back is None:
        return result, False
    more = f" ({held_back} more rejected from {sender!r} since the last report)" if held_back else ""
    log.warning("hana_storage: rejected %s: %s%s", tag[:300], problem["reason"], more)
    rule = data.get("rule")
    report = {"tag": tag, "claimed_minion": minion, **problem, "held_back": held_back}
    _fire(REJECTED_TAG, {**report, "rule": rule if isinstance(rule, str) and len(rule) <= 64 else None})
    return result, True


def _handle(minion, findings, via):
    """One result per finding: alert the manual ones, remediate the auto ones in one call to the minion."""
    known, store_error = core.rules.rule_table(), core.store.failures()
    results, to_fix = [], []
    for finding in findings:
        rule = finding.get("rule")
        if rule not in known:
            results.append({"action": "ignored", "minion": minion, "reason": f"unknown rule {rule!r}"})
            continue
        # the key as sent, or its hash when it is longer than any the beacon makes: a minion names
        # keys, and each is kept in its record
        key, since = core.limits.finding_key(finding["key"]), finding["since"]
        facts = {k: finding.get(k) for k in FACTS}
        facts.update(severity=known[rule]["severity"], via=via, key=key, since=since)  # since: the occurrence
        alert = (
            None
            if known[rule]["remediation"] == "auto"
            else {"minion": minion, **facts, "remediation": "manual"}
        )
        try:
            claim = _claim(minion, rule, key, since, alert)
        except store_error as error:
            log.error("hana_storage: %s on %s not triaged: %s", rule, minion, error)
            results.append({"action": "store-failed", "minion": minion, "rule": rule, "reason": str(error)})
            continue
        verdict = claim.pop("verdict")
        if verdict != "act":
            results.append({"action": verdict, "minion": minion, "rule": rule, **claim})
        elif alert is None:
            to_fix.append((facts, key, since))
        else:
            results.append({"action": "alerted", "minion": minion, "rule": rule})
    if to_fix:
        with _renewing(minion, [(facts["rule"], key) for facts, key, _since in to_fix]):
            results += _remediate(minion, to_fix)
    return results


def _remediate(minion, to_fix):
    """Run the fix for the claimed auto findings [(facts, key, since)] and report each: only a
    verified fix (or nothing left to fix) is done; anything else is alerted and released."""
    rules = sorted({facts["rule"] for facts, _key, _since in to_fix})
    try:
        returned = _call_remediate(minion, rules)
    except Exception as exc:  # noqa: BLE001 - reported like any other call that returned nothing
        log.error("hana_storage: calling hana_storage.remediate on %s failed: %s", minion, exc)
        returned = exc
    ret, missing = _remediation_return(returned, minion)
    results = []
    for facts, key, since in to_fix:
        rule = facts["rule"]
        result, reason = _verdict(ret, missing, rule)
        detail = missing[1] if ret is None else {k: _of_rule(ret[k], rule) for k in REMEDIATE_LISTS}
        events = [
            _outbox_event(
                REMEDIATION_TAG,
                {"minion": minion, **facts, "result": result, "reason": reason, "detail": detail},
            )
        ]
        entry = {"minion": minion, "rule": rule, "result": result, "reason": reason, "detail": detail}
        if result in DONE:
            _complete(minion, rule, key, since, "remediated", events)
            results.append({"action": "remediated", **entry})
            continue
        alert = {"minion": minion, **facts, "remediation": "auto", "result": result, "reason": reason}
        _release(minion, rule, key, "remediation-failed", events + [_outbox_event(ALERT_TAG, alert)])
        results.append({"action": "remediation-failed", **entry})
    return results


REMEDIATE_LISTS = ("fixed", "failed", "skipped", "remaining")


# seconds: the minion waits its turn and for a running state (at most 300 s in all), re-audits, fixes
REMEDIATE_TIMEOUT = 600


def _call_remediate(minion, rules):
    """``hana_storage.remediate`` on that one minion (target type ``list``: an id is never a
    pattern): {minion: its return}, or {} when it did not answer.

    A direct call, as the ``salt.function`` state of the orchestration that used to wrap it
    made it: running the orchestration added a highstate's loaders and the master's pillar to
    each remediation, about 0.1 s of the master's CPU (bench/test_fleet.py, CPU per event by
    process, one run each way).
    """
    client = salt.client.get_local_client(mopts=__opts__)
    try:
        return client.cmd(
            [minion],  # a list of one: an id is never read as a list or a pattern
            "hana_storage.remediate",
            kwarg={"rules": rules},
            tgt_type="list",
            timeout=REMEDIATE_TIMEOUT,
        )
    finally:
        client.destroy()


def _remediation_return(returned, minion):
    """(the minion's remediate() return, None), or (None, (code, why there is none)) out of what
    the call returned. A return counts only with all four lists: anything else (an error text,
    a minion that did not answer) is no return at all, never "nothing to fix"."""
    if isinstance(returned, Exception):
        return None, ("call_failed", str(returned) or type(returned).__name__)
    if not isinstance(returned, dict):
        return None, ("call_failed", f"the call returned {returned!r}, not a mapping of returns")
    ret = returned.get(minion)
    if isinstance(ret, dict) and all(isinstance(ret.get(k), list) for k in REMEDIATE_LISTS):
        return ret, None
    if ret is None:
        return None, ("no_return", f"{minion} did not answer within {REMEDIATE_TIMEOUT} s")
    return None, ("no_return", f"{minion} returned no remediation: {str(ret)[:200]}")


def _of_rule(entries, rule):
    return [e for e in entries if isinstance(e, dict) and e.get("rule") == rule]


def _verdict(ret, missing, rule):
    """(result, reason code) of one rule's remediation, from the minion's remediate() return.

    fixed: listed as fixed, and its re-audit after the fix finds it no more (``remaining``);
    absent: the minion's audit found nothing of the rule to fix; not-fixed: skipped (reason: the
    minion's code, such as not_allowed) or still open; failed: the fix failed, or no return
    (``missing``: its code and why).
    """
    if ret is None:
        return "failed", missing[0]
    if _of_rule(ret["failed"], rule):
        return "failed", "fix_failed"
    skipped = _of_rule(ret["skipped"], rule)
    if _of_rule(ret["remaining"], rule) or skipped:
        code = skipped[0].get("code") if skipped else None
        if isinstance(code, str) and code:
            return "not-fixed", code
        return "not-fixed", "skipped" if skipped else "still_open"
    if _of_rule(ret["fixed"], rule):
        return "fixed", "verified"
    return "absent", "not_found"


def tallies():
    """
    The actions triage completed, per action and rule (``{"alerted|HANA-ENC-001": 3, ...}``),
    from its store: with hot masters sharing one, the fleet's across every master. The exporter
    serves them as ``hana_storage_triage_actions_total``.

    CLI Example:

    .. code-block:: bash

        salt-run hana_storage.tallies
    """
    return _store().tallies()


REPORT_FORMATS = ("text", "json", "html")


def report(tgt="*", tgt_type="glob", timeout=None, format="text", out=None):  # noqa: A002 - salt-run's word
    """
    Fleet compliance: audit every targeted minion now.

    format
        ``text`` (default): minion, volume, compliant and the rules failing, as a table (the data
        with ``--out=json``). ``json`` or ``html``: the evidence report a person signs off - the
        fleet summary, a host-by-rule matrix, each finding with its evidence, the keys' state,
        what triage did (the store's journal) and the compliance over time (the store keeps the
        fleet's compliance at each such report) - written to ``out``.
    out
        Where the json or html report goes: a new file (mode 0640), never one that exists;
        default ``<cachedir>/hana_storage/reports/evidence-<UTC time>.<format>``.

    CLI Example:

    .. code-block:: bash

        salt-run hana_storage.report
        salt-run hana_storage.report tgt='hana-*' --out=json
        salt-run hana_storage.report format=html out=/srv/evidence/hana-2026-11.html
    """
    if format not in REPORT_FORMATS:
        raise CommandExecutionError(f"format must be one of {', '.join(REPORT_FORMATS)}, not {format!r}")
    config = _config()
    client = salt.client.get_local_client(__opts__["conf_file"])
    returns = client.cmd(
        tgt,
        "hana_storage.audit" if format == "text" else "hana_storage.evidence",
        tgt_type=tgt_type,
        timeout=_seconds(timeout, config["report_timeout"]),
        full_return=True,
    )
    if format == "text":
        fleet = core.report.fleet(returns)
        if __opts__.get("output"):
            return fleet
        return core.report.table(fleet["rows"])
    # a job of its own: a minion whose formula is older still gives its evidence
    ready = _readiness_of(client, tgt, tgt_type, _seconds(timeout, config["readiness_timeout"]))
    now = time.time()
    doc = core.evidence.document(returns, __opts__.get("id", "master"), core.VERSION, now, readiness=ready)
    try:
        store = _store()
        store.add_snapshot(doc["summary"])
        doc["history"], doc["actions"] = store.history(), store.actions()
        doc["tallies"] = store.tallies()
    except core.store.failures() as error:
        log.error("hana_storage: the report has no history: the store failed: %s", error)
        doc["history"] = [doc["summary"]]
    if format == "json":  # strict JSON: a NaN or an Infinity is no JSON number
        text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"
    else:
        text = core.evidence.html(doc)
    if out is None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        out = os.path.join(__opts__["cachedir"], "hana_storage", "reports", f"evidence-{stamp}.{format}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), mode=0o750, exist_ok=True)
    try:
        core.files.create_file(out, text.encode(), mode=0o640)
    except FileExistsError:
        raise CommandExecutionError(f"{out} exists: a report is written to a new file only") from None
    return {"written": out, "format": format, "summary": doc["summary"]}


def readiness(tgt="*", tgt_type="glob", timeout=None):
    """
    Will the targeted minions unlock their storage at their next boot, without Salt? Runs
    ``hana_storage.boot_readiness`` on each now (it asks the Tang servers, as the boot will) and
    fires ``hana/storage/readiness``, signed by the master, for each minion that answered: the
    exporter's ``hana_storage_boot_ready{minion}``. Run it before a patch day; the shipped
    conf/master.d/hana-storage.conf runs it every six hours. A minion that does not answer keeps
    its last value, with the time it was checked (``hana_storage_boot_readiness_timestamp_seconds``).

    Returns ``{minion: {"ready": True, False, or None when its answer was no verdict, "not_ready":
    ["<crypttab line>: <problem code>", ...], "error": when it could not be checked}}``; the
    lines' causes and fixes: ``salt <minion> hana_storage.boot_readiness``.

    CLI Example:

    .. code-block:: bash

        salt-run hana_storage.readiness
        salt-run hana_storage.readiness tgt='hana-*'
    """
    client = salt.client.get_local_client(__opts__["conf_file"])
    parts = _readiness_of(client, tgt, tgt_type, _seconds(timeout, _config()["readiness_timeout"]))
    return {minion: core.readiness.summary(part) for minion, part in parts.items()}


def _readiness_of(client, tgt, tgt_type, timeout):
    """{minion: its boot readiness (core.evidence.readiness_parts: checked now, by the master's
    clock)} of the targeted minions that answered; each verdict announced as
    ``hana/storage/readiness``, for the exporter. An answer that is no verdict ("ready" None) is
    not announced: the minion's gauge keeps its value and its time, which then grows stale."""
    returns = client.cmd(
        tgt, "hana_storage.boot_readiness", tgt_type=tgt_type, timeout=timeout, full_return=True
    )
    parts = core.evidence.readiness_parts(returns, time.time())
    for minion, part in sorted(parts.items()):
        if part["ready"] is not None:
            _fire(
                READINESS_TAG, {"minion": minion, **core.readiness.summary(part), "checked": part["checked"]}
            )
    return parts


def snapshot(tgt="*", tgt_type="glob", timeout=None):
    """
    Keep the fleet's compliance now in the store's history, for the evidence report's chart of
    compliance over time: a fleet audit, nothing else. Schedule it on one master (the shipped
    conf/master.d/hana-storage.conf runs it hourly); every ``report format=json|html`` keeps one
    too.

    CLI Example:

    .. code-block:: bash

        salt-run hana_storage.snapshot
    """
    config = _config()
    client = salt.client.get_local_client(__opts__["conf_file"])
    returns = client.cmd(
        tgt,
        "hana_storage.audit",
        tgt_type=tgt_type,
        timeout=_seconds(timeout, config["report_timeout"]),
        full_return=True,
    )
    hosts = core.evidence.host_parts(returns, "verdict")
    entry = core.evidence.snapshot(hosts, time.time())
    try:
        _store().add_snapshot(entry)
    except core.store.failures() as error:
        raise CommandExecutionError(f"the snapshot was not kept: {error}") from None
    return entry
