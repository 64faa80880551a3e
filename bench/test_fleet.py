"""Fleet scale on one master: 1,000 minions x 10 findings = 10,000 violation events.

What is real: the salt-master (pytest-salt-factories) with the settings of
conf/master.d/hana-storage.conf as shipped - the reactor map, the triage runner, the Prometheus
exporter, the triage settings and the large-fleet settings; ``REAL`` salt-minion daemons with
their own keys, connected to the master; the master's request server, through which every event
arrives (each real minion forwards its share of the fleet's beacon batches with ``fire_master``,
the way a minion sends its beacons' events); remediations: triage calls ``hana_storage.remediate``
on the real minions, which re-audits this host.

What is simulated: the other minions are accepted keys (one shared RSA key pair: the master
verifies every signature, the signing is what is simulated) whose events a real minion forwards;
their findings are all manual rules, because a remediation on a minion that is not
connected only waits for its timeout. The real minions' pillar names devices this host does not
have and disables fixing (``remediation: enabled: false``), so the call, the publish,
the minion's audit and its return are measured, but no fix is made on the host.

Each real minion has 5 auto and 5 manual findings, each simulated one 10 manual ones. Two
rounds, as on a real fleet: the burst of violation events (one in WITHHOLD_EVERY never sent, as
if the master had been down), then each minion's audit event listing its 10 open findings. At
the end every (minion, rule) must have exactly one outcome on the master's bus: a manual finding
one alert, an auto finding one remediation event (plus one alert when it was not fixed), none
twice, none missing - checked per series, not only in totals.

The same burst (a sample of it) also goes, in the same run, to a master with the same settings
but without the triage engine: the reactor then starts a triage runner job per event, the design
before the engine (and still the fallback when the engine is not running). The ratio of the two
triage rates is what the engine buys.
"""

import collections
import contextlib
import os
import threading
import time
import urllib.request

import psutil
import pytest
import salt.utils.event
import yaml
from hana_storage_core import rules as rules
from prometheus_client.parser import text_string_to_metric_families

from bench.conftest import Target
from tests import beacon_events
from tests.conftest import REPO
from tests.support.keys import keypair
from tests.support.master import formula_master, free_port, pillar_tree, shipped_settings

MINIONS, FINDINGS = int(os.environ.get("BENCH_MINIONS", 1000)), 10
REAL = int(os.environ.get("BENCH_REAL_MINIONS", 10))  # salt-minion daemons; the rest simulated
WITHHOLD_EVERY = 1000  # one violation in this many never reaches the master: the audit round must catch it
OLD_SAMPLE = int(
    os.environ.get("BENCH_OLD_SAMPLE", 2000)
)  # events sent to the master with a runner job per event (~60 s at its rate)
BATCH = FINDINGS  # events per fire_master request: one minion's beacon tick with all its findings
AUTO_RULES = sorted(rules.auto_rules())[:5]
MANUAL_RULES = sorted(r for r, rule in rules.RULES.items() if rule.remediation == "manual")
DONE = ("fixed", "absent")  # the triage runner's verified results
TRIAGE_JOB = "runner.hana_storage.triage"  # what the reactor starts when the engine cannot take an event


def real_pillar(root):
    """pillar.example on devices this host does not have, with fixing disabled: the audit and
    remediate() run for real, and change nothing."""
    storage = yaml.safe_load((REPO / "pillar.example").read_text())["hana"]["storage"]
    for name, volume in storage["volumes"].items():
        volume["devices"] = [
            f"/dev/disk/by-id/bench-missing-{name}{i}" for i in range(len(volume["devices"]))
        ]
        volume.pop("allow_format", None)
    storage["compliance"]["remediation"] = {"enabled": False}
    return pillar_tree(root, storage)


@contextlib.contextmanager
def fleet_master(salt_factories, tmp_path_factory, name, real, triage_engine=True):
    """A master configured as shipped, with ``real`` minion daemons connected and synced;
    without the triage engine unless ``triage_engine``."""
    port = free_port()
    overrides = formula_master(
        real_pillar(tmp_path_factory.mktemp("pillar")),
        reactor=True,
        triage_engine=triage_engine,
        exporter_port=port,
        interface="127.0.0.1",
        log_level_logfile="warning",
        **shipped_settings(),
    )
    factory = salt_factories.salt_master_daemon(name, overrides=overrides)
    with factory.started(start_timeout=120), contextlib.ExitStack() as minions:
        factory.metrics_url = f"http://127.0.0.1:{port}/metrics"
        factory.minions = [
            minions.enter_context(
                factory.salt_minion_daemon(
                    f"{name}-real-{i:02d}", overrides={"log_level_logfile": "warning"}
                ).started(start_timeout=120)
            )
            for i in range(real)
        ]
        sync = factory.salt_cli(timeout=300).run("saltutil.sync_all", minion_tgt=f"{name}-real-*")
        assert sync.returncode == 0 and len(sync.data) == real, sync
        yield factory


def totals(master):
    text = urllib.request.urlopen(master.metrics_url, timeout=30).read().decode()
    sums = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                sums[sample.name] = sums.get(sample.name, 0) + sample.value
    return sums


def sim_key():
    """The simulated minions' shared key pair; their public key is accepted as each of them."""
    pub, pem = REPO / "build" / "bench" / "sim.pub", REPO / "build" / "bench" / "sim.pem"
    pub.parent.mkdir(parents=True, exist_ok=True)
    if not pem.exists():
        private, public = keypair()
        pem.write_text(private)
        pub.write_text(public)
    return str(pem), pub.read_text()


def finding(rule):
    return {
        "rule": rule,
        "severity": rules.RULES[rule].severity,
        "volume": "data",
        "mountpoint": "/hana/data",
        "device": "/dev/mapper/hana_data",
        "remediation": rules.RULES[rule].remediation,
        "message": "simulated",
    }


def fleet_events(master, limit=None, minions=MINIONS):
    """{minion: (violation events, audit event)}, signed as the beacon signs, in minion order:
    the real minions first (their own keys, AUTO_RULES + manual rules), then simulated ones up to
    ``minions``. ``limit`` keeps only the first violations (and the audits of their minions)."""
    pem, pub = sim_key()
    plan, now, count = {}, time.time(), 0
    real = [m.id for m in master.minions]
    for index in range(minions):
        minion = real[index] if index < len(real) else f"sim-{index:04d}"
        if index < len(real):
            key = os.path.join(master.minions[index].config["pki_dir"], "minion.pem")
            names = AUTO_RULES + MANUAL_RULES[: FINDINGS - len(AUTO_RULES)]
        else:
            with open(f"{master.config['pki_dir']}/minions/{minion}", "w", encoding="utf-8") as handle:
                handle.write(pub)
            key, names = pem, MANUAL_RULES[:FINDINGS]
        found = [finding(rule) for rule in names][: None if limit is None else max(0, limit - count)]
        if not found:
            break
        count += len(found)
        violations = [
            {
                "tag": f"salt/beacon/{minion}/hana_storage/violation",
                "data": beacon_events.sign(key, minion, "violation", beacon_events.violation_data(f, now)),
            }
            for f in found
        ]
        audit = beacon_events.audit_data([(f, now) for f in found], volumes=("data",), ts=now)
        audit = {
            "tag": f"salt/beacon/{minion}/hana_storage/audit",
            "data": beacon_events.sign(key, minion, "audit", audit),
        }
        plan[minion] = (violations, audit)
    return plan


class FirstSeen:
    """Event ids seen so far, shared by the followers of several masters' buses: an outbox event
    put on a bus again (with its event_id) is one outcome, not two."""

    def __init__(self):
        self.ids, self.repeats, self.lock = set(), 0, threading.Lock()

    def first(self, event_id):
        with self.lock:
            if event_id is not None and event_id in self.ids:
                self.repeats += 1
                return False
            self.ids.add(event_id)
            return True


class Outcomes:
    """Follows the master's bus: what triage returned (``hana/storage/triaged``), and every alert
    and remediation event per (minion, rule), each event_id once (``seen``: shared with the
    followers of other masters)."""

    def __init__(self, master, seen=None):
        self.opts = master.config
        self.seen = seen or FirstSeen()
        self.returned = collections.Counter()
        self.findings = collections.Counter()  # per-finding actions of the reconciling jobs
        self.alerts, self.remediations = collections.Counter(), collections.Counter()
        self.runner_jobs = 0  # triage runner jobs the reactor started: events the engine did not take
        self.results = {}
        self.last = time.monotonic()  # when the last alert or remediation arrived
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.follow, daemon=True)

    def __enter__(self):
        self.thread.start()
        time.sleep(1)  # subscribed before the first event is sent
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def follow(self):
        with salt.utils.event.get_master_event(self.opts, self.opts["sock_dir"], listen=True) as bus:
            while not self.stop.is_set():
                event = bus.get_event(wait=1, full=True)
                if event:
                    self.count(event["tag"], event["data"])

    def count(self, tag, data):
        if tag in ("hana/storage/alert", "hana/storage/remediation"):
            if not self.seen.first(data.get("event_id")):
                return
            series = (data.get("minion"), data.get("rule"))
            (self.alerts if tag.endswith("alert") else self.remediations)[series] += 1
            if tag.endswith("remediation"):
                self.results[series] = data.get("result")
            self.last = time.monotonic()
        elif tag.startswith("salt/run/") and tag.endswith("/new") and data.get("fun") == TRIAGE_JOB:
            self.runner_jobs += 1
        elif tag == "hana/storage/triaged":
            result = data.get("result")
            action = result.get("action") if isinstance(result, dict) else "exception"
            self.returned[action] += 1
            for item in result.get("findings", []) if action == "reconciled" else ():
                self.findings[item["action"]] += 1

    def handled(self):
        return sum(self.alerts.values()) + sum(self.remediations.values())

    def problems(self, plan):
        """Every (minion, rule) whose outcomes are not exactly one: [(series, what is wrong)]."""
        return problems(plan, self.alerts, self.remediations, self.results)


def problems(plan, alerts, remediations, results):
    """Every (minion, rule) of ``plan`` whose outcomes (Counters of alerts and remediations per
    series, and each remediation's result) are not exactly one: [(series, what is wrong)]."""
    expected = {
        (minion, e["data"]["rule"]): e["data"]["remediation"]
        for minion, (violations, _audit) in plan.items()
        for e in violations
    }
    wrong = []
    for series in sorted(set(expected) | set(alerts) | set(remediations)):
        sent, fixes, kind = alerts[series], remediations[series], expected.get(series)
        if kind == "manual" and (sent, fixes) != (1, 0):
            wrong.append((series, f"manual: {sent} alerts, {fixes} remediations"))
        elif kind == "auto":
            alerted = 0 if results.get(series) in DONE else 1
            if (fixes, sent) != (1, alerted):
                wrong.append((series, f"auto: {fixes} remediations, {sent} alerts"))
        elif kind is None:
            wrong.append((series, f"not a finding: {sent} alerts, {fixes} remediations"))
    return wrong


def forward(master, batches):
    """Send [events] batches to the master through the real minions' connections (round robin,
    one thread per minion, one fire_master request per batch); seconds it took."""
    shares = [batches[i :: len(master.minions)] for i in range(len(master.minions))]
    failures = []

    def send(minion, share):
        try:
            opts = minion.config
            with salt.utils.event.get_event(
                "minion", opts=opts, sock_dir=opts["sock_dir"], listen=False
            ) as bus:
                for events in share:
                    sent = bus.fire_event(
                        {"events": events, "tag": None, "data": None, "pretag": None}, "fire_master"
                    )
                    assert sent, f"{minion.id}'s event bus refused a batch"
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            failures.append(f"{minion.id}: {exc!r}")

    started = time.monotonic()
    threads = [threading.Thread(target=send, args=pair) for pair in zip(master.minions, shares, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    return time.monotonic() - started


def settle(read, expected, started, quiet=60, timeout=1800):
    """(value, seconds from ``started`` to its last change): waits until ``read()`` reaches
    ``expected`` or stops moving for ``quiet`` seconds (a lost reaction never arrives)."""
    value, changed = read(), time.monotonic()
    while value < expected and time.monotonic() - changed < quiet:
        assert time.monotonic() - started < timeout, f"{value} of {expected} after {timeout}s"
        time.sleep(0.5)
        now = read()
        if now != value:
            value, changed = now, time.monotonic()
    return value, changed - started


def role(process):
    """What a process of the run does, from its title (Salt sets one per process, cut to the
    length of the original command line) and, for the engines, what it listens on."""
    title = " ".join(process.cmdline())
    if "cli_salt_minion" in title:
        return "minion daemons"
    if process.pid == os.getpid():
        return "the bench (forwarding, following)"
    if "Engine(" in title:
        if any(
            c.laddr and str(c.laddr).endswith("hana_storage_triage.sock")
            for c in process.net_connections("unix")
        ):
            return "master: triage engine"
        if any(c.status == psutil.CONN_LISTEN for c in process.net_connections("tcp")):
            return "master: exporter engine"
        return "master: Salt's engines (the reactor)"
    for name in ("MWorker", "EventPublisher", "ReqServer", "PubServer", "Maintenance"):
        if name in title:
            return f"master: {name}"
    return "master: other"


class CpuUse:
    """CPU seconds used by every process of the run (the master's, the minion daemons', the
    bench's own), by role, between ``start`` and ``stop``: what each triaged event costs the
    machine, and where. Children that exited (runner jobs) count in their parent."""

    def __init__(self, master):
        self.roots = [psutil.Process(master.pid), *(psutil.Process(m.pid) for m in master.minions)]

    def sample(self):
        used = collections.Counter()
        for process in [
            psutil.Process(),
            *self.roots,
            *(c for r in self.roots for c in r.children(recursive=True)),
        ]:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                used[role(process)] += times.user + times.system + times.children_user + times.children_system
        return used

    def __enter__(self):
        self.before = self.sample()
        return self

    def stop(self):
        after = self.sample()
        return {name: after[name] - self.before.get(name, 0) for name in after}

    def __exit__(self, *exc):
        return False


def run_fleet(master, plan):
    """The violation burst, then the audit round; every (minion, rule) checked. The figures."""
    assert not totals(master).get("hana_storage_violations_total")
    everything = [e for violations, _audit in plan.values() for e in violations]
    sent = [e for i, e in enumerate(everything) if i % WITHHOLD_EVERY != WITHHOLD_EVERY - 1]
    # one request per minion tick, in minion order: a real minion's batch carries only its events
    batches, by_minion = [], collections.defaultdict(list)
    for event in sent:
        by_minion[event["tag"].split("/")[2]].append(event)
    for events in by_minion.values():
        batches += [events[i : i + BATCH] for i in range(0, len(events), BATCH)]
    auto = sum(1 for e in sent if e["data"]["remediation"] == "auto")
    with Outcomes(master) as outcomes, CpuUse(master) as cpu:
        started = time.monotonic()
        forwarded = forward(master, batches)
        counted, exporter = settle(
            lambda: totals(master).get("hana_storage_violations_total", 0), len(sent), started
        )
        assert counted == len(sent), f"the exporter counted {counted} of {len(sent)} violations"
        # every sent finding ends in one alert or one remediation (a failed fix adds an alert)
        handled, reactor = settle(
            lambda: sum(outcomes.remediations.values()) + sum(outcomes.alerts.values()) - failed(outcomes),
            len(sent),
            started,
        )
        triaged = sum(outcomes.returned.values())
        burst_cpu = cpu.stop()
        audit_started = time.monotonic()
        forward(master, [[audit] for _violations, audit in plan.values()])
        reconciled, audit_seconds = settle(lambda: outcomes.returned["reconciled"], len(plan), audit_started)
        settle(outcomes.handled, outcomes.handled() + 1, time.monotonic(), quiet=10)  # the last ones
        wrong = outcomes.problems(plan)
    assert totals(master).get("hana_storage_rejected_events_total", 0) == 0
    assert not wrong, f"{len(wrong)} (minion, rule) series without exactly one outcome: {wrong[:20]}"
    return {
        "sent": len(sent),
        "forwarded": len(sent) / forwarded,
        "exporter": len(sent) / exporter,
        "reactor": handled / reactor,
        "withheld": len(everything) - len(sent),
        "lost": len(sent) - handled,
        "auto": auto,
        "results": collections.Counter(outcomes.results.values()),
        "triaged": triaged,
        "runner jobs": outcomes.runner_jobs,
        "audit round": outcomes.findings,
        "audit rate": reconciled / audit_seconds,
        "cpu per event": {name: seconds / max(handled, 1) for name, seconds in burst_cpu.items()},
        "burst seconds": reactor,
        "sent again": outcomes.seen.repeats,
    }


def failed(outcomes):
    """Remediations alerted as not fixed: their alert is the same outcome, not another one."""
    return sum(1 for result in outcomes.results.values() if result not in DONE)


@pytest.fixture(scope="module")
def old_design(salt_factories, tmp_path_factory):
    """The triage rate with a runner job per event (no triage engine), on a sample."""
    with fleet_master(salt_factories, tmp_path_factory, "hana-fleet-jobs", 2, triage_engine=False) as jobs:
        return run_fleet(jobs, fleet_events(jobs, OLD_SAMPLE))


def test_fleet_every_finding_handled_once(salt_factories, tmp_path_factory, old_design, bench):
    with fleet_master(salt_factories, tmp_path_factory, "hana-fleet", REAL) as master:
        plan = fleet_events(master)
        fleet = run_fleet(master, plan)
    n, sent = sum(len(v) for v, _a in plan.values()), fleet["sent"]
    bench.record(
        "fleet: events forwarded to the master",
        "events/s",
        [fleet["forwarded"]],
        note=f"{n} events through {REAL} real minions' connections",
    )
    bench.record(
        "fleet: exporter sustained rate",
        "events/s",
        [fleet["exporter"]],
        note=f"all {sent} sent counted (asserted); signature verified per event",
    )
    bench.record(
        "fleet: triage, a runner job per event (before the engine)",
        "events/s",
        [old_design["reactor"]],
        note=f"{old_design['sent']} events, same settings, no triage engine",
    )
    bench.record(
        "fleet: triage, shipped (reactor -> triage engine)",
        "events/s",
        [fleet["reactor"]],
        note=f"{n} findings ({fleet['auto']} auto: one remediation call each, results "
        f"{dict(fleet['results'])}); from the first event sent to the last outcome",
    )
    bench.record(
        "fleet: triage engine / a runner job per event",
        "x",
        [fleet["reactor"] / old_design["reactor"]],
        target=Target(">=", 1.5),
    )
    for name, design in (("shipped", fleet), ("a runner job per event", old_design)):
        per_event = design["cpu per event"]
        bench.record(
            f"fleet: CPU per triaged event, whole machine ({name})",
            "ms",
            [1000 * sum(per_event.values())],
            note="; ".join(
                f"{role} {1000 * s:.2f}" for role, s in sorted(per_event.items(), key=lambda i: -i[1])
            )
            + f" (ms per event, {psutil.cpu_count()} CPUs, the burst took {design['burst seconds']:.0f} s)",
        )
    bench.record(
        "fleet: outcomes sent again (same event_id)",
        "events",
        [fleet["sent again"]],
        note="outbox events the engine had not confirmed from its bus within the lease (60 s), sent "
        "again and counted once; more than none means its bus follower lagged that far",
    )
    bench.record(
        "fleet: events triaged by runner jobs, not the engine",
        "events",
        [fleet["runner jobs"]],
        note=f"of {sent} sent and {len(plan)} audit events: the reactor's fallback when the engine's "
        "socket is full",
    )
    bench.record(
        "fleet: violations the reactor lost",
        "events",
        [fleet["lost"]],
        note=f"of {sent} sent (triaged: {fleet['triaged']}); the audit round handles them",
    )
    audit_round = fleet["audit round"]
    bench.record(
        "fleet: audit round, findings handled",
        "findings",
        [audit_round["alerted"] + audit_round["remediated"] + audit_round["remediation-failed"]],
        note=f"{fleet['withheld']} withheld + {fleet['lost']} lost; exactly one outcome per "
        f"(minion, rule) asserted; {audit_round['duplicate']} came back duplicate",
    )
    bench.record(
        "fleet: audit round, audit events triaged",
        "events/s",
        [fleet["audit rate"]],
        note=f"each lists {FINDINGS} open findings",
    )
