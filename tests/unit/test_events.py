"""Beacon, triage runner and exporter logic, with the Salt loader's dunders filled in by hand.

The real thing (daemons, kernel events, reactor) runs in tests/vm/test_events.py; here: the
event bookkeeping, signatures and forgeries, cooldowns and the metrics arithmetic.
"""

import base64
import importlib.util
import json
import time
from pathlib import Path

import pytest
import salt.crypt
from hana_storage_core import events as events
from hana_storage_core import limits as limits
from hana_storage_core import pillar as pillar
from hana_storage_core import rules as rules
from hana_storage_core import store as store
from hana_storage_core import tab as tab
from prometheus_client import CollectorRegistry, generate_latest

from tests import beacon_events
from tests.conftest import REPO
from tests.support.keys import keypair
from tests.unit.conftest import full_audits_in_the_tick
from tests.unit.test_evidence import report_runner
from tests.unit.test_readiness_fleet import verdict as readiness_verdict


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if getattr(module, "core", False) is None:  # the beacon imports the package on its first tick
        module.core = importlib.import_module("hana_storage_core")
    return module


def finding(rule="HANA-PERF-002", volume="data", device="/dev/mapper/hana_data"):
    severity, remediation = rules.RULES[rule].severity, rules.RULES[rule].remediation
    return {
        "rule": rule,
        "severity": severity,
        "volume": volume,
        "mountpoint": f"/hana/{volume}",
        "device": device,
        "expected": ["a"],
        "actual": [],
        "remediation": remediation,
        "message": "m",
    }


# ---- findings bookkeeping --------------------------------------------------------------------------


def test_diff_reports_appear_and_clear_once():
    known, appeared, cleared = events.diff_findings({}, [finding()], None)
    assert [f["rule"] for f in appeared] == ["HANA-PERF-002"] and cleared == []
    known, appeared, cleared = events.diff_findings(known, [finding()], None)
    assert appeared == [] and cleared == []  # unchanged: never repeated
    known, appeared, cleared = events.diff_findings(known, [], None)
    assert appeared == [] and [f["rule"] for f in cleared] == ["HANA-PERF-002"]
    assert known == {}


def test_diff_of_a_partial_audit_keeps_other_volumes():
    known, _, _ = events.diff_findings({}, [finding(), finding("HANA-ENC-001", "log", "/dev/vdb")], None)
    known, appeared, cleared = events.diff_findings(known, [], {"data"})
    assert [f["volume"] for f in cleared] == ["data"] and appeared == []
    assert list(known) == ["HANA-ENC-001|log|/dev/vdb"]


def test_uevents_map_to_volumes():
    assert events.uevent_device({"ACTION": "change", "SUBSYSTEM": "block", "DEVNAME": "dm-3"}) == "dm-3"
    assert events.uevent_device({"ACTION": "add", "SUBSYSTEM": "module", "DEVPATH": "/module/xor"}) is None
    assert (
        events.uevent_device(
            {"ACTION": "remove", "SUBSYSTEM": "block", "DEVPATH": "/devices/virtual/block/dm-7"}
        )
        == "dm-7"
    )
    watched = {"data": ["dm-1", "dm-0", "vda", "vdb"], "log": ["dm-4", "vdc"]}
    assert events.affected_volumes({"dm-0", "sda"}, watched) == ["data"]
    assert events.affected_volumes({"sda"}, watched) == []


def test_mount_changes_name_the_mountpoints():
    before = {"/hana/data": ("253:1", ("rw",))}
    after = {"/hana/data": ("253:1", ("rw",)), "/hana/shared": ("254:48", ("rw",))}
    assert events.changed_mountpoints(before, after) == ["/hana/shared"]
    assert events.changed_mountpoints(after, after) == []


def test_tags():
    assert events.minion_of_tag("salt/beacon/db1/hana_storage/violation") == ("db1", "violation")
    assert events.minion_of_tag("salt/beacon/db1/other/violation") == (None, None)
    assert events.minion_of_tag("salt/beacon//hana_storage/violation") == (None, None)


# ---- the beacon --------------------------------------------------------------------------------------


@pytest.fixture
def beacon(tmp_path):
    module = load("_beacons/hana_storage.py", "beacon_under_test")
    module.__context__ = {}
    module.__opts__ = {"id": "db1", "pki_dir": str(tmp_path)}
    module.audits = []
    report = {
        "compliant": True,
        "findings": [],
        "volumes": {
            "data": {
                "mountpoint": "/hana/data",
                "stack": ["dm-1", "dm-0", "vda"],
                "disks": ["vda"],
                "compliant": True,
                "rules": [],
            }
        },
    }
    module.report = report

    def audit(volumes=None):
        module.audits.append(volumes)
        return module.report

    module.__salt__ = {"hana_storage.audit": audit}

    class Watch:
        queued = []

        def drain(self):
            return self.queued.pop(0) if self.queued else (set(), False, False)

    module.watch = Watch()
    module.__context__["hana_storage.beacon"] = None
    module.__context__.pop("hana_storage.beacon")
    module._state()["watch"] = module.watch
    module._read_mounts = lambda: []
    return full_audits_in_the_tick(module)


def test_kernel_watch_sees_a_real_uevent_from_another_thread(beacon):
    """The real KernelWatch on this host's kernel: a `change` written to a block device's uevent
    file is read back, from the calling thread, without blocking (regression: pyroute2 keeps its
    socket per thread, and the minion ticks beacons from another one than the binder)."""
    import os

    devices = sorted(os.listdir("/sys/class/block"))
    if not devices or not os.access(f"/sys/class/block/{devices[0]}/uevent", os.W_OK):
        pytest.skip("no writable block device uevent file here")
    import socket

    control = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)  # NETLINK_KOBJECT_UEVENT
    control.bind((0, 1))
    watch = beacon.core.kernel_watch.KernelWatch(True)
    try:
        watch.drain()  # whatever was queued before
        with open(f"/sys/class/block/{devices[0]}/uevent", "w") as handle:
            handle.write("change")
        deadline = time.monotonic() + 5
        seen = set()
        while devices[0] not in seen and time.monotonic() < deadline:
            seen |= watch.drain()[0]
            time.sleep(0.05)
        control.settimeout(0.1)
        try:
            control.recv(65536)
        except TimeoutError:
            pytest.skip("no uevents reach this network namespace (a container): nothing to compare")
        assert devices[0] in seen
    finally:
        watch.close()
        control.close()


def test_beacon_validate_messages(beacon):
    assert beacon.validate([{"interval": 5}, {"full_audit_interval": 60}]) == (
        True,
        "Valid beacon configuration",
    )
    ok, message = beacon.validate({"interval": 5})
    assert not ok and "must be a list" in message
    ok, message = beacon.validate([{"full_audit_interval": 5}])
    assert not ok and "full_audit_interval must be an integer of at least 10" in message
    ok, message = beacon.validate([{"colour": "red"}])
    assert not ok and "unknown setting(s) colour" in message
    ok, message = beacon.validate([{"interval": 60}, {"full_audit_interval": 30}])
    assert not ok and "must not be shorter than interval" in message


def test_beacon_full_audit_then_idle_then_uevent(beacon):
    config = [{"full_audit_interval": 3600}]
    first = beacon.beacon(config)
    assert [e["tag"] for e in first] == ["audit"] and beacon.audits == [None]
    assert first[0]["sig"] is None  # no minion key in this test: unsigned
    assert beacon.beacon(config) == [] and beacon.audits == [None]  # idle: no audit at all
    beacon.watch.queued.append(({"dm-0"}, False, False))
    beacon.report["findings"] = [finding()]
    out = beacon.beacon(config)
    assert beacon.audits[-1] == ["data"]
    assert [(e["tag"], e["rule"], e["trigger"]) for e in out] == [("violation", "HANA-PERF-002", "uevent")]
    beacon.watch.queued.append(({"dm-0"}, False, False))
    assert beacon.beacon(config) == []  # still there: not repeated
    beacon.watch.queued.append(({"vda"}, False, False))
    beacon.report["findings"] = []
    assert [e["tag"] for e in beacon.beacon(config)] == ["resolved"]
    beacon.watch.queued.append(({"sdz"}, False, False))
    assert beacon.beacon(config) == [] and len(beacon.audits) == 4  # not a HANA device: no audit


def test_beacon_settle_pass_catches_what_completes_after_the_uevent(beacon):
    """cryptsetup refresh --persistent reloads the table (uevent) before it writes the header."""
    config = [{"full_audit_interval": 3600}]
    beacon.beacon(config)
    beacon.watch.queued.append(({"dm-0"}, False, False))
    beacon.report["findings"] = [finding()]
    assert [e["rule"] for e in beacon.beacon(config)] == ["HANA-PERF-002"]
    beacon.report["findings"] = [finding(), finding(rule="HANA-PERF-003")]
    assert beacon.beacon(config) == []  # not due yet: no audit
    audits = len(beacon.audits)
    volumes, trigger, _due = beacon._state()["settle"]
    beacon._state()["settle"] = (volumes, trigger, 0)  # due now
    out = beacon.beacon(config)
    assert [(e["rule"], e["trigger"]) for e in out] == [("HANA-PERF-003", "uevent")]
    assert beacon.audits[audits:] == [["data"]]
    assert beacon.beacon(config) == [] and len(beacon.audits) == audits + 1  # once only


def test_the_audit_event_lists_open_findings_since_their_violation(beacon):
    config = [{"full_audit_interval": 3600}]
    beacon.report["findings"] = [finding()]
    first = {e["tag"]: e for e in beacon.beacon(config)}
    key = events.finding_key(finding())
    assert first["audit"]["since"] == {key: first["violation"]["ts"]}
    beacon.watch.queued.append(({"dm-0"}, False, False))
    beacon.report["findings"] = []
    assert [e["tag"] for e in beacon.beacon(config)] == ["resolved"]
    beacon._state()["next_full"] = None
    beacon.report["findings"] = [finding()]
    again = {e["tag"]: e for e in beacon.beacon(config)}  # a new occurrence: a new since
    assert again["audit"]["since"] == {key: again["violation"]["ts"]} != first["audit"]["since"]
    del beacon._state()["since"]  # the context of a beacon from before the field, after an upgrade
    beacon._state()["next_full"] = None
    assert beacon.beacon(config)[-1]["since"] == {key: beacon._state()["since"][key]}


def test_beacon_lost_events_force_a_full_audit(beacon):
    beacon.beacon([])
    beacon.watch.queued.append((set(), False, True))
    assert [e["tag"] for e in beacon.beacon([])] == ["audit"]


def test_beacon_reports_an_audit_error_once(beacon):
    def broken(volumes=None):
        raise ValueError("dmsetup table failed")

    beacon.__salt__["hana_storage.audit"] = broken
    assert [e["tag"] for e in beacon.beacon([])] == ["error"]
    beacon.__context__["hana_storage.beacon"]["next_full"] = None
    assert beacon.beacon([]) == []


def test_beacon_retries_a_failed_full_audit_soon(beacon):
    """A failed full audit leaves the beacon blind to uevents: the next one comes in seconds,
    not a full interval later."""
    audit = beacon.__salt__["hana_storage.audit"]
    beacon.__salt__["hana_storage.audit"] = lambda volumes=None: (_ for _ in ()).throw(
        TimeoutError("File client timed out after 180 seconds")
    )
    config = [{"full_audit_interval": 3600}]
    assert [e["tag"] for e in beacon.beacon(config)] == ["error"]
    state = beacon.__context__["hana_storage.beacon"]
    assert state["next_full"] - time.monotonic() <= beacon.RETRY_SECONDS
    beacon.__salt__["hana_storage.audit"] = audit
    state["next_full"] = time.monotonic()  # the retry is due
    assert "audit" in [e["tag"] for e in beacon.beacon(config)]
    assert state["next_full"] - time.monotonic() > 3500


# ---- signatures and triage -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def keys():
    """Three RSA key pairs (the master's, db1's, db2's), made once: 2048-bit keys take a while."""
    return {name: keypair() for name in ("master", "db1", "db2")}


@pytest.fixture
def pki(tmp_path, keys):
    """A master's pki dir (master.pem, master.pub) with two accepted minions, db1 and db2 (their
    private keys beside)."""
    (tmp_path / "minions").mkdir()
    (tmp_path / "master.pem").write_text(keys["master"][0])
    (tmp_path / "master.pub").write_text(keys["master"][1])
    for minion in ("db1", "db2"):
        private, public = keys[minion]
        (tmp_path / f"{minion}.pem").write_text(private)
        (tmp_path / "minions" / minion).write_text(public)
    return tmp_path


real_sleep = time.sleep  # tests patch the runner's time.sleep (its retries)


def signed(pki, minion, data, age=0, event="violation"):
    return beacon_events.sign(pki / f"{minion}.pem", minion, event, {"ts": time.time() - age, **data})


def violation(pki, minion, found, ts):
    """A violation event as the beacon sends it: the finding, its key, first reported at ``ts``."""
    return signed(pki, minion, beacon_events.violation_data(found, ts))


def audit(pki, minion, open_since):
    """An audit event listing open findings: [(finding, the ts its violation was sent at)]."""
    return signed(pki, minion, beacon_events.audit_data(open_since), event="audit")


def record_fired(module):
    """The runner's ``_fire`` replaced by a recorder: what triage fired about the event itself
    (``module.fired``), and the outcome it reported on hana/storage/triaged (``module.triaged``)."""
    module.fired, module.triaged = [], []
    module._fire = lambda tag, data: (
        (module.triaged if tag == module.TRIAGED_TAG else module.fired).append((tag, data)) or True
    )


@pytest.fixture
def runner(pki, tmp_path):
    module = load("_runners/hana_storage.py", "runner_under_test")
    module.__opts__ = {
        "pki_dir": str(pki),
        "cachedir": str(tmp_path / "cache"),
        "hana_storage": {"cooldown": 300},
        "minion_id_lowercase": False,
    }
    module.remediate_calls = []
    record_fired(module)

    def fixed_all(rules):
        """What the minion's remediate() returns when it fixed every rule asked for: verified."""
        return {
            "result": True,
            "fixed": [{"rule": rule, "volume": "data", "device": "/dev/mapper/hana_data"} for rule in rules],
            "failed": [],
            "skipped": [],
            "remaining": [],
        }

    module.minion_ret = fixed_all  # a test replaces it: rules -> the minion's return

    def call_remediate(minion, rules):
        """The minion's answer to hana_storage.remediate: {minion: its return}, {} when silent."""
        module.remediate_calls.append({"minion": minion, "rules": rules})
        ret = module.minion_ret(rules)
        return {} if ret is None else {minion: ret}

    module._call_remediate = call_remediate
    return module


def test_genuine_violation_is_remediated_on_its_sender_only(runner, pki):
    data = signed(pki, "db1", {"tag": "violation", **finding()})
    result = runner.triage("salt/beacon/db1/hana_storage/violation", data)
    assert result["action"] == "remediated"
    assert runner.remediate_calls == [{"minion": "db1", "rules": ["HANA-PERF-002"]}]
    assert runner.fired[-1][0] == "hana/storage/remediation" and runner.fired[-1][1]["result"] == "fixed"


def test_forgeries_are_rejected(runner, pki):
    genuine = signed(pki, "db1", {"tag": "violation", **finding()})
    cases = {
        "names another minion": ("salt/beacon/db2/hana_storage/violation", genuine, "bad_signature"),
        "unsigned": ("salt/beacon/db1/hana_storage/violation", {**genuine, "sig": None}, "unsigned"),
        "tampered rule": (
            "salt/beacon/db1/hana_storage/violation",
            {**genuine, "rule": "HANA-KEY-001"},
            "bad_signature",
        ),
        "unknown minion": ("salt/beacon/ghost/hana_storage/violation", genuine, "unknown_minion"),
        "glob as id": ("salt/beacon/*/hana_storage/violation", genuine, "bad_minion_id"),
        "garbage signature": (
            "salt/beacon/db1/hana_storage/violation",
            {**genuine, "sig": "@@"},
            "bad_signature",
        ),
    }
    for name, (tag, data, code) in cases.items():
        result = runner.triage(tag, data)
        assert result["action"] == "rejected" and result["code"] == code, name
    replayed = signed(pki, "db1", {"tag": "violation", **finding()}, age=3600)
    assert runner.verify("salt/beacon/db1/hana_storage/violation", replayed)["code"] == "stale"
    assert runner.remediate_calls == []


def test_manual_rule_claimed_auto_only_alerts(runner, pki):
    data = signed(pki, "db1", {"tag": "violation", **finding("HANA-ENC-001"), "remediation": "auto"})
    assert runner.triage("salt/beacon/db1/hana_storage/violation", data)["action"] == "alerted"
    assert runner.remediate_calls == [] and runner.fired[-1][0] == "hana/storage/alert"


def test_flood_gets_one_action_per_minion_and_rule(runner, pki):
    """10,000 genuine events, triaged by 10 threads as the reactor's pool does: one remediation;
    the events that came while it ran find the occurrence held, the later ones handled."""
    from concurrent.futures import ThreadPoolExecutor

    runner.__opts__["hana_storage"] = {"cooldown": 300, "event_burst": 20_000}  # no rate limit here
    data = signed(pki, "db1", {"tag": "violation", **finding()})
    with ThreadPoolExecutor(10) as pool:
        actions = list(
            pool.map(
                lambda _: runner.triage("salt/beacon/db1/hana_storage/violation", data)["action"],
                range(10_000),
            )
        )
    assert actions.count("remediated") == 1
    assert actions.count("duplicate") + actions.count("held") == 9_999 and actions[-1] == "duplicate"
    other = signed(pki, "db2", {"tag": "violation", **finding()})
    assert runner.triage("salt/beacon/db2/hana_storage/violation", other)["action"] == "remediated"


@pytest.fixture
def two_masters(runner, redis_url):
    """Two masters' triage (own module, own id, own connections) sharing one real Redis store."""
    prefix = f"two-masters-{time.monotonic_ns()}:"
    masters = []
    for name in ("hot-a", "hot-b"):
        master = load("_runners/hana_storage.py", f"runner_{name}")
        for attribute in ("_call_remediate", "minion_ret", "remediate_calls"):
            setattr(master, attribute, getattr(runner, attribute))
        record_fired(master)
        settings = {
            "cooldown": 300,
            "lease": 1,
            "store": {"driver": "redis", "url": redis_url, "prefix": prefix},
        }
        master.__opts__ = {**runner.__opts__, "id": name, "hana_storage": settings}
        masters.append(master)
    return masters


def test_hot_masters_act_once_on_what_both_receive(two_masters, pki):
    """Hot multi-master: each beacon event reaches both masters (one beacon per connection, the
    same occurrence: same key and since). Every rule on two minions, both masters triaging
    everything in 8 threads each: one alert or remediation per finding across the two."""
    from concurrent.futures import ThreadPoolExecutor

    work = []
    for minion in ("db1", "db2"):
        for rule in rules.RULES:
            data = violation(pki, minion, finding(rule), time.time() - 5)
            work += [(master, minion, data) for master in two_masters]
    with ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(lambda w: w[0].triage(f"salt/beacon/{w[1]}/hana_storage/violation", w[2]), work)
        )
    findings = 2 * len(rules.RULES)
    acted = [r for r in results if r["action"] in ("alerted", "remediated")]
    assert len(acted) == findings and len({(r["minion"], r["rule"]) for r in acted}) == findings, results
    assert {r["action"] for r in results} <= {"alerted", "remediated", "duplicate", "held"}
    outcomes = ("hana/storage/alert", "hana/storage/remediation")
    assert len([d for m in two_masters for t, d in m.fired if t in outcomes]) == findings
    tallies = two_masters[0]._store().tallies()
    assert tallies == two_masters[1]._store().tallies() and sum(tallies.values()) == findings


def test_a_master_that_dies_holding_an_occurrence_is_taken_over(two_masters, pki):
    """Master a claims an occurrence and dies before acting: master b's copy of the event finds
    it held, and once a's lease has run out (1 s here) b acts on it, the cooldown a started
    notwithstanding; a's late completion (had it lived) is not counted twice."""
    a, b = two_masters
    tag = "salt/beacon/db1/hana_storage/violation"
    data = violation(pki, "db1", finding("HANA-ENC-001"), time.time() - 5)
    claim = a._claim("db1", "HANA-ENC-001", events.finding_key(finding("HANA-ENC-001")), data["ts"])
    assert claim["verdict"] == "act"  # ... and a dies here
    held = b.triage(tag, data)
    assert held["action"] == "held" and 0 < held["retry_in"] <= 1, held
    assert b.fired == []
    time.sleep(held["retry_in"] + 0.05)
    assert b.triage(tag, data)["action"] == "alerted"
    assert b.triage(tag, data)["action"] == "duplicate"
    key = events.finding_key(finding("HANA-ENC-001"))
    assert a._complete("db1", "HANA-ENC-001", key, data["ts"], "alerted", []) is False
    assert b._store().tallies() == {"alerted|HANA-ENC-001": 1}


def test_a_remediation_outlasting_its_lease_keeps_it(two_masters, pki):
    """A remediation waits seconds for the minion; its master renews the lease meanwhile,
    so the other master's copy of the event waits instead of fixing the same thing again."""
    a, b = two_masters
    tag = "salt/beacon/db1/hana_storage/violation"
    data = violation(pki, "db1", finding("HANA-PERF-002"), time.time() - 5)
    slow = a._call_remediate
    a._call_remediate = lambda minion, rules: time.sleep(2.5) or slow(minion, rules)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        fixing = pool.submit(a.triage, tag, data)
        time.sleep(1.5)  # past the 1 s lease
        assert b.triage(tag, data)["action"] == "held"
        assert fixing.result()["action"] == "remediated"
    assert b.triage(tag, data)["action"] == "duplicate"
    assert len(a.remediate_calls) == 1


def test_a_store_lost_after_the_claim_is_logged_and_the_outcome_stands(runner, pki, caplog):
    """The fix was made; recording it failed: its event goes on the bus all the same, triage says
    what it did, and the claim's lease runs out (acted on twice rather than forgotten)."""
    real, calls = runner._store(), []

    class Failing:
        def update(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise store.StoreError("the redis store: connection lost")
            return real.update(*args, **kwargs)

    runner._store = Failing
    result = runner.triage(
        "salt/beacon/db1/hana_storage/violation", violation(pki, "db1", finding(), time.time())
    )
    assert result["action"] == "remediated" and [t for t, _d in runner.fired] == ["hana/storage/remediation"]
    assert "handled but not recorded" in caplog.text


def test_an_unreachable_store_acts_on_nothing_and_says_so(runner, pki):
    runner.__opts__["hana_storage"] = {"store": {"driver": "redis", "url": "redis://127.0.0.1:1/0"}}
    result = runner.triage(
        "salt/beacon/db1/hana_storage/violation", violation(pki, "db1", finding(), time.time())
    )
    assert result["action"] == "store-failed" and "redis store" in result["reason"], result
    assert runner.fired == [] and runner.remediate_calls == []


def test_cooldown_survives_a_reload_and_ends(runner, pki):
    """The reactor's runner module reloaded (or the master restarted): still in cooldown."""
    tag = "salt/beacon/db1/hana_storage/violation"
    assert runner.triage(tag, violation(pki, "db1", finding(), time.time() - 9))["action"] == "remediated"
    again = load("_runners/hana_storage.py", "runner_reloaded")
    for name in ("__opts__", "_call_remediate", "_fire"):
        setattr(again, name, getattr(runner, name))
    drifted_again = violation(pki, "db1", finding(), time.time())  # the same finding, a new occurrence
    assert again.triage(tag, drifted_again)["action"] == "cooldown"
    record = Path(runner.__opts__["cachedir"]) / "hana_storage" / "actions" / "db1@HANA-PERF-002"
    record.write_text(repr(time.time() - 301))  # the cooldown (300 s) has passed; an older record's form
    assert again.triage(tag, drifted_again)["action"] == "remediated"


def test_the_audit_event_handles_a_lost_reaction_once(runner, pki):
    """Salt's reactor lost the reaction to one violation: the minion's next audit event lists the
    finding as open since that violation, and triage alerts on it then - and on nothing twice."""
    tag, now = "salt/beacon/db1/hana_storage/", time.time()
    alerted, lost = finding("HANA-ENC-001"), finding("HANA-MOUNT-001", "log", "/dev/mapper/hana_log")
    assert runner.triage(tag + "violation", violation(pki, "db1", alerted, now - 100))["action"] == "alerted"
    summary = audit(pki, "db1", [(alerted, now - 100), (lost, now - 99)])
    result = runner.triage(tag + "audit", summary)
    assert result["action"] == "reconciled"
    assert [(r["rule"], r["action"]) for r in result["findings"]] == [
        ("HANA-ENC-001", "duplicate"),
        ("HANA-MOUNT-001", "alerted"),
    ]
    alert = runner.fired[-1][1]
    assert runner.fired[-1][0] == "hana/storage/alert" and alert["via"] == "audit"
    assert (alert["volume"], alert["mountpoint"], alert["device"]) == (
        "log",
        "/hana/log",
        "/dev/mapper/hana_log",
    )
    assert {r["action"] for r in runner.triage(tag + "audit", summary)["findings"]} == {"duplicate"}
    late = violation(pki, "db1", lost, now - 99)  # the lost event after all (a replay, or late)
    assert runner.triage(tag + "violation", late)["action"] == "duplicate"
    assert [t for t, _ in runner.fired].count("hana/storage/alert") == 2
    forged = {**summary, "since": {events.finding_key(finding("HANA-ENC-003")): 1.0}}
    assert runner.triage(tag + "audit", forged)["action"] == "rejected"


def cooldown_passed(runner, minion, rule):
    """Move the cooldowns of a local record 301 s back: the runner's 300 s have passed."""
    record = Path(runner.__opts__["cachedir"]) / "hana_storage" / "actions" / f"{minion}@{rule}"
    stored = json.loads(record.read_text())
    record.write_text(
        json.dumps({**stored, "cooldown": {k: at - 301 for k, at in stored["cooldown"].items()}})
    )


def test_a_manual_finding_is_alerted_whatever_the_cooldown(runner, pki):
    """Regression (issue 29, item 7): the cooldown was per minion and rule, so a HANA-KEY-005 alert
    on one volume made the same rule on another volume, 5 s later, a ``cooldown``: not recorded,
    and never alerted if gone by the next full audit. A manual finding is alerted every
    occurrence (a repeated event of one occurrence stays a duplicate)."""
    tag, now = "salt/beacon/db1/hana_storage/", time.time()
    log = finding("HANA-KEY-005", "hana_log_0", "/dev/mapper/hana_log_0")
    data = finding("HANA-KEY-005", "hana_data", "/dev/mapper/hana_data")
    assert runner.triage(tag + "violation", violation(pki, "db1", log, now - 10))["action"] == "alerted"
    assert runner.triage(tag + "violation", violation(pki, "db1", data, now - 5))["action"] == "alerted"
    assert runner.triage(tag + "violation", violation(pki, "db1", data, now - 5))["action"] == "duplicate"
    again = violation(pki, "db1", log, now)  # the same finding again: a new occurrence
    assert runner.triage(tag + "violation", again)["action"] == "alerted"
    alerts = [d["volume"] for t, d in runner.fired if t == "hana/storage/alert"]
    assert alerts == ["hana_log_0", "hana_data", "hana_log_0"]


def test_a_remediation_cools_down_its_finding_only(runner, pki):
    """One auto rule on two volumes: both fixed at once. The same finding again within the
    cooldown waits, and a later audit event fixes it once the cooldown has passed."""
    tag, now = "salt/beacon/db1/hana_storage/", time.time()
    data, log = finding("HANA-PERF-002"), finding("HANA-PERF-002", "log", "/dev/mapper/hana_log")
    assert runner.triage(tag + "violation", violation(pki, "db1", data, now - 100))["action"] == "remediated"
    assert runner.triage(tag + "violation", violation(pki, "db1", log, now - 98))["action"] == "remediated"
    assert runner.triage(tag + "violation", violation(pki, "db1", data, now - 50))["action"] == "cooldown"
    summary = audit(pki, "db1", [(data, now - 50), (log, now - 98)])
    assert [r["action"] for r in runner.triage(tag + "audit", summary)["findings"]] == [
        "cooldown",
        "duplicate",
    ]
    cooldown_passed(runner, "db1", "HANA-PERF-002")
    assert [r["action"] for r in runner.triage(tag + "audit", summary)["findings"]] == [
        "duplicate",  # the log volume's (a remediation's result comes after the others)
        "remediated",
    ]
    assert [c["minion"] for c in runner.remediate_calls] == ["db1"] * 3


def test_an_audit_event_remediates_its_auto_findings_in_one_call(runner, pki):
    tag = "salt/beacon/db1/hana_storage/audit"
    flags, crypttab = finding("HANA-PERF-002"), finding("HANA-PERSIST-001")
    result = runner.triage(
        tag, audit(pki, "db1", [(flags, 5.0), (crypttab, 6.0), (finding("HANA-ENC-002"), 7.0)])
    )
    assert sorted(r["action"] for r in result["findings"]) == ["alerted", "remediated", "remediated"]
    assert runner.remediate_calls == [{"minion": "db1", "rules": ["HANA-PERF-002", "HANA-PERSIST-001"]}]
    assert runner.triage(tag, audit(pki, "db1", []))["findings"] == []


def test_open_findings_skips_what_does_not_parse():
    good = events.finding_key(finding())
    audit_data = {
        "since": {good: 5.0, "no-bars": 1.0, 7: 1.0, good.replace("data", "log"): "yesterday", "a|b|c": True},
        "volumes": {"data": {"mountpoint": "/hana/data"}, "log": "garbage"},
    }
    assert [(f["key"], f["since"], f["mountpoint"]) for f in events.open_findings(audit_data)] == [
        (good, 5.0, "/hana/data")
    ]
    for bad in (None, [], {"since": []}, {"since": {good: 1.0}, "volumes": []}):
        assert [f["mountpoint"] for f in events.open_findings(bad)] in ([], [None])


def test_an_alert_the_bus_refused_is_put_on_it_again_when_due(runner, pki, monkeypatch):
    """A busy master refuses fire_event's connection (it returns False): triage tries again; an
    alert that never left stays in the outbox and goes on the bus once it is due, with its
    event_id, and the occurrence is not alerted a second time."""
    fresh = load("_runners/hana_storage.py", "runner_firing")
    for name in ("__opts__", "_call_remediate"):
        setattr(fresh, name, getattr(runner, name))
    fresh.__opts__ = {**runner.__opts__, "hana_storage": {"cooldown": 300, "lease": 0.5}}
    monkeypatch.setattr(fresh.time, "sleep", lambda seconds: None)
    tries, sent = [], []

    def send(tag, data):
        if tag == fresh.TRIAGED_TAG:
            return True
        tries.append(tag)
        return len(tries) > 2 and not sent.append((tag, data))

    monkeypatch.setattr(fresh, "_send", send)
    tag, first = (
        "salt/beacon/db1/hana_storage/violation",
        violation(pki, "db1", finding("HANA-ENC-001"), time.time()),
    )
    assert fresh.triage(tag, first)["action"] == "alerted"
    assert tries == ["hana/storage/alert"] * 3 and len(sent) == 1, "retried until the bus took it"
    assert fresh.redeliver() == 0, "delivered without the engine: confirmed"

    monkeypatch.setattr(fresh, "_send", lambda tag, data: tag == fresh.TRIAGED_TAG)
    other = violation(pki, "db2", finding("HANA-ENC-001"), time.time())
    assert fresh.triage("salt/beacon/db2/hana_storage/violation", other)["action"] == "alerted"
    assert fresh.redeliver() == 0, "not due yet: its master may still deliver it"
    monkeypatch.setattr(fresh, "_send", send)
    real_sleep(0.6)
    assert fresh.redeliver() == 1
    (_tag, again) = sent[-1]
    assert (again["minion"], again["rule"]) == ("db2", "HANA-ENC-001") and again["event_id"]
    assert fresh.triage("salt/beacon/db2/hana_storage/violation", other)["action"] == "duplicate"
    real_sleep(0.6)
    assert fresh.redeliver() == 0, "confirmed: the bus took it"


def test_what_a_master_decided_before_it_died_reaches_the_other_masters_bus(two_masters, pki, tmp_path):
    """Regression (issue 17): master a recorded an alert and died before its bus carried it; the
    store held it as handled, so master b found a duplicate and nobody was alerted. Now the
    alert is in the outbox with its record: b puts it on its bus once it is due (the lease, 1 s
    here), once, with the event_id a gave it."""
    a, b = two_masters
    for master in (a, b):  # each with its triage engine running, which confirms what its bus carries
        sock_dir = tmp_path / master.__opts__["id"]
        sock_dir.mkdir()
        (sock_dir / master.ENGINE_SOCKET).touch()
        master.__opts__ = {**master.__opts__, "sock_dir": str(sock_dir)}
    a._deliver = lambda events, **how: None  # a dies right after the store's change
    tag = "salt/beacon/db1/hana_storage/violation"
    data = violation(pki, "db1", finding("HANA-ENC-001"), time.time())
    assert a.triage(tag, data)["action"] == "alerted" and a.fired == []
    assert b.triage(tag, data)["action"] == "duplicate"
    assert b.redeliver() == 0, "not due: a may still deliver it"
    time.sleep(1.1)
    assert b.redeliver() == 1 and a.redeliver() == 0, "claimed by one master"
    ((fired_tag, alert),) = b.fired
    assert (fired_tag, alert["minion"], alert["rule"], alert["remediation"]) == (
        "hana/storage/alert",
        "db1",
        "HANA-ENC-001",
        "manual",
    )
    assert len(alert["event_id"]) == 32
    time.sleep(1.1)
    assert a.redeliver() == b.redeliver() == 0, "sent again once: confirmed when b's bus took it"
    assert b._store().tallies() == {"alerted|HANA-ENC-001": 1}


def test_with_the_engine_a_first_send_waits_for_the_bus_to_confirm_it(two_masters, pki, tmp_path):
    """The engine confirms what its bus carried; a fire the bus took is not yet a delivery (the
    master's publisher may die holding it), so until then the event stays in the outbox."""
    a, _b = two_masters
    (tmp_path / a.ENGINE_SOCKET).touch()
    a.__opts__ = {**a.__opts__, "sock_dir": str(tmp_path)}
    tag = "salt/beacon/db1/hana_storage/violation"
    assert a.triage(tag, violation(pki, "db1", finding("HANA-ENC-001"), time.time()))["action"] == "alerted"
    ((_tag, alert),) = a.fired
    assert a._store().overdue() == [], "not due yet"
    time.sleep(1.1)
    (pending,) = a._store().overdue()
    assert pending["event_id"] == alert["event_id"]


def test_only_the_masters_own_outbox_events_confirm_delivery(firing, pki):
    """The triage engine confirms what its bus carried; a minion can put any tag on the bus, so
    an event the master did not sign confirms nothing (it would silence a pending alert)."""
    alert = {"minion": "db1", "rule": "HANA-ENC-001", "severity": "critical", "remediation": "manual"}
    assert firing._fire("hana/storage/alert", {**alert, "event_id": "f" * 32})
    ((tag, genuine),) = firing.sent
    assert firing.delivered(tag, genuine) is True
    for forged in ({**genuine, "sig": None}, {**genuine, "event_id": "0" * 32}, {**genuine, "sig": "@@"}):
        assert firing.delivered(tag, forged) is False
    assert firing.delivered("hana/storage/triaged", genuine) is False
    assert firing.delivered(tag, {k: v for k, v in genuine.items() if k != "event_id"}) is False


# ---- only a verified fix counts (issue 13, defect 10) ----------------------------------------------------

KEY_FILE = "/etc/hana-storage/keys/hana.key"


def key_finding():
    return finding("HANA-KEY-001", "data", KEY_FILE)


def minion_entry(code=None):
    entry = {"rule": "HANA-KEY-001", "volume": "data", "device": KEY_FILE}
    return {**entry, "code": code, "reason": f"in words: {code}"} if code else entry


def remediate_ret(fixed=(), failed=(), skipped=(), remaining=()):
    return {
        "result": not failed and not skipped and not remaining,
        "fixed": list(fixed),
        "failed": list(failed),
        "skipped": list(skipped),
        "remaining": list(remaining),
    }


def claimed_success(ret):
    """What remediate() returned before issue 13: result True whenever no fix had failed."""
    return {**ret, "result": True}


NOT_FIXED = {
    "remediation disabled in the minion's pillar": (
        lambda rules: claimed_success(
            remediate_ret(skipped=[minion_entry("not_allowed")], remaining=[key_finding()])
        ),
        ("not-fixed", "not_allowed"),
    ),
    "the rule not in the minion's list, an older minion (no code)": (
        lambda rules: claimed_success(
            remediate_ret(skipped=[{**minion_entry(), "reason": "not allowed"}], remaining=[key_finding()])
        ),
        ("not-fixed", "skipped"),
    ),
    "fixed, but its re-audit still finds it": (
        lambda rules: remediate_ret(fixed=[minion_entry()], remaining=[key_finding()]),
        ("not-fixed", "still_open"),
    ),
    "the fix failed": (
        lambda rules: remediate_ret(failed=[minion_entry()], remaining=[key_finding()]),
        ("failed", "fix_failed"),
    ),
    "the minion did not answer": (lambda rules: None, ("failed", "no_return")),
    "not a remediate() return": (
        lambda rules: "'hana_storage.remediate' is not available.",
        ("failed", "no_return"),
    ),
    "an error dict, not the four lists": (lambda rules: {"result": True}, ("failed", "no_return")),
}


@pytest.mark.parametrize("case", sorted(NOT_FIXED))
def test_only_a_verified_fix_counts_anything_else_alerts_and_is_released(runner, pki, case):
    """Regression (issue 13, defect 10): triage claimed the occurrence, then reported `fixed`
    whenever remediate() said result True - also when it had skipped everything - and a high
    finding got no alert, and `duplicate` forever after."""
    minion_ret, (result, reason) = NOT_FIXED[case]
    runner.minion_ret = minion_ret
    tag, since = "salt/beacon/db1/hana_storage/violation", time.time() - 5
    event = violation(pki, "db1", key_finding(), since)
    outcome = runner.triage(tag, event)
    assert outcome["action"] == "remediation-failed", outcome
    assert (outcome["result"], outcome["reason"]) == (result, reason)
    fired = dict(runner.fired)
    assert (fired["hana/storage/remediation"]["result"], fired["hana/storage/remediation"]["reason"]) == (
        result,
        reason,
    )
    alert = fired["hana/storage/alert"]
    assert (alert["minion"], alert["rule"], alert["severity"], alert["device"]) == (
        "db1",
        "HANA-KEY-001",
        "high",
        KEY_FILE,
    )
    assert (alert["result"], alert["reason"], alert["remediation"]) == (result, reason, "auto")
    # released: the same occurrence is not a duplicate; the alert keeps the finding's cooldown
    assert runner.triage(tag, event)["action"] == "cooldown"
    cooldown_passed(runner, "db1", "HANA-KEY-001")
    again = runner.triage("salt/beacon/db1/hana_storage/audit", audit(pki, "db1", [(key_finding(), since)]))
    assert [r["action"] for r in again["findings"]] == ["remediation-failed"]
    assert len(runner.remediate_calls) == 2
    assert [t for t, _ in runner.fired].count("hana/storage/alert") == 2


def test_a_call_that_failed_alerts_and_is_released(runner, pki):
    def raises(minion, rules):
        raise TimeoutError("the master's job cache timed out")

    for call, detail in ((raises, "timed out"), (lambda minion, rules: None, "not a mapping")):
        runner._call_remediate = call
        runner.fired.clear()
        data = violation(pki, "db1", key_finding(), time.time())
        outcome = runner.triage("salt/beacon/db1/hana_storage/violation", data)
        assert (outcome["action"], outcome["result"], outcome["reason"]) == (
            "remediation-failed",
            "failed",
            "call_failed",
        )
        assert detail in outcome["detail"]
        assert [t for t, _ in runner.fired] == ["hana/storage/remediation", "hana/storage/alert"]
        record = Path(runner.__opts__["cachedir"]) / "hana_storage" / "actions" / "db1@HANA-KEY-001"
        record.write_text("{}")  # past the cooldown for the next case


def test_a_verified_fix_and_nothing_to_fix_are_done_without_an_alert(runner, pki):
    tag = "salt/beacon/db1/hana_storage/audit"
    flags, header = finding("HANA-PERF-002"), finding("HANA-PERF-003")
    # the fix of the flags (cryptsetup refresh --persistent) fixed the header flags too: when
    # PERF-003's remediation runs, the minion's audit finds nothing of it to fix
    runner.minion_ret = lambda rules: remediate_ret(
        fixed=[{"rule": "HANA-PERF-002", "volume": "data", "device": "/dev/mapper/hana_data"}]
    )
    result = runner.triage(tag, audit(pki, "db1", [(flags, 5.0), (header, 6.0)]))
    assert sorted((r["rule"], r["action"], r["result"], r["reason"]) for r in result["findings"]) == [
        ("HANA-PERF-002", "remediated", "fixed", "verified"),
        ("HANA-PERF-003", "remediated", "absent", "not_found"),
    ]
    assert [t for t, _ in runner.fired] == ["hana/storage/remediation"] * 2
    assert {d["rule"]: d["result"] for _, d in runner.fired} == {
        "HANA-PERF-002": "fixed",
        "HANA-PERF-003": "absent",
    }
    assert {
        r["action"] for r in runner.triage(tag, audit(pki, "db1", [(flags, 5.0), (header, 6.0)]))["findings"]
    } == {"duplicate"}


def remediation_plan(policy):
    """A plan with one volume, enough for every fix in the rule table to find its arguments."""
    volume = {
        "name": "data",
        "mountpoint": "/hana/data",
        "key": {
            "file": KEY_FILE,
            "source": "keyfile",
            "store": "keyfile",
            "pillar": None,
            "crypttab": KEY_FILE,
        },
        "crypt": [{"name": "hana_data", "device": "/dev/vg_hana_data/lv_hana_data"}],
        "crypttab_options": ["luks"],
        "fs_device": "/dev/mapper/hana_data",
        "mount_options": ["noatime"],
        "fstab_options": ["noatime"],
    }
    return {
        "compliance": {"remediation": policy},
        "luks": {"flags": pillar.crypt_flags({"perf": {"no_read_workqueue": True}})},
        "volumes": {"data": volume},
    }


@pytest.fixture
def module(monkeypatch, tmp_path):
    """The execution module's remediate() on a made-up audit: one HANA-KEY-001 finding, fixed by
    its state unless the test says otherwise."""
    module = load("_modules/hana_storage.py", "module_under_test")
    module.__context__ = {}
    module.__opts__ = {"cachedir": str(tmp_path)}
    module.policy = {"enabled": True, "rules": ["HANA-KEY-001", "HANA-PERSIST-002", "HANA-PERF-002"]}
    module.findings = [key_finding()]
    module.after_fix = []
    module.fixes, module.fixed_since_audit = [], False

    def audit_of(plan, facts):
        """The findings, or after a fix the findings it left (``after_fix``)."""
        found = module.after_fix if module.fixed_since_audit else module.findings
        module.fixed_since_audit = False
        volumes = {"data": {"mounted": False}}
        return {"findings": found, "volumes": volumes, "compliant": not found}

    monkeypatch.setattr(module.core.rules, "audit", audit_of)
    monkeypatch.setattr(module, "_plan", lambda pillar=None: remediation_plan(module.policy))

    def single(fun, name, test=None, queue=None, **kwargs):
        """As Salt's state.single takes its arguments: ``pillar`` (and the others of
        STATE_SINGLE_OWN) are its own, never the state's."""
        taken = sorted(set(kwargs) & STATE_SINGLE_OWN)
        if taken:
            return f"state.single took {taken} as its own arguments"  # what Salt's error amounts to
        module.fixes.append((fun, {"name": name, **kwargs}))
        module.fixed_since_audit = True
        return {"x": {"result": True, "changes": {"mode": "0400"}, "comment": "fixed"}}

    module.__salt__ = {
        "state.single": single,
        "state.running": lambda: [],
        "hana_storage_host.facts": lambda plan: {},
    }
    return module


# The keyword arguments Salt's state.single keeps for itself (salt/modules/state.py: the pillar
# override, the environments and options get_sls_opts reads, and the low chunk's own keys):
# a state argument of one of these names never reaches the state.
STATE_SINGLE_OWN = frozenset(
    {"pillar", "pillar_enc", "saltenv", "pillarenv", "localconfig", "test", "queue", "concurrent"}
    | {"state", "fun", "__id__", "__pub_jid"}
)


def test_no_fix_of_the_rule_table_passes_an_argument_state_single_keeps_for_itself():
    """Regression (issue 29, item 14): the HANA-KEY-001 fix handed key_present its ``pillar``
    argument through state.single, whose own ``pillar`` is a pillar override: every remediation
    failed with "Pillar data must be formatted as a dictionary"."""
    taken = {rule: sorted(set(r.fix.args) & STATE_SINGLE_OWN) for rule, r in rules.RULES.items() if r.fix}
    assert {rule: names for rule, names in taken.items() if names} == {}


def test_remediate_is_true_only_when_nothing_asked_for_is_left(module):
    """Regression (issue 13, defect 10): remediate() said result True when it had skipped every
    finding (remediation disabled in the pillar, or the rule not in its list)."""
    module.policy = {"enabled": False, "rules": ["HANA-KEY-001"]}
    ret = module.remediate(rules=["HANA-KEY-001"])
    assert ret["result"] is False and module.__context__["retcode"] == 1
    assert [(e["rule"], e["code"]) for e in ret["skipped"]] == [("HANA-KEY-001", "not_allowed")]
    assert [f["rule"] for f in ret["remaining"]] == ["HANA-KEY-001"] and module.fixes == []


def test_remediate_names_a_code_for_each_skip_and_counts_what_remains(module):
    module.policy = {"enabled": True, "rules": ["HANA-PERF-002"]}
    ret = module.remediate(rules="HANA-KEY-001")  # allowed rules: KEY-001 not among them
    assert [e["code"] for e in ret["skipped"]] == ["not_allowed"] and ret["result"] is False
    module.findings = [finding("HANA-ENC-001")]
    assert [e["code"] for e in module.remediate(rules="HANA-ENC-001")["skipped"]] == ["manual_rule"]
    ret = module.remediate()  # by default every auto rule: a manual finding is not asked for
    assert ret["skipped"] == [] and ret["remaining"] == [] and ret["result"] is True
    module.findings, module.policy["rules"] = [finding("HANA-PERSIST-002")], ["HANA-PERSIST-002"]
    assert [e["code"] for e in module.remediate()["skipped"]] == ["not_mounted"]
    # a crypt device the plan does not manage: no state of the formula may touch it
    module.findings = [finding("HANA-PERF-002", device="/dev/mapper/someone_elses")]
    module.policy["rules"] = ["HANA-PERF-002"]
    ret = module.remediate(rules=["HANA-PERF-002"])
    assert [e["code"] for e in ret["skipped"]] == ["no_fix"] and ret["result"] is False
    assert module.fixes == []


def test_remediate_calls_the_state_the_rule_table_names_with_the_plans_arguments(module):
    module.policy = {"enabled": True}
    module.findings = [finding("HANA-PERF-002"), finding("HANA-PERF-003"), key_finding()]
    ret = module.remediate()
    assert ret["result"] is True and [e["rule"] for e in ret["fixed"]] == [
        "HANA-PERF-002",
        "HANA-PERF-003",
        "HANA-KEY-001",
    ]
    assert ret["fixed"][1]["changes"] == "fixed with an earlier finding"  # one refresh fixes both
    assert module.fixes == [
        (
            "hana_storage.luks_flags",
            {
                "name": "hana_data",
                "device": "/dev/vg_hana_data/lv_hana_data",
                "key_file": KEY_FILE,
                "flags": pillar.crypt_flags({"perf": {"no_read_workqueue": True}}),
            },
        ),
        ("hana_storage.key_present", {"name": KEY_FILE, "source": "keyfile", "pillar_path": None}),
    ]


def test_remediate_by_default_allows_every_rule_with_a_fix(module):
    """The allow-list's default is derived from the rule table, not written out a second time."""
    module.policy = {"enabled": True}  # what parameters/defaults.yaml gives
    module.findings = [key_finding()]
    assert module.remediate()["result"] is True
    assert [fun for fun, _ in module.fixes] == ["hana_storage.key_present"]


def test_remediate_counts_a_fix_once_its_re_audit_finds_it_no_more(module):
    module.after_fix = [key_finding()]  # the state said it fixed it; the audit after it disagrees
    ret = module.remediate(rules=["HANA-KEY-001"])
    assert [e["rule"] for e in ret["fixed"]] == ["HANA-KEY-001"] and ret["remaining"] == [key_finding()]
    assert ret["result"] is False
    module.__context__.clear()
    module.after_fix = []
    ret = module.remediate(rules=["HANA-KEY-001"])
    assert ret["result"] is True and ret["remaining"] == [] and "retcode" not in module.__context__


# ---- the exporter ----------------------------------------------------------------------------------------


@pytest.fixture
def exporter():
    module = load("_engines/hana_storage_exporter.py", "exporter_under_test")
    registry = CollectorRegistry()
    return module, module.Metrics(registry), registry


def test_exporter_serves_the_tallies_of_triages_store(exporter, caplog):
    """Every master sharing a store serves the same actions, read at each scrape; a store that
    cannot be read leaves the series out and says why in the log."""
    module, _metrics, registry = exporter
    tallies = {"alerted|HANA-ENC-001": 2, "remediated|HANA-PERF-002": 1}
    reads = []

    def read():
        reads.append(1)
        if len(reads) > 1:
            raise store.StoreError("the redis store: down")
        return tallies

    registry.register(module.StoreTallies(read))
    text = generate_latest(registry).decode()
    assert 'hana_storage_triage_actions_total{action="alerted",rule="HANA-ENC-001"} 2.0' in text
    assert 'hana_storage_triage_actions_total{action="remediated",rule="HANA-PERF-002"} 1.0' in text
    assert "hana_storage_triage_actions_total{" not in generate_latest(registry).decode()
    assert "triage's store could not be read" in caplog.text


def test_exporter_follows_findings(exporter):
    module, metrics, registry = exporter
    audit = events.audit_event(
        {
            "compliant": True,
            "findings": [],
            "volumes": {"data": {"compliant": True, "rules": [], "mountpoint": "/hana/data"}},
        },
        "full",
        0.1,
        1000.0,
        {},
    )
    module.handle(metrics, "salt/beacon/db1/hana_storage/audit", audit)
    violation = events.finding_event("violation", finding(), "uevent", 1001.0)
    module.handle(metrics, "salt/beacon/db1/hana_storage/violation", violation)
    text = generate_latest(registry).decode()
    assert 'hana_storage_compliant{minion="db1",volume="data"} 0.0' in text
    assert 'hana_storage_findings{minion="db1",rule="HANA-PERF-002",severity="medium"} 1.0' in text
    assert 'hana_storage_violations_total{minion="db1",rule="HANA-PERF-002",severity="medium"} 1.0' in text
    module.handle(
        metrics,
        "salt/beacon/db1/hana_storage/resolved",
        events.finding_event("resolved", finding(), "uevent", 1002.0),
    )
    module.handle(
        metrics, "hana/storage/remediation", {"minion": "db1", "rule": "HANA-PERF-002", "result": "fixed"}
    )
    text = generate_latest(registry).decode()
    assert 'hana_storage_compliant{minion="db1",volume="data"} 1.0' in text
    assert 'hana_storage_findings{minion="db1",rule="HANA-PERF-002",severity="medium"} 0.0' in text
    assert 'hana_storage_remediations_total{minion="db1",result="fixed",rule="HANA-PERF-002"} 1.0' in text
    assert 'hana_storage_last_audit_timestamp_seconds{minion="db1"} 1000.0' in text


def test_exporter_counts_the_open_findings_it_does_not_keep(exporter, monkeypatch, caplog):
    """Beyond MAX_OPEN_FINDINGS a minion's new findings are not kept: counted per minion, logged
    at most once per interval; what is kept still drives its series, a key named again or
    resolved included; the volume of one not kept is not compliant until an audit event starts
    over from what it lists."""
    module, metrics, registry = exporter
    monkeypatch.setattr(limits, "MAX_OPEN_FINDINGS", 2)
    violated = "salt/beacon/db1/hana_storage/violation"
    for volume in ("data", "log", "log", "shared"):
        data = events.finding_event("violation", finding("HANA-ENC-001", volume), "uevent", 1.0)
        module.handle(metrics, violated, data)
    assert len(metrics.open["db1"]) == 2
    assert series(registry, "hana_storage_findings_held_back_total") == {(("minion", "db1"),): 1.0}
    assert caplog.text.count("more not kept") == 1
    findings = series(registry, "hana_storage_findings")
    assert findings == {(("minion", "db1"), ("rule", "HANA-ENC-001"), ("severity", "critical")): 2.0}
    resolved = events.finding_event("resolved", finding("HANA-ENC-001", "log"), "uevent", 2.0)
    module.handle(metrics, "salt/beacon/db1/hana_storage/resolved", resolved)
    compliant = {dict(k)["volume"]: v for k, v in series(registry, "hana_storage_compliant").items()}
    assert compliant == {"data": 0.0, "log": 1.0, "shared": 0.0}
    report = {
        "compliant": False,
        "findings": [finding("HANA-ENC-001", v) for v in ("a", "b", "c")],
        "volumes": {},
    }
    audit = events.audit_event(
        report, "full", 0.1, 3.0, {events.finding_key(f): 1.0 for f in report["findings"]}
    )
    module.handle(metrics, "salt/beacon/db1/hana_storage/audit", audit)
    assert sorted(v for v, _r, _s in metrics.open["db1"].found.values()) == ["a", "b"]
    assert not metrics.open["db1"].failing("shared") and metrics.open["db1"].failing("c")
    assert series(registry, "hana_storage_findings_held_back_total") == {(("minion", "db1"),): 2.0}
    long = {**events.finding_event("violation", finding("HANA-PERF-002"), "uevent", 4.0), "key": "k" * 10**6}
    module.handle(metrics, "salt/beacon/db2/hana_storage/violation", long)
    assert all(len(key) <= limits.MAX_FINDING_KEY for key in metrics.open["db2"].found)
    with pytest.raises(ValueError):
        module.handle(metrics, "salt/beacon/db2/hana_storage/violation", {**long, "key": ["a"]})


def test_exporter_counts_an_outcome_sent_again_once(exporter):
    """Triage sends an outbox event again, with its event_id, when no bus carried it in time: it
    is one alert, not two; another alert for the same finding is another one."""
    module, metrics, registry = exporter
    alert = {"minion": "db1", "rule": "HANA-ENC-001", "event_id": "a" * 32}
    for data in (alert, alert, {**alert, "event_id": "b" * 32}, {"minion": "db1", "rule": "HANA-ENC-001"}):
        module.handle(metrics, "hana/storage/alert", data)
    assert (
        'hana_storage_alerts_total{minion="db1",rule="HANA-ENC-001"} 3.0'
        in generate_latest(registry).decode()
    )


def test_exporter_reads_open_findings_by_the_key_the_beacon_made(exporter):
    """One place builds and reads a finding's key: a device path with '|' in it stays whole, and
    an audit event with a key that is not one changes no metric."""
    module, metrics, registry = exporter
    odd = dict(finding(), device="/dev/disk/by-id/odd|name")
    key = events.finding_key(odd)
    assert events.parse_finding_key(key) == {k: odd[k] for k in ("rule", "volume", "device")}
    report = {
        "compliant": False,
        "findings": [odd],
        "volumes": {"data": {"compliant": False, "rules": [odd["rule"]], "mountpoint": "/hana/data"}},
    }
    since = {key: 999.0}
    module.handle(
        metrics, "salt/beacon/db1/hana_storage/audit", events.audit_event(report, "full", 0.1, 1000.0, since)
    )
    before = generate_latest(registry).decode()
    assert 'hana_storage_findings{minion="db1",rule="HANA-PERF-002",severity="medium"} 1.0' in before
    bad = events.audit_event(report, "full", 0.1, 1001.0, since)
    bad["open"] = {"not a key": "high"}
    with pytest.raises(ValueError, match="not a finding key"):
        module.handle(metrics, "salt/beacon/db1/hana_storage/audit", bad)
    assert generate_latest(registry).decode() == before


def test_exporter_ignores_rejected_senders(exporter):
    module, metrics, registry = exporter
    violation = events.finding_event("violation", finding(), "uevent", 1.0)
    module.handle(
        metrics,
        "salt/beacon/db1/hana_storage/violation",
        violation,
        verify=lambda tag, data: {"code": "bad_signature", "reason": "x"},
    )
    text = generate_latest(registry).decode()
    assert 'hana_storage_rejected_events_total{reason="bad_signature"} 1.0' in text
    assert "hana_storage_violations_total{" not in text


# ---- the master's own events (issue 13, defect 12) --------------------------------------------------------


@pytest.fixture
def firing(runner, monkeypatch):
    """A runner whose _fire is the real one (signing included), its bus a list."""
    fresh = load("_runners/hana_storage.py", "runner_signing")
    for name in ("__opts__", "_call_remediate"):
        setattr(fresh, name, getattr(runner, name))
    fresh.sent = []
    monkeypatch.setattr(fresh, "_send", lambda tag, data: fresh.sent.append((tag, data)) or True)
    return fresh


def test_the_master_signs_what_it_fires_and_only_that_is_counted(firing, pki, exporter):
    """Regression (issue 13, defect 12): the exporter counted any hana/storage/remediation and
    hana/storage/alert, and a minion can fire those tags (event.send with a preload)."""
    module, metrics, registry = exporter
    alert = {"minion": "db1", "rule": "HANA-ENC-001", "severity": "critical", "remediation": "manual"}
    assert firing._fire("hana/storage/alert", alert)
    ((tag, genuine),) = firing.sent
    assert genuine.get("sig"), genuine  # the master signs what it fires
    assert abs(genuine["ts"] - time.time()) < 60
    assert salt.crypt.verify_signature(
        str(pki / "master.pub"),
        events.master_signed_bytes(tag, genuine),
        base64.b64decode(genuine["sig"]),
        algorithm=salt.crypt.PKCS1v15_SHA224,
    )
    assert firing.verify_master(tag, {**genuine, "_stamp": "2026-11-23T16:12:00"}) is None  # Salt's stamp
    remediation = {"minion": "db2", "rule": "HANA-PERF-002", "result": "failed", "ts": time.time()}
    as_master = beacon_events.sign_as_master(pki / "master.pem", "hana/storage/remediation", remediation)
    forged = {
        "unsigned, as event.send sends it": (
            "hana/storage/alert",
            {**alert, "id": "db2", "cmd": "_minion_event"},
        ),
        "a made-up signature": ("hana/storage/remediation", {**remediation, "sig": "AAAA"}),
        "not base64": ("hana/storage/remediation", {**remediation, "sig": "@@"}),
        "signed by a minion's key": (
            "hana/storage/remediation",
            beacon_events.sign_as_master(pki / "db2.pem", "hana/storage/remediation", remediation),
        ),
        "a genuine alert, its rule changed": ("hana/storage/alert", {**genuine, "rule": "HANA-ENC-003"}),
        "a genuine alert's signature under another tag": (
            "hana/storage/remediation",
            genuine,
        ),
        "a genuine remediation's fields under the alert tag": ("hana/storage/alert", as_master),
        "a genuine event replayed an hour later": (
            "hana/storage/remediation",
            beacon_events.sign_as_master(
                pki / "master.pem", "hana/storage/remediation", {**remediation, "ts": time.time() - 3600}
            ),
        ),
        "a genuine event with its ts removed": ("hana/storage/remediation", {**as_master, "ts": None}),
    }
    for name, (forged_tag, data) in forged.items():
        problem = firing.verify_master(forged_tag, data)
        assert problem and problem["code"] == "forged_master_event", name
        module.handle(metrics, forged_tag, data, verify_master=firing.verify_master)
    module.handle(metrics, tag, genuine, verify_master=firing.verify_master)
    module.handle(metrics, "hana/storage/remediation", as_master, verify_master=firing.verify_master)
    text = generate_latest(registry).decode()
    assert f'hana_storage_rejected_events_total{{reason="forged_master_event"}} {len(forged)}.0' in text
    assert 'hana_storage_alerts_total{minion="db1",rule="HANA-ENC-001"} 1.0' in text
    assert 'hana_storage_remediations_total{minion="db2",result="failed",rule="HANA-PERF-002"} 1.0' in text
    assert 'hana_storage_events_total{event="alert"} 1.0' in text
    assert 'hana_storage_events_total{event="remediation"} 1.0' in text
    counted = "\n".join(line for line in text.splitlines() if not line.startswith("hana_storage_rule_info"))
    assert 'rule="HANA-ENC-003"' not in counted  # the forged ones counted nothing


def test_every_event_triage_fires_is_signed(firing, pki):
    """Alerts, remediations and rejections alike: each verifies as the master's."""
    firing._call_remediate = lambda minion, rules: {}  # the minion did not answer
    tag = "salt/beacon/db1/hana_storage/violation"
    firing.triage(tag, violation(pki, "db1", finding("HANA-ENC-001"), time.time()))
    firing.triage(tag, violation(pki, "db1", key_finding(), time.time()))
    firing.triage(tag, {**violation(pki, "db1", finding(), time.time()), "sig": "AAAA"})
    assert sorted(t for t, _ in firing.sent) == [
        "hana/storage/alert",
        "hana/storage/alert",
        "hana/storage/rejected",
        "hana/storage/remediation",
        "hana/storage/triaged",
        "hana/storage/triaged",
        "hana/storage/triaged",
    ]
    assert all(firing.verify_master(t, d) is None for t, d in firing.sent)
    outcomes = [d["result"]["action"] for t, d in firing.sent if t == "hana/storage/triaged"]
    assert outcomes == ["alerted", "remediation-failed", "rejected"]


def test_an_event_that_cannot_be_signed_is_not_fired(firing, pki):
    (pki / "master.pem").unlink()
    assert firing._fire("hana/storage/alert", {"minion": "db1", "rule": "HANA-ENC-001"}) is False
    assert firing.sent == []


def test_a_violation_is_the_occurrence_its_since_names():
    """Two beacon instances (one per master connection) report one occurrence with one since."""
    runner = load("_runners/hana_storage.py", "runner_since")
    data = beacon_events.violation_data(finding(), 200.0)
    assert runner._violation_finding({**data, "since": 100.0})["since"] == 100.0
    assert runner._violation_finding(data)["since"] == 200.0  # an older beacon: its ts
    assert runner._violation_finding({**data, "since": True})["since"] == 200.0


def test_each_thread_keeps_one_bus_connection_and_drops_a_failed_one(runner, monkeypatch):
    """Opening a bus connection per event capped triage: one per thread, reopened after a failure."""
    fresh = load("_runners/hana_storage.py", "runner_sending")
    fresh.__opts__ = runner.__opts__ | {"sock_dir": "/nonexistent"}
    made, answers = [], iter([True, True, False, True])

    class Bus:
        destroyed = False

        def fire_event(self, data, tag, timeout):
            return next(answers)

        def destroy(self):
            self.destroyed = True

    def connect(opts, sock_dir, listen):
        made.append(Bus())
        return made[-1]

    monkeypatch.setattr(fresh.salt.utils.event, "get_master_event", connect)
    assert [fresh._send("t", {}) for _ in range(4)] == [True, True, False, True]
    assert len(made) == 2 and made[0].destroyed and not made[1].destroyed


# ---- minion ids that are targets, not ids (issue 29, item 5) ----------------------------------------


@pytest.mark.parametrize("minion", ["evil,db2", "db*", "db?", "db[12]", "db 2", "db\t2", " db2"])
def test_an_id_with_list_or_glob_characters_is_rejected_before_anything(runner, pki, keys, minion):
    """Regression (issue 29, item 5): an accepted minion ``evil,db2`` signed its own violation of an
    auto rule, and triage targeted ``"evil,db2"`` as a list: db2 ran hana_storage.remediate."""
    (pki / "minions" / minion).write_text(keys["db1"][1])  # accepted, with db1's key pair
    (pki / f"{minion}.pem").write_text(keys["db1"][0])
    tag = f"salt/beacon/{minion}/hana_storage/violation"
    data = violation(pki, minion, finding(), time.time())
    assert runner.verify(tag, data)["code"] == "bad_minion_id"
    result = runner.triage(tag, data)
    assert (result["action"], result["code"]) == ("rejected", "bad_minion_id")
    assert runner.remediate_calls == []


def test_remediate_targets_a_list_of_one_id(runner, monkeypatch):
    """The id is one element of the target list, never a list spelled as text."""
    fresh = load("_runners/hana_storage.py", "runner_targeting")
    fresh.__opts__ = runner.__opts__
    calls = []

    class Client:
        def cmd(self, tgt, fun, **kwargs):
            calls.append((tgt, fun, kwargs["tgt_type"]))
            return {}

        def destroy(self):
            pass

    monkeypatch.setattr(fresh.salt.client, "get_local_client", lambda **kwargs: Client())
    fresh._call_remediate("db1", ["HANA-PERF-002"])
    assert calls == [(["db1"], "hana_storage.remediate", "list")]


# ---- the shared store's writers are not the master (issue 29, item 4) --------------------------------


def test_a_redis_writer_cannot_have_the_master_sign_its_events(two_masters, pki, caplog):
    """Regression (issue 29, item 4): whoever could write to Redis put entries into the outbox
    (tag ``salt/auth``, and a made-up remediation ``fixed``), and ``redeliver`` signed and sent
    them with master.pem. Only the outbox's two tags, under a MAC of the masters' shared key."""
    import redis

    a, _b = two_masters
    prefix = a.__opts__["hana_storage"]["store"]["prefix"]
    writer = redis.Redis.from_url(a.__opts__["hana_storage"]["store"]["url"])
    made_up = {
        "e1": {"event_id": "e1", "tag": "salt/auth", "data": {"id": "db1", "act": "accept"}},
        "e2": {
            "event_id": "e2",
            "tag": "hana/storage/remediation",
            "data": {"minion": "db1", "rule": "HANA-PERF-002", "result": "fixed", "reason": "verified"},
        },
    }
    for event_id, event in made_up.items():
        writer.hset(prefix + "outbox", event_id, json.dumps(event))
        writer.zadd(prefix + "outbox-due", {event_id: 0})
    assert a.redeliver() == 0 and a.fired == []
    assert writer.hlen(prefix + "outbox") == writer.zcard(prefix + "outbox-due") == 0, "dropped"
    assert "dropped from the outbox" in caplog.text and "salt/auth" not in str(a.fired)


def test_a_redis_writer_cannot_mark_an_occurrence_handled(two_masters, pki, caplog):
    """A record forged in Redis (the occurrence "handled", to silence its alert) does not verify:
    it is read as empty, so triage acts (acting again is the safe direction), and it says so."""
    import redis

    a, _b = two_masters
    prefix = a.__opts__["hana_storage"]["store"]["prefix"]
    found = finding("HANA-ENC-001")
    data = violation(pki, "db1", found, time.time())
    forged = {"handled": {events.finding_key(found): data["ts"]}, "held": {}, "cooldown": {}}
    writer = redis.Redis.from_url(a.__opts__["hana_storage"]["store"]["url"])
    writer.set(prefix + "action:db1@HANA-ENC-001", json.dumps(forged))
    assert a.triage("salt/beacon/db1/hana_storage/violation", data)["action"] == "alerted"
    assert "does not verify" in caplog.text


def test_two_clusters_on_one_redis_share_nothing(runner, pki, keys, redis_url, tmp_path):
    """Two clusters (other master keys) on one Redis: by default each has a prefix of its own, from
    its master.pub, so one cluster's records never make the other's findings duplicates."""
    import hashlib

    other_pki = tmp_path / "other-pki"
    (other_pki / "minions").mkdir(parents=True)
    (other_pki / "master.pem").write_text(keys["db2"][0])  # another cluster's master key
    (other_pki / "master.pub").write_text(keys["db2"][1])
    (other_pki / "minions" / "db1").write_text(keys["db1"][1])
    clusters = []
    for name, directory in (("one", pki), ("two", other_pki)):
        master = load("_runners/hana_storage.py", f"runner_cluster_{name}")
        for attribute in ("_call_remediate", "minion_ret", "remediate_calls"):
            setattr(master, attribute, getattr(runner, attribute))
        record_fired(master)
        settings = {"cooldown": 300, "store": {"driver": "redis", "url": redis_url}}
        master.__opts__ = {**runner.__opts__, "pki_dir": str(directory), "hana_storage": settings}
        clusters.append(master)
    data = violation(pki, "db1", finding("HANA-ENC-001"), time.time())
    tag = "salt/beacon/db1/hana_storage/violation"
    assert [c.triage(tag, data)["action"] for c in clusters] == ["alerted", "alerted"]
    digest = hashlib.sha256((pki / "master.pub").read_bytes()).hexdigest()[:16]
    assert clusters[0]._store().prefix == f"hana_storage:{digest}:"


# ---- what one minion may cost triage (issue 29, item 11) ---------------------------------------------


def many_findings(n):
    """n open findings of one manual rule, each on a volume of its own."""
    return [(finding("HANA-ENC-001", f"v{i:04d}", f"/dev/vd{i}"), 100.0 + i) for i in range(n)]


def test_an_audit_event_is_triaged_for_at_most_max_audit_findings(runner, pki, caplog):
    """Regression (issue 29, item 11): an audit event with 5,000 findings held a triage thread for
    0.7 s and made a 325 KB signed event. The first ``max_audit_findings`` are triaged, the rest
    counted in the result and logged."""
    runner.__opts__["hana_storage"] = {"cooldown": 300, "max_audit_findings": 10}
    data = signed(pki, "db1", beacon_events.audit_data(many_findings(30), volumes=()), event="audit")
    result = runner.triage("salt/beacon/db1/hana_storage/audit", data)
    assert len(result["findings"]) == 10 and result["dropped"] == 20, result
    assert "20 more open findings" in caplog.text


def test_an_event_too_large_is_rejected_before_its_signature_is_checked(runner, pki, monkeypatch):
    runner.__opts__["hana_storage"] = {"cooldown": 300, "max_event_bytes": 4096}
    data = signed(pki, "db1", beacon_events.audit_data(many_findings(60), volumes=()), event="audit")
    assert len(json.dumps(data)) > 4096
    checked = []
    monkeypatch.setattr(runner.salt.crypt, "verify_signature", lambda *args, **kwargs: checked.append(1))
    result = runner.triage("salt/beacon/db1/hana_storage/audit", data)
    assert (result["action"], result["code"]) == ("rejected", "too_large"), result
    assert [t for t, _d in runner.fired] == ["hana/storage/rejected"] and checked == []


def test_a_flood_from_one_minion_is_rate_limited(runner, pki):
    """Beyond its bucket a minion's events are dropped unverified: counted, and reported once per
    interval (one hana/storage/rejected, no hana/storage/triaged each); other minions go on."""
    runner.__opts__["hana_storage"] = {"cooldown": 300, "event_burst": 3, "event_rate": 0.001}
    tag = "salt/beacon/db1/hana_storage/violation"
    results = [
        runner.triage(tag, violation(pki, "db1", finding("HANA-ENC-001", f"v{n}"), time.time()))
        for n in range(10)
    ]
    assert [r["action"] for r in results] == ["alerted"] * 3 + ["rejected"] * 7
    assert {r["code"] for r in results[3:]} == {"rate_limited"}
    assert [t for t, _d in runner.fired].count("hana/storage/rejected") == 1
    assert len(runner.triaged) == 4, "the three triaged and the one reported"
    other = violation(pki, "db2", finding("HANA-ENC-001"), time.time())
    assert runner.triage("salt/beacon/db2/hana_storage/violation", other)["action"] == "alerted"


def test_forged_events_cost_one_report_per_claimed_minion_and_interval(runner, pki, caplog):
    """Each forged event cost two signed master events and a log line. Now a rejection is
    reported (logged, hana/storage/rejected, hana/storage/triaged) once per interval per claimed
    minion - made-up ids share one - with the number held back since."""
    runner.__opts__["hana_storage"] = {"cooldown": 300, "report_interval": 0.5}
    genuine = violation(pki, "db1", finding("HANA-ENC-001"), time.time())
    for n in range(20):
        result = runner.triage("salt/beacon/db1/hana_storage/violation", {**genuine, "sig": "AAAA"})
        assert (result["action"], result["code"]) == ("rejected", "bad_signature")
        result = runner.triage(f"salt/beacon/ghost-{n}/hana_storage/violation", genuine)
        assert (result["action"], result["code"]) == ("rejected", "unknown_minion")
    rejected = [d for t, d in runner.fired if t == "hana/storage/rejected"]
    assert [(d["claimed_minion"], d["held_back"]) for d in rejected] == [("db1", 0), ("ghost-0", 0)]
    assert len(runner.triaged) == 2 and caplog.text.count("rejected salt/beacon/") == 2
    real_sleep(0.6)
    runner.triage("salt/beacon/db1/hana_storage/violation", {**genuine, "sig": "AAAA"})
    assert runner.fired[-1][1]["held_back"] == 19


def test_the_rate_limit_holds_on_the_engines_path(runner, pki, tmp_path):
    """The triage engine's threads share the runner module, and so its buckets: a flood handed off
    over the engine's socket is triaged up to the burst, and reported once."""
    import os
    import shutil
    import tempfile

    from tests.unit.test_triage_engine import eventually, hand_off, load_engine, running

    runner.__opts__["hana_storage"] = {"cooldown": 300, "event_burst": 5, "event_rate": 0.001}
    sock_dir = tempfile.mkdtemp(prefix=f"hsf-{os.getpid()}-", dir="/tmp")  # AF_UNIX paths are short
    try:
        path = running(load_engine(), sock_dir, runner.triage)
        tag = "salt/beacon/db1/hana_storage/violation"
        flood = [violation(pki, "db1", finding("HANA-ENC-001", f"v{n}"), time.time()) for n in range(30)]
        hand_off(path, *({"tag": tag, "data": data} for data in flood))
        eventually(lambda: len(runner.triaged) == 6, f"five triaged and one report: {runner.triaged}")
        real_sleep(1)
        assert [d["result"]["action"] for _t, d in runner.triaged].count("alerted") == 5
        assert [t for t, _d in runner.fired].count("hana/storage/rejected") == 1
        assert len(runner.triaged) == 6
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_the_limits_ship_as_their_defaults_and_a_bad_one_falls_back(runner, caplog):
    import yaml

    shipped = yaml.safe_load((REPO / "conf" / "master.d" / "hana-storage.conf").read_text())["hana_storage"]
    assert {name: shipped[name] for name in runner.LIMITS} == {
        name: runner.DEFAULTS[name] for name in runner.LIMITS
    }
    runner.__opts__["hana_storage"] = {"event_burst": "many", "event_rate": 0, "max_event_bytes": True}
    for _ in range(3):
        config = runner._config()
    assert (config["event_burst"], config["event_rate"], config["max_event_bytes"]) == (200, 5, 262144)
    assert caplog.text.count("is not a positive, finite number") == 3, "once each"


# ---- the exporter's series are the master's, and bounded (issue 29, item 10) ---------------------------


def series(registry, name):
    """{labels: value} of one metric's samples."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name
    }


def test_exporter_labels_come_from_the_masters_rule_table(exporter):
    """Regression (issue 29, item 10): 2,000 validly signed events from one minion made 2,000
    series in each of four metrics, their rule, severity, volume and event name taken from the
    event. Rule and severity come from the master's table (an unknown rule counts as "unknown"),
    event names from a fixed set, at most MAX_VOLUMES volumes per minion."""
    module, metrics, registry = exporter
    for n in range(200):
        made_up = {**finding(), "rule": f"MADE-UP-{n}", "severity": f"s{n}", "volume": f"vol{n}"}
        module.handle(
            metrics,
            "salt/beacon/db1/hana_storage/violation",
            events.finding_event("violation", made_up, "uevent", 1.0),
        )
        module.handle(metrics, f"salt/beacon/db1/hana_storage/made-up-{n}", {"ts": 1.0})
    lying = {**finding("HANA-ENC-001"), "severity": "low"}
    module.handle(
        metrics,
        "salt/beacon/db1/hana_storage/violation",
        events.finding_event("violation", lying, "uevent", 1.0),
    )
    violations = series(registry, "hana_storage_violations_total")
    assert violations == {
        (("minion", "db1"), ("rule", "unknown"), ("severity", "unknown")): 200.0,
        (("minion", "db1"), ("rule", "HANA-ENC-001"), ("severity", "critical")): 1.0,
    }
    assert len(series(registry, "hana_storage_findings")) == 2
    assert len(series(registry, "hana_storage_compliant")) == module.MAX_VOLUMES == 32
    assert set(series(registry, "hana_storage_events_total")) == {
        (("event", "other"),),
        (("event", "violation"),),
    }


def test_exporter_drops_the_series_of_volumes_and_minions_that_are_gone(exporter):
    """A stale 0 or 1 keeps an alert firing: a volume no longer in a minion's audit event loses its
    compliant series, and a minion whose key is no longer accepted loses all its series."""
    module, _metrics, registry = exporter
    accepted = {"db1", "db2"}
    metrics = module.Metrics(CollectorRegistry(), accepted=lambda minion: minion in accepted)
    registry = metrics.registry

    def audit_of(volumes, found=()):
        report = {
            "compliant": not found,
            "findings": list(found),
            "volumes": {v: {"compliant": True, "rules": [], "mountpoint": f"/hana/{v}"} for v in volumes},
        }
        return events.audit_event(report, "full", 0.1, 1000.0, {events.finding_key(f): 1.0 for f in found})

    for minion in ("db1", "db2"):
        module.handle(
            metrics, f"salt/beacon/{minion}/hana_storage/audit", audit_of(("data", "log"), [finding()])
        )
        module.handle(metrics, "hana/storage/alert", {"minion": minion, "rule": "HANA-ENC-001"})
        violated = events.finding_event("violation", finding(), "uevent", 1001.0)
        module.handle(metrics, f"salt/beacon/{minion}/hana_storage/violation", violated)
    module.handle(metrics, "salt/beacon/db1/hana_storage/audit", audit_of(("data",)))
    assert sorted(
        dict(k)["volume"] for k in series(registry, "hana_storage_compliant") if dict(k)["minion"] == "db1"
    ) == ["data"]
    accepted.discard("db2")
    metrics.prune()
    for name in (
        "hana_storage_compliant",
        "hana_storage_findings",
        "hana_storage_violations_total",
        "hana_storage_alerts_total",
        "hana_storage_last_audit_timestamp_seconds",
    ):
        assert {dict(k)["minion"] for k in series(registry, name)} == {"db1"}, name


# ---- outside review (attack branch): each test below fails until its hole is fixed ----------------


def test_a_minions_triage_record_stays_bounded_whatever_keys_its_events_name(runner, pki):
    """Robustness (master DoS). Triage takes an event's ``key`` as it comes (any text, up to
    max_event_bytes) and records each handled occurrence under it; ``handled`` is never pruned.
    A minion (its own key, e.g. root on one host) that names a new key in every event, within
    the rate limit, grows its record by the key's size per event; every later event of that
    minion and rule reads, parses and writes the whole record under its lock (the local file,
    or one Redis value per WATCH/MULTI round). 40 events of 100 KB keys: a 4 MB record here,
    5 events/s of 256 KB keys make ~110 GB a day, a JSON document each triage rewrites."""
    tag = "salt/beacon/db1/hana_storage/violation"
    for n in range(40):
        found = finding("HANA-ENC-001", "data", f"/dev/vd{n}")
        data = {**beacon_events.violation_data(found, time.time()), "key": f"{n}|" + "k" * 100_000}
        assert runner.triage(tag, signed(pki, "db1", data))["action"] == "alerted"
    record = Path(runner.__opts__["cachedir"]) / "hana_storage" / "actions" / "db1@HANA-ENC-001"
    assert record.stat().st_size <= runner.DEFAULTS["max_event_bytes"], f"{record.stat().st_size} bytes"


def test_the_exporter_keeps_a_bounded_number_of_open_findings_per_minion(exporter):
    """Robustness (master DoS). The exporter bounds the series a minion makes, not what it keeps:
    each violation with a new ``key`` adds an entry to ``Metrics.open[minion]`` (never dropped but
    by a resolved event or the next audit event), and every event of that minion then walks all of
    them (``_refresh``). The exporter applies no event size or rate limit of its own."""
    module, metrics, _registry = exporter
    for n in range(3000):
        data = events.finding_event("violation", finding("HANA-ENC-001"), "uevent", 1.0)
        module.handle(metrics, "salt/beacon/db1/hana_storage/violation", {**data, "key": f"k{n}"})
    assert len(metrics.open["db1"]) <= 1000, f"{len(metrics.open['db1'])} open findings kept for db1"


def test_the_triage_engine_does_not_hold_forged_outbox_events_in_memory(tmp_path):
    """Robustness (master DoS). Any minion can fire ``hana/storage/alert`` (README). The engine's
    confirm_each queues every alert or remediation event its bus carries - forged ones too - in
    an unbounded heap for ``settle`` (30) seconds, data and all, before ``delivered`` checks the
    master's signature: a minion firing large forged events holds 30 s of its flood in the
    master's memory."""
    spec = importlib.util.spec_from_file_location(
        "triage_engine_attack", REPO / "_engines/hana_storage_triage.py"
    )
    engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine)
    later, checked = engine.Later(), []
    forged = (
        {"tag": "hana/storage/alert", "data": {"minion": "db1", "rule": "HANA-ENC-001", "event_id": f"{n:032x}",
                                               "ts": time.time(), "sig": "AAAA", "pad": "x" * 1000}}
        for n in range(20_000)
    )  # fmt: skip
    engine.confirm_each(forged, later, lambda tag, data: checked.append(tag), 30)
    with later._wake:
        held = len(later._due)
    assert held <= 1000, f"{held} forged events (20 MB) held for 30 s before any signature check"


def test_a_redis_writer_cannot_add_series_to_the_exporter(runner, redis_url):
    """Forgery / DoS. The tallies hash carries no MAC (README: a Redis writer can change the
    counts), and the exporter makes a series of every field in it: its action and rule labels are
    the Redis writer's, not the master's table's. 5,000 made-up fields are 5,000 series on every
    master's /metrics (each label as long as the writer likes)."""
    import redis

    module = load("_engines/hana_storage_exporter.py", "exporter_tallies_attack")
    prefix = f"attack-tallies-{time.monotonic_ns()}:"
    opened = store.RedisStore(redis_url, prefix, b"k" * 32)
    writer = redis.Redis.from_url(redis_url)
    writer.hincrby(prefix + "tallies", "alerted|HANA-ENC-001", 1)
    for n in range(5000):
        writer.hincrby(prefix + "tallies", f"made-up-{n}|RULE-{n}", 1)
    registry = CollectorRegistry()
    registry.register(module.StoreTallies(opened.tallies))
    labels = set(series(registry, "hana_storage_triage_actions_total"))
    actions = {"alerted", "remediated", "remediation-failed"}
    known = set(rules.RULES) | {"unknown"}
    foreign = {k for k in labels if dict(k)["action"] not in actions or dict(k)["rule"] not in known}
    assert not foreign, f"{len(foreign)} series named by whoever writes to Redis"


def test_the_exporter_serves_the_rule_table_with_each_rules_controls(exporter):
    _module, _metrics, registry = exporter
    text = generate_latest(registry).decode()
    info = [line for line in text.splitlines() if line.startswith("hana_storage_rule_info{")]
    assert len(info) == len(rules.RULES)
    enc = rules.RULES["HANA-ENC-001"]
    assert (
        f'hana_storage_rule_info{{controls="{",".join(enc.controls)}",remediation="manual",'
        'rule="HANA-ENC-001",severity="critical"} 1.0' in text
    )


# ---- boot readiness, from the runner to the exporter (issue 33) -------------------------------------


def test_the_runner_fires_a_signed_readiness_per_minion_that_the_exporter_counts(
    firing, pki, exporter, tmp_path, monkeypatch
):
    returns = {
        "db1": {"ret": readiness_verdict(), "retcode": 0},
        "db2": {"ret": readiness_verdict(key_exists=False), "retcode": 1},
        "db3": {"ret": "Minion did not return. [Not connected]", "retcode": 1},
    }
    sent = report_runner(tmp_path, monkeypatch, {}, "readiness_runner", readiness=returns)
    sent.__opts__ = {**firing.__opts__, "conf_file": "/dev/null"}
    sent._fire = firing._fire
    result = sent.readiness()
    assert result["db1"] == {"ready": True, "not_ready": []}
    assert result["db2"] == {"ready": False, "not_ready": ["hana_data: key_file_missing"]}
    assert result["db3"]["ready"] is None and "Not connected" in result["db3"]["error"]

    module, metrics, registry = exporter
    # db3 gave no verdict: nothing is announced for it, its gauge keeps its value and grows stale
    assert [(tag, data["minion"]) for tag, data in firing.sent] == [
        ("hana/storage/readiness", "db1"),
        ("hana/storage/readiness", "db2"),
    ]
    for tag, data in firing.sent:
        assert firing.verify_master(tag, data) is None
        module.handle(metrics, tag, data, verify_master=firing.verify_master)
    forged = {"minion": "db2", "ready": True, "not_ready": [], "checked": time.time(), "ts": time.time()}
    for data in (
        forged,
        {**forged, "sig": "AAAA"},
        beacon_events.sign_as_master(pki / "db2.pem", "x", forged),
    ):
        module.handle(metrics, "hana/storage/readiness", data, verify_master=firing.verify_master)

    def sample(name, **labels):
        return registry.get_sample_value(name, labels)

    assert sample("hana_storage_boot_ready", minion="db1") == 1
    assert sample("hana_storage_boot_ready", minion="db2") == 0  # the forged "ready" counted nowhere
    assert sample("hana_storage_boot_ready", minion="db3") is None
    checked = sample("hana_storage_boot_readiness_timestamp_seconds", minion="db2")
    assert checked == int(firing.sent[1][1]["checked"]) and abs(checked - time.time()) < 60
    assert sample("hana_storage_rejected_events_total", reason="forged_master_event") == 3

    # a genuine verdict checked before the one counted (a report and the schedule overlapping, a
    # replay within max_event_age) changes nothing
    older = {"minion": "db2", "ready": True, "not_ready": [], "checked": checked - 500}
    firing.sent.clear()
    assert firing._fire("hana/storage/readiness", older)
    module.handle(metrics, *firing.sent[0], verify_master=firing.verify_master)
    assert sample("hana_storage_boot_ready", minion="db2") == 0
    assert sample("hana_storage_boot_readiness_timestamp_seconds", minion="db2") == checked


def test_the_report_asks_readiness_in_a_job_of_its_own(firing, tmp_path, monkeypatch):
    """A minion whose formula predates boot_readiness still gives its evidence (an argument its
    evidence() does not know would have made the whole host "not audited"); each verdict is
    announced, by the master's clock."""
    from tests.unit.test_evidence import host_part, returns_of

    readiness = {
        "db1": {"ret": readiness_verdict(key_exists=False), "retcode": 1},
        "db2": {"ret": "'hana_storage.boot_readiness' is not available.", "retcode": 254},
    }
    runner = report_runner(
        tmp_path, monkeypatch, returns_of([host_part("db1"), host_part("db2")]), "report_readiness", readiness
    )
    runner.__opts__ = {**firing.__opts__, "conf_file": "/dev/null", "id": "salt-master-1"}
    runner._fire = firing._fire
    written = runner.report(format="json", out=str(tmp_path / "report.json"))
    doc = json.loads((tmp_path / "report.json").read_text())
    assert written["summary"]["errors"] == 0 and set(doc["hosts"]) == {"db1", "db2"}
    assert doc["hosts"]["db1"]["readiness"]["ready"] is False
    assert (
        doc["hosts"]["db2"]["readiness"]["ready"] is None
        and "not available" in doc["hosts"]["db2"]["readiness"]["error"]
    )
    assert [(tag, data["minion"], data["ready"]) for tag, data in firing.sent] == [
        ("hana/storage/readiness", "db1", False)
    ]
    assert abs(firing.sent[0][1]["checked"] - time.time()) < 60


@pytest.mark.parametrize(
    "data",
    [
        {"minion": "db1", "ready": 1, "checked": 1},
        {"minion": ["db1"], "ready": True, "checked": 1},
        {"ready": True, "checked": 1},
        {"minion": "db1", "ready": None, "checked": 1},  # no verdict: the runner never sends one
        {"minion": "db1", "ready": True},
        {"minion": "db1", "ready": True, "checked": "now"},
    ],
)
def test_the_exporter_takes_no_malformed_readiness(exporter, data):
    module, metrics, registry = exporter
    with pytest.raises((KeyError, TypeError, ValueError)):
        module.handle(metrics, "hana/storage/readiness", data)
    assert "hana_storage_boot_ready{" not in generate_latest(registry).decode()


@pytest.mark.parametrize("checked", [time.time() + 3600, float("inf"), float("nan")])
def test_the_exporter_takes_no_readiness_checked_in_the_future(exporter, checked):
    """Re-review: a check stamped an hour ahead (a master whose clock stepped back since) held the
    gauge until real time caught up, and kept the stale alert from firing."""
    module, metrics, registry = exporter
    with pytest.raises(ValueError):
        module.handle(metrics, "hana/storage/readiness", {"minion": "db1", "ready": True, "checked": checked})
    module.handle(
        metrics, "hana/storage/readiness", {"minion": "db1", "ready": False, "checked": time.time()}
    )
    assert registry.get_sample_value("hana_storage_boot_ready", {"minion": "db1"}) == 0


@pytest.mark.parametrize(
    "name,value",
    [
        ("readiness_timeout", 180.0),  # Salt's LocalClient replaces a float with its 5 s
        ("readiness_timeout", float("nan")),
        ("report_timeout", float("inf")),
        ("max_event_age", float("nan")),  # every replay accepted
        ("max_event_age", "30"),
        ("max_event_age", 0),
    ],
)
def test_a_bad_timeout_or_event_age_falls_back_to_its_default(runner, name, value, caplog):
    runner.__opts__["hana_storage"] = {name: value}
    assert runner._config()[name] == runner.DEFAULTS[name]
    assert f"hana_storage: {name} {value!r} is not a positive, finite number" in caplog.text


@pytest.mark.parametrize("timeout,seconds", [(None, 180), (30, 30), (30.2, 31)])
def test_a_timeout_argument_is_whole_seconds(runner, timeout, seconds):
    assert runner._seconds(timeout, 180) == seconds


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "3m", True])
def test_a_bad_timeout_argument_is_refused(runner, timeout):
    with pytest.raises(runner.CommandExecutionError, match="timeout must be a positive number of seconds"):
        runner._seconds(timeout, 180)
