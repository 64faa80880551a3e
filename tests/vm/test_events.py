"""Event-driven compliance end to end, with real daemons and a real kernel.

A salt-master runs on the host (pytest-salt-factories) with the formula's reactor, triage runner,
remediation orchestration and Prometheus exporter engine; a salt-minion daemon runs in the lab
VM, reaches the master over QEMU user networking, syncs the formula's modules from it, applies
hana.storage and runs the compliance beacon. The full audit interval is an hour, so whatever the
beacon reports within seconds came from a kernel event (uevent or mount-table change).

Scenarios: flags dropped by `cryptsetup refresh`, the crypt table reloaded by `dmsetup` without
the flags, and an unencrypted XFS mounted at /hana/shared. Latencies from the drift to the
violation and to the resolved event on the master bus are printed (and kept in build/).
"""

import json
import socket
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO
from tests.vm.conftest import boot

pytestmark = pytest.mark.vm

MINION = "hana-lab"
BEACON = f"salt/beacon/{MINION}/hana_storage"
KEY = "/run/hana-storage/keys/hana.key"
LATENCIES = REPO / "build" / "event-latencies.json"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lab_pillar(vm):
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["volumes"] = {
        "data": {"mountpoint": "/hana/data", "devices": ["/dev/vda", "/dev/vdb"], "stripe_size": 256},
        "shared": {"mountpoint": "/hana/shared", "devices": ["/dev/vdc"]},
    }
    storage["compliance"]["beacon"] = {"interval": 1, "full_audit_interval": 3600}
    storage["compliance"]["remediation"] = {"cooldown": 20}
    return {"hana": {"storage": storage}}


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=4, disk_size="1G", network=True)
    vm.run("mkfs.xfs -q /dev/vdd", check=True)  # the unencrypted filesystem of the last scenario
    return vm


@pytest.fixture(scope="module")
def master(request, salt_factories, tmp_path_factory, vm):
    pillar = tmp_path_factory.mktemp("pillar")
    (pillar / "top.sls").write_text("base:\n  '*':\n    - hana\n")
    (pillar / "hana.sls").write_text(yaml.safe_dump(lab_pillar(vm)))
    port = free_port()
    overrides = {
        "interface": "127.0.0.1",
        "auto_accept": True,
        "file_roots": {"base": [str(REPO / "salt"), str(REPO)]},
        "pillar_roots": {"base": [str(pillar)]},
        # master-side modules straight from the checkout (production: salt-run saltutil.sync_all)
        "runner_dirs": [str(REPO / "_runners")],
        "engines_dirs": [str(REPO / "_engines")],
        "utils_dirs": [str(REPO / "_utils")],
        "reactor": [{"salt/beacon/*/hana_storage/violation": ["salt://hana/storage/reactor/violation.sls"]}],
        "engines": [{"hana_storage_exporter": {"port": port}}],
        "hana_storage": {"cooldown": 20},
    }
    factory = salt_factories.salt_master_daemon("hana-events-master", overrides=overrides)
    with factory.started(start_timeout=120):
        factory.metrics_url = f"http://127.0.0.1:{port}/metrics"
        yield factory


@pytest.fixture(scope="module")
def minion(vm, master):
    vm.start_minion(master.config["ret_port"], master.config["publish_port"], MINION)
    cli = master.salt_cli(timeout=900)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if cli.run("test.ping", minion_tgt=MINION, _timeout=30).data is True:
            break
        time.sleep(5)
    else:
        pytest.fail(f"the minion in the VM never answered; read {vm.console} and /run/salt/minion.log")
    sync = cli.run("saltutil.sync_all", minion_tgt=MINION)
    assert "modules.hana_storage" in json.dumps(sync.data), sync
    return cli


@pytest.fixture(scope="module")
def applied(minion):
    started = time.time()
    result = minion.run("state.apply", "hana.storage", minion_tgt=MINION, _timeout=1200)
    states = result.data
    assert isinstance(states, dict), result
    failed = [s["comment"] for s in states.values() if s["result"] is not True]
    assert not failed, failed
    return started


def wait_for(event_listener, master, tags, after, timeout=240):
    """The first event of each tag (fnmatch) after ``after``; fails with what did arrive."""
    matched = event_listener.wait_for_events(
        [(master.id, t) for t in tags], after_time=after, timeout=timeout
    )
    assert matched.found_all_events, (
        f"missing {[t for _, t in matched.missed]}; got "
        f"{[(e.tag, e.data.get('rule')) for e in event_listener.get_events([(master.id, '*')], after_time=after)]}"
    )
    return {
        tag: next(e for e in matched.matches if e.tag == tag or event_fnmatch(e.tag, tag)) for tag in tags
    }


def event_fnmatch(tag, pattern):
    import fnmatch

    return fnmatch.fnmatch(tag, pattern)


def metrics(master):
    text = urllib.request.urlopen(master.metrics_url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_beacon_configured_and_first_audit_compliant(event_listener, master, minion, applied):
    beacons = minion.run("beacons.list", "return_yaml=False", minion_tgt=MINION).data
    assert beacons["hana_storage"]
    events = wait_for(event_listener, master, [f"{BEACON}/audit"], applied)
    audit = events[f"{BEACON}/audit"].data
    assert audit["compliant"] is True, audit
    assert audit["sig"] and audit["trigger"] == "full"
    samples = metrics(master)
    assert value(samples, "hana_storage_compliant", minion=MINION, volume="data") == 1
    assert value(samples, "hana_storage_last_audit_timestamp_seconds", minion=MINION) > 0


def drift(vm, event_listener, master, script, rules, record):
    """Run a drift in the guest; wait for its violations, the remediation and the resolved events."""
    before = metrics(master)
    after = time.time()
    vm.run(script, check=True, echo=False)
    drifted = time.time()
    violations = wait_for(event_listener, master, [f"{BEACON}/violation"], after)
    got = {
        e.data["rule"]
        for e in event_listener.get_events([(master.id, f"{BEACON}/violation")], after_time=after)
    }
    assert set(rules) <= got, got
    violation = violations[f"{BEACON}/violation"]
    assert violation.data["trigger"] in ("uevent", "mount"), violation.data  # not the hourly full audit
    wait_for(event_listener, master, ["hana/storage/remediation"], after)
    resolved = wait_for(event_listener, master, [f"{BEACON}/resolved"], after)[f"{BEACON}/resolved"]
    record(violation.timestamp - drifted, resolved.timestamp - drifted)
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
    vm, event_listener, master, applied, latencies
):
    before = drift(
        vm,
        event_listener,
        master,
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
    assert (
        value(samples, "hana_storage_remediations_total", minion=MINION, rule="HANA-PERF-002", result="fixed")
        >= 1
    )
    assert value(samples, "hana_storage_resolved_total", minion=MINION, rule="HANA-PERF-002") >= 1
    assert value(samples, "hana_storage_compliant", minion=MINION, volume="data") == 1


def test_dmsetup_reload_without_flags_is_caught(vm, event_listener, master, applied, latencies):
    time.sleep(21)  # past the cooldown of the previous remediation of this rule
    # the tamperer needs the volume key: dump it inside the guest, reload the table without the flags
    script = (
        f"vk=$(cryptsetup luksDump --dump-volume-key --batch-mode --key-file {KEY} /dev/vg_hana_data/lv_hana_data "
        "| sed -n '/MK dump:/,$p' | sed 's/MK dump://' | tr -d ' \\t\\n')\n"
        "set -- $(dmsetup table hana_data)\n"
        'dmsetup reload hana_data --table "$1 $2 crypt $4 $vk $6 $7 $8 1 sector_size:4096" && dmsetup resume hana_data'
    )
    drift(vm, event_listener, master, script, ["HANA-PERF-002"], latencies)
    table, _header = flags_of(vm)
    assert "no_read_workqueue no_write_workqueue" in table


def test_unencrypted_mount_at_shared_raises_an_alert_and_touches_nothing(vm, event_listener, master, applied):
    before_sum = vm.checksum(3)
    after = time.time()
    vm.run("umount /hana/shared && mount /dev/vdd /hana/shared", check=True)
    events = wait_for(event_listener, master, [f"{BEACON}/violation", "hana/storage/alert"], after)
    alert = events["hana/storage/alert"].data
    assert alert["minion"] == MINION and alert["rule"] == "HANA-ENC-001" and alert["remediation"] == "manual"
    rules = {
        e.data["rule"]
        for e in event_listener.get_events([(master.id, f"{BEACON}/violation")], after_time=after)
    }
    assert "HANA-ENC-001" in rules
    assert events[f"{BEACON}/violation"].data["trigger"] == "mount"
    time.sleep(20)  # let any remediation the reactor attempts finish
    mounted = vm.run("findmnt -n -o SOURCE /hana/shared", echo=False).output.strip()
    assert mounted == "/dev/vdd"
    assert vm.checksum(3) == before_sum
    samples = metrics(master)
    assert value(samples, "hana_storage_alerts_total", minion=MINION, rule="HANA-ENC-001") >= 1
    assert value(samples, "hana_storage_compliant", minion=MINION, volume="shared") == 0
    assert (
        value(samples, "hana_storage_findings", minion=MINION, rule="HANA-ENC-001", severity="critical") == 1
    )
