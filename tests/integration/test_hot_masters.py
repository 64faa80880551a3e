"""Hot multi-master with real parts: two salt-masters sharing one master key and one real
redis-server as triage's store, and two salt-minion daemons connected to both (``master`` a list:
one connection, one beacon and one scheduler per master), the beacon running as shipped on them.

Each minion's pillar names a volume whose device does not exist here (manual findings) and a key
file, and disables fixing, so nothing on the host is changed. Each finding reaches both masters
(once per beacon instance), and:

* both beacon instances name each occurrence alike (key and since), and across the two masters
  each finding gets exactly one alert; the fleet report and the triage metrics read the same
  from either master;
* then the key file becomes readable by others (HANA-KEY-001, an auto rule): the first master
  to start a remediation for it is killed, process tree and all, while it waits for the minion;
  the other master finds the occurrence held, takes it over once the lease (5 s here) has run
  out, and every finding still ends in exactly one remediation and one alert (not fixed: not
  allowed) across the two masters - none twice, none lost.
"""

import contextlib
import os
import shutil
import time

import pytest
import redis
import salt.version
from hana_storage_core import rules as rules
from hana_storage_core import store as hana_storage_store

from tests.conftest import REPO
from tests.integration.master_bus import Bus, wait_for_reactor, wait_until
from tests.support.master import (
    OUTCOMES,
    free_port,
    hot_peers,
    kill_tree,
    outcomes,
    pillar_tree,
    started_hot_masters,
)
from tests.support.redis_store import STORE_ACL, as_user, redis_server

# Regression (3008.5): a minion connected to two masters runs its beacons in its main process,
# and the full audit's first salt:// fetch, made in the tick, waited for that process's loop
# until "File client timed out after 180 seconds": no finding reached either master.
pytestmark = pytest.mark.integration

LEASE = 5
MINIONS = ("hana-hot-minion-1", "hana-hot-minion-2")
BEACON = {"hana_storage": [{"interval": 1}, {"full_audit_interval": 10}]}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    key = tmp_path_factory.mktemp("hot-key") / "hana.key"
    key.write_bytes(os.urandom(64))
    key.chmod(0o600)
    return key


@pytest.fixture(scope="module")
def hot(salt_factories, tmp_path_factory, event_listener, key_file):
    """(masters [a, b] as Bus, minions): the topology above, torn down in reverse."""
    storage = {
        "key": {"source": "keyfile", "path": str(key_file)},
        "volumes": {"itest": {"mountpoint": "/hana/itest-hot", "devices": ["/dev/hana-itest-hot-missing"]}},
        "compliance": {"remediation": {"enabled": False}},
    }
    pillar = pillar_tree(tmp_path_factory.mktemp("hot-pillar"), storage)
    with contextlib.ExitStack() as stack:
        # the masters' user may run the store's commands on the store's keys only
        users = {"hana": ("hana-store-password", f"~hana_storage:* {STORE_ACL}")}
        url = stack.enter_context(redis_server(tmp_path_factory.mktemp("hot-redis"), users=users))
        store = {"driver": "redis", "url": as_user(url, "hana", "hana-store-password")}
        settings = {"cooldown": 3600, "lease": LEASE, "store": store}
        exporters = {"hana-hot-a": free_port(), "hana-hot-b": free_port()}
        addresses = {"hana-hot-a": "127.0.0.1", "hana-hot-b": "127.0.0.2"}
        configs = hot_peers(pillar, addresses, exporters, hana_storage=settings)
        masters = []
        for factory in started_hot_masters(stack, salt_factories, configs):
            wait_for_reactor(factory, event_listener)
            masters.append(Bus(factory, f"http://127.0.0.1:{exporters[factory.id]}/metrics"))
        minions = []
        for name in MINIONS:
            overrides = {"master": list(addresses.values()), "beacons": BEACON}
            minion = masters[0].factory.salt_minion_daemon(name, overrides=overrides)
            stack.enter_context(minion.started(start_timeout=120))
            minions.append(minion)
        for master in masters:  # each connection's loader, beacons included, reloads after a sync
            wait_until(lambda m=master: accepted(m, MINIONS), what=f"{master.id} accepting the minions")
            sync = master.factory.salt_cli(timeout=300).run(
                "saltutil.sync_all", minion_tgt="hana-hot-minion-*"
            )
            assert sync.returncode == 0 and len(sync.data) == len(MINIONS), sync
        try:
            yield masters, minions, url
        finally:  # the daemons' logs outlive the run: the place to read why a step timed out
            logs = REPO / "build" / "test-logs" / f"hot-masters-{salt.version.__saltstack_version__.major}"
            logs.mkdir(parents=True, exist_ok=True)
            for daemon in [m.factory for m in masters] + minions:
                with contextlib.suppress(OSError):
                    shutil.copy2(daemon.config["log_file"], logs / f"{daemon.id}.log")


def accepted(master, minions):
    return all(os.path.exists(os.path.join(master.factory.config["pki_dir"], "minions", m)) for m in minions)


def violations(event_listener, master, after):
    found = event_listener.get_events([(master.id, "salt/beacon/*/hana_storage/violation")], after_time=after)
    return [
        (e.tag.split("/")[2], e.data["key"], e.data["since"]) for e in found if "key" in e.data
    ]  # not probes


def expected(findings):
    """The outcomes of exactly-once triage for {(minion, rule)}, with fixing disabled."""
    auto = set(rules.auto_rules())
    return sorted(
        (tag, minion, rule)
        for minion, rule in findings
        for tag in (OUTCOMES if rule in auto else ("hana/storage/alert",))
    )


def test_each_finding_is_alerted_once_across_both_masters(hot, event_listener):
    masters, minions, _url = hot
    started = time.time() - 600  # everything since the topology came up

    def both_saw_everything():
        seen = [sorted(set(violations(event_listener, m, started))) for m in masters]
        return (
            seen if seen[0] and seen[0] == seen[1] and len({s[0] for s in seen[0]}) == len(minions) else None
        )

    # one violation per finding from each connection's beacon, named alike: key and since
    wait_until(both_saw_everything, timeout=240, what="both masters receiving every finding")
    time.sleep(LEASE + 10)  # the findings of later audits, a held event's retry, a second outcome
    seen = both_saw_everything()
    assert seen, [sorted(set(violations(event_listener, m, started))) for m in masters]
    findings = {(minion, key.split("|")[0]) for minion, key, _since in seen[0]}
    found = outcomes(event_listener, masters, started)
    # a manual finding: one alert; an auto one: one remediation (not fixed: not allowed) and one alert
    assert sorted((tag, m, r) for _master, tag, m, r in found) == expected(findings), (found, seen)
    reports = [
        m.factory.salt_run_cli(timeout=300).run("hana_storage.report", "--out=json").data for m in masters
    ]
    assert reports[0]["rows"] == reports[1]["rows"] and len({r["minion"] for r in reports[0]["rows"]}) == 2
    actions = [
        {k: v for k, v in m.metrics().items() if k[0] == "hana_storage_triage_actions_total"} for m in masters
    ]
    assert actions[0] == actions[1] and sum(actions[0].values()) == len(findings), actions


def test_a_master_killed_while_remediating_is_taken_over(hot, event_listener, key_file):
    masters, minions, url = hot
    started = time.time()
    store = redis.Redis.from_url(url)
    # the masters' keys, under their cluster's prefix (both have the same master.pub)
    with open(os.path.join(masters[0].factory.config["pki_dir"], "master.pub"), "rb") as pub:
        prefix = hana_storage_store.cluster_prefix(pub.read())
    key_file.chmod(0o644)  # HANA-KEY-001 on both minions at their beacons' next full audits

    def claimant():
        """(master, minion) of a claim on HANA-KEY-001 held now (the lease's owner starts with the
        master's id), or None."""
        for name in store.scan_iter(f"{prefix}action:*@HANA-KEY-001"):
            record = (store.get(name) or b"").decode()[hana_storage_store.MAC_HEX :]  # past its MAC
            for lease in hana_storage_store.load(record)["held"].values():
                holder = next(m for m in masters if str(lease.get("owner", "")).startswith(f"{m.id}/"))
                return holder, name.decode().split(":")[-1].split("@")[0]
        return None

    # a claim is taken before the call to the minion starts, which waits for the minion's audit (a few
    # hundred ms here): the store is polled so the kill lands while the claim is held
    deadline = time.monotonic() + 120
    while not (claim := claimant()):
        assert time.monotonic() < deadline, "no master claimed HANA-KEY-001"
        time.sleep(0.005)
    victim, held_for = claim
    kill_tree(victim.factory)
    survivor = next(m for m in masters if m is not victim)
    wanted = expected({(minion.id, "HANA-KEY-001") for minion in minions})

    def settled():
        found = sorted(
            (tag, m, r) for _master, tag, m, r in outcomes(event_listener, masters, started, {"HANA-KEY-001"})
        )
        return found if len(found) >= len(wanted) else None

    wait_until(settled, timeout=LEASE * 4 + 120, what="a remediation and an alert for every minion")
    time.sleep(LEASE + 5)
    final = outcomes(event_listener, masters, started, {"HANA-KEY-001"})
    assert sorted((tag, m, r) for _master, tag, m, r in final) == wanted, final
    # what the victim held when it died, the survivor did
    assert {master for master, _tag, m, _r in final if m == held_for} == {survivor.id}, final
    # the survivor's exporter serves the store's tallies: the victim's actions and its own
    labels = {"action": "remediation-failed", "rule": "HANA-KEY-001"}
    assert survivor.metric("hana_storage_triage_actions_total", **labels) == len(minions)
    # every outcome carried by a bus and confirmed: what the victim left unconfirmed, the survivor
    # sent again and its engine confirmed
    wait_until(lambda: store.hlen(f"{prefix}outbox") == 0, timeout=LEASE + 60, what="an empty outbox")
    assert any(store.scan_iter(f"{prefix}action:*")), "the records are under the cluster's prefix"
