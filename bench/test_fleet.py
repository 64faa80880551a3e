"""Fleet scale on one master: 1,000 simulated minions x 10 findings = 10,000 violation events.

A real salt-master (pytest-salt-factories) runs the formula's reactor, triage runner and
Prometheus exporter. The simulated minions are accepted keys in the master's PKI directory (they
share one RSA key pair: signing is what is simulated, verifying is real), and their signed
violation events are put on the master's event bus on loopback, the way the master itself
forwards a beacon's events. Every finding is a `manual` rule seen for the first time, so each
event must end as exactly one alert: the exporter's violation counters and the reactor's alert
counters must both reach 10,000 exactly - not one lost, not one doubled.

Reported: the rate events were put on the bus, the exporter's and the reactor's sustained
processing rates (events/s from the first event to the last one counted) - the slower of the two
is where one master saturates.

Two masters run, one after the other, both with all 1,000 keys accepted: first with Salt's
defaults (a sample of the events: its reactor manages ~2 events/s), then with the large-fleet
settings of conf/master.d/hana-storage.conf (all 10,000 events). The ratio of their reactor
rates is what the tuning buys, measured in the same run.
"""

import base64
import contextlib
import os
import socket
import time
import urllib.request

import hana_storage_events as events
import hana_storage_rules as rules
import salt.crypt
import salt.utils.event
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO

REACTOR_SLS = REPO / "salt" / "hana" / "storage" / "reactor" / "violation.sls"

MINIONS, FINDINGS = int(os.environ.get("BENCH_MINIONS", 1000)), 10
DEFAULTS_SAMPLE = 300  # events sent to the master with Salt's defaults (~100 s at its rate)
# conf/master.d/hana-storage.conf: a runner job's job-cache record matches the master's id
# against every accepted key (O(keys) per reaction), and the publisher drops a subscriber - the
# reactor - that falls 10,000 events behind.
LARGE_FLEET = {"runnerclient_returns": False, "pub_server_write_queue_size": 100000}
MANUAL_RULES = sorted(r for r, (_s, remediation, _t) in rules.RULES.items() if remediation == "manual")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def master(salt_factories, name, tuning):
    port = free_port()
    overrides = {
        "interface": "127.0.0.1",
        "file_roots": {"base": [str(REPO / "salt"), str(REPO)]},
        "runner_dirs": [str(REPO / "_runners")],
        "engines_dirs": [str(REPO / "_engines")],
        "utils_dirs": [str(REPO / "_utils")],
        "reactor": [{"salt/beacon/*/hana_storage/violation": [str(REACTOR_SLS)]}],
        "engines": [{"hana_storage_exporter": {"port": port}}],
        "hana_storage": {"cooldown": 3600, "max_event_age": 7200},  # the backlog drains for minutes
        "reactor_worker_hwm": 20000,  # the queue must hold a burst of 10,000 (Salt's default: 10,000)
        "log_level_logfile": "warning",
        **tuning,
    }
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


def signed_events(master, limit=None):
    """10,000 violation events from 1,000 accepted minions, signed the way the beacon signs.

    All minions' keys are accepted; ``limit`` signs only the first events.
    """
    pki = master.config["pki_dir"]
    pub, pem = REPO / "build" / "bench" / "sim.pub", REPO / "build" / "bench" / "sim.pem"
    pub.parent.mkdir(parents=True, exist_ok=True)
    if not pem.exists():
        private, public = salt.crypt.gen_keys(2048)
        pem.write_text(private)
        pub.write_text(public)
    key = salt.crypt.PrivateKey.from_file(str(pem))
    minions_dir = f"{pki}/minions"
    out, now = [], time.time()
    for m in range(MINIONS):
        minion = f"sim-{m:04d}"
        with open(f"{minions_dir}/{minion}", "w", encoding="utf-8") as handle:
            handle.write(pub.read_text())
        for rule in MANUAL_RULES[:FINDINGS]:
            if limit is not None and len(out) >= limit:
                break
            data = {
                "rule": rule,
                "severity": rules.RULES[rule][0],
                "volume": "data",
                "mountpoint": "/hana/data",
                "device": "/dev/vda",
                "remediation": "manual",
                "message": "simulated",
                "key": f"{rule}|data|/dev/vda",
                "trigger": "uevent",
                "ts": now,
            }
            tag = f"salt/beacon/{minion}/hana_storage/violation"
            message = events.signed_bytes(minion, "violation", data)
            data["sig"] = base64.b64encode(key.sign(message, salt.crypt.PKCS1v15_SHA224)).decode()
            out.append((tag, data))
    return out


def wait_for_count(master, name, expected, started, timeout=1800):
    """Seconds from ``started`` until counter ``name`` reached ``expected``; fails on more or stall."""
    last, last_change = -1, time.monotonic()
    while True:
        count = totals(master).get(name, 0)
        if count >= expected:
            assert count == expected, f"{name} = {count}: events counted twice"
            return time.monotonic() - started
        if count != last:
            last, last_change = count, time.monotonic()
        assert time.monotonic() - last_change < 120, f"{name} stalled at {count} of {expected}"
        assert time.monotonic() - started < timeout, f"{name} at {count} of {expected} after {timeout}s"
        time.sleep(0.5)


def run_fleet(master, batch):
    """(events/s onto the bus, exporter events/s, reactor events/s); every counter exact."""
    before = totals(master)
    assert not before.get("hana_storage_violations_total")
    started = time.monotonic()
    with salt.utils.event.get_master_event(master.config, master.config["sock_dir"], listen=False) as bus:
        for tag, data in batch:
            bus.fire_event(data, tag)
    fired = time.monotonic() - started
    exporter = wait_for_count(master, "hana_storage_violations_total", len(batch), started)
    reactor = wait_for_count(master, "hana_storage_alerts_total", len(batch), started)
    assert totals(master).get("hana_storage_rejected_events_total", 0) == 0
    n = len(batch)
    return n / fired, n / exporter, n / reactor


def test_fleet_events_none_lost(salt_factories, bench):
    with master(salt_factories, "hana-fleet-defaults", {}) as plain:
        _, _, default_rate = run_fleet(plain, signed_events(plain, DEFAULTS_SAMPLE))
    with master(salt_factories, "hana-fleet-master", LARGE_FLEET) as tuned:
        batch = signed_events(tuned)
        fired, exporter, reactor = run_fleet(tuned, batch)
    n = len(batch)
    bench.record("fleet: events put on the bus", "events/s", [fired], note=f"{MINIONS} minions x {FINDINGS}")
    bench.record(
        "fleet: exporter sustained rate",
        "events/s",
        [exporter],
        target=f"all {n} counted",
        met=True,
        note="signature verified per event",
    )
    bench.record(
        "fleet: reactor + triage, Salt defaults",
        "events/s",
        [default_rate],
        target=f"all {DEFAULTS_SAMPLE} alerted once",
        met=True,
        note=f"{MINIONS} keys accepted; each runner job's job-cache record matches every key",
    )
    bench.record(
        "fleet: reactor + triage sustained rate",
        "events/s",
        [reactor],
        target=f"all {n} alerted once",
        met=True,
        note="the saturation point, with the large-fleet settings: one runner job per event",
    )
    bench.record("fleet: reactor, large-fleet settings / Salt defaults", "x", [reactor / default_rate])
