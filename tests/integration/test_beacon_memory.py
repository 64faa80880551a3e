"""The beacon's memory on a real salt-minion daemon: an open finding is reported once, and neither
a pillar refresh, a module refresh nor a minion restart (each a new beacon loader, a new
``__context__``) reports it again or gives it a new ``since``.

The pillar names a volume whose device does not exist on this host, so the audit finds its
mountpoint unmounted (HANA-MOUNT-001) and touches nothing. The minion's beacon ticks every
second, with a full audit every 10 s; a new loader's first tick is a full audit.
"""

import base64
import json
import os
import stat
import time

import pytest

from tests.support.master import formula_master, pillar_tree

pytestmark = pytest.mark.integration

MOUNTPOINT = "/hana/itest"
DEVICE = "/dev/hana-itest-missing"
STORAGE = {
    "key": {"source": "pillar", "material": base64.b64encode(b"\x02" * 64).decode()},
    "volumes": {"itest": {"mountpoint": MOUNTPOINT, "devices": [DEVICE]}},
}
BEACON = [{"interval": 1}, {"full_audit_interval": 10}, {"uevents": True}]


@pytest.fixture(scope="module")
def memory_master(salt_factories, tmp_path_factory):
    pillar = pillar_tree(tmp_path_factory.mktemp("beacon-pillar"), STORAGE)
    factory = salt_factories.salt_master_daemon("hana-memory-master", overrides=formula_master(pillar))
    with factory.started(start_timeout=120):
        yield factory


@pytest.fixture(scope="module")
def memory_minion(memory_master):
    factory = memory_master.salt_minion_daemon("hana-memory-minion")
    factory.master_id = memory_master.id
    with factory.started(start_timeout=120):
        sync = factory.salt_call_cli(timeout=120).run("saltutil.sync_all")
        assert sync.returncode == 0, sync
        yield factory


def beacon_events(event_listener, minion, kind, after):
    """The minion's beacon events of one kind on the master's bus since ``after``, oldest first."""
    tag = f"salt/beacon/{minion.id}/hana_storage/{kind}"
    found = event_listener.get_events([(minion.master_id, tag)], after_time=after)
    return [e.data for e in sorted(found, key=lambda e: e.stamp)]


def next_audit(event_listener, minion, after, timeout=240):
    """The first audit event of the minion's beacon after ``after``. A new loader loads every
    beacon module first: on a machine the VM tier keeps busy that took more than 90 s once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = beacon_events(event_listener, minion, "audit", after)
        if found:
            return found[0]
        time.sleep(0.5)
    errors = beacon_events(event_listener, minion, "error", after)
    raise AssertionError(f"no audit event from the beacon within {timeout} s (errors: {errors})")


def test_the_audit_runs_on_this_host_and_finds_the_volume_unmounted(memory_minion):
    ret = memory_minion.salt_call_cli(timeout=120).run("hana_storage.audit")
    assert ret.returncode == 0, ret
    rules = {(f["rule"], f["volume"]) for f in ret.data["findings"]}
    assert ("HANA-MOUNT-001", "itest") in rules
    assert not os.path.exists(MOUNTPOINT)  # audited, not created


def test_an_open_finding_survives_refreshes_and_a_restart(memory_minion, event_listener):
    """Regression (issue 13, item 11): the beacon's memory lived in __context__ only; each of these
    steps built a new loader, and every open finding came again as a new violation, new ts."""
    call = memory_minion.salt_call_cli(timeout=120)
    started = time.time()
    # what beacon.present (save: true) does: add it to the running minion, write beacons.conf
    added = call.run("beacons.add", "hana_storage", beacon_data=BEACON)
    assert added.returncode == 0 and added.data["result"] is True, added
    assert call.run("beacons.save").returncode == 0
    first = next_audit(event_listener, memory_minion, started)
    assert first["compliant"] is False
    assert any(key.startswith("HANA-MOUNT-001|itest|") for key in first["since"]), first
    violations = beacon_events(event_listener, memory_minion, "violation", started)
    assert {v["key"]: v["ts"] for v in violations} == first["since"]  # each reported once, since = ts

    def restart():
        memory_minion.terminate()
        memory_minion.start(start_timeout=120)

    steps = {
        "saltutil.refresh_pillar": lambda: call.run("saltutil.refresh_pillar", wait=True),
        "saltutil.refresh_modules": lambda: call.run("saltutil.refresh_modules", wait=True),
        "a minion restart": restart,
    }
    for name, step in steps.items():
        before = time.time()
        result = step()
        assert result is None or result.returncode == 0, (name, result)
        # the new loader's first tick is a full audit; a violation would come in the same return
        audit = next_audit(event_listener, memory_minion, time.time())
        time.sleep(2)
        again = beacon_events(event_listener, memory_minion, "violation", before)
        assert again == [], f"reported again after {name}: {[v['key'] for v in again]}"
        assert audit["since"] == first["since"], name  # the same occurrences, the same since

    assert all(v["since"] == v["ts"] for v in violations)  # the violation names its occurrence
    memory = os.path.join(memory_minion.config["cachedir"], "hana_storage", "beacon-memory.json")
    info = os.lstat(memory)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    with open(memory, encoding="utf-8") as handle:
        (record,) = json.load(handle)["instances"].values()
    assert record["since"] == first["since"]
    assert STORAGE["key"]["material"] not in json.dumps(record)
