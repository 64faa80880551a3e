"""The reactor path end to end on a real salt-master: the shipped reactor map, reactor/triage.sls
rendered by Salt's reactor, the triage runner in its thread pool, alerts on the bus.

The minion is simulated (its key is accepted, its events are signed the way the beacon signs
them), so no minion daemon can be remediated on this host: every finding here is a manual rule.
What must hold: a manual finding is alerted at each occurrence (the same rule on another volume
too: it has no cooldown), one whose violation never reached the master is alerted from the next
audit event, the ones already alerted are not, and the same audit event again alerts nothing.
"""

import time

import pytest
import salt.utils.event
from hana_storage_core import rules as rules

from tests import beacon_events
from tests.integration.master_bus import wait_for_reactor
from tests.support.keys import write_keypair
from tests.support.master import formula_master, triage_results

pytestmark = pytest.mark.integration

MINION = "db-sim"
COOLDOWN = 8


@pytest.fixture(scope="module")
def reactor_master(salt_factories, tmp_path_factory, event_listener):
    overrides = formula_master(reactor=True, hana_storage={"cooldown": COOLDOWN})
    factory = salt_factories.salt_master_daemon("hana-reactor-master", overrides=overrides)
    keys = tmp_path_factory.mktemp("sim")
    pem, pub = write_keypair(keys, "minion")
    with factory.started(start_timeout=120):
        with open(f"{factory.config['pki_dir']}/minions/{MINION}", "w", encoding="utf-8") as accepted:
            accepted.write(pub.read_text())
        factory.sim_key = str(pem)  # signed as the beacon signs, on every Salt line
        wait_for_reactor(factory, event_listener)
        yield factory


def finding(rule, volume):
    return {
        "rule": rule,
        "severity": rules.RULES[rule][0],
        "volume": volume,
        "mountpoint": f"/hana/{volume}",
        "device": f"/dev/mapper/hana_{volume}",
        "remediation": "manual",
        "message": "simulated",
    }


def fire(master, event, data):
    """Put a beacon event of the simulated minion on the master's bus, signed as the beacon signs."""
    data = beacon_events.sign(master.sim_key, MINION, event, data)
    with salt.utils.event.get_master_event(master.config, master.config["sock_dir"], listen=False) as bus:
        assert bus.fire_event(data, f"salt/beacon/{MINION}/hana_storage/{event}")


def violation(master, found, since):
    fire(master, "violation", beacon_events.violation_data(found, since))


def audit(master, open_since):
    fire(master, "audit", beacon_events.audit_data(open_since))


def alerts(event_listener, master, after):
    found = event_listener.get_events([(master.id, "hana/storage/alert")], after_time=after)
    return sorted((e.data["rule"], e.data["volume"], e.data["via"]) for e in found)


def triage_returns(event_listener, master, after):
    return [r for r in triage_results(event_listener, master.id, after) if r.get("minion") == MINION]


def wait_until(check, timeout=240):  # generous: CI runs three Salt lines and two VMs on two cores
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def test_the_audit_event_alerts_what_the_violations_did_not(reactor_master, event_listener):
    started, now = time.time(), time.time()
    encrypted_data, encrypted_log = finding("HANA-ENC-001", "data"), finding("HANA-ENC-001", "log")
    unmounted = finding("HANA-MOUNT-001", "data")
    violation(reactor_master, encrypted_data, now)
    wait_until(lambda: len(triage_returns(event_listener, reactor_master, started)) == 1)
    # the same rule on another volume, within what was the rule's cooldown (issue 29, item 7)
    violation(reactor_master, encrypted_log, now + 1)
    wait_until(lambda: len(triage_returns(event_listener, reactor_master, started)) == 2)
    # the violation of `unmounted` never reaches the master (it was down)
    assert sorted(r["action"] for r in triage_returns(event_listener, reactor_master, started)) == [
        "alerted",
        "alerted",
    ]
    open_since = [(encrypted_data, now), (encrypted_log, now + 1), (unmounted, now + 2)]
    audit(reactor_master, open_since)
    wait_until(lambda: len(triage_returns(event_listener, reactor_master, started)) == 3)
    (reconciled,) = [r for r in triage_returns(event_listener, reactor_master, started) if "findings" in r]
    assert sorted((r["rule"], r["action"]) for r in reconciled["findings"]) == [
        ("HANA-ENC-001", "duplicate"),
        ("HANA-ENC-001", "duplicate"),
        ("HANA-MOUNT-001", "alerted"),
    ]
    expected = [
        ("HANA-ENC-001", "data", "violation"),
        ("HANA-ENC-001", "log", "violation"),
        ("HANA-MOUNT-001", "data", "audit"),
    ]
    wait_until(lambda: alerts(event_listener, reactor_master, started) == expected)

    time.sleep(COOLDOWN)
    audit(reactor_master, open_since)  # the next full audit: everything handled already
    audit(reactor_master, [])  # a compliant audit: no runner job at all
    wait_until(lambda: len(triage_returns(event_listener, reactor_master, started)) == 4)
    again = [r for r in triage_returns(event_listener, reactor_master, started) if "findings" in r]
    assert sorted(sorted(r["action"] for r in ret["findings"]) for ret in again) == [
        ["alerted", "duplicate", "duplicate"],
        ["duplicate", "duplicate", "duplicate"],
    ]
    time.sleep(3)
    assert len(triage_returns(event_listener, reactor_master, started)) == 4
    assert alerts(event_listener, reactor_master, started) == expected
