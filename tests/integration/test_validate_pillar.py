"""validate_pillar on a real minion, its modules synced from the formula's file_roots by a real master."""

import base64
import subprocess

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.integration

KEY = base64.b64encode(b"\x01" * 64).decode()
GATE = "hana_storage_|-hana-storage-pillar-valid_|-hana-storage-pillar-valid_|-pillar_valid"
NO_PACKAGES = {"install": False}  # the test host's packages are make deps' business
GOOD = {
    "packages": NO_PACKAGES,
    "key": {"source": "pillar", "material": KEY},
    "volumes": {
        "data": {"mountpoint": "/hana/data", "devices": ["/dev/vdx0", "/dev/vdx1"]},
        "log": {"mountpoint": "/hana/log", "devices": ["/dev/vdx2"], "stripe_size": 64},
    },
}


def test_custom_modules_are_synced(minion):
    ret = minion.salt_call_cli().run("sys.list_functions", "hana_storage")
    assert ret.returncode == 0
    assert {"hana_storage.validate_pillar", "hana_storage.settings"} <= set(ret.data)


def test_valid_pillar_without_host_checks(minion, set_pillar):
    set_pillar(GOOD)
    ret = minion.salt_call_cli().run("hana_storage.validate_pillar", host_checks=False)
    assert ret.returncode == 0, ret
    assert ret.data == []


def test_host_checks_report_missing_devices(minion, set_pillar):
    set_pillar(GOOD)
    ret = minion.salt_call_cli().run("hana_storage.validate_pillar")
    assert ret.data == [
        "hana:storage:volumes:data:devices:0: /dev/vdx0 does not exist on this host",
        "hana:storage:volumes:data:devices:1: /dev/vdx1 does not exist on this host",
        "hana:storage:volumes:log:devices:0: /dev/vdx2 does not exist on this host",
    ]


def test_bad_pillar_errors_name_key_paths_and_hide_the_key(minion, set_pillar):
    bad = {
        "key": {"source": "pillar", "material": "c2hvcnQ="},
        "volumes": {
            "log": {
                "mountpoint": "/hana/log",
                "devices": ["/dev/vdx2"],
                "stripe_size": 100,
                "mount_options": ["nobarrier"],
            }
        },
    }
    set_pillar(bad)
    ret = minion.salt_call_cli().run("hana_storage.validate_pillar", host_checks=False)
    paths = sorted(e.split(": ", 1)[0] for e in ret.data)
    assert paths == [
        "hana:storage:key:material",
        "hana:storage:volumes:log:mount_options:0",
        "hana:storage:volumes:log:stripe_size",
    ], ret.data
    assert "c2hvcnQ=" not in str(ret.data)


def test_state_apply_with_invalid_pillar_touches_nothing(minion, set_pillar):
    """Only the packages (they touch no device) and the gate run; every device state is absent."""
    set_pillar({"packages": NO_PACKAGES, "volumes": {"data": {"mountpoint": "/", "devices": ["/dev/vdx0"]}}})
    ret = minion.salt_call_cli(timeout=120).run("state.apply", "hana.storage")
    assert ret.returncode != 0
    states = ret.data
    assert sorted(states) == [
        GATE,
        "test_|-hana-storage-packages_|-hana-storage-packages_|-show_notification",
    ]
    state = states[GATE]
    assert state["result"] is False and state["changes"] == {}
    assert "hana:storage:volumes:data:mountpoint: / is a system directory" in state["comment"]


def test_state_apply_with_valid_pillar_on_the_test_host(minion, set_pillar):
    """Devices that do not exist here: validation fails with host errors, still nothing else runs."""
    set_pillar(GOOD)
    ret = minion.salt_call_cli(timeout=300).run("state.apply", "hana.storage", test=True)
    states = ret.data
    gate = states[GATE]
    assert gate["result"] is False and "does not exist on this host" in gate["comment"]
    others = [s for s in states.values() if s is not gate and "packages" not in s["__id__"]]
    assert others and all(s["result"] is False and s["changes"] == {} for s in others)
    assert all("requisite failed" in s["comment"] for s in others)


def test_packages_for_this_host_through_real_salt(minion, set_pillar):
    """The package map rendered and checked by the real pkg and pip states (test=True: nothing is
    installed): exactly the Debian map's packages this host lacks are reported as to be installed,
    the libraries are in Salt's Python."""
    set_pillar(dict(GOOD, packages={"install": True}))
    ret = minion.salt_call_cli(timeout=300).run("state.sls", "hana.storage.packages", test=True)
    states = {s["__id__"]: s for s in ret.data.values()}
    debian_map = yaml.safe_load((REPO / "salt/hana/storage/parameters/os_family/Debian.yaml").read_text())
    wanted = debian_map["packages"]["system"] + debian_map["packages"]["scap"]  # compliance:scap is on
    missing = {pkg for pkg in wanted if not dpkg_installed(pkg)}
    system = states["hana-storage-packages"]
    assert set(system["changes"]) == missing, system
    assert system["result"] is (None if missing else True), system
    assert states["hana-storage-python-libraries"]["result"] is True, states["hana-storage-python-libraries"]


def dpkg_installed(package):
    status = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return status.stdout.endswith("install ok installed")
