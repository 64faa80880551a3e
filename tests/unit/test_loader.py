"""The formula's package (``_utils/hana_storage_core``) as Salt's own loaders reach it: the loader
modules import it, on every supported Salt line (make test-unit runs this on each), and a module
reloaded after a sync runs on the files the sync brought."""

import importlib
import os
import shutil
import sys

import pytest
import salt.config
import salt.loader

from tests.conftest import REPO


@pytest.fixture
def opts(tmp_path):
    opts = salt.config.minion_config(None)
    opts.update(
        file_client="local",
        cachedir=str(tmp_path / "cache"),
        pki_dir=str(tmp_path / "pki"),
        module_dirs=[str(REPO / "_modules")],
        states_dirs=[str(REPO / "_states")],
        beacons_dirs=[str(REPO / "_beacons")],
        utils_dirs=[str(REPO / "_utils")],
        file_roots={"base": [str(REPO / "salt")]},
        grains={},
    )
    return opts


def test_the_execution_and_state_modules_import_the_package(opts):
    utils = salt.loader.utils(opts)
    functions = salt.loader.minion_mods(opts, utils=utils)
    assert "hana_storage.settings" in functions and "hana_storage_host.probe" in functions
    errors = functions["hana_storage.validate_pillar"]({"volumes": {}}, host_checks=False)
    assert errors == ["hana:storage:volumes: needs at least 1 entry"]  # the package's checks ran
    states = salt.loader.states(opts, functions, utils, {})
    assert "hana_storage.header_backed_up" in states


def test_the_beacon_finds_the_package_though_its_loader_adds_no_utils_directory(opts, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(REPO / "_utils")])
    for name in [n for n in sys.modules if n.startswith("hana_storage_core")]:
        monkeypatch.delitem(sys.modules, name)
    beacons = salt.loader.beacons(opts, {})
    module = sys.modules[beacons["hana_storage.beacon"].__module__]
    core = module._load_core()
    assert core.events.finding_key({"rule": "R", "volume": "v", "device": "d"}) == "R|v|d"


def test_a_synced_package_is_imported_again(tmp_path, monkeypatch):
    """saltutil.sync_all replaces the package's files under a running minion and reloads the
    loader modules: fresh() gives them the new files, not what the process imported first."""
    synced = tmp_path / "extmods" / "utils"
    shutil.copytree(REPO / "_utils" / "hana_storage_core", synced / "hana_storage_core")
    monkeypatch.setattr(sys, "path", [str(synced), *[p for p in sys.path if p != str(REPO / "_utils")]])
    for name in [n for n in sys.modules if n.startswith("hana_storage_core")]:
        monkeypatch.delitem(sys.modules, name)
    first = importlib.import_module("hana_storage_core")
    assert first.fresh() is first
    events = synced / "hana_storage_core" / "events.py"
    events.write_text(events.read_text() + "\nSYNCED = 'the newer file'\n")
    stat = os.stat(events)
    os.utime(events, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = first.fresh()
    assert second is not first and second.events.SYNCED == "the newer file"
    assert second.fresh() is second and first.fresh() is second


# ---- outside review (attack branch): each test below fails until its hole is fixed ----------------


def test_the_beacon_puts_no_directory_of_salts_own_on_sys_path(opts, monkeypatch):
    """Robustness. _load_core appends every directory of the utils loader to sys.path for the life
    of the minion process (the beacon runs in it; each job it forks inherits it): that includes
    Salt's own salt/utils package directory, so each of its ~170 modules becomes importable as a
    top-level module of that name wherever the real one is missing (``import openstack``,
    ``import napalm``, ``import nacl``, ``import crypt`` on Python 3.13 ...): another module's
    optional-dependency check then finds Salt's helper instead of an ImportError."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    beacons = salt.loader.beacons(opts, {})
    module = sys.modules[beacons["hana_storage.beacon"].__module__]
    module._load_core()
    salt_utils = os.path.realpath(os.path.join(os.path.dirname(salt.__file__), "utils"))
    assert salt_utils not in map(os.path.realpath, sys.path), f"{salt_utils} is on sys.path"
