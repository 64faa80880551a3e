"""The state SLS files rendered from a plan, by Salt's own Jinja: which steps each volume gets
and what each requires."""

import re

import pytest
import salt.utils.yaml
import yaml
from hana_storage_core import pillar as hp

from tests.conftest import REPO
from tests.support.sls import render

DEFAULTS = yaml.safe_load((REPO / "salt/hana/storage/parameters/defaults.yaml").read_text())
TANG = {
    "source": "tang",
    "servers": [{"url": "http://tang.example:7500", "thumbprint": "T" * 43}],
    "recovery": {"source": "keyfile", "path": "/etc/hana-storage/keys/recovery.key"},
}


def rendered(tmp_path, storage, sls="luks.sls", moving=()):
    """``moving``: the volumes whose PVs are being moved onto LUKS PVs (moves_pending)."""
    plan = hp.normalize(hp.merge(DEFAULTS, storage))
    functions = {
        "hana_storage.settings": lambda host_checks=True: {"valid": True, "config": plan},
        "hana_storage_host.moves_pending": lambda volume: volume["name"] in moving,
    }
    return salt.utils.yaml.safe_load(render(tmp_path, sls, "Suse", functions=functions))


# every SLS file with states of a volume, in init.sls's order
VOLUME_SLS = ("keys.sls", "guard.sls", "luks.sls", "lvm.sls", "crypttab.sls", "filesystem.sls", "mount.sls")


def rendered_all(tmp_path, storage, files=VOLUME_SLS, moving=()):
    """The states of ``files`` rendered together (an SLS with no state renders to None)."""
    states = {}
    for sls in files:
        states.update(rendered(tmp_path, storage, sls, moving) or {})
    return states


def luks_states(tmp_path, storage):
    return rendered(tmp_path, storage)


def requires(step):
    (require,) = [arg["require"] for arg in step if "require" in arg]
    return [state_id for requisite in require for state_id in requisite.values()]


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
    assert {"hana_storage": "hana-storage-log-flags-0"} in require
    flags = requires(states["hana-storage-log-flags-0"]["hana_storage.luks_flags"])
    assert flags == ["hana-storage-log-clevis-0" if key == "tang" else "hana-storage-log-inside-0"]
    if key == "tang":
        tang = states["hana-storage-data-clevis-0"]["hana_storage.clevis_bound"]
        assert {"header_backup": "/var/lib/hana-storage/luks-headers/hana_data.luks-header"} in tang


@pytest.mark.parametrize("key", ["keyfile", "tang"])
def test_under_fips_each_device_has_its_keyslots_converted_before_its_flags_are_stored(tmp_path, key):
    assert not [s for s in luks_states(tmp_path, storage()) if "-fips-" in s]
    extra = {
        "luks": {"pbkdf": {"type": "pbkdf2", "force_iterations": 1000}},
        "compliance": {"fips": True, "min_pbkdf": {"type": "pbkdf2", "iterations": 1000}},
    }
    if key == "tang":
        extra["key"] = TANG
    states = luks_states(tmp_path, storage(**extra))
    step = states["hana-storage-log-fips-0"]["hana_storage.fips_keyslots"]
    assert {"pbkdf": {"type": "pbkdf2", "force_iterations": 1000, "hash": "sha256"}} in step
    assert requires(step) == ["hana-storage-log-clevis-0" if key == "tang" else "hana-storage-log-inside-0"]
    assert requires(states["hana-storage-log-flags-0"]["hana_storage.luks_flags"]) == [
        "hana-storage-log-fips-0"
    ]
    assert sorted(s for s in states if "-fips-" in s) == [
        "hana-storage-data-fips-0",
        "hana-storage-log-fips-0",
    ]


def test_no_rotation_steps_unless_the_pillar_names_a_previous_key(tmp_path):
    everything = {}
    for sls in ("keys.sls", "guard.sls", "luks.sls", "crypttab.sls"):
        everything.update(rendered(tmp_path, storage(), sls))
    assert not [s for s in everything if "rekey" in s or "retire" in s or s.endswith("-previous")]


@pytest.mark.parametrize("key", ["keyfile", "pillar", "tang"])
def test_a_rotation_adds_the_key_before_opening_and_removes_the_previous_once_crypttab_names_it(
    tmp_path, key
):
    """The order that keeps every device opening with one key or both, and a boot in between
    unlocking: previous key in place -> guard -> open (with either key) -> what it holds is
    checked -> new keyslot (proven) -> flags stored -> crypttab names the new key -> previous
    keyslot removed -> header backup of the final keyslots."""
    previous = {"source": "keyfile", "path": "/etc/hana-storage/keys/old.key"}
    new = {
        "keyfile": {"source": "keyfile", "path": "/etc/hana-storage/keys/new.key", "previous": previous},
        "pillar": {"source": "pillar", "material": "bmV3" * 16, "previous": previous},
        "tang": dict(TANG, recovery=dict(TANG["recovery"], previous=previous)),
    }[key]
    pillar = storage(key=new, header_backup={"directory": "/var/lib/hana-storage/luks-headers"})
    states = {}
    for sls in ("keys.sls", "guard.sls", "luks.sls", "crypttab.sls"):
        states.update(rendered(tmp_path, pillar, sls))
    key_file = {"keyfile": "/etc/hana-storage/keys/new.key", "pillar": "/run/hana-storage/keys/hana.key",
                "tang": "/etc/hana-storage/keys/recovery.key"}[key]  # fmt: skip
    assert {"name": "/etc/hana-storage/keys/old.key"} in states["hana-storage-key-default-previous"][
        "hana_storage.key_present"
    ]
    assert "hana-storage-key-default-previous" in requires(
        states["hana-storage-log-guard"]["hana_storage.devices_safe"]
    )
    for volume, device in (("data", "/dev/vg_hana_data/lv_hana_data"), ("log", "/dev/mapper/mpathc")):
        formatted = states[f"hana-storage-{volume}-luks-0"]["hana_storage.luks_formatted"]
        assert {"previous_key_file": "/etc/hana-storage/keys/old.key"} in formatted
        rekey = states[f"hana-storage-{volume}-rekey-0"]["hana_storage.key_enrolled"]
        assert {"name": device} in rekey and {"key_file": key_file} in rekey
        assert {"previous_key_file": "/etc/hana-storage/keys/old.key"} in rekey
        inside = "hana-storage-data-mkfs" if volume == "data" else "hana-storage-log-inside-0"
        assert requires(rekey) == [inside]
        opened = states[f"hana-storage-{volume}-open-0"]["hana_storage.luks_opened"]
        assert requires(opened) == [f"hana-storage-{volume}-luks-0"]
        assert {"previous_key_file": "/etc/hana-storage/keys/old.key"} in opened
        retire = states[f"hana-storage-{volume}-retire-0"]["hana_storage.previous_key_removed"]
        assert {"name": device} in retire and {"key_file": key_file} in retire
        assert requires(retire) == [f"hana-storage-{volume}-crypttab-0"]
        backup = requires(states[f"hana-storage-{volume}-header-backup-0"]["hana_storage.header_backed_up"])
        assert f"hana-storage-{volume}-retire-0" in backup
        if key == "tang":
            assert requires(states[f"hana-storage-{volume}-clevis-0"]["hana_storage.clevis_bound"]) == [
                f"hana-storage-{volume}-rekey-0"
            ]


def transitive(states, state_id):
    """Every state ``state_id`` requires, directly or through others."""
    seen, todo = set(), [state_id]
    while todo:
        current = todo.pop()
        for step in states.get(current, {}).values():
            for arg in step:
                for requisite in arg.get("require", []) if isinstance(arg, dict) else []:
                    for required in requisite.values():
                        if required not in seen:
                            seen.add(required)
                            todo.append(required)
    return seen


@pytest.mark.parametrize("key", ["keyfile", "tang", "rotation"])
def test_nothing_persistent_reaches_a_device_before_what_it_holds_is_checked(tmp_path, key):
    """Regression (issue 29, item 3): a disk LUKS the key opens, holding XFS, was opened with
    --persistent (its header rewritten) before pv_safe refused it, and got a crypttab line after.
    Every step that writes a header (a keyslot, a binding, stored flags, a backup) or a boot file
    (crypttab) of a crypt device now requires the look inside it (below LVM pv_safe, above it
    the mkfs state's verdict)."""
    keys = {
        "keyfile": {},
        "tang": {"key": TANG},
        "rotation": {"key": {"source": "keyfile", "path": "/etc/hana-storage/keys/new.key",
                             "previous": {"source": "keyfile", "path": "/etc/hana-storage/keys/old.key"}}},
    }[key]  # fmt: skip
    pillar = storage(header_backup={"directory": "/var/lib/hana-storage/luks-headers"}, **keys)
    states = rendered_all(tmp_path, pillar)
    persistent = ("rekey", "tang", "flags", "header-backup", "crypttab", "retire")
    checked = 0
    for volume, inside in (("data", "hana-storage-data-mkfs"), ("log", "hana-storage-log-inside-0")):
        for step in persistent:
            state_id = f"hana-storage-{volume}-{step}-0"
            if state_id in states:
                assert inside in transitive(states, state_id), state_id
                checked += 1
        assert inside not in transitive(states, f"hana-storage-{volume}-open-0")
    assert checked >= 6


def test_no_step_checks_with_unless_onlyif_or_creates():
    """A step with unless/onlyif/creates makes Salt look for ``<module>.mod_run_check`` among the
    state modules; where its module has none (lvm, cmd) the lookup loads every state module and
    with them every execution module: over a minute of each apply on an emulated guest (the lab)
    and seconds of CPU on every minion. The steps check with calls instead."""
    checked = [
        f"{sls.relative_to(REPO)}:{number}: {line.strip()}"
        for sls in sorted((REPO / "salt").rglob("*.sls"))
        for number, line in enumerate(sls.read_text().splitlines(), 1)
        if re.match(r"\s*-\s*(unless|onlyif|creates)\s*:", line)
    ]
    assert not checked, checked


def test_reencrypt_online_re_encrypts_each_pv_below_lvm_keeping_its_sector_size(tmp_path):
    """Above LVM one step on the LV; below it one per PV, each told it is a PV (below_lvm) and
    watching the LV's filesystem."""
    volumes = storage()["volumes"]
    volumes["log"]["devices"].append("/dev/mapper/mpathd")
    for volume in volumes.values():
        volume["reencrypt_online"] = True
    states = luks_states(tmp_path, {"volumes": volumes, "key": {"source": "keyfile", "path": "/k"}})
    steps = {sid: dict(kv for arg in s["hana_storage.reencrypted_online"] for kv in arg.items())
             for sid, s in states.items() if "hana_storage.reencrypted_online" in s}  # fmt: skip
    assert sorted(steps) == ["hana-storage-data-reencrypt-0", "hana-storage-log-reencrypt-0",
                             "hana-storage-log-reencrypt-1"]  # fmt: skip
    assert steps["hana-storage-data-reencrypt-0"]["below_lvm"] is False
    assert steps["hana-storage-data-reencrypt-0"]["fs_device"] == "/dev/mapper/hana_data"
    for index, disk in enumerate(["/dev/mapper/mpathc", "/dev/mapper/mpathd"]):
        step = steps[f"hana-storage-log-reencrypt-{index}"]
        assert step["below_lvm"] is True and step["device"] == disk, step
        assert step["fs_device"] == "/dev/vg_hana_log/lv_hana_log", step
        assert step["max_mib_s"] is None, step


@pytest.mark.parametrize("cap,data,log", [(100, 100, 50), (1, 1, 1), (3, 3, 1)])
def test_below_lvm_the_pvs_units_share_the_volumes_cap(tmp_path, cap, data, log):
    volumes = storage()["volumes"]
    volumes["log"]["devices"].append("/dev/mapper/mpathd")
    for volume in volumes.values():
        volume["reencrypt_online"] = True
    states = luks_states(
        tmp_path,
        {"volumes": volumes, "key": {"source": "keyfile", "path": "/k"}, "in_place": {"max_mib_s": cap}},
    )
    caps = {sid: dict(kv for arg in s["hana_storage.reencrypted_online"] for kv in arg.items())["max_mib_s"]
            for sid, s in states.items() if "hana_storage.reencrypted_online" in s}  # fmt: skip
    assert caps == {"hana-storage-data-reencrypt-0": data, "hana-storage-log-reencrypt-0": log,
                    "hana-storage-log-reencrypt-1": log}  # fmt: skip
