"""Beacon events built and signed as the beacon does, for tests and benchmarks that play a minion."""

import base64
import time

import hana_storage_events as events
import salt.crypt


def sign(key, minion, event, data):
    """``data`` with the minion's signature (``key``: its salt.crypt.PrivateKey) in ``sig``."""
    message = events.signed_bytes(minion, event, data)
    return {**data, "sig": base64.b64encode(key.sign(message, salt.crypt.PKCS1v15_SHA224)).decode()}


def violation_data(finding, ts):
    """A violation event's data: the finding, its key, reported at ``ts``."""
    return {**finding, "key": events.finding_key(finding), "trigger": "uevent", "ts": ts}


def audit_data(open_since, volumes=("data", "log"), ts=None):
    """An audit event's data listing open findings: [(finding, the ts its violation was sent at)]."""
    findings = [f for f, _ in open_since]
    failing = {v: sorted({f["rule"] for f in findings if f["volume"] == v}) for v in volumes}
    report = {
        "compliant": not findings,
        "findings": findings,
        "volumes": {
            v: {"compliant": not rules, "rules": rules, "mountpoint": f"/hana/{v}"}
            for v, rules in failing.items()
        },
    }
    since = {events.finding_key(f): first for f, first in open_since}
    data = events.audit_event(report, "full", 0.5, time.time() if ts is None else ts, since)
    data.pop("tag")
    return data
