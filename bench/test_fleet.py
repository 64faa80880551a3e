"""Fleet scale on one master: 1,000 simulated minions x 10 findings = 10,000 violation events.

A real salt-master (pytest-salt-factories) runs the formula's reactor, triage runner and
Prometheus exporter. The simulated minions are accepted keys in the master's PKI directory (they
share one RSA key pair: signing is what is simulated, verifying is real), and their signed
violation events are put on the master's event bus on loopback, the way the master itself
forwards a beacon's events. Every finding is a `manual` rule seen for the first time, so each
finding must end as exactly one alert.

Two rounds, as on a real fleet: the burst of 10,000 violation events, then each minion's audit
event (the beacon sends one after every full audit) listing its 10 open findings with the time
their violation was sent. Salt's reactor can lose a reaction (a worker thread that fails to
start the runner client is logged at debug level only: the bench counts triage's starts and
returns on the bus), and the audit round is what hands such a finding to triage again. The
exporter must count all 10,000 violations and the alerts must end at 10,000 exactly: not one
lost, not one doubled (every finding alerted already must come back `duplicate`).

Reported: the rate events were put on the bus, the exporter's and the reactor's sustained
processing rates (events/s from the first event to the last one counted) - the slower of the two
is where one master saturates - and the reactions the violation round lost.

Two masters run, one after the other, both with all 1,000 keys accepted: first with Salt's
defaults (a sample of the events: its reactor manages ~2 events/s), then with the large-fleet
settings of conf/master.d/hana-storage.conf (all 10,000 events). The ratio of their reactor
rates is what the tuning buys, measured in the same run.
"""

import collections
import contextlib
import os
import threading
import time
import urllib.request

import hana_storage_rules as rules
import salt.utils.event
from prometheus_client.parser import text_string_to_metric_families

from tests import beacon_events
from tests.conftest import REPO
from tests.support.keys import keypair
from tests.support.master import formula_master, free_port

MINIONS, FINDINGS = int(os.environ.get("BENCH_MINIONS", 1000)), 10
WITHHOLD_EVERY = 1000  # one violation in this many never reaches the bus: the audit round must catch it
DEFAULTS_SAMPLE = 300  # events sent to the master with Salt's defaults (~100 s at its rate)
# conf/master.d/hana-storage.conf: a runner job's job-cache record matches the master's id
# against every accepted key (O(keys) per reaction), and the publisher drops a subscriber - the
# reactor - that falls 10,000 events behind.
LARGE_FLEET = {"runnerclient_returns": False, "pub_server_write_queue_size": 100000}
MANUAL_RULES = sorted(r for r, rule in rules.RULES.items() if rule.remediation == "manual")


@contextlib.contextmanager
def master(salt_factories, name, tuning):
    port = free_port()
    overrides = formula_master(
        reactor=True,
        exporter_port=port,
        interface="127.0.0.1",
        hana_storage={"cooldown": 3600, "max_event_age": 7200},  # the backlog drains for minutes
        reactor_worker_hwm=20000,  # the queue must hold a burst of 10,000 (Salt's default: 10,000)
        log_level_logfile="warning",
        **tuning,
    )
    factory = salt_factories.salt_master_daemon(name, overrides=overrides)
    with factory.started(start_timeout=120):
        factory.metrics_url = f"http://127.0.0.1:{port}/metrics"
        yield factory


def totals(master):
    text = urllib.request.urlopen(master.metrics_url, timeout=30).read().decode()
    sums = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                sums[sample.name] = sums.get(sample.name, 0) + sample.value
    return sums


def simulated_fleet(master, limit=None):
    """(violation events, audit events) of 1,000 accepted minions, signed as the beacon signs.

    All minions' keys are accepted; ``limit`` keeps only the first violations (and the audits of
    their minions, listing just those findings).
    """
    pki = master.config["pki_dir"]
    pub, pem = REPO / "build" / "bench" / "sim.pub", REPO / "build" / "bench" / "sim.pem"
    pub.parent.mkdir(parents=True, exist_ok=True)
    if not pem.exists():
        private, public = keypair()
        pem.write_text(private)
        pub.write_text(public)
    key = str(pem)
    minions_dir = f"{pki}/minions"
    violations, audits, now = [], [], time.time()
    for m in range(MINIONS):
        minion = f"sim-{m:04d}"
        with open(f"{minions_dir}/{minion}", "w", encoding="utf-8") as handle:
            handle.write(pub.read_text())
        found = []
        for rule in MANUAL_RULES[:FINDINGS]:
            if limit is not None and len(violations) >= limit:
                break
            finding = {
                "rule": rule,
                "severity": rules.RULES[rule].severity,
                "volume": "data",
                "mountpoint": "/hana/data",
                "device": "/dev/vda",
                "remediation": "manual",
                "message": "simulated",
            }
            found.append(finding)
            data = beacon_events.violation_data(finding, now)
            violations.append(
                (
                    f"salt/beacon/{minion}/hana_storage/violation",
                    beacon_events.sign(key, minion, "violation", data),
                )
            )
        if found:
            data = beacon_events.audit_data([(f, now) for f in found], volumes=("data",), ts=now)
            audits.append(
                (f"salt/beacon/{minion}/hana_storage/audit", beacon_events.sign(key, minion, "audit", data))
            )
    return violations, audits


class TriageTally:
    """Counts, on the master's bus, the triage runner jobs that started and what they returned."""

    def __init__(self, master):
        self.opts, self.started, self.returned = master.config, 0, collections.Counter()
        self.findings = collections.Counter()  # per-finding actions of the reconciling jobs
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.follow, daemon=True)

    def __enter__(self):
        self.thread.start()
        time.sleep(1)  # subscribed before the first event is fired
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def follow(self):
        with salt.utils.event.get_master_event(self.opts, self.opts["sock_dir"], listen=True) as bus:
            while not self.stop.is_set():
                event = bus.get_event(wait=1, full=True, tag="salt/run/")
                if not event or event["data"].get("fun") != "runner.hana_storage.triage":
                    continue
                if event["tag"].endswith("/new"):
                    self.started += 1
                elif event["tag"].endswith("/ret"):
                    ret = event["data"].get("return")
                    action = ret.get("action") if isinstance(ret, dict) else "exception"
                    self.returned[action] += 1
                    for finding in ret.get("findings", []) if action == "reconciled" else ():
                        self.findings[finding["action"]] += 1


def fire(master, batch):
    """Put ``batch`` on the master's bus; seconds it took."""
    started = time.monotonic()
    with salt.utils.event.get_master_event(master.config, master.config["sock_dir"], listen=False) as bus:
        for tag, data in batch:
            assert bus.fire_event(data, tag), f"the master's bus refused {tag}"
    return time.monotonic() - started


def settle(read, expected, started, quiet=30, timeout=1800):
    """Seconds from ``started`` until ``read()`` reached ``expected`` or stopped moving for
    ``quiet`` seconds (a lost reaction never arrives): (value, seconds to its last change)."""
    value, changed = read(), time.monotonic()
    while value < expected and time.monotonic() - changed < quiet:
        assert time.monotonic() - started < timeout, f"{value} of {expected} after {timeout}s"
        time.sleep(0.5)
        now = read()
        if now != value:
            value, changed = now, time.monotonic()
    assert value <= expected, f"{value} counted, {expected} expected: counted twice"
    return value, changed - started


def run_fleet(master, violations, audits):
    """The violation burst, then the audit round; every counter checked. Returns the figures.

    One violation in WITHHOLD_EVERY is never put on the bus (as if the master had been down):
    the audit round must alert on those too, exactly like on the ones the reactor lost.
    """
    assert not totals(master).get("hana_storage_violations_total")
    n = len(violations)
    sent = [v for i, v in enumerate(violations) if i % WITHHOLD_EVERY != WITHHOLD_EVERY - 1]
    with TriageTally(master) as tally:
        started = time.monotonic()
        fired = fire(master, sent)
        counted, exporter = settle(
            lambda: totals(master).get("hana_storage_violations_total", 0), len(sent), started
        )
        assert counted == len(sent), f"the exporter counted {counted} of {len(sent)} violations"
        alerted, reactor = settle(
            lambda: totals(master).get("hana_storage_alerts_total", 0), len(sent), started
        )
        alerted, reacted = int(alerted), (tally.started, sum(tally.returned.values()))
        audit_started = time.monotonic()
        fire(master, audits)
        reconciled, audit_seconds = settle(lambda: tally.returned["reconciled"], len(audits), audit_started)
        final = totals(master).get("hana_storage_alerts_total", 0)
    assert totals(master).get("hana_storage_rejected_events_total", 0) == 0
    assert final == n, f"{final} alerts for {n} findings after the audit round: {dict(tally.findings)}"
    assert tally.findings["alerted"] == n - alerted and tally.findings["duplicate"] == alerted
    return {
        "fired": len(sent) / fired,
        "exporter": len(sent) / exporter,
        "reactor": alerted / reactor,
        "withheld": n - len(sent),
        "lost": len(sent) - alerted,
        "triage started/returned": reacted,
        "audit round": tally.findings,
        "audit rate": reconciled / audit_seconds,
    }


def test_fleet_events_none_lost(salt_factories, bench):
    with master(salt_factories, "hana-fleet-defaults", {}) as plain:
        default = run_fleet(plain, *simulated_fleet(plain, DEFAULTS_SAMPLE))
    with master(salt_factories, "hana-fleet-master", LARGE_FLEET) as tuned:
        violations, audits = simulated_fleet(tuned)
        fleet = run_fleet(tuned, violations, audits)
    n, sent = len(violations), len(violations) - fleet["withheld"]
    started, returned = fleet["triage started/returned"]
    audit_round = fleet["audit round"]
    bench.record(
        "fleet: events put on the bus", "events/s", [fleet["fired"]], note=f"{MINIONS} minions x {FINDINGS}"
    )
    bench.record(
        "fleet: exporter sustained rate",
        "events/s",
        [fleet["exporter"]],
        target=f"all {sent} sent counted",
        met=True,
        note="signature verified per event",
    )
    bench.record(
        "fleet: reactor + triage, Salt defaults",
        "events/s",
        [default["reactor"]],
        target=f"all {DEFAULTS_SAMPLE} alerted once",
        met=True,
        note=f"{MINIONS} keys accepted; each runner job's job-cache record matches every key",
    )
    bench.record(
        "fleet: reactor + triage sustained rate",
        "events/s",
        [fleet["reactor"]],
        target=f"all {n} alerted once",
        met=True,
        note="the saturation point, with the large-fleet settings: one runner job per event",
    )
    bench.record(
        "fleet: violations the reactor lost",
        "events",
        [fleet["lost"]],
        note=f"of {sent} sent: triage started {started}, returned {returned}; Salt defaults: "
        f"{default['lost']} of {DEFAULTS_SAMPLE - default['withheld']}",
    )
    bench.record(
        "fleet: audit round, findings alerted",
        "findings",
        [audit_round["alerted"]],
        target="every finding not alerted yet, none twice",
        met=True,
        note=f"{fleet['withheld']} violations withheld + {fleet['lost']} lost by the reactor; "
        f"{audit_round['duplicate']} already alerted came back duplicate; 1 audit event per minion",
    )
    bench.record(
        "fleet: audit round, audit events triaged",
        "events/s",
        [fleet["audit rate"]],
        note=f"each lists {FINDINGS} open findings; a compliant audit starts no runner job",
    )
    bench.record(
        "fleet: reactor, large-fleet settings / Salt defaults", "x", [fleet["reactor"] / default["reactor"]]
    )
