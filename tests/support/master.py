"""A salt-master configured the way conf/master.d/hana-storage.conf configures one, for the
masters that tests and benchmarks start (pytest-salt-factories ``overrides``)."""

import contextlib
import os
import shutil
import signal
import socket

import psutil
import yaml

from tests.conftest import REPO

# where conf/master.d/hana-storage.conf expects the checkout
INSTALLED_AT = "/srv/formulas/hana-storage-formula"
# what the checkout's root serves in production (the second file root): the custom module dirs
MODULE_DIRS = ("_modules", "_states", "_beacons", "_utils", "_runners", "_engines")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shipped_conf():
    """conf/master.d/hana-storage.conf, parsed."""
    return yaml.safe_load((REPO / "conf" / "master.d" / "hana-storage.conf").read_text())


def shipped_reactor():
    """The reactor map of conf/master.d/hana-storage.conf, its paths pointed at this checkout."""
    conf = shipped_conf()
    return [
        {tag: [path.replace(INSTALLED_AT, str(REPO)) for path in paths]}
        for entry in conf["reactor"]
        for tag, paths in entry.items()
    ]


def shipped_settings():
    """The master settings of conf/master.d/hana-storage.conf other than its paths (file roots,
    reactor map, engines): the triage settings and the large-fleet settings, as shipped."""
    return {
        k: v for k, v in shipped_conf().items() if k not in ("file_roots", "reactor", "engines", "schedule")
    }


def pillar_tree(root, storage):
    """A pillar_roots tree giving every minion ``hana:storage`` = ``storage``; returns ``root``."""
    (root / "top.sls").write_text("base:\n  '*':\n    - hana\n")
    (root / "hana.sls").write_text(yaml.safe_dump({"hana": {"storage": storage}}))
    return root


def module_root():
    """A file root holding only the checkout's module dirs (symlinks), for the test masters.

    Served whole, a development checkout (venvs of three Salt lines, .git: some 45,000 files) is
    what every fileserver request of ``saltutil.sync_all`` lists: three masters doing that beside
    the VM tier pushed one sync past two minutes. Idempotent; parallel test runs share it."""
    root = REPO / "build" / "module-root"
    root.mkdir(parents=True, exist_ok=True)
    for name in MODULE_DIRS:
        try:
            (root / name).symlink_to(REPO / name, target_is_directory=True)
        except FileExistsError:
            pass
    return root


def formula_master(pillar_root=None, reactor=False, exporter_port=None, triage_engine=True, **extra):
    """Master overrides: the formula's two file roots (the module dirs only, module_root); with
    ``reactor`` the shipped reactor map, the master-side modules it runs (runner, utils) and the
    triage engine it hands events to (unless not ``triage_engine``: then the reactor starts a
    runner job per event); with ``exporter_port`` the Prometheus exporter engine on that port.
    Master-side modules load straight from the checkout (production: salt-run saltutil.sync_all)."""
    overrides = {"file_roots": {"base": [str(REPO / "salt"), str(module_root())]}}
    if pillar_root is not None:
        overrides["pillar_roots"] = {"base": [str(pillar_root)]}
    engines = []
    if reactor or exporter_port:
        overrides["runner_dirs"] = [str(REPO / "_runners")]
        overrides["utils_dirs"] = [str(REPO / "_utils")]
    if reactor:
        overrides["reactor"] = shipped_reactor()
        if triage_engine:
            engines.append({"hana_storage_triage": {}})
    if exporter_port:
        engines.append({"hana_storage_exporter": {"port": exporter_port}})
    if engines:
        overrides["engines_dirs"] = [str(REPO / "_engines")]
        overrides["engines"] = engines
    return {**overrides, **extra}


def triage_results(event_listener, master_id, after, began=False):
    """What triage returned for each event since ``after`` (``hana/storage/triaged``, fired on
    the engine's path and the runner job's alike), in the order triage began."""
    found = event_listener.get_events([(master_id, "hana/storage/triaged")], after_time=after)
    found = sorted(found, key=lambda e: e.data["began"])
    return [(e.data["began"], e.data["result"]) if began else e.data["result"] for e in found]


def hot_peers(pillar_root, addresses, exporters, **settings):
    """[(id, overrides)] for started_hot_masters: shipped-reactor masters, each at its address in
    ``addresses`` ({id: address}) on the same two ports (a minion expects every master at an
    address of its own with the same ports), its exporter on ``exporters[id]``."""
    ports = {"ret_port": free_port(), "publish_port": free_port()}
    return [
        (
            name,
            formula_master(
                pillar_root,
                reactor=True,
                exporter_port=exporters[name],
                interface=address,
                **ports,
                **settings,
            ),
        )
        for name, address in addresses.items()
    ]


def started_hot_masters(stack, salt_factories, masters):
    """Start salt-masters as Salt's hot multi-master peers: ``masters`` is [(id, overrides)].
    Each master after the first gets the first's key pair (a minion checks every master with one
    master.pub). Each stops when ``stack`` (a contextlib.ExitStack) closes; returns them."""
    started = []
    for name, overrides in masters:
        factory = salt_factories.salt_master_daemon(name, overrides=overrides)
        if started:
            for part in ("master.pem", "master.pub"):
                shutil.copy2(os.path.join(started[0].config["pki_dir"], part), factory.config["pki_dir"])
        stack.enter_context(factory.started(start_timeout=120))
        started.append(factory)
    return started


def kill_tree(factory):
    """What a master's host dying does to it: every process of it stopped at once (none runs on
    while the others are being killed), then killed; no clean-up."""
    parent = psutil.Process(factory.pid)
    family = [parent, *parent.children(recursive=True)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)
    psutil.wait_procs(family, timeout=30)


OUTCOMES = ("hana/storage/alert", "hana/storage/remediation")  # what triage decides, via its outbox


def outcomes(event_listener, masters, after, rules=None):
    """[(master id, tag, minion, rule)] of every alert and remediation the masters' buses carried
    since ``after`` (for ``rules``, or all), each event_id once: an event sent again (its master
    died before a bus carried it, or before confirming it) is one outcome, not two."""
    found, seen = [], set()
    for master in masters:
        for tag in OUTCOMES:
            for event in event_listener.get_events([(master.id, tag)], after_time=after):
                if (rules is None or event.data.get("rule") in rules) and event.data["event_id"] not in seen:
                    seen.add(event.data["event_id"])
                    found.append((master.id, tag, event.data["minion"], event.data["rule"]))
    return found
