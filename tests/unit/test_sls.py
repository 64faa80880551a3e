"""The state SLS files rendered from a plan, by Salt's own Jinja: which steps each volume gets
and what each requires."""

import hana_storage_pillar as hp
import pytest
import salt.utils.yaml
import yaml

from tests.conftest import REPO
from tests.support.sls import render

DEFAULTS = yaml.safe_load((REPO / "salt/hana/storage/parameters/defaults.yaml").read_text())
TANG = {
    "source": "tang",
    "servers": [{"url": "http://tang.example:7500", "thumbprint": "T" * 43}],
    "recovery": {"source": "keyfile", "path": "/etc/hana-storage/keys/recovery.key"},
}


def luks_states(tmp_path, storage):
    plan = hp.normalize(hp.merge(DEFAULTS, storage))
    settings = {"hana_storage.settings": lambda host_checks=True: {"valid": True, "config": plan}}
    return salt.utils.yaml.safe_load(render(tmp_path, "luks.sls", "Suse", functions=settings))


def storage(**extra):
    volumes = {
        "data": {"mountpoint": "/hana/data", "devices": ["/dev/mapper/mpatha", "/dev/mapper/mpathb"]},
        "log": {"mountpoint": "/hana/log", "devices": ["/dev/mapper/mpathc"], "encryption": "below_lvm"},
    }
    return {"volumes": volumes, **extra}


def test_no_header_backup_step_unless_the_pillar_asks(tmp_path):
    assert not [s for s in luks_states(tmp_path, storage()) if "header-backup" in s]


@pytest.mark.parametrize("key", ["keyfile", "tang"])
def test_the_header_is_backed_up_after_its_keyslots_and_flags_are_in_place(tmp_path, key):
    extra = {"header_backup": {"directory": "/var/lib/hana-storage/luks-headers"}}
    if key == "tang":
        extra["key"] = TANG
    states = luks_states(tmp_path, storage(**extra))
    step = states["hana-storage-log-header-backup-0"]["hana_storage.header_backed_up"]
    assert {"name": "/dev/mapper/mpathc"} in step
    assert {"backup": "/var/lib/hana-storage/luks-headers/hana_log_0.luks-header"} in step
    (require,) = [arg["require"] for arg in step if "require" in arg]
    assert {"hana_storage": "hana-storage-log-open-0"} in require
    assert ({"hana_storage": "hana-storage-log-tang-0"} in require) is (key == "tang")
    if key == "tang":
        tang = states["hana-storage-data-tang-0"]["hana_storage.tang_bound"]
        assert {"header_backup": "/var/lib/hana-storage/luks-headers/hana_data.luks-header"} in tang
