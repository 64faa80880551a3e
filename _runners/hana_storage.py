"""
Fleet side of the HANA storage formula: the fleet compliance report, and the triage the reactor
runs for each ``salt/beacon/<minion>/hana_storage/violation`` event.

Any minion can put any tag and data on the master's bus, so triage trusts nothing in an event:

* the sender is the minion whose accepted key verifies the event's signature (the beacon signs
  every event); an unsigned, forged or stale event is rejected and reported;
* whether a rule may be fixed automatically comes from the master's own rule table;
* the fix runs on that minion only (target type ``list``: an id is never a pattern), through the
  orchestration ``hana.storage.orch.remediate``, and the minion re-audits before fixing anything;
* one remediation or alert per minion and rule per cooldown, however many events arrive (the
  last action's time is a file under the master's cachedir: it holds across the reactor's
  threads, module reloads and master restarts).

Master configuration (``conf/master.d/hana-storage.conf``)::

    hana_storage:
      cooldown: 300          # seconds between two actions for one minion and rule
      max_event_age: 600     # seconds: an older (or replayed) event is rejected
      require_signature: true
"""

import base64
import fcntl
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
    """The file holding the time of the last action for (minion, rule)."""
    return os.path.join(__opts__["cachedir"], "hana_storage", "actions", f"{minion}@{rule}")


def _claim(minion, rule, cooldown):
    """True when nothing was done for (minion, rule) within the cooldown; records the action.

    ``minion`` is a verified id (``valid_id``: no path separators), ``rule`` one of the table's.
    """
    path = _action_record(minion, rule)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(descriptor, "r+", encoding="utf-8") as record:
        fcntl.flock(record, fcntl.LOCK_EX)  # per open file: excludes threads and processes alike
        try:
            last = float(record.read() or "-inf")
        except ValueError:
            last = float("-inf")  # an unreadable record never blocks an action
        now = time.time()
        if last <= now < last + cooldown:
            return False
        record.seek(0)
        record.truncate()
        record.write(repr(now))
        return True


def _release(minion, rule):
    """Forget the action recorded by _claim: the alert it stood for never left the master."""
    with open(_action_record(minion, rule), "r+", encoding="utf-8") as record:
        fcntl.flock(record, fcntl.LOCK_EX)
        record.truncate()


def triage(tag, data):
    """
    Decide what to do about one violation event (the reactor calls this; see the module doc).

    Returns ``{"action": "remediated"|"remediation-failed"|"alerted"|"alert-failed"|"cooldown"|"rejected"|"ignored", ...}``.

    CLI Example (what the reactor does):

    .. code-block:: bash

        salt-run hana_storage.triage tag=salt/beacon/db1/hana_storage/violation data='{...}'
    """
    config = _config()
    minion, event = __utils__["hana_storage_events.minion_of_tag"](tag)
    if event != "violation" or not isinstance(data, dict):
        return {"action": "ignored", "reason": "not a hana_storage violation event"}
    problem = verify(tag, data)
    if problem:
        log.warning("hana_storage: rejected %s: %s", tag, problem["reason"])
        _fire(REJECTED_TAG, {"tag": tag, "claimed_minion": minion, **problem, "rule": data.get("rule")})
        return {"action": "rejected", "minion": minion, **problem}
    rule = data.get("rule")
    known = __utils__["hana_storage_rules.rule_table"]()
    if rule not in known:
        return {"action": "ignored", "minion": minion, "reason": f"unknown rule {rule!r}"}
    if not _claim(minion, rule, config["cooldown"]):
        return {"action": "cooldown", "minion": minion, "rule": rule}
    finding = {k: data.get(k) for k in ("rule", "volume", "mountpoint", "device", "message")}
    finding["severity"] = known[rule]["severity"]
    if known[rule]["remediation"] != "auto":
        if not _fire(ALERT_TAG, {"minion": minion, **finding, "remediation": "manual"}):
            _release(minion, rule)  # the next violation event alerts again, not the cooldown
            return {"action": "alert-failed", "minion": minion, "rule": rule}
        return {"action": "alerted", "minion": minion, "rule": rule}
    outcome = __salt__["state.orchestrate"](
        "hana.storage.orch.remediate",
        pillar={"hana_storage_remediation": {"minion": minion, "rules": [rule]}},
    )
    ok, detail = _orchestration_result(outcome, minion)
    _fire(
        REMEDIATION_TAG,
        {"minion": minion, **finding, "result": "fixed" if ok else "failed", "detail": detail},
    )
    return {
        "action": "remediated" if ok else "remediation-failed",
        "minion": minion,
        "rule": rule,
        "detail": detail,
    }


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
