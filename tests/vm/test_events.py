"""Event-driven compliance end to end, with real daemons and a real kernel, on two hot masters.

Two salt-masters run on the host (pytest-salt-factories) as Salt's hot multi-master peers: one key
pair, the formula's reactor, triage engine and runner, remediation calls and Prometheus
exporter engine on each, and one real Redis as the triage store they share (README, "More than
one master"). A salt-minion daemon runs in the lab VM, connected to both over QEMU user
networking; it applies hana.storage and runs the compliance beacon, one instance per master
connection (its modules load from the checkout: see lab/hana_lab.py DAEMON_CONFIG). The full
audit interval is an hour, so whatever the beacon reports within seconds came from a kernel
event (uevent or mount-table change).

Scenarios: flags dropped by `cryptsetup refresh`, the crypt table reloaded by `dmsetup` without
the flags, and an unencrypted XFS mounted at /hana/shared. Each finding reaches both masters
with one key and since, and is acted on once across them: one remediation, or one alert.
Latencies from the drift to the violation and to the resolved event on the first master's bus
are printed (and kept in build/).
"""

import base64
import contextlib
import json
import os
import shutil
import time
import urllib.request

import pytest
import redis
import salt.utils.event
from prometheus_client.parser import text_string_to_metric_families

from tests import beacon_events
from tests.conftest import REPO
from tests.support.lab_master import BEACON, KEY, MINION, ask, connect_minion, lab_master, wait_for
from tests.support.master import free_port, outcomes, started_hot_masters, triage_results
from tests.support.redis_store import redis_server
from tests.vm.conftest import boot

pytestmark = pytest.mark.vm

LATENCIES = REPO / "build" / "event-latencies.json"
LEASE = 20  # seconds: a copy held by the other master's claim is triaged again this soon
STORY_FIELDS = ("rule", "key", "since", "trigger", "via", "result", "reason", "ts", "open")


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=4, disk_size="1G", network=True)
    vm.run("mkfs.xfs -q /dev/vdd", check=True)  # the unencrypted filesystem of the last scenario
    return vm


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The URL of the real Redis the masters share as their triage store."""
    with redis_server(tmp_path_factory.mktemp("events-redis")) as url:
        yield url


@pytest.fixture(scope="module")
def masters(salt_factories, tmp_path_factory, vm, store):
    """[a, b]: two hot masters sharing a key pair and a Redis triage store."""
    with contextlib.ExitStack() as stack:
        exporters = {"hana-events-a": free_port(), "hana-events-b": free_port()}
        configs = [
            (
                name,
                lab_master(
                    tmp_path_factory,
                    vm,
                    exporter_port=port,
                    hana_storage={
                        "cooldown": 20,
                        "lease": LEASE,
                        "store": {"driver": "redis", "url": store},
                        "event_burst": FLOOD + 10,  # the flood below tests the cooldown, not the rate limit
                    },
                    gather_job_timeout=60,  # a minion under software emulation answers find_job slowly
                ),
            )
            for name, port in exporters.items()
        ]
        started = started_hot_masters(stack, salt_factories, configs)
        for factory in started:
            factory.metrics_url = f"http://127.0.0.1:{exporters[factory.id]}/metrics"
        try:
            yield started
        finally:  # the masters' logs outlive the run: the place to read why a step failed
            logs = REPO / "build" / "test-logs"
            logs.mkdir(parents=True, exist_ok=True)
            for factory in started:
                with contextlib.suppress(OSError):
                    shutil.copy2(factory.config["log_file"], logs / f"vm-events-{factory.id}.log")


@pytest.fixture(scope="module")
def master(masters):
    """The master the single-master checks read: the first."""
    return masters[0]


@pytest.fixture(scope="module")
def minion(vm, masters):
    cli = connect_minion(vm, *masters)
    assert ask(cli, vm, "hana_storage.validate_pillar") == []
    return cli


@pytest.fixture(scope="module")
def applied(vm, minion):
    started = time.time()
    result = minion.run("state.apply", "hana.storage", minion_tgt=MINION, _timeout=1200)
    states = result.data
    assert isinstance(states, dict), f"{result}; read {vm.minion_log()}"
    failed = [s["comment"] for s in states.values() if s["result"] is not True]
    assert not failed, f"{failed}; read {vm.minion_log()}"
    return started


def metrics(master):
    text = urllib.request.urlopen(master.metrics_url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(masters, name, **labels):
    """A counter summed over the masters' exporters: each counts the events of its own bus."""
    return sum(value(metrics(m), name, **labels) for m in masters)


def occurrences(event_listener, masters, after, rules):
    """Per master, the (key, since) of its violations of ``rules`` since ``after``."""
    return [
        sorted(
            (e.data["key"], e.data["since"])
            for e in event_listener.get_events([(m.id, f"{BEACON}/violation")], after_time=after)
            if e.data.get("rule") in rules
        )
        for m in masters
    ]


def test_beacon_configured_and_first_audit_compliant(event_listener, vm, master, minion, applied):
    beacons = ask(minion, vm, "beacons.list", "return_yaml=False")
    assert beacons["hana_storage"]
    events = wait_for(event_listener, master, [f"{BEACON}/audit"], applied)
    audit = events[f"{BEACON}/audit"].data
    assert audit["compliant"] is True, audit
    assert audit["sig"] and audit["trigger"] == "full"
    samples = metrics(master)
    assert value(samples, "hana_storage_compliant", minion=MINION, volume="data") == 1
    assert value(samples, "hana_storage_last_audit_timestamp_seconds", minion=MINION) > 0


def rules_seen(event_listener, masters, tag, rules, after, timeout):
    """Events of ``tag`` on any of ``masters`` after ``after`` until every rule has one; fails
    with what came instead."""
    deadline = time.monotonic() + timeout
    while True:
        events = sorted(
            (
                e
                for m in masters
                for e in event_listener.get_events([(m.id, tag)], after_time=after)
                if e.data.get("rule") in rules
            ),
            key=lambda e: e.stamp,
        )
        if {e.data["rule"] for e in events} >= set(rules):
            return events
        assert time.monotonic() < deadline, (
            f"{tag}: got {sorted({e.data['rule'] for e in events})} of {rules} in {timeout}s"
        )
        time.sleep(0.5)


def acted_once(event_listener, masters, after, rules, expected):
    """Each master heard every finding of ``rules`` named alike (key and since) and triaged its
    copy to an end (one held by the other master's lease comes back when the lease runs out);
    across both, the outcomes were ``expected`` ([(tag, rule)]): no finding acted on twice."""
    deadline = time.monotonic() + LEASE * 3 + 120
    while True:
        ended = [
            {
                r["rule"]
                for r in triage_results(event_listener, m.id, after)
                if r.get("minion") == MINION and r.get("rule") in rules and r["action"] != "held"
            }
            for m in masters
        ]
        if all(done >= set(rules) for done in ended):
            break
        assert time.monotonic() < deadline, f"triage of {rules} unfinished: {ended}"
        time.sleep(1)
    seen = occurrences(event_listener, masters, after, rules)
    assert seen[0] and all(s == seen[0] for s in seen), seen
    story = [  # what to read when it fails
        (e.stamp.isoformat(), m.id, e.tag.rsplit("/", 1)[-1], {k: e.data.get(k) for k in STORY_FIELDS})
        for m in masters
        for e in event_listener.get_events([(m.id, "*")], after_time=after)
        if e.data.get("rule") in rules or e.tag.endswith(("/triaged", "/audit"))
    ]
    found = sorted(
        (tag, rule) for _master, tag, _minion, rule in outcomes(event_listener, masters, after, rules)
    )
    assert found == sorted(expected), sorted(story)


def drift(vm, event_listener, masters, script, rules, record):
    """Run a drift in the guest; wait for its violations, the remediation and the resolved events.
    One remediation per rule across both masters (the second finds the first fixed it)."""
    before = metrics(masters[0])
    after = time.time()
    vm.run(script, check=True, echo=False)
    drifted = time.time()
    violations = rules_seen(event_listener, masters[:1], f"{BEACON}/violation", rules, after, 240)
    assert {e.data["trigger"] for e in violations} <= {"uevent", "mount"}, violations  # not the full audit
    rules_seen(event_listener, masters, "hana/storage/remediation", rules, after, 600)
    resolved = rules_seen(event_listener, masters[:1], f"{BEACON}/resolved", rules, after, 300)
    violation, resolved = violations[0], max(resolved, key=lambda e: e.stamp)
    record(violation.stamp.timestamp() - drifted, resolved.stamp.timestamp() - drifted)
    acted_once(event_listener, masters, after, rules, [("hana/storage/remediation", r) for r in rules])
    return before


@pytest.fixture(scope="module")
def latencies():
    recorded = {"to_violation_s": [], "to_resolved_s": []}
    yield lambda v, r: (
        recorded["to_violation_s"].append(round(v, 2)),
        recorded["to_resolved_s"].append(round(r, 2)),
    )
    LATENCIES.parent.mkdir(exist_ok=True)
    LATENCIES.write_text(json.dumps(recorded, indent=2))
    print(
        f"\ndrift -> violation: {recorded['to_violation_s']} s; drift -> resolved: {recorded['to_resolved_s']} s"
    )


def flags_of(vm, name="hana_data"):
    table = vm.run(f"dmsetup table {name}", check=True, echo=False).output
    header = json.loads(
        vm.run(
            "cryptsetup luksDump --dump-json-metadata /dev/vg_hana_data/lv_hana_data", check=True, echo=False
        ).output
    )
    return table, sorted(header["config"].get("flags", []))


def test_refresh_without_flags_is_caught_remediated_and_resolved(
    vm, event_listener, masters, master, applied, latencies
):
    before = drift(
        vm,
        event_listener,
        masters,
        f"cryptsetup refresh --key-file {KEY} --persistent hana_data",
        ["HANA-PERF-002", "HANA-PERF-003"],
        latencies,
    )
    table, header = flags_of(vm)
    assert "no_read_workqueue no_write_workqueue" in table and header == [
        "no-read-workqueue",
        "no-write-workqueue",
    ]
    samples = metrics(master)
    labels = {"minion": MINION, "rule": "HANA-PERF-002", "severity": "medium"}
    assert (
        value(samples, "hana_storage_violations_total", **labels)
        == value(before, "hana_storage_violations_total", **labels) + 1
    )
    # fixed by its own call, or absent: PERF-003's fix (the same refresh) got there first;
    # on whichever master claimed it
    assert (
        sum(
            total(masters, "hana_storage_remediations_total", minion=MINION, rule="HANA-PERF-002", result=r)
            for r in ("fixed", "absent")
        )
        >= 1
    )
    assert value(samples, "hana_storage_resolved_total", minion=MINION, rule="HANA-PERF-002") >= 1
    assert value(samples, "hana_storage_compliant", minion=MINION, volume="data") == 1


def test_dmsetup_reload_without_flags_is_caught(vm, event_listener, masters, applied, latencies):
    time.sleep(21)  # past the cooldown of the previous remediation of this rule
    # the tamperer needs the volume key: dump it inside the guest, reload the table without the flags
    script = (
        f"vk=$(cryptsetup luksDump --dump-volume-key --batch-mode --key-file {KEY} /dev/vg_hana_data/lv_hana_data "
        "| sed -n '/MK dump:/,$p' | sed 's/MK dump://' | tr -d ' \\t\\n')\n"
        "set -- $(dmsetup table hana_data)\n"
        'echo "$1 $2 crypt $4 $vk $6 $7 $8 1 sector_size:4096" | dmsetup reload hana_data && dmsetup resume hana_data'
    )
    drift(vm, event_listener, masters, script, ["HANA-PERF-002"], latencies)
    table, _header = flags_of(vm)
    assert "no_read_workqueue no_write_workqueue" in table


def test_unencrypted_mount_at_shared_raises_an_alert_and_touches_nothing(
    vm, event_listener, masters, master, applied
):
    before_sum = vm.checksum(3)
    after = time.time()
    # ro,norecovery: XFS then writes nothing itself (a plain ro mount does), so a change is someone else's
    vm.run("umount /hana/shared && mount -o ro,norecovery /dev/vdd /hana/shared", check=True)
    # a tick between umount and mount may first report HANA-MOUNT-001 (not mounted): wait for ENC-001
    violation = rules_seen(event_listener, [master], f"{BEACON}/violation", ["HANA-ENC-001"], after, 240)[0]
    assert violation.data["trigger"] == "mount"
    alert = rules_seen(event_listener, masters, "hana/storage/alert", ["HANA-ENC-001"], after, 120)[0].data
    assert alert["minion"] == MINION and alert["remediation"] == "manual"
    acted_once(event_listener, masters, after, ["HANA-ENC-001"], [("hana/storage/alert", "HANA-ENC-001")])
    time.sleep(20)  # let any remediation the reactor attempts finish
    mounted = vm.run("findmnt -n -o SOURCE /hana/shared", echo=False).output.strip()
    assert mounted == "/dev/vdd"
    assert vm.checksum(3) == before_sum
    samples = metrics(master)
    assert total(masters, "hana_storage_alerts_total", minion=MINION, rule="HANA-ENC-001") >= 1
    assert value(samples, "hana_storage_compliant", minion=MINION, volume="shared") == 0
    assert (
        value(samples, "hana_storage_findings", minion=MINION, rule="HANA-ENC-001", severity="critical") == 1
    )


# ---- reactor safety: what a minion (or anything on the bus) may claim ------------------------

FLOOD = 500  # through the real reactor (about 10 events/s: bench/test_fleet.py); 10,000 in tests/unit


def signed(key, minion, data):
    return beacon_events.sign(key, minion, "violation", data)


def violation(rule, **extra):
    return {
        "rule": rule,
        "severity": "low",
        "volume": "data",
        "mountpoint": "/hana/data",
        "device": "/dev/mapper/hana_data",
        "message": "forged",
        "key": f"{rule}|data|/dev/mapper/hana_data",
        "trigger": "uevent",
        "ts": time.time(),
        **extra,
    }


def test_forged_events_cause_no_action_and_a_flood_one_remediation(
    vm, event_listener, master, minion, applied
):
    time.sleep(21)  # past the cooldown of earlier remediations
    pem = vm.run("cat /run/salt/pki/minion.pem", check=True, echo=False).output
    key_path = master.config["root_dir"] + "/hana-lab-minion.pem"
    with open(key_path, "w", encoding="utf-8") as handle:
        handle.write(pem)
    key = key_path  # signed as the beacon signs: the same calls on every Salt line
    before = metrics(master)
    after = time.time()
    # 1. the minion in the VM names another minion in the tag: it cannot sign for that one
    other = json.dumps(violation("HANA-PERF-002", remediation="auto", sig="AAAA"))
    minion.run(
        "event.send", "salt/beacon/hana-other/hana_storage/violation", f"data={other}", minion_tgt=MINION
    )
    # 2. ... or signs for itself with a stolen-looking signature (another minion's: the master's key)
    with salt.utils.event.get_master_event(master.config, master.config["sock_dir"], listen=False) as bus:
        bus.fire_event(
            violation("HANA-PERF-002", sig=base64.b64encode(b"x" * 256).decode()), f"{BEACON}/violation"
        )
        # 3. a correctly signed event claiming `remediation: auto` for a manual rule: an alert, no fix
        bus.fire_event(
            signed(key, MINION, violation("HANA-ENC-005", remediation="auto")), f"{BEACON}/violation"
        )
        # 4. a flood of correctly signed events for one auto rule: one remediation per cooldown
        flood_started = time.monotonic()
        for _ in range(FLOOD):
            bus.fire_event(signed(key, MINION, violation("HANA-PERF-004")), f"{BEACON}/violation")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if len(triage_results(event_listener, master.id, after)) >= FLOOD + 3:
            break
        time.sleep(2)
    flood_seconds = time.monotonic() - flood_started
    actions = triage_results(event_listener, master.id, after)
    assert len(actions) == FLOOD + 3, f"only {len(actions)} of {FLOOD + 3} events were triaged"
    by_action = {}
    for action in actions:
        by_action.setdefault(action["action"], []).append(action)
    assert {a["code"] for a in by_action["rejected"]} == {"unknown_minion", "bad_signature"}
    assert [a["rule"] for a in by_action["alerted"]] == ["HANA-ENC-005"]
    # one remediation per cooldown (20 s here): when each triage that acted began
    acted = [
        began
        for began, result in triage_results(event_listener, master.id, after, began=True)
        if result["action"] in ("remediated", "remediation-failed")
    ]
    assert acted and all(b - a >= 19.5 for a, b in zip(acted, acted[1:], strict=False)), acted
    assert len(acted) <= flood_seconds / 20 + 1
    assert len(by_action["cooldown"]) == FLOOD - len(acted)
    samples = metrics(master)
    assert (
        value(samples, "hana_storage_rejected_events_total", reason="bad_signature")
        >= value(before, "hana_storage_rejected_events_total", reason="bad_signature") + 1
    )
    print(
        f"\nflood of {FLOOD} signed events triaged in {flood_seconds:.0f} s ({FLOOD / flood_seconds:.0f}/s)"
    )
    assert vm.run("findmnt -n -o SOURCE /hana/data", echo=False).output.strip() == "/dev/mapper/hana_data"


def test_no_key_material_on_the_bus_in_logs_job_cache_or_dm_tables(
    vm, event_listener, masters, store, minion, applied
):
    """The pillar key and the volume key, raw, hex or base64: not in any event, either master's
    log or job cache, the shared triage store, the minion's debug log or job cache, or
    hana_storage.dm_tables."""
    volume_key = vm.run(
        f"cryptsetup luksDump --dump-volume-key --batch-mode --key-file {KEY} /dev/vg_hana_data/lv_hana_data "
        "| sed -n '/MK dump:/,$p' | sed 's/MK dump://' | tr -d ' \\t\\n'",
        check=True,
        echo=False,
    ).output.strip()
    secrets = [base64.b64decode(vm.key_b64()), bytes.fromhex(volume_key)]
    needles = []
    for secret in secrets:
        needles += [secret, secret.hex().encode(), secret.hex().upper().encode(), base64.b64encode(secret)]
    haystacks = {}
    for master in masters:
        events = event_listener.get_events([(master.id, "*")])
        haystacks[f"events of {master.id}"] = json.dumps([e.data for e in events]).encode()
        haystacks[f"log of {master.id}"] = open(master.config["log_file"], "rb").read()
        jobs = master.config["cachedir"] + "/jobs"
        haystacks[f"job cache of {master.id}"] = b"".join(
            open(os.path.join(d, f), "rb").read() for d, _dirs, files in os.walk(jobs) for f in files
        )
    client = redis.Redis.from_url(store)
    haystacks["triage store"] = b"".join(k + (client.dump(k) or b"") for k in client.scan_iter())
    client.close()
    guest = vm.run(
        "cat /run/salt/minion.log; find /run/salt/cache -type f -exec cat {} +", echo=False
    ).output.encode("utf-8", "surrogateescape")
    haystacks["minion log and cache"] = guest
    haystacks["dm_tables"] = json.dumps(ask(minion, vm, "hana_storage.dm_tables")).encode()
    assert b"hana_data" in haystacks["dm_tables"] and len(haystacks["job cache of hana-events-a"]) > 1000
    assert b"HANA-PERF-002" in haystacks["triage store"]
    assert b"DEBUG" in haystacks["minion log and cache"]
    for where, text in haystacks.items():
        for needle in needles:
            assert needle not in text, f"key material in the {where}"
