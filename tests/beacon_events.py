"""Beacon events built and signed as the beacon does, for tests and benchmarks that play a minion."""

import base64
import os
import time

import salt.crypt
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding
from hana_storage_core import events as events


def signature(key, message):
    """base64 PKCS1v15_SHA224 signature of ``message``. ``key``: a salt.crypt.PrivateKey, or the
    path of a PEM private key (read through salt.crypt.get_rsa_key, which Salt 3006.9+, 3007 and
    3008 all have and which keeps it loaded: PrivateKey.from_file is 3008 only)."""
    if isinstance(key, (str, os.PathLike)):
        raw = salt.crypt.get_rsa_key(os.fspath(key), None).sign(message, padding.PKCS1v15(), hashes.SHA224())
    else:
        raw = key.sign(message, salt.crypt.PKCS1v15_SHA224)
    return base64.b64encode(raw).decode()


def sign(key, minion, event, data):
    """``data`` with the minion's signature in ``sig`` (``key``: see ``signature``)."""
    return {**data, "sig": signature(key, events.signed_bytes(minion, event, data))}


def sign_as_master(key, tag, data):
    """``data`` signed as the master signs the events it fires (``key``: see ``signature``): with
    the master's own key a genuine event; with any other key, what a forger can make."""
    return {**data, "sig": signature(key, events.master_signed_bytes(tag, data))}


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
