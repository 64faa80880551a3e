"""The master's own events on a real master and a real minion daemon (issue 13, defects 10 and 12).

The master runs the shipped reactor map, the triage runner and the exporter engine; the minion
daemon's pillar names a volume whose device does not exist here and a key file others can read,
so its audit finds HANA-KEY-001 (an auto rule) for real, and it disables remediation, so nothing
is touched. The minion's beacon events are simulated: signed with its own key, as the beacon signs.

* Only a verified fix counts (defect 10): a violation of HANA-KEY-001 goes to triage, which runs
  the remediation on the minion; the minion skips it (not allowed), so triage must alert, report
  the remediation as not fixed, and release the occurrence: the minion's next audit event acts on
  it again (never ``duplicate``).
* A minion cannot forge the master's events (defect 12): Salt reserves no tag prefix for the
  master, so the minion daemon runs ``event.send hana/storage/alert`` and ``event.send
  hana/storage/remediation``, with a ``preload`` that puts the fields at the top of the event as
  triage's are, with and without a made-up ``sig``. They reach the master's bus; the exporter must
  count none of them as an alert or a remediation, count each as ``forged_master_event`` and log
  it. An alert triage fires (signed with the master's key) is counted, and ``salt-run
  hana_storage.verify_master`` accepts it.
"""

import base64
import json
import os
import pathlib
import stat
import time
import types

import pytest
import yaml

from tests import beacon_events
from tests.integration.master_bus import Bus, wait_for_reactor, wait_until
from tests.support.keys import keypair
from tests.support.master import formula_master, free_port

pytestmark = pytest.mark.integration

COOLDOWN = 8  # seconds between two actions for one minion and rule (production: 300)


@pytest.fixture(scope="module")
def events_pillar(tmp_path_factory):
    root = tmp_path_factory.mktemp("events-pillar")
    key = tmp_path_factory.mktemp("events-key") / "hana.key"
    key.write_bytes(os.urandom(64))
    key.chmod(0o644)  # readable by others: HANA-KEY-001
    storage = {
        "key": {"source": "keyfile", "path": str(key)},
        "volumes": {
            "itest": {"mountpoint": "/hana/itest-events", "devices": ["/dev/hana-itest-events-missing"]}
        },
        "compliance": {"remediation": {"enabled": False}},
    }
    (root / "top.sls").write_text("base:\n  '*':\n    - hana\n")
    (root / "hana.sls").write_text(yaml.safe_dump({"hana": {"storage": storage}}))
    return types.SimpleNamespace(root=root, key_file=key)


@pytest.fixture(scope="module")
def events_master(salt_factories, events_pillar, event_listener):
    port = free_port()
    overrides = formula_master(
        events_pillar.root,
        reactor=True,
        exporter_port=port,
        # rejections are reported once per claimed minion and interval (made-up ids share one): the
        # reactor probe's would hold back the next test's
        hana_storage={"cooldown": COOLDOWN, "report_interval": 1},
    )
    factory = salt_factories.salt_master_daemon("hana-events-master", overrides=overrides)
    with factory.started(start_timeout=120):
        wait_for_reactor(factory, event_listener)
        yield Bus(factory, f"http://127.0.0.1:{port}/metrics")


@pytest.fixture(scope="module")
def events_minion(events_master):
    factory = events_master.factory.salt_minion_daemon("hana-events-minion")
    with factory.started(start_timeout=120):
        sync = factory.salt_call_cli(timeout=300).run("saltutil.sync_all")
        assert sync.returncode == 0, sync
        factory.key_path = os.path.join(factory.config["pki_dir"], "minion.pem")
        yield factory


# ---- defect 10: only a verified fix counts ---------------------------------------------------------


def test_an_auto_finding_the_minion_may_not_fix_is_alerted_and_acted_on_again(
    events_master, events_minion, events_pillar, event_listener
):
    audit = events_minion.salt_call_cli(timeout=120).run("hana_storage.audit")
    assert audit.returncode == 0, audit
    (found,) = [f for f in audit.data["findings"] if f["rule"] == "HANA-KEY-001"]
    started, since = time.time(), time.time()

    def triaged():
        return events_master.triage_returns(event_listener, started, events_minion.id)

    def master_events(tag):
        found = events_master.events(event_listener, tag, started)
        return [e.data for e in found if e.data.get("rule") == "HANA-KEY-001"]

    events_master.fire_beacon(events_minion, "violation", beacon_events.violation_data(found, since))
    (first,) = wait_until(triaged, what="the triage of the violation")
    assert first["action"] == "remediation-failed", first
    assert (first["result"], first["reason"]) == ("not-fixed", "not_allowed"), first
    (alert,) = wait_until(lambda: master_events("hana/storage/alert"), what="the alert")
    assert (alert["minion"], alert["rule"], alert["severity"]) == (events_minion.id, "HANA-KEY-001", "high")
    assert (alert["result"], alert["reason"], alert["device"]) == (
        "not-fixed",
        "not_allowed",
        str(events_pillar.key_file),
    )

    # the same occurrence, listed by the minion's next audit events: released, so never a
    # duplicate; within the rule's cooldown it waits, after it the remediation runs (and is
    # alerted) again. The remediation may outlast the cooldown on a busy machine: then the
    # first audit event acts already.
    actions = []
    while "remediation-failed" not in actions:
        assert len(actions) < 3, actions
        if actions:
            time.sleep(COOLDOWN)
        audit = beacon_events.audit_data([(found, since)], volumes=("itest",))
        events_master.fire_beacon(events_minion, "audit", audit)
        wait_until(lambda: len(triaged()) == len(actions) + 2, what="the triage of the audit event")
        (handled,) = triaged()[-1]["findings"]
        assert handled["rule"] == "HANA-KEY-001", handled
        assert handled["action"] in ("cooldown", "remediation-failed"), handled  # never "duplicate"
        actions.append(handled["action"])
    wait_until(lambda: len(master_events("hana/storage/alert")) == 2, what="the second alert")
    assert [a["via"] for a in master_events("hana/storage/alert")] == ["violation", "audit"]
    remediations = master_events("hana/storage/remediation")
    assert [(r["result"], r["reason"]) for r in remediations] == [("not-fixed", "not_allowed")] * 2
    labels = {"minion": events_minion.id, "rule": "HANA-KEY-001"}
    wait_until(lambda: events_master.metric("hana_storage_alerts_total", **labels) == 2)
    assert events_master.metric("hana_storage_remediations_total", result="not-fixed", **labels) == 2
    assert events_master.metric("hana_storage_remediations_total", result="fixed", **labels) == 0
    assert stat.S_IMODE(os.stat(events_pillar.key_file).st_mode) == 0o644  # remediation is off: untouched


# ---- defect 12: a minion cannot forge the master's events ------------------------------------------

VICTIM = "hana-victim"
ALERT = {
    "minion": VICTIM,
    "rule": "HANA-ENC-001",
    "severity": "critical",
    "volume": "data",
    "message": "forged",
    "remediation": "manual",
    "via": "violation",
}
FAILURE = {"minion": VICTIM, "rule": "HANA-PERF-002", "result": "failed", "reason": "fix_failed"}
FORGED = [
    ("hana/storage/alert", {"data": ALERT}),  # event.send as documented: the fields under "data"
    ("hana/storage/alert", {"preload": ALERT}),  # the fields at the top, where triage's are
    ("hana/storage/remediation", {"preload": FAILURE}),
    ("hana/storage/remediation", {"preload": {**FAILURE, "sig": base64.b64encode(b"\x01" * 256).decode()}}),
]


def master_events(bus, event_listener, after):
    return [
        e
        for tag in ("hana/storage/alert", "hana/storage/remediation")
        for e in bus.events(event_listener, tag, after)
    ]


def test_a_real_minion_cannot_forge_alerts_or_remediations(events_master, events_minion, event_listener):
    def forged_count():
        return events_master.metric("hana_storage_rejected_events_total", reason="forged_master_event")

    before, started = forged_count(), time.time()
    cli = events_master.factory.salt_cli(timeout=120)
    for tag, parts in FORGED:
        args = [f"{name}={json.dumps({**value, 'ts': time.time()})}" for name, value in parts.items()]
        sent = cli.run("event.send", tag, *args, minion_tgt=events_minion.id)
        assert sent.returncode == 0 and sent.data is True, sent
    # Salt put every one of them on the master's bus, under the master's tags, as the minion's
    wait_until(
        lambda: len(master_events(events_master, event_listener, started)) == len(FORGED),
        what="the forged events on the master's bus",
    )
    arrived = master_events(events_master, event_listener, started)
    assert {e.data.get("id") for e in arrived} == {events_minion.id}
    assert sum(e.data.get("minion") == VICTIM for e in arrived) == 3  # the preloaded ones: top level

    # then a genuine alert: triage's, for a manual finding the minion's beacon reports. The exporter
    # takes the bus in order: once it counted this one, it has seen the forged ones
    finding = {
        "rule": "HANA-ENC-001",
        "severity": "critical",
        "volume": "itest",
        "mountpoint": "/hana/itest-events",
        "device": "/dev/mapper/hana_itest",
        "remediation": "manual",
        "message": "simulated",
    }
    events_master.fire_beacon(events_minion, "violation", beacon_events.violation_data(finding, time.time()))
    (genuine,) = wait_until(
        lambda: [
            e.data
            for e in events_master.events(event_listener, "hana/storage/alert", started)
            if (e.data.get("minion"), e.data.get("rule")) == (events_minion.id, "HANA-ENC-001")
        ],
        what="triage's alert",
    )
    counted = {"minion": events_minion.id, "rule": "HANA-ENC-001"}
    wait_until(lambda: events_master.metric("hana_storage_alerts_total", **counted) == 1, what="it counted")
    assert events_master.metric("hana_storage_alerts_total", minion=VICTIM, rule="HANA-ENC-001") == 0
    failed = {"minion": VICTIM, "rule": "HANA-PERF-002", "result": "failed"}
    assert events_master.metric("hana_storage_remediations_total", **failed) == 0
    assert forged_count() == before + len(FORGED)
    log = pathlib.Path(events_master.factory.config["log_file"]).read_text(encoding="utf-8")
    sender = f"(sent by {events_minion.id})"
    assert f"hana/storage/alert not counted, unsigned: the master signs every event it fires {sender}" in log
    assert (
        f"hana/storage/remediation not counted, the signature does not verify with the master's key {sender}"
        in log
    )

    # the master signed it, and any other consumer verifies it as the exporter does
    assert genuine.get("sig"), genuine
    run = events_master.factory.salt_run_cli(timeout=120)
    verified = run.run("hana_storage.verify_master", "tag=hana/storage/alert", f"data={json.dumps(genuine)}")
    assert verified.returncode == 0 and verified.data is None, verified
    tampered = json.dumps({**genuine, "minion": VICTIM})
    rejected = run.run("hana_storage.verify_master", "tag=hana/storage/alert", f"data={tampered}")
    assert rejected.data["code"] == "forged_master_event", rejected


# ---- issue 33: the fleet's boot readiness ------------------------------------------------------------


def test_the_fleets_boot_readiness_reaches_the_exporter_and_a_minion_cannot_forge_it(
    events_master, events_minion, event_listener
):
    """salt-run hana_storage.readiness asks the real minion (its verdict on this machine's own
    /etc/crypttab) and fires it signed: the exporter's gauge follows. The same tag sent by the
    minion, for itself or another host, is counted as forged and moves no gauge."""
    minion, started = events_minion.id, time.time()
    ready = events_master.factory.salt_run_cli(timeout=300).run("hana_storage.readiness")
    assert ready.returncode == 0 and ready.data[minion]["ready"] in (True, False), ready
    expected = 1 if ready.data[minion]["ready"] else 0
    (fired,) = wait_until(
        lambda: [
            e.data
            for e in events_master.events(event_listener, "hana/storage/readiness", started)
            if e.data.get("minion") == minion
        ],
        what="the master's hana/storage/readiness",
    )
    assert fired["sig"] and fired["ready"] is ready.data[minion]["ready"]
    checked = ("hana_storage_boot_readiness_timestamp_seconds", frozenset({"minion": minion}.items()))
    wait_until(lambda: events_master.metrics().get(checked), what="the exporter's readiness of the minion")
    assert abs(events_master.metrics()[checked] - started) < 300
    assert events_master.metric("hana_storage_boot_ready", minion=minion) == expected

    forged_before = events_master.metric("hana_storage_rejected_events_total", reason="forged_master_event")
    cli = events_master.factory.salt_cli(timeout=120)
    for target in (minion, VICTIM):
        lie = {
            "minion": target,
            "ready": not expected,
            "not_ready": [],
            "checked": time.time(),
            "ts": time.time(),
        }
        sent = cli.run(
            "event.send", "hana/storage/readiness", f"preload={json.dumps(lie)}", minion_tgt=minion
        )
        assert sent.returncode == 0 and sent.data is True, sent
    wait_until(
        lambda: (
            events_master.metric("hana_storage_rejected_events_total", reason="forged_master_event")
            == forged_before + 2
        ),
        what="both forged readiness events rejected",
    )
    assert events_master.metric("hana_storage_boot_ready", minion=minion) == expected
    assert ("hana_storage_boot_ready", frozenset({"minion": VICTIM}.items())) not in events_master.metrics()


# ---- issue 29, item 5: a minion id that is a target list -------------------------------------------


def test_an_accepted_id_with_a_comma_remediates_no_other_minion(
    events_master, events_minion, event_listener, tmp_path
):
    """Regression (issue 29, item 5): triage called ``hana_storage.remediate`` with the sender's id
    as a ``list`` target spelled as text, so the accepted minion ``evil,<other>`` had ``<other>``
    run it. Here ``evil,<the real minion>`` has an accepted key and signs a violation of an auto
    rule correctly: triage rejects the id, and the real minion runs nothing."""
    evil = f"evil,{events_minion.id}"
    private, public = keypair()
    accepted = pathlib.Path(events_master.factory.config["pki_dir"]) / "minions" / evil
    accepted.write_text(public)
    pem = tmp_path / "evil.pem"
    pem.write_text(private)
    finding = {
        "rule": "HANA-KEY-001",
        "severity": "high",
        "volume": "itest",
        "mountpoint": "/hana/itest-events",
        "device": "/etc/hana-storage/keys/hana.key",
        "remediation": "auto",
        "message": "simulated",
    }
    started = time.time()
    try:
        data = beacon_events.sign(pem, evil, "violation", beacon_events.violation_data(finding, started))
        events_master.fire(f"salt/beacon/{evil}/hana_storage/violation", data)
        (result,) = wait_until(
            lambda: events_master.triage_returns(event_listener, started, evil), what="the triage"
        )
        assert (result["action"], result["code"]) == ("rejected", "bad_minion_id"), result
        time.sleep(10)  # a remediation job would have returned by now
    finally:
        accepted.unlink()
    jobs = event_listener.get_events(
        [(events_master.id, f"salt/job/*/ret/{events_minion.id}")], after_time=started
    )
    assert [e.data.get("fun") for e in jobs if e.data.get("fun") == "hana_storage.remediate"] == []


def test_the_triage_engines_threads_run_without_a_failure(events_master):
    """Regression (VM events module, two 3006 masters): the engine's bus follower read
    ``__runners__`` in its own thread, which has no loader context on Salt 3006, and failed every
    5 s; no outbox event was confirmed from the bus. The engine logs each thread's failure."""
    with open(events_master.factory.config["log_file"], encoding="utf-8", errors="replace") as log:
        failures = [line.strip() for line in log if "hana_storage_triage:" in line and "ERROR" in line]
    assert failures == [], failures[:5]
