"""
Fleet side of the HANA storage formula: the fleet compliance report, and the triage the reactor
runs for each ``salt/beacon/<minion>/hana_storage/violation`` event and each ``.../audit`` event
that lists open findings.

Any minion can put any tag and data on the master's bus, so triage trusts nothing in an event:

* the sender is the minion whose accepted key verifies the event's signature (the beacon signs
  every event); an unsigned, forged or stale event is rejected and reported;
* whether a rule may be fixed automatically comes from the master's own rule table;
* the fix runs on that minion only (target type ``list``: an id is never a pattern), through the
  orchestration ``hana.storage.orch.remediate``, and the minion re-audits before fixing anything;
* one remediation or alert per minion and rule per cooldown, however many events arrive, and
  never two for one occurrence of a finding (a file per minion and rule under the master's
  cachedir: it holds across the reactor's threads, module reloads and master restarts);
* events are edges, and Salt's reactor can lose one (its worker pool drops a reaction whose
  runner client fails to start, logging it at debug level only); the minion's ``audit`` event
  after each full audit lists every open finding with the time it was first reported, and
  triage acts on each occurrence it has not handled: a lost reaction, a finding deferred by
  the cooldown, or one raised while the master was down is handled within one full-audit
  interval.

Master configuration (``conf/master.d/hana-storage.conf``)::

    hana_storage:
      cooldown: 300          # seconds between two actions for one minion and rule
      max_event_age: 600     # seconds: an older (or replayed) event is rejected
      require_signature: true
"""

import base64
import contextlib
import fcntl
import json
import logging
import os
import time

import salt.client
import salt.crypt
import salt.utils.event
import salt.utils.verify

log = logging.getLogger(__name__)

__virtualname__ = "hana_storage"

DEFAULTS = {"cooldown": 300, "max_event_age": 600, "require_signature": True, "report_timeout": 120}
ALERT_TAG = "hana/storage/alert"
REMEDIATION_TAG = "hana/storage/remediation"
REJECTED_TAG = "hana/storage/rejected"
SIGNING = salt.crypt.PKCS1v15_SHA224
FACTS = ("rule", "volume", "mountpoint", "device", "message")  # what alerts and remediations name
FIRE_ATTEMPTS = 5


def __virtual__():
    return __virtualname__


def _config():
    return {**DEFAULTS, **(__opts__.get("hana_storage") or {})}


def _send(tag, data):
    """One try: False when the bus did not take the event.

    Salt's fire_event returns False when it cannot connect and raises when the send fails; the
    reactor would only record either in a job return nobody reads.
    """
    try:
        with salt.utils.event.get_master_event(__opts__, __opts__["sock_dir"], listen=False) as bus:
            return bus.fire_event(data, tag, timeout=5000)
    except Exception as exc:  # noqa: BLE001 - any failure is one failed try
        log.debug("hana_storage: putting %s on the bus failed: %s", tag, exc)
        return False


def _fire(tag, data):
    """Put an event on the master's bus, retrying: a busy master refuses a connection now and then."""
    for attempt in range(FIRE_ATTEMPTS):
        if attempt:
            time.sleep(0.25 * 2**attempt)  # between tries only
        if _send(tag, data):
            return True
    log.error("hana_storage: %s could not be put on the master's event bus", tag)
    return False


def verify(tag, data):
    """
    Who sent a hana_storage beacon event: ``None`` when the minion named in the tag signed it
    with its accepted key and it is fresh, else ``{"code", "reason"}`` (code: unknown_minion,
    unsigned, bad_signature, stale).

    CLI Example:

    .. code-block:: bash

        salt-run hana_storage.verify tag=salt/beacon/db1/hana_storage/violation data='{...}'
    """
    config = _config()
    minion, event = __utils__["hana_storage_events.minion_of_tag"](tag)
    if not minion or not salt.utils.verify.valid_id(__opts__, minion):
        return {"code": "unknown_minion", "reason": "the tag names no valid minion id"}
    pub = os.path.join(__opts__["pki_dir"], "minions", minion)
    if not os.path.isfile(pub):
        return {"code": "unknown_minion", "reason": f"no accepted key for minion {minion!r}"}
    signature = data.get("sig") if isinstance(data, dict) else None
    if not signature:
        if config["require_signature"]:
            return {"code": "unsigned", "reason": "unsigned event"}
        return None
    message = __utils__["hana_storage_events.signed_bytes"](minion, event, data)
    try:
        good = salt.crypt.verify_signature(pub, message, base64.b64decode(signature), algorithm=SIGNING)
    except Exception:  # noqa: BLE001 - a malformed signature is a forgery like any other
        good = False
    if not good:
        return {"code": "bad_signature", "reason": f"the signature does not verify with {minion!r}'s key"}
    age = time.time() - float(data.get("ts") or 0)
    if abs(age) > config["max_event_age"]:
        return {
            "code": "stale",
            "reason": f"event is {age:.0f} s old (max_event_age {config['max_event_age']})",
        }
    return None


def _action_record(minion, rule):
    """The file holding, for (minion, rule), the last action's time and the occurrences handled."""
    return os.path.join(__opts__["cachedir"], "hana_storage", "actions", f"{minion}@{rule}")


def _read_record(record):
    """{"at": last action time or None, "handled": {finding key: since}}; an older record held
    only the time; an unreadable one never blocks an action."""
    text = record.read()
    try:
        loaded = json.loads(text) if text else {}
    except ValueError:
        loaded = {}
    if isinstance(loaded, int | float):
        loaded = {"at": loaded}
    if not isinstance(loaded, dict):
        loaded = {}
    at, handled = loaded.get("at"), loaded.get("handled")
    return {
        "at": at if isinstance(at, int | float) else None,
        "handled": handled if isinstance(handled, dict) else {},
    }


@contextlib.contextmanager
def _locked_record(minion, rule):
    """The action record of (minion, rule), read under an exclusive lock; written back on exit.

    ``minion`` is a verified id (``valid_id``: no path separators), ``rule`` one of the table's.
    """
    path = _action_record(minion, rule)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(descriptor, "r+", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # per open file: excludes threads and processes alike
        record = _read_record(handle)
        before = json.dumps(record, sort_keys=True)
        yield record
        if json.dumps(record, sort_keys=True) != before:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(record, sort_keys=True))


def _claim(minion, rule, key, since, cooldown):
    """What to do about one occurrence of a finding: ``key`` first reported at ``since``.

    "act" (recorded: this occurrence is handled), "duplicate" (it was handled already: a repeated
    or reconciled event) or "cooldown" (an action for this rule within the cooldown: not
    recorded, so the minion's next audit event brings it back once the cooldown is over).
    """
    with _locked_record(minion, rule) as record:
        if key in record["handled"] and record["handled"][key] == since:
            return "duplicate"
        now = time.time()
        if record["at"] is not None and record["at"] <= now < record["at"] + cooldown:
            return "cooldown"
        record["at"] = now
        record["handled"][key] = since
        return "act"


def _release(minion, rule, key):
    """Forget the action _claim recorded: the alert it stood for never left the master."""
    with _locked_record(minion, rule) as record:
        record["at"] = None
        record["handled"].pop(key, None)


def _violation_finding(data):
    """The finding a violation event reports, with the occurrence it is (key, since)."""
    finding = {k: data.get(k) for k in FACTS}
    finding["key"] = data.get("key") or __utils__["hana_storage_events.finding_key"](finding)
    finding["since"] = data.get("ts")
    return finding


def triage(tag, data):
    """
    Decide what to do about a beacon event (the reactor calls this; see the module doc).

    A ``violation`` event is one finding; an ``audit`` event lists every open finding with the
    time its violation was first reported, and each occurrence not handled yet (its reaction
    lost, or deferred by the cooldown) is handled now. The same occurrence is never acted on
    twice.

    Returns ``{"action": "remediated"|"remediation-failed"|"alerted"|"alert-failed"|"cooldown"|
    "duplicate"|"rejected"|"ignored", ...}`` for a violation, and
    ``{"action": "reconciled", "minion": ..., "findings": [one such result per open finding]}``
    for an audit event.

    CLI Example (what the reactor does):

    .. code-block:: bash

        salt-run hana_storage.triage tag=salt/beacon/db1/hana_storage/violation data='{...}'
    """
    minion, event = __utils__["hana_storage_events.minion_of_tag"](tag)
    if event not in ("violation", "audit") or not isinstance(data, dict):
        return {"action": "ignored", "reason": "not a hana_storage violation or audit event"}
    problem = verify(tag, data)
    if problem:
        log.warning("hana_storage: rejected %s: %s", tag, problem["reason"])
        _fire(REJECTED_TAG, {"tag": tag, "claimed_minion": minion, **problem, "rule": data.get("rule")})
        return {"action": "rejected", "minion": minion, **problem}
    if event == "violation":
        return _handle(minion, [_violation_finding(data)], event)[0]
    findings = __utils__["hana_storage_events.open_findings"](data)
    return {"action": "reconciled", "minion": minion, "findings": _handle(minion, findings, event)}


def _handle(minion, findings, via):
    """One result per finding: alert the manual ones, remediate the auto ones in one orchestration."""
    config, known = _config(), __utils__["hana_storage_rules.rule_table"]()
    results, to_fix = [], []
    for finding in findings:
        rule = finding.get("rule")
        if rule not in known:
            results.append({"action": "ignored", "minion": minion, "reason": f"unknown rule {rule!r}"})
            continue
        claim = _claim(minion, rule, finding["key"], finding["since"], config["cooldown"])
        if claim != "act":
            results.append({"action": claim, "minion": minion, "rule": rule})
            continue
        facts = {k: finding.get(k) for k in FACTS}
        facts.update(severity=known[rule]["severity"], via=via)
        if known[rule]["remediation"] == "auto":
            to_fix.append(facts)
        elif _fire(ALERT_TAG, {"minion": minion, **facts, "remediation": "manual"}):
            results.append({"action": "alerted", "minion": minion, "rule": rule})
        else:
            _release(minion, rule, finding["key"])  # the next event alerts again, not the cooldown
            results.append({"action": "alert-failed", "minion": minion, "rule": rule})
    if to_fix:
        rules = sorted({facts["rule"] for facts in to_fix})
        outcome = __salt__["state.orchestrate"](
            "hana.storage.orch.remediate",
            pillar={"hana_storage_remediation": {"minion": minion, "rules": rules}},
        )
        ok, detail = _orchestration_result(outcome, minion)
        for facts in to_fix:
            result = "fixed" if ok else "failed"
            _fire(REMEDIATION_TAG, {"minion": minion, **facts, "result": result, "detail": detail})
            action = "remediated" if ok else "remediation-failed"
            results.append({"action": action, "minion": minion, "rule": facts["rule"], "detail": detail})
    return results


def _orchestration_result(outcome, minion):
    """(ok, the minion's remediate() return or the orchestration's comment)."""
    states = (outcome or {}).get("data", {})
    states = next(iter(states.values()), {}) if isinstance(states, dict) else {}
    for state in states.values() if isinstance(states, dict) else []:
        ret = (state.get("changes") or {}).get("ret", {}).get(minion)
        if isinstance(ret, dict):
            return bool(state.get("result")) and ret.get("result") is True, {
                k: ret.get(k) for k in ("fixed", "failed", "skipped")
            }
        return bool(state.get("result")), state.get("comment")
    return False, "the orchestration returned nothing"


def report(tgt="*", tgt_type="glob", timeout=None):
    """
    Fleet compliance: audit every targeted minion now and list minion, volume, compliant and
    the rules failing. A text table by default; the data with ``--out=json`` (or yaml, ...).

    CLI Example:

    .. code-block:: bash

        salt-run hana_storage.report
        salt-run hana_storage.report tgt='hana-*' --out=json
    """
    config = _config()
    client = salt.client.get_local_client(__opts__["conf_file"])
    returns = client.cmd(
        tgt,
        "hana_storage.audit",
        tgt_type=tgt_type,
        timeout=timeout or config["report_timeout"],
        full_return=True,
    )
    fleet = __utils__["hana_storage_report.fleet"](returns)
    if __opts__.get("output"):
        return fleet
    return __utils__["hana_storage_report.table"](fleet["rows"])
