"""Two hot masters, one killed while a burst is triaged: still one outcome per finding.

What is real: two salt-masters configured as shipped (conf/master.d/hana-storage.conf: reactor,
triage engine, exporter, triage and fleet settings, the 60 s lease), peers in Salt's hot
multi-master (one master key, each at its own address), sharing a real redis-server as triage's
store; ``REAL`` salt-minion daemons connected to both, whose connections carry every event to
each master, as a minion's beacon events reach every master it is connected to; remediations
on those minions (triage calls their ``hana_storage.remediate``). The burst (MINIONS x 10 findings, as in test_fleet.py)
reaches both masters; once a third of the findings have an outcome, every process of master A is
stopped and killed, no clean-up, as when its host dies. Master B then finishes the burst: what A
had claimed and not completed, B finds held and takes over once the lease has run out. Then each
minion's audit event (to B alone now) reconciles what is left.

What is simulated: as in test_fleet.py, the minions beyond the real ones are accepted keys whose
signed events the real minions forward; their findings are manual.

Counted on both masters' buses (A's until it died), per (minion, rule), each event_id once: a
manual finding one alert, an auto one one remediation (and an alert when it was not fixed). A
finding acted on by both masters, or by neither, fails the run. What A had decided and its bus
had not carried when it died, B puts on its bus once it is due (the lease): an outcome seen on
both buses with one event_id is one outcome, and counted as put on a bus again.
"""

import collections
import contextlib
import os
import shutil
import time

from bench.conftest import Target
from bench.test_fleet import (
    DONE,
    FirstSeen,
    Outcomes,
    fleet_events,
    forward,
    problems,
    real_pillar,
    settle,
    totals,
)
from tests.support.master import free_port, hot_peers, kill_tree, shipped_settings, started_hot_masters
from tests.support.redis_store import redis_server

MINIONS = int(os.environ.get("BENCH_HOT_MINIONS", 200))  # x 10 findings
REAL = 4
KILL_AT = 1 / 3  # of the findings: the share with an outcome (from either master) when A is killed
ADDRESSES = {"hana-hot-fleet-a": "127.0.0.1", "hana-hot-fleet-b": "127.0.0.2"}


class MortalOutcomes(Outcomes):
    """Outcomes on a master that is killed: its bus going away ends the count."""

    def follow(self):
        with contextlib.suppress(Exception):
            super().follow()


@contextlib.contextmanager
def hot_masters(salt_factories, tmp_path_factory):
    """[A, B]: the topology above, REAL minions connected to both and synced (on A: .minions)."""
    pillar = real_pillar(tmp_path_factory.mktemp("pillar"))
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_server(tmp_path_factory.mktemp("redis")))
        settings = shipped_settings()
        settings["hana_storage"] = {**settings["hana_storage"], "store": {"driver": "redis", "url": url}}
        exporters = {name: free_port() for name in ADDRESSES}
        configs = hot_peers(pillar, ADDRESSES, exporters, log_level_logfile="warning", **settings)
        a, b = started_hot_masters(stack, salt_factories, configs)
        for master in (a, b):
            master.metrics_url = f"http://127.0.0.1:{exporters[master.id]}/metrics"
        a.minions = []
        for i in range(REAL):
            minion = a.salt_minion_daemon(
                f"hana-hot-fleet-real-{i:02d}",
                overrides={"master": list(ADDRESSES.values()), "log_level_logfile": "warning"},
            )
            a.minions.append(stack.enter_context(minion.started(start_timeout=120)))
        for master in (a, b):  # each connection's loader reloads after its own sync
            keys = [os.path.join(master.config["pki_dir"], "minions", m.id) for m in a.minions]
            deadline = time.monotonic() + 120
            while not all(os.path.exists(key) for key in keys):
                assert time.monotonic() < deadline, f"{master.id} did not accept the minions"
                time.sleep(0.5)
            sync = master.salt_cli(timeout=300).run("saltutil.sync_all", minion_tgt="hana-hot-fleet-real-*")
            assert sync.returncode == 0 and len(sync.data) == REAL, sync
        yield a, b


def test_hot_masters_one_killed_every_finding_handled_once(salt_factories, tmp_path_factory, bench):
    with hot_masters(salt_factories, tmp_path_factory) as (a, b):
        plan = fleet_events(a, minions=MINIONS)
        for minion in plan:  # the simulated minions' key, accepted by B too
            accepted = os.path.join("minions", minion)
            if not os.path.exists(os.path.join(b.config["pki_dir"], accepted)):
                shutil.copy2(
                    os.path.join(a.config["pki_dir"], accepted), os.path.join(b.config["pki_dir"], accepted)
                )
        findings = sum(len(violations) for violations, _audit in plan.values())
        batches = [violations for violations, _audit in plan.values()]
        seen = FirstSeen()
        with MortalOutcomes(a, seen) as on_a, Outcomes(b, seen) as on_b:
            started = time.monotonic()

            def outcomes():
                return on_a.handled() + on_b.handled()

            forward(a, batches)
            settle(outcomes, int(findings * KILL_AT), started)
            killed, a_before = time.monotonic(), on_a.handled()
            kill_tree(a)
            time.sleep(1)  # what A's bus still carried has reached the listener, or never will

            def as_wanted():
                """Findings with exactly their outcomes so far, across both buses."""
                while True:
                    try:  # the followers' threads add to the counters meanwhile
                        alerts, fixes = on_a.alerts + on_b.alerts, on_a.remediations + on_b.remediations
                        results = {**on_a.results, **on_b.results}
                        break
                    except RuntimeError:
                        continue
                return findings - len(problems(plan, alerts, fixes, results))

            # B finishes the burst: it takes over what A held once the lease runs out (60 s), and
            # sends what A decided and no bus carried once that is due (the lease, too)
            lease = shipped_settings()["hana_storage"]["lease"]
            settle(as_wanted, findings, killed, quiet=lease + 30)
            audit_started = time.monotonic()
            forward(a, [[audit] for _violations, audit in plan.values()])
            settle(lambda: on_b.returned["reconciled"], len(plan), audit_started)
            settle(outcomes, outcomes() + 1, time.monotonic(), quiet=10)  # the last ones
            last = max(on_a.last, on_b.last) - killed
        # what the shared store tallies as done, read from the survivor's exporter
        recorded = totals(b).get("hana_storage_triage_actions_total", 0)
        alerts, remediations = on_a.alerts + on_b.alerts, on_a.remediations + on_b.remediations
        results = {**on_a.results, **on_b.results}
    twice, never, by_master = 0, 0, collections.Counter()
    for minion, (violations, _audit) in plan.items():
        for event in violations:
            series = (minion, event["data"]["rule"])
            want = (
                1 if event["data"]["remediation"] == "manual" else (1 if results.get(series) in DONE else 2)
            )
            got = alerts[series] + remediations[series]
            twice, never = twice + (got > want), never + (got == 0)
            by_master["a"] += on_a.alerts[series] + on_a.remediations[series]
            by_master["b"] += on_b.alerts[series] + on_b.remediations[series]
    wrong = problems(plan, alerts, remediations, results)
    note = f"{findings} findings ({MINIONS} minions, {REAL} real, connected to both masters)"
    bench.record(
        "hot masters: outcomes, one master killed",
        "outcomes",
        [sum(alerts.values()) + sum(remediations.values())],
        note=f"{note}; A put out {by_master['a']} ({a_before} when killed), B {by_master['b']}; "
        f"alerts {sum(alerts.values())}, remediations {sum(remediations.values())} "
        f"({dict(collections.Counter(results.values()))})",
    )
    bench.record(
        "hot masters: findings acted on twice across the masters",
        "findings",
        [twice],
        target=Target("==", 0),
        note=f"B's triage found {on_b.returned['held']} events held by A's claims (taken over after the lease)",
    )
    bench.record(
        "hot masters: findings never acted on",
        "findings",
        [never],
        target=Target("==", 0),
        note=f"the shared store tallies {recorded:g} completed actions, the two buses carried "
        f"{sum(alerts.values()) + sum(remediations.values())} outcomes; B's triage {dict(on_b.returned)}, "
        f"its audit round {dict(on_b.findings)}",
    )
    bench.record(
        "hot masters: outcomes put on a bus again",
        "events",
        [seen.repeats],
        note="an outbox event A's bus carried but A had not confirmed when it died, put on B's bus with "
        "its event_id (a consumer drops the repeat); counted once above",
    )
    bench.record(
        "hot masters: from the kill to the last outcome",
        "s",
        [last],
        note="the takeover waits for the lease (60 s as shipped), then B's engine triages the held events again",
    )
    assert not wrong, f"{len(wrong)} (minion, rule) series without exactly one outcome: {wrong[:20]}"
