"""The lab VM's salt-minion daemon and a master on the host: what tests/vm/test_events.py and
bench/test_drift.py share."""

import fnmatch
import time

import pytest
import yaml

from tests.support.master import formula_master, pillar_tree

MINION = "hana-lab"
BEACON = f"salt/beacon/{MINION}/hana_storage"
KEY = "/run/hana-storage/keys/hana.key"


QUIET_BEACON = {"interval": 1, "full_audit_interval": 3600}


def lab_storage(vm, beacon=QUIET_BEACON):
    """The lab pillar with two volumes: data striped over vda and vdb, shared on vdc. The beacon:
    ``beacon`` (None: the formula's defaults); by default it ticks every second and its full
    audit is an hour away, so what it reports came from the kernel."""
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["volumes"] = {
        "data": {"mountpoint": "/hana/data", "devices": ["/dev/vda", "/dev/vdb"], "stripe_size": 256},
        "shared": {"mountpoint": "/hana/shared", "devices": ["/dev/vdc"]},
    }
    if beacon is None:
        storage["compliance"].pop("beacon", None)
    else:
        storage["compliance"]["beacon"] = beacon
    return storage


def lab_master(tmp_path_factory, vm, beacon=QUIET_BEACON, reactor=True, **options):
    """A master on loopback that the guest reaches (10.0.2.2), accepting its key, serving the
    formula, the lab pillar, the master-side modules and (with ``reactor``) the shipped reactor."""
    pillar = pillar_tree(tmp_path_factory.mktemp("pillar"), lab_storage(vm, beacon))
    return formula_master(pillar, reactor=reactor, interface="127.0.0.1", auto_accept=True, **options)


def connect_minion(vm, *masters):
    """Start the VM's salt-minion connected to every master given (more than one: hot
    multi-master) and wait until it answers each; returns the first master's salt CLI."""
    vm.start_minion([(m.config["ret_port"], m.config["publish_port"]) for m in masters], MINION)
    deadline = time.monotonic() + 600
    for master in masters:
        cli = master.salt_cli(timeout=900)
        # a short CLI timeout: a publish sent before the minion connected is never answered
        while cli.run("--timeout=30", "test.ping", minion_tgt=MINION).data is not True:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the minion in the VM never answered {master.id}; read {vm.console} and {vm.minion_log()}"
                )
            time.sleep(5)
    return masters[0].salt_cli(timeout=900)


def ask(cli, vm, fun, *args, timeout=120, tries=3):
    """The answer of the lab's minion to a read-only call. Beside another lab on two cores, an
    emulated minion's return can outlast its return budget and be dropped (Salt logs "failed to
    return the job information"): a read-only call is asked again, where waiting out a long CLI
    timeout would cost a quarter of an hour and say nothing."""
    for _ in range(tries):
        result = cli.run(f"--timeout={timeout}", fun, *args, minion_tgt=MINION, _timeout=timeout + 120)
        if result.returncode == 0 and not (isinstance(result.data, str) and "did not return" in result.data):
            return result.data
    pytest.fail(f"{fun}: {MINION} did not answer in {tries} tries of {timeout} s; read {vm.minion_log()}")


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
        tag: next(e for e in matched.matches if e.tag == tag or fnmatch.fnmatch(e.tag, tag)) for tag in tags
    }
