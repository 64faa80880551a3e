#!py
# vim: ft=python
"""
salt/beacon/<minion>/hana_storage/violation, and .../audit when it lists open findings -> triage.

The event is only a hint: triage checks the sender's signature, takes auto/manual from the
master's rule table, applies the cooldown, then calls hana_storage.remediate on that minion or fires
hana/storage/alert. An audit event reconciles: each open finding the master has not handled yet
(its violation's reaction was lost) is handled.

The event goes to the hana_storage_triage engine over its socket, which triages without a runner
job per event; when the engine is not running, its backlog is full or the event is too large for
one datagram, the triage runner job is started here as a reaction, as before.
"""

import json
import os
import socket

ENGINE_SOCKET = "hana_storage_triage.sock"  # _engines/hana_storage_triage.py binds it


def handed_off(payload):
    """Whether the triage engine took the event (never blocks the reactor)."""
    path = os.path.join(__opts__["sock_dir"], ENGINE_SOCKET)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(payload, path)
        except OSError:  # not running (ENOENT, ECONNREFUSED), backlog full (EAGAIN), EMSGSIZE
            return False
    return True


def run():
    if not (tag.endswith("/violation") or (isinstance(data, dict) and data.get("since"))):
        return {}
    if handed_off(json.dumps({"tag": tag, "data": data}, default=str).encode()):
        return {}
    job = {"args": [{"tag": tag}, {"data": data}]}
    return {"hana-storage-triage": {"runner.hana_storage.triage": [job]}}
