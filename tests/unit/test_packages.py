"""The package map (salt/hana/storage/packages.jinja) for every distribution, rendered by Salt's
own Jinja (import_yaml through the file client, slsutil.merge), and the SLS it drives."""

import pytest
import salt.utils.yaml

from tests.support.sls import render

EXPECT = {
    "Suse": ["cryptsetup", "lvm2", "xfsprogs", "device-mapper", "multipath-tools", "fio", "openscap-utils"],
    "RedHat": [
        "cryptsetup", "lvm2", "xfsprogs", "device-mapper", "device-mapper-multipath", "fio", "openscap-scanner"
    ],
    "Debian": ["cryptsetup-bin", "lvm2", "xfsprogs", "dmsetup", "multipath-tools", "fio", "openscap-scanner"],
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(EXPECT))
def test_each_family_gets_its_own_package_names_and_pip_for_salts_python(tmp_path, family):
    states = salt.utils.yaml.safe_load(render(tmp_path, "packages.sls", family))
    packages = states["hana-storage-packages"]["pkg.installed"]
    assert {"pkgs": EXPECT[family]} in packages and {"reload_modules": True} in packages
    python = states["hana-storage-python-libraries"]["pip.installed"]
    assert {"pkgs": ["jsonschema", "pyroute2"]} in python


def test_the_scap_scanner_only_while_compliance_scap_is_enabled(tmp_path):
    off = {"hana": {"storage": {"compliance": {"scap": {"enabled": False}}}}}
    states = salt.utils.yaml.safe_load(render(tmp_path, "packages.sls", "Suse", pillar=off))
    assert {"pkgs": EXPECT["Suse"][:-1]} in states["hana-storage-packages"]["pkg.installed"]


@pytest.mark.parametrize("family", ["Suse", "RedHat"])
def test_salt_on_the_system_python_gets_distribution_packages_not_pip(tmp_path, family):
    states = salt.utils.yaml.safe_load(render(tmp_path, "packages.sls", family, python="/usr/bin/python3.6"))
    assert {"pkgs": ["python3-jsonschema", "python3-pyroute2"]} in states["hana-storage-python-libraries"][
        "pkg.installed"
    ]


def test_the_pillar_overrides_the_map(tmp_path):
    pillar = {"hana": {"storage": {"packages": {"system": ["cryptsetup"], "python": ["jsonschema<5"]}}}}
    states = salt.utils.yaml.safe_load(render(tmp_path, "packages.sls", "Suse", pillar=pillar))
    assert {"pkgs": ["cryptsetup", "openscap-utils"]} in states["hana-storage-packages"]["pkg.installed"]
    assert {"pkgs": ["jsonschema<5"]} in states["hana-storage-python-libraries"]["pip.installed"]
    off = {"hana": {"storage": {"packages": {"install": False}}}}
    states = salt.utils.yaml.safe_load(render(tmp_path, "packages.sls", "Suse", pillar=off))
    assert (
        list(states) == ["hana-storage-packages"]
        and "test.show_notification" in states["hana-storage-packages"]
    )


def test_an_unsupported_family_fails_with_a_reason(tmp_path):
    states = salt.utils.yaml.safe_load(render(tmp_path, "packages.sls", "Arch"))
    (fail,) = states["hana-storage-packages"]["test.fail_without_changes"]
    assert "SLES and RHEL" in fail["name"]


CLEVIS = {
    "Suse": ["clevis"],
    "RedHat": ["clevis", "clevis-luks", "clevis-systemd", "clevis-dracut"],
    "Debian": ["clevis", "clevis-luks", "clevis-systemd"],
}


@pytest.mark.parametrize("family", sorted(CLEVIS))
@pytest.mark.parametrize("where", ["key", "volume key"])
def test_clevis_is_installed_only_where_a_volume_uses_tang(tmp_path, family, where):
    tang = {"source": "tang"}
    storage = {"key": tang} if where == "key" else {"volumes": {"log": {"key": tang}}}
    states = salt.utils.yaml.safe_load(
        render(tmp_path, "packages.sls", family, pillar={"hana": {"storage": storage}})
    )
    wanted = EXPECT[family][:-1] + CLEVIS[family] + EXPECT[family][-1:]  # the SCAP scanner last
    assert {"pkgs": wanted} in states["hana-storage-packages"]["pkg.installed"]
