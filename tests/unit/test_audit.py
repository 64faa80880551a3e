"""Stack model and compliance rules on facts recorded in the lab VM (tests/unit/data/lab-mix).

The recording: /hana/data = XFS on LUKS2 on a 2 x 256 KiB striped LV (above LVM), /hana/log =
XFS on a 2 x 64 KiB striped LV over two LUKS2 disks with allow_discards (below LVM),
/hana/shared = plain XFS on vdh, plus a LUKS1 (old1), a plain dm-crypt (plainx) and a
cipher_null (nullc) mapping. `compliant()` is that host with crypttab/fstab written and the log
volume's discards off; each rule test breaks one fact and expects exactly its rule.
"""

import base64
import copy
import json
import re

import pytest
import yaml
from hana_storage_core import dm as dm
from hana_storage_core import luks as luks
from hana_storage_core import lvm as lvm
from hana_storage_core import pillar as hp
from hana_storage_core import rules as rules
from hana_storage_core import stack as stack
from hana_storage_core import tab as tab
from hana_storage_core import xfs as xfs

from tests.conftest import REPO
from tests.unit.conftest import DATA

LAB = DATA / "lab-mix"
DEFAULTS = yaml.safe_load((REPO / "salt/hana/storage/parameters/defaults.yaml").read_text())
SCHEMA = json.loads((REPO / "salt/hana/storage/schema.json").read_text())
KEY_FILE = "/etc/hana-storage/keys/hana.key"
PILLAR = {
    "key": {"source": "keyfile", "path": KEY_FILE},
    "volumes": {
        "data": {"mountpoint": "/hana/data", "devices": ["/dev/vda", "/dev/vdb"], "vg": "vg_a", "lv": "lv_a"},
        "log": {
            "mountpoint": "/hana/log",
            "devices": ["/dev/vdc", "/dev/vdd"],
            "encryption": "below_lvm",
            "stripe_size": 64,
            "vg": "vg_l",
            "lv": "lv_l",
            "mount_options": ["relatime"],
        },
    },
    "compliance": {"min_pbkdf": {"type": "argon2i", "memory_kib": 32768, "time": 4}},
}


RAM_KIB = 16 << 20  # the recorded host's, as the plan has it (core.kdf)


def plan_of(pillar, ram_kib=RAM_KIB, crypttab=None):
    config = hp.merge(DEFAULTS, pillar)
    assert hp.validate(config, SCHEMA) == []
    return hp.normalize(config, None, ram_kib, crypttab)


def recorded_sysfs():
    snapshot = {}
    for line in (LAB / "sysfs.txt").read_text().splitlines():
        name, *pairs = line.split()
        info = dict(pair.split("=", 1) for pair in pairs)
        snapshot[name] = {
            "dev": info["dev"],
            "size": int(info["size"]),
            "slaves": [s for s in info["slaves"].split(",") if s],
            "holders": [s for s in info["holders"].split(",") if s],
            "partition_of": None,
            "dm": {"name": info["dmname"], "uuid": info["dmuuid"], "suspended": info["suspended"] == "1"}
            if info["dmname"]
            else None,
        }
    return snapshot


def header(name):
    return luks.parse_header(luks.reader_for((LAB / name).read_bytes()))


def recorded_facts(sysfs=None):
    mounts = tab.parse_mountinfo((LAB / "mountinfo.txt").read_text())
    devices = stack.build_devices(
        sysfs or recorded_sysfs(), dm.parse_tables((LAB / "dmsetup-table.txt").read_text()), mounts
    )
    return {
        "devices": devices,
        "mounts": mounts,
        "headers": {
            "dm-0": header("hdr-lv_a.bin"),
            "vdc": header("hdr-vdc.bin"),
            "vdd": header("hdr-vdc.bin"),
            "vde": header("hdr-vde.bin"),
        },
        "superblocks": {
            "dm-1": xfs.parse_superblock((LAB / "xfs-sb-data.bin").read_bytes()),
            "dm-4": xfs.parse_superblock((LAB / "xfs-sb-log.bin").read_bytes()),
        },
        "lvm": lvm.parse_segments((LAB / "lvs-segments.json").read_text()),
        "crypttab": [],
        "fstab": [],
        "key_files": {KEY_FILE: {"exists": True, "mode": 0o400, "uid": 0}},
    }


def compliant():
    """The recorded host with persistence written and the log volume's discards off."""
    facts = recorded_facts()
    for name in ("dm-2", "dm-3"):
        facts["devices"][name]["table"][0]["flags"].remove("allow_discards")
    for name in ("vdc", "vdd"):
        facts["headers"][name] = dict(
            facts["headers"][name], flags=["no-read-workqueue", "no-write-workqueue"]
        )
    uuids = {
        "hana_data": facts["headers"]["dm-0"]["uuid"],
        "hana_log_0": facts["headers"]["vdc"]["uuid"],
        "hana_log_1": facts["headers"]["vdd"]["uuid"],
    }
    facts["crypttab"] = tab.parse_crypttab(
        "\n".join(
            tab.render_crypttab(n, f"UUID={u}", KEY_FILE, ["luks", "no-read-workqueue", "no-write-workqueue"])
            for n, u in uuids.items()
        )
    )
    facts["fstab"] = tab.parse_fstab(
        tab.render_fstab(
            f"UUID={facts['superblocks']['dm-1']['uuid']}",
            "/hana/data",
            "xfs",
            ["noatime", "nodiratime", "logbsize=256k"],
        )
        + "\n"
        + tab.render_fstab(f"UUID={facts['superblocks']['dm-4']['uuid']}", "/hana/log", "xfs", ["relatime"])
    )
    facts["crypto_drivers"] = {"aes-xts-plain64": driver("xts-aes-aesni", "aesni_intel", 401)}
    return facts


def driver(name, module, priority):
    """A crypto_drivers fact as the execution module gathers it (core.crypto.driver_of)."""
    return {
        "algorithm": "xts(aes)",
        "driver": name,
        "module": module,
        "priority": priority,
        "generic": "generic" in name,
    }


def found(facts, pillar=PILLAR):
    return sorted(
        (f["rule"], f["volume"], f["device"]) for f in rules.audit(plan_of(pillar), facts)["findings"]
    )


def test_stack_model_of_the_recording():
    devices = recorded_facts()["devices"]
    assert devices["dm-1"]["kind"] == "crypt" and devices["dm-0"]["kind"] == "lv"
    assert devices["dm-6"]["crypt_type"] == "PLAIN" and devices["dm-5"]["crypt_type"] == "LUKS1"
    assert devices["dm-1"]["mountpoints"] == ["/hana/data"]
    assert stack.describe(devices, "dm-1") == {
        "top": "dm-1",
        "devices": ["dm-1", "dm-0", "vda", "vdb"],
        "crypts": ["dm-1"],
        "lvs": ["dm-0"],
        "disks": ["vda", "vdb"],
        "layer": "above_lvm",
        "unencrypted": [],
        "direct_paths": [],
    }
    log = stack.describe(devices, "dm-4")
    assert log["layer"] == "below_lvm" and log["crypts"] == ["dm-2", "dm-3"]
    assert stack.describe(devices, "vdh")["layer"] is None
    assert stack.backing_device(devices["dm-2"]) == "vdc"


def test_partly_unencrypted_stripe_is_found():
    sysfs = recorded_sysfs()
    sysfs["dm-4"]["slaves"] = ["dm-2", "vdd"]  # one leg of the log stripe bypasses dm-crypt
    devices = stack.build_devices(sysfs, dm.parse_tables((LAB / "dmsetup-table.txt").read_text()), [])
    assert stack.unencrypted_leaves(devices, "dm-4") == ["vdd"]


def test_compliant_host_has_no_findings():
    report = rules.audit(plan_of(PILLAR), compliant())
    assert report["findings"] == [] and report["compliant"] is True
    assert report["volumes"]["data"] == {
        "mountpoint": "/hana/data",
        "mounted": True,
        "device": "/dev/mapper/hana_data",
        "fstype": "xfs",
        "layer": "above_lvm",
        "crypt": ["hana_data"],
        "compliant": True,
        "rules": [],
        "stack": ["dm-1", "dm-0", "vda", "vdb"],
        "reencryption": {},
    }
    assert report["volumes"]["log"]["crypt"] == ["hana_log_0", "hana_log_1"]


def test_recorded_mix_against_the_lab_pillar():
    pillar = copy.deepcopy(PILLAR)
    pillar["volumes"]["shared"] = {"mountpoint": "/hana/shared", "devices": ["/dev/vdh"]}
    assert found(recorded_facts(), pillar) == [
        ("HANA-ENC-001", "shared", "/dev/vdh"),
        ("HANA-LAYOUT-001", "shared", "/dev/vdh"),
        ("HANA-PERF-004", "log", "/dev/mapper/hana_log_0"),
        ("HANA-PERF-004", "log", "/dev/mapper/hana_log_1"),
        ("HANA-PERSIST-001", "data", "/dev/mapper/hana_data"),
        ("HANA-PERSIST-001", "log", "/dev/mapper/hana_log_0"),
        ("HANA-PERSIST-001", "log", "/dev/mapper/hana_log_1"),
        ("HANA-PERSIST-001", "shared", "/dev/mapper/hana_shared"),
        ("HANA-PERSIST-002", "data", "/dev/mapper/hana_data"),
        ("HANA-PERSIST-002", "log", "/dev/vg_l/lv_l"),
        ("HANA-PERSIST-002", "shared", "/dev/mapper/hana_shared"),
    ]


def crypt_segment(facts, name="dm-1"):
    return facts["devices"][name]["table"][0]


def as_luks1(facts):
    facts["headers"]["dm-0"] = dict(header("hdr-vde.bin"), uuid=facts["headers"]["dm-0"]["uuid"])


def on_one_path_of_a_lun(facts):
    """vda is one path of a SAN LUN whose other path, sdz, the host sees too: no multipath map."""
    devices = facts["devices"]
    devices["vda"]["wwid"] = "naa.600a098038304437"
    devices["sdz"] = dict(
        copy.deepcopy(devices["vda"]), name="sdz", dev="65:144", path="/dev/sdz", holders=[]
    )


BREAKS = {
    "HANA-ENC-002": as_luks1,
    "HANA-ENC-003": lambda f: crypt_segment(f).update(cipher="aes-cbc-essiv:sha256"),
    "HANA-ENC-004": lambda f: crypt_segment(f).update(key_bits=256),
    "HANA-ENC-005": lambda f: f["headers"].update({"dm-0": {"error": "no LUKS header"}}),
    "HANA-ENC-006": lambda f: f["headers"]["dm-0"]["keyslots"][0].update(
        kdf={"type": "pbkdf2", "hash": "sha256", "iterations": 1000}
    ),
    "HANA-ENC-007": lambda f: f["headers"]["dm-0"].update(
        degraded=True, copies={"primary": "header at 0: sha256 checksum mismatch", "secondary": "ok"}
    ),
    "HANA-PERF-001": lambda f: crypt_segment(f).update(sector_size=512),
    "HANA-PERF-002": lambda f: crypt_segment(f).update(flags=["no_read_workqueue"]),
    "HANA-PERF-005": lambda f: f["crypto_drivers"].update(
        {"aes-xts-plain64": driver("xts(ecb(aes-generic))", "xts", 100)}
    ),
    "HANA-PERF-003": lambda f: f["headers"]["dm-0"].update(flags=[]),
    "HANA-PERF-004": lambda f: crypt_segment(f).update(
        flags=["allow_discards", "no_read_workqueue", "no_write_workqueue"]
    ),
    "HANA-LAYOUT-001": lambda f: f["lvm"][0].update(stripe_size=65536),
    # a growth in another geometry: a 1-stripe tail after the 2 x 256 KiB segment
    "HANA-LAYOUT-008": lambda f: f["lvm"].insert(
        1, dict(f["lvm"][0], stripes=1, stripe_size=0, start=1 << 30)
    ),
    "HANA-LAYOUT-009": lambda f: f["superblocks"]["dm-1"].update(
        data_bytes=f["superblocks"]["dm-1"]["data_bytes"] - (64 << 20)
    ),
    "HANA-LAYOUT-003": lambda f: f["superblocks"]["dm-1"].update(sunit_bytes=0, swidth_bytes=0),
    "HANA-LAYOUT-004": lambda f: f["devices"]["dm-0"].update(suspended=True),
    "HANA-LAYOUT-005": on_one_path_of_a_lun,
    "HANA-LAYOUT-006": lambda f: f.update(
        device_names={"/dev/vda": {"unstable": True, "stable": ["/dev/disk/by-id/virtio-lun0"]}}
    ),
    "HANA-PERSIST-001": lambda f: f["crypttab"][0].update(options=["luks"]),
    "HANA-PERSIST-002": lambda f: f["fstab"][0].update(options=["noatime"]),
    # 3 devices open at boot in half of 16 GiB: 2.7 GiB each, and this keyslot asks for 4
    "HANA-PERSIST-003": lambda f: f["headers"]["dm-0"]["keyslots"][0]["kdf"].update(memory=4 << 20),
    "HANA-KEY-001": lambda f: f["key_files"][KEY_FILE].update(mode=0o644),
    "HANA-KEY-005": lambda f: f["headers"]["dm-0"]["keyslots"].append(
        dict(f["headers"]["dm-0"]["keyslots"][0], id=1)
    ),
}
DEVICE = {
    "HANA-KEY-001": KEY_FILE,
    "HANA-LAYOUT-001": "/dev/mapper/vg_a-lv_a",
    "HANA-LAYOUT-008": "/dev/mapper/vg_a-lv_a",
    "HANA-LAYOUT-005": "/dev/vda",
    "HANA-LAYOUT-006": "/dev/vda",
}
# what else is true of the broken fact: LUKS1 keyslots are always PBKDF2; the key file is shared
ALSO = {
    "HANA-ENC-002": [("HANA-ENC-006", "data", "/dev/mapper/hana_data")],
    "HANA-KEY-001": [("HANA-KEY-001", "log", KEY_FILE)],
    # the kernel's driver serves every device of the cipher
    "HANA-PERF-005": [("HANA-PERF-005", "log", f"/dev/mapper/hana_log_{i}") for i in (0, 1)],
}


@pytest.mark.parametrize("rule", sorted(BREAKS))
def test_each_rule_fires_alone_on_its_broken_fact(rule):
    facts = compliant()
    BREAKS[rule](facts)
    device = DEVICE.get(rule, "/dev/mapper/hana_data")
    assert found(facts) == sorted([(rule, "data", device), *ALSO.get(rule, [])])


def test_keyslots_the_pillar_does_not_account_for_are_key_005(make_luks, keyfile, tmp_path):
    """On a real header: a second passphrase added by hand, then a token enrolled on a third
    keyslot, each open the volume without the key store; once killed, nothing is said."""
    import subprocess

    image, other = make_luks(), tmp_path / "other.key"
    other.write_bytes(b"o" * 64)
    facts = compliant()

    def unaccounted():
        summary = luks.parse_header(luks.reader_for(image.read_bytes()))
        facts["headers"]["dm-0"] = dict(
            facts["headers"]["dm-0"], keyslots=summary["keyslots"], tokens=summary["tokens"]
        )
        report = rules.audit(plan_of(PILLAR), facts)
        return [(f["device"], f["actual"]) for f in report["findings"] if f["rule"] == "HANA-KEY-005"]

    def cryptsetup(action, *args):
        subprocess.run(
            ["cryptsetup", "-q", action, "--key-file", str(keyfile), str(image), *args], check=True
        )

    assert unaccounted() == []
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    cryptsetup("luksAddKey", *cheap, str(other))
    assert unaccounted() == [("/dev/mapper/hana_data", ["keyslot 0", "keyslot 1"])]
    cryptsetup("luksAddKey", *cheap, "--key-slot", "2", str(other))
    token = tmp_path / "token.json"
    token.write_text(json.dumps({"type": "hand-enrolled", "keyslots": ["2"]}))
    subprocess.run(["cryptsetup", "token", "import", "--json-file", str(token), str(image)], check=True)
    assert unaccounted() == [
        ("/dev/mapper/hana_data", ["keyslot 0", "keyslot 1", "keyslot 2 (token hand-enrolled)"])
    ]
    cryptsetup("luksKillSlot", "1")
    cryptsetup("luksKillSlot", "2")
    assert unaccounted() == []


def test_while_a_key_is_rotated_the_previous_keys_keyslot_is_accounted_for(make_luks, keyfile, tmp_path):
    """On a real header: the new key added beside the key in use (the rotation's first step) is
    no back door while the pillar names the previous key; a third passphrase still is."""
    import subprocess

    image, new, other = make_luks(), tmp_path / "new.key", tmp_path / "other.key"
    new.write_bytes(b"n" * 64)
    other.write_bytes(b"o" * 64)
    rotating = copy.deepcopy(PILLAR)
    rotating["key"] = {
        "source": "keyfile",
        "path": str(new),
        "previous": {"source": "keyfile", "path": KEY_FILE},
    }
    facts = compliant()
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]

    def unaccounted(pillar):
        summary = luks.parse_header(luks.reader_for(image.read_bytes()))
        facts["headers"]["dm-0"] = dict(facts["headers"]["dm-0"], keyslots=summary["keyslots"])
        facts["previous_keys"] = {"dm-0": {"keyslots": keyslots_opened_by(image, keyfile), "error": None}}
        report = rules.audit(plan_of(pillar), facts)
        return [f["actual"] for f in report["findings"] if f["rule"] == "HANA-KEY-005"]

    subprocess.run(
        ["cryptsetup", "-q", "luksAddKey", *cheap, "--key-file", str(keyfile), str(image), str(new)],
        check=True,
    )
    assert unaccounted(rotating) == []
    assert unaccounted(PILLAR) == [["keyslot 0", "keyslot 1"]]  # the rotation's pillar is gone: say so
    subprocess.run(
        ["cryptsetup", "-q", "luksAddKey", *cheap, "--key-file", str(keyfile), str(image), str(other)],
        check=True,
    )
    # the previous key's keyslot 0 is accounted for: the new key's and the third one are in question
    assert unaccounted(rotating) == [["keyslot 1", "keyslot 2"]]


def keyslots_opened_by(image, key):
    """The keyslots ``key`` opens on a real header (what hana_storage_host.key_slots finds)."""
    import subprocess

    summary = luks.parse_header(luks.reader_for(image.read_bytes()))
    return [
        int(slot["id"])
        for slot in summary["keyslots"]
        if subprocess.run(
            ["cryptsetup", "open", "--test-passphrase", "--key-file", str(key), "--key-slot", str(slot["id"]),
             str(image)],
            capture_output=True,
        ).returncode
        == 0
    ]  # fmt: skip


def test_a_previous_key_left_in_the_pillar_hides_no_keyslot_once_the_rotation_ended(
    make_luks, keyfile, tmp_path
):
    """Regression (issue 29, item 8): after a finished rotation the audit still allowed two
    passphrase keyslots while ``previous`` stayed in the pillar, so a rogue passphrase added then
    went unreported. The previous key's keyslot is accounted for only while the previous key
    opens one; a previous key that opens none is reported (HANA-KEY-008)."""
    import subprocess

    image, new, rogue = make_luks(), tmp_path / "new.key", tmp_path / "rogue.key"
    new.write_bytes(b"n" * 64)
    rogue.write_bytes(b"r" * 64)
    rotating = copy.deepcopy(PILLAR)
    rotating["key"] = {
        "source": "keyfile",
        "path": str(new),
        "previous": {"source": "keyfile", "path": KEY_FILE},
    }
    facts = compliant()
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]

    def findings():
        summary = luks.parse_header(luks.reader_for(image.read_bytes()))
        facts["headers"]["dm-0"] = dict(facts["headers"]["dm-0"], keyslots=summary["keyslots"])
        facts["previous_keys"] = {"dm-0": {"keyslots": keyslots_opened_by(image, keyfile), "error": None}}
        report = rules.audit(plan_of(rotating), facts)
        return sorted(
            (f["rule"], str(f["actual"])) for f in report["findings"] if f["rule"].startswith("HANA-KEY")
        )

    def cryptsetup(action, key, *args):
        subprocess.run(
            ["cryptsetup", "-q", action, *cheap, "--key-file", str(key), str(image), *args], check=True
        )

    cryptsetup("luksAddKey", keyfile, str(new))  # the rotation's first step: the new key beside the old
    assert findings() == []
    subprocess.run(["cryptsetup", "-q", "luksKillSlot", "--key-file", str(new), str(image), "0"], check=True)
    assert findings() == [("HANA-KEY-008", "[]")]  # retired: the pillar's previous key opens nothing
    cryptsetup("luksAddKey", new, str(rogue))  # a back door added while previous is still in the pillar
    assert findings() == [("HANA-KEY-005", "['keyslot 0', 'keyslot 1']"), ("HANA-KEY-008", "[]")]


BACKUPS = "/var/lib/hana-storage/luks-headers"


def with_header_backups():
    pillar = copy.deepcopy(PILLAR)
    pillar["header_backup"] = {"directory": BACKUPS}
    return pillar


def backup_of(summary, **fact):
    """A header backup fact (hana_storage_host.header_backup) of the header ``summary``."""
    return {
        "exists": True,
        "mode": 0o400,
        "uid": 0,
        "uuid": summary["uuid"],
        "fingerprint": summary["fingerprint"],
        "keyslots": [{"id": k["id"], "fingerprint": k["fingerprint"]} for k in summary["keyslots"]],
        **fact,
    }


@pytest.mark.parametrize(
    "fact,problem",
    [
        (None, "none"),
        ({"exists": True, "error": "no LUKS header"}, "unreadable: no LUKS header"),
        ({"fingerprint": "0" * 64}, "older than the header"),
        ({"mode": 0o644}, "mode 0644, owner uid 0"),
    ],
)
def test_a_missing_stale_or_exposed_header_backup_is_key_006(fact, problem):
    facts = compliant()
    live = facts["headers"]["dm-0"]
    backups = {}
    for crypt in ("hana_data", "hana_log_0", "hana_log_1"):
        header = live if crypt == "hana_data" else facts["headers"][crypt_backing(facts, crypt)]
        backups[f"{BACKUPS}/{crypt}.luks-header"] = backup_of(header)
    facts["header_backups"] = backups
    assert rules.audit(plan_of(with_header_backups()), facts)["compliant"] is True
    data = f"{BACKUPS}/hana_data.luks-header"
    if fact is None:
        del backups[data]
    elif "error" in fact:
        backups[data] = fact
    else:
        backups[data] = backup_of(live, **fact)
    (finding,) = rules.audit(plan_of(with_header_backups()), facts)["findings"]
    assert (finding["rule"], finding["device"], finding["remediation"]) == (
        "HANA-KEY-006",
        "/dev/mapper/hana_data",
        "auto",
    )
    assert finding["actual"].startswith(problem), finding
    fix = rules.fix_for(plan_of(with_header_backups()), finding, {"mounted": True})
    assert fix == {
        "state": "hana_storage.header_backed_up",
        "kwargs": {  # the test pillar names its LV
            "name": "/dev/vg_a/lv_a",
            "backup": data,
            "key_file": KEY_FILE,
            "previous_key_file": None,
            "policy": None,
        },
    }


@pytest.mark.parametrize(
    "damage,actual",
    [
        ({"uuid": "0b5d6e2a-0000-4000-8000-000000000000"}, "the header of another LUKS device"),
        (
            {"keyslots": [{"id": 0, "fingerprint": "gone"}]},
            "keyslots 0 of the backup are gone from the header",
        ),
    ],
)
def test_a_header_that_lost_what_its_backup_holds_is_key_007_and_never_auto(damage, actual):
    """Regression (issue 29, item 1): a backup of another UUID (a stray luksFormat) or holding a
    keyslot the header lost (luksErase, luksKillSlot) was HANA-KEY-006, whose auto fix replaced
    the only copy of the volume key with the damage. It is a manual finding that says restore."""
    facts = compliant()
    live = facts["headers"]["dm-0"]
    data = f"{BACKUPS}/hana_data.luks-header"
    facts["header_backups"] = {data: backup_of(live, **damage)}
    findings = [
        f for f in rules.audit(plan_of(with_header_backups()), facts)["findings"] if f["volume"] == "data"
    ]
    (finding,) = findings
    assert (finding["rule"], finding["remediation"]) == ("HANA-KEY-007", "manual")
    assert finding["actual"].startswith(actual) and "luksHeaderRestore /dev/vg_a/lv_a" in finding["message"]
    assert rules.fix_for(plan_of(with_header_backups()), finding, {"mounted": True}) == {
        "code": "manual_rule"
    }


def crypt_backing(facts, crypt):
    """The kernel name of the device below the crypt mapping ``crypt``."""
    device = next(d for d in facts["devices"].values() if d["dm_name"] == crypt)
    return next(s for s in device["table"] if s["target"] == "crypt")["device_name"]


def test_a_real_header_backup_is_current_until_a_keyslot_changes(make_luks, keyfile, tmp_path):
    import subprocess

    image, backup = make_luks(), tmp_path / "hdr.luks-header"
    subprocess.run(
        ["cryptsetup", "luksHeaderBackup", str(image), "--header-backup-file", str(backup)], check=True
    )
    live = luks.parse_header(luks.reader_for(image.read_bytes()))
    fact = backup_of(luks.parse_header(luks.reader_for(backup.read_bytes())))
    assert rules.header_backup_problem(fact, live) is None
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    subprocess.run(
        ["cryptsetup", "luksAddKey", "-q", *cheap, "--key-file", str(keyfile), str(image), str(keyfile)],
        check=True,
    )
    live = luks.parse_header(luks.reader_for(image.read_bytes()))
    assert rules.header_backup_problem(fact, live)["code"] == "stale"


def test_plain_mapping_is_enc_005():
    facts = compliant()
    facts["devices"]["dm-1"]["crypt_type"] = "PLAIN"
    assert found(facts) == [("HANA-ENC-005", "data", "/dev/mapper/hana_data")]


def test_a_reencryption_in_progress_is_a_fact_not_a_finding():
    """The sector-size re-encryption HANA-PERF-001 asks for, initialised by cryptsetup
    (tests/unit/data/luks2-reencrypt): the reencrypt keyslot (no kdf) is neither an unreadable
    header (HANA-ENC-005) nor a weak KDF (HANA-ENC-006); the volume says the re-encryption runs,
    and PERF-001 (still true until it ends) says so instead of asking for one."""
    facts = compliant()
    recorded = header("../luks2-reencrypt/hdr-init-only.bin")
    facts["headers"]["dm-0"] = dict(
        recorded, uuid=facts["headers"]["dm-0"]["uuid"], flags=["no-read-workqueue", "no-write-workqueue"]
    )
    crypt_segment(facts).update(sector_size=512)  # the dm table until the re-encryption ends
    report = rules.audit(plan_of(PILLAR), facts)
    assert [(f["rule"], f["device"]) for f in report["findings"]] == [
        ("HANA-PERF-001", "/dev/mapper/hana_data")
    ]
    (perf,) = report["findings"]
    assert perf["message"] == (
        "/dev/mapper/hana_data uses 512-byte sectors, the policy asks for 4096 (LUKS2 re-encryption in "
        "progress to aes-xts-plain64, 4096-byte sectors (reencrypt, forward): cryptsetup reencrypt "
        "--resume-only continues it if it is not running)"
    )
    assert report["volumes"]["data"]["reencryption"] == {"/dev/mapper/hana_data": recorded["reencryption"]}
    assert report["volumes"]["log"]["reencryption"] == {}
    # the same header once the re-encryption is through: the fact goes, PERF-001 with it
    facts["headers"]["dm-0"]["reencryption"] = None
    crypt_segment(facts).update(sector_size=4096)
    assert rules.audit(plan_of(PILLAR), facts)["compliant"] is True


def test_layout_002_when_pillar_says_the_other_layer():
    pillar = copy.deepcopy(PILLAR)
    pillar["volumes"]["data"]["encryption"] = "below_lvm"
    facts = compliant()
    # the pillar's below-LVM names: hana_data_0, hana_data_1 in crypttab; not this test's point
    facts["crypttab"] += tab.parse_crypttab(
        "hana_data_0 /dev/vda /etc/hana-storage/keys/hana.key luks,no-read-workqueue,no-write-workqueue\n"
        "hana_data_1 /dev/vdb /etc/hana-storage/keys/hana.key luks,no-read-workqueue,no-write-workqueue\n"
    )
    facts["fstab"][0]["spec"] = "/dev/vg_a/lv_a"
    facts["superblocks"] = {}
    assert ("HANA-LAYOUT-002", "data", "/dev/mapper/hana_data") in found(facts, pillar)


def test_unmounted_volume_is_mount_001_and_still_audited():
    facts = compliant()
    facts["mounts"] = [m for m in facts["mounts"] if m["mountpoint"] != "/hana/data"]
    crypt_segment(facts).update(flags=[])
    assert found(facts) == [
        ("HANA-MOUNT-001", "data", "/dev/mapper/hana_data"),
        ("HANA-PERF-002", "data", "/dev/mapper/hana_data"),
    ]


def test_live_mount_option_missing_is_persist_002():
    facts = compliant()
    mount = next(m for m in facts["mounts"] if m["mountpoint"] == "/hana/data")
    mount["super_options"].remove("logbsize=256k")
    (finding,) = rules.audit(plan_of(PILLAR), facts)["findings"]
    assert finding["rule"] == "HANA-PERSIST-002" and finding["actual"]["live_missing"] == ["logbsize=256k"]


def test_ignore_rules_and_finding_shape():
    facts = compliant()
    BREAKS["HANA-PERF-002"](facts)
    pillar = copy.deepcopy(PILLAR)
    report = rules.audit(plan_of(pillar), facts)
    (finding,) = report["findings"]
    assert set(finding) == {
        "rule",
        "severity",
        "volume",
        "mountpoint",
        "device",
        "expected",
        "actual",
        "remediation",
        "message",
    }
    assert finding["remediation"] == "auto" and finding["expected"] == [
        "no_read_workqueue",
        "no_write_workqueue",
    ]
    pillar["compliance"]["ignore_rules"] = ["HANA-PERF-002"]
    assert rules.audit(plan_of(pillar), facts)["compliant"] is True


def test_pillar_key_file_expected_in_crypttab():
    pillar = copy.deepcopy(PILLAR)
    pillar["key"] = {"source": "pillar", "material": base64.b64encode(b"k" * 64).decode()}
    rules_found = {r for r, *_ in found(compliant(), pillar)}
    assert rules_found == {"HANA-PERSIST-001", "HANA-PERSIST-002"}  # keyfile path and noauto differ


def test_a_generic_aes_driver_is_named_on_every_crypt_device_and_an_unread_one_too():
    facts = compliant()
    BREAKS["HANA-PERF-005"](facts)
    report = rules.audit(plan_of(PILLAR), facts)
    perf = [f for f in report["findings"] if f["rule"] == "HANA-PERF-005"]
    assert sorted(f["device"] for f in perf) == [
        "/dev/mapper/hana_data",
        "/dev/mapper/hana_log_0",
        "/dev/mapper/hana_log_1",
    ]
    assert perf[0]["actual"] == "xts(ecb(aes-generic))" and perf[0]["remediation"] == "manual"
    facts["crypto_drivers"] = {"error": "/proc/crypto: line 3: not 'field : value'"}
    assert {f["actual"] for f in rules.audit(plan_of(PILLAR), facts)["findings"]} == {
        "not read: /proc/crypto: line 3: not 'field : value'"
    }
    facts["crypto_drivers"] = {}  # a cipher no driver serves: ENC-003's business, not this rule's
    assert rules.audit(plan_of(PILLAR), facts)["compliant"] is True


def test_every_rule_has_a_test():
    tested = set(BREAKS) | {
        "HANA-ENC-001",
        "HANA-ENC-005",
        "HANA-LAYOUT-002",
        "HANA-MOUNT-001",
        "HANA-KEY-002",
    }
    tested |= {"HANA-KEY-003", "HANA-KEY-004", "HANA-KEY-006", "HANA-KEY-007", "HANA-KEY-008"}
    tested |= {"HANA-LAYOUT-007", "HANA-ENC-008"}  # ENC-008: test_fips.py
    tested |= {"HANA-KEY-009"}  # test_tpm2.py
    tested |= {"HANA-KEY-010"}  # the cryptoperiod, below
    assert tested == set(rules.RULES)


def test_a_multipath_map_is_its_own_kind_and_its_paths_are_fine_behind_it():
    sysfs = {
        "dm-9": {"dev": "253:9", "size": 8, "slaves": ["sdb", "sdc"], "holders": [], "partition_of": None,
                 "dm": {"name": "mpatha", "uuid": "mpath-3600a098038304437", "suspended": False}},
        "sdb": {"dev": "8:16", "size": 8, "slaves": [], "holders": ["dm-9"], "partition_of": None, "dm": None,
                "wwid": "naa.600a098038304437"},
        "sdc": {"dev": "8:32", "size": 8, "slaves": [], "holders": ["dm-9"], "partition_of": None, "dm": None,
                "wwid": "naa.600a098038304437"},
    }  # fmt: skip
    devices = stack.build_devices(sysfs, {}, [])
    assert devices["dm-9"]["kind"] == "multipath" and devices["dm-9"]["path"] == "/dev/mapper/mpatha"
    assert stack.direct_paths(devices, "dm-9") == []


@pytest.mark.parametrize("scans,found", [(["sdb", "dm-9"], ["sdb"]), (["dm-9"], None), (None, "not known")])
def test_lvm_scanning_the_paths_of_a_map_that_is_a_pv_is_layout_007(scans, found):
    """Issue 29, item 15: above LVM on multipath maps, LVM must see the maps only (pvs -a)."""
    sysfs = {
        "dm-9": {"dev": "253:9", "size": 8, "slaves": ["sdb", "sdc"], "holders": [], "partition_of": None,
                 "dm": {"name": "mpatha", "uuid": "mpath-3600a098038304437", "suspended": False}},
        "sdb": {"dev": "8:16", "size": 8, "slaves": [], "holders": ["dm-9"], "partition_of": None, "dm": None},
        "sdc": {"dev": "8:32", "size": 8, "slaves": [], "holders": ["dm-9"], "partition_of": None, "dm": None},
    }  # fmt: skip
    devices = stack.build_devices(sysfs, {}, [])
    pillar = {
        "key": PILLAR["key"],
        "volumes": {"data": {"mountpoint": "/hana/data", "devices": ["/dev/mapper/mpatha"]}},
    }
    audit = rules.VolumeAudit(
        plan_of(pillar), plan_of(pillar)["volumes"]["data"], {"devices": devices, "lvm_scans": scans}
    )
    audit._lvm_path_rules(stack.describe(devices, "dm-9"))
    got = [(f["rule"], f["device"], f["actual"]) for f in audit.findings]
    if found is None:
        assert got == []
    else:
        assert got == [
            (
                "HANA-LAYOUT-007",
                "/dev/mapper/mpatha",
                found if found != "not known" else "pvs -a failed: not known",
            )
        ]


def test_the_readmes_rule_table_is_the_rule_tables():
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (HANA-[A-Z]+-\d{3}) \| (\w+) \| (\w+) \|.*\| ([^|]+) \|$", readme, re.MULTILINE)
    assert rows == [
        (rule, r.severity, r.remediation, ", ".join(r.controls)) for rule, r in rules.RULES.items()
    ]


# ---- Tang (Clevis bindings made by the real clevis against a real tangd on loopback) -----------


@pytest.fixture(scope="module")
def tang_servers(tmp_path_factory):
    from tang_server import TangServer

    root = tmp_path_factory.mktemp("tang")
    with TangServer(root / "a") as first, TangServer(root / "b") as second:
        yield first, second


def bound_header(tmp_path, tang, name="hdr.img"):
    """A LUKS2 header (a file: no device-mapper needed) bound by `clevis luks bind` to ``tang``
    (the plan's key.clevis), its recovery key in slot 0."""
    import subprocess

    from hana_storage_core import commands as commands

    image, key = tmp_path / name, tmp_path / f"{name}.key"
    key.write_bytes(b"r" * 64)
    subprocess.run(["truncate", "-s", "20M", str(image)], check=True)
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    subprocess.run(
        ["cryptsetup", "luksFormat", "-q", "--type", "luks2", *cheap, "--key-file", str(key), str(image)],
        check=True,
    )
    subprocess.run(commands.clevis_bind(str(image), str(key), tang), check=True, capture_output=True)
    return luks.parse_header(luks.reader_for(image.read_bytes()))


def tang_key(*servers, threshold=1):
    return {
        "source": "tang",
        "servers": [{"url": s.url, "thumbprint": s.thumbprint} for s in servers],
        "threshold": threshold,
        "recovery": {"source": "keyfile", "path": KEY_FILE},
    }


def tang_pillar(key):
    pillar = copy.deepcopy(PILLAR)
    pillar["volumes"]["data"]["key"] = key
    return pillar


def tang_facts(header_of_data):
    """compliant(), the data volume's LUKS header bound as given and its crypttab and fstab as a
    Tang volume has them (no key file, unlocked and mounted once the network is up)."""
    facts = compliant()
    facts["headers"]["dm-0"] = dict(facts["headers"]["dm-0"], tokens=header_of_data["tokens"])
    entry = next(e for e in facts["crypttab"] if e["name"] == "hana_data")
    entry.update(keyfile="none", options=[*entry["options"], "_netdev"])
    facts["fstab"][0]["options"] = [*facts["fstab"][0]["options"], "_netdev"]
    return facts


def test_a_tang_volume_bound_to_its_servers_is_compliant(tang_servers, tmp_path):
    first, second = tang_servers
    single = tang_key(first)
    plan = plan_of(tang_pillar(single))["volumes"]["data"]
    assert plan["key"]["crypttab"] == "none" and "_netdev" in plan["crypttab_options"]
    header = bound_header(tmp_path, plan["key"]["clevis"])
    binding = header["tokens"][0]["clevis"]
    assert binding["pin"] == "tang" and binding["servers"][0]["url"] == first.url
    assert found(tang_facts(header), tang_pillar(single)) == []
    # two servers, both needed (Shamir's sss): bound the same way, compliant too
    both = tang_key(first, second, threshold=2)
    header = bound_header(tmp_path, plan_of(tang_pillar(both))["volumes"]["data"]["key"]["clevis"], "sss.img")
    assert header["tokens"][0]["clevis"]["pin"] == "sss"
    assert found(tang_facts(header), tang_pillar(both)) == []
    assert "jwe" not in json.dumps(header) and "ciphertext" not in json.dumps(header)


def test_a_tang_volume_without_a_binding_is_key_002(tang_servers):
    facts = tang_facts({"tokens": []})
    assert found(facts, tang_pillar(tang_key(tang_servers[0]))) == [
        ("HANA-KEY-002", "data", "/dev/mapper/hana_data")
    ]


@pytest.mark.parametrize("change", ["other server", "other threshold", "one server more"])
def test_a_binding_the_pillar_does_not_name_is_key_003(tang_servers, tmp_path, change):
    first, second = tang_servers
    header = bound_header(tmp_path, plan_of(tang_pillar(tang_key(first)))["volumes"]["data"]["key"]["clevis"])
    pillar_key = {
        "other server": tang_key(second),
        "other threshold": tang_key(first, second, threshold=2),
        "one server more": tang_key(first, second, threshold=1),
    }[change]
    assert found(tang_facts(header), tang_pillar(pillar_key)) == [
        ("HANA-KEY-003", "data", "/dev/mapper/hana_data")
    ]


def test_a_binding_made_with_a_rotated_away_key_is_key_004(tmp_path_factory, tmp_path):
    from tang_server import TangServer

    with TangServer(tmp_path_factory.mktemp("rotating")) as server:
        before = tang_key(server)
        header = bound_header(tmp_path, plan_of(tang_pillar(before))["volumes"]["data"]["key"]["clevis"])
        old = server.thumbprint
        server.rotate()
        assert server.thumbprint != old
        after = tang_pillar(tang_key(server))  # the site puts the new thumbprint in the pillar
        assert found(tang_facts(header), tang_pillar(before)) == []
        report = rules.audit(plan_of(after), tang_facts(header))
        (finding,) = report["findings"]
        assert (finding["rule"], finding["remediation"]) == ("HANA-KEY-004", "auto")
        assert finding["expected"] == [server.thumbprint] and finding["actual"] == [old]
        # its keyslot is Clevis's (PBKDF2, a random passphrase): not an ENC-006 finding too


def test_tang_pillar_errors_name_their_key_paths(tang_servers):
    first, _ = tang_servers
    bad = tang_key(first, threshold=2)
    bad["servers"].append(dict(bad["servers"][0]))
    bad["material"] = "c2VjcmV0"
    config = hp.merge(DEFAULTS, tang_pillar(bad))
    errors = hp.validate(config, SCHEMA)
    assert sorted(e.split(": ", 1)[0] for e in errors) == [
        "hana:storage:volumes:data:key:material",
        "hana:storage:volumes:data:key:servers:1:thumbprint",
        "hana:storage:volumes:data:key:servers:1:url",
    ], errors
    assert "c2VjcmV0" not in str(errors)
    without_recovery = {k: v for k, v in tang_key(first).items() if k != "recovery"}
    assert any(
        "recovery" in e for e in hp.validate(hp.merge(DEFAULTS, tang_pillar(without_recovery)), SCHEMA)
    )


def test_only_the_pillars_clevis_keyslot_is_exempt_from_the_kdf_rule(tang_servers, tmp_path):
    """Clevis adds its keyslot with PBKDF2 (1000 iterations) for a passphrase of 32 random bytes:
    no KDF makes that harder to guess. The recovery keyslot (here cheap on purpose) is judged."""
    first, _ = tang_servers
    pillar = tang_pillar(tang_key(first))
    header = bound_header(tmp_path, plan_of(pillar)["volumes"]["data"]["key"]["clevis"])
    facts = tang_facts(header)
    facts["headers"]["dm-0"]["keyslots"] = header["keyslots"]
    (finding,) = [f for f in rules.audit(plan_of(pillar), facts)["findings"]]
    assert finding["rule"] == "HANA-ENC-006" and [a.split(":")[0] for a in finding["actual"]] == ["keyslot 0"]
    # the same header on a key-file volume: the binding is not the pillar's, both slots count
    facts = compliant()
    facts["headers"]["dm-0"] = dict(
        facts["headers"]["dm-0"], keyslots=header["keyslots"], tokens=header["tokens"]
    )
    weak, unaccounted = rules.audit(plan_of(PILLAR), facts)["findings"]
    assert [a.split(":")[0] for a in weak["actual"]] == ["keyslot 0", "keyslot 1"]
    # and a binding on a volume that names no Tang opens it without the key store
    assert unaccounted["rule"] == "HANA-KEY-005"
    assert unaccounted["actual"] == ["keyslot 0", "keyslot 1 (token clevis)"]


def test_a_lost_tang_binding_is_a_stale_backup_not_a_lost_key(tang_servers, tmp_path):
    """A Clevis binding to the pillar's servers removed since the backup loses no access (the
    recovery key's keyslot holds the key) and binding again restores it: HANA-KEY-006, auto. The
    recovery key's own keyslot lost is HANA-KEY-007."""
    first, _ = tang_servers
    key = tang_key(first)
    bound = bound_header(tmp_path, plan_of(tang_pillar(key))["volumes"]["data"]["key"]["clevis"])
    backup = backup_of(bound, tokens=[t for t in bound["tokens"] if t["type"] == "clevis"])
    pillar = tang_pillar(key)
    pillar["header_backup"] = {"directory": BACKUPS}

    def backup_rules(live):
        facts = tang_facts(bound)
        facts["headers"]["dm-0"] = dict(facts["headers"]["dm-0"], **live)
        facts["header_backups"] = {
            f"{BACKUPS}/{c}.luks-header": {"exists": False} for c in ("hana_log_0", "hana_log_1")
        }
        facts["header_backups"][f"{BACKUPS}/hana_data.luks-header"] = backup
        return sorted(
            (f["rule"], f["volume"])
            for f in rules.audit(plan_of(pillar), facts)["findings"]
            if f["rule"] in ("HANA-KEY-006", "HANA-KEY-007") and f["volume"] == "data"
        )

    recovery, clevis = bound["keyslots"][0], bound["keyslots"][1]
    same = {"uuid": bound["uuid"], "fingerprint": bound["fingerprint"], "keyslots": bound["keyslots"]}
    assert backup_rules(same) == []
    unbound = {**same, "fingerprint": "0" * 64, "keyslots": [recovery], "tokens": []}
    assert backup_rules(unbound) == [("HANA-KEY-006", "data")]
    lost_recovery = {**same, "fingerprint": "0" * 64, "keyslots": [clevis]}
    assert backup_rules(lost_recovery) == [("HANA-KEY-007", "data")]


def test_an_erased_header_of_a_closed_volume_is_key_007():
    """Issue 29, item 1: with the volume shut down the audit said only HANA-MOUNT-001; the header
    of a closed crypt device of the plan is read from its device and judged against its backup."""
    facts = compliant()
    live = facts["headers"]["dm-0"]
    backup = backup_of(live)
    pillar = with_header_backups()
    for name in [n for n, d in facts["devices"].items() if d["dm_name"] == "hana_data"]:
        del facts["devices"][name]  # closed
    facts["closed_headers"] = {"hana_data": dict(live, keyslots=[], fingerprint="0" * 64)}
    facts["header_backups"] = {f"{BACKUPS}/hana_data.luks-header": backup}
    found = {(f["rule"], f["device"]) for f in rules.audit(plan_of(pillar), facts)["findings"]}
    assert ("HANA-KEY-007", "/dev/mapper/hana_data") in found, found


def test_a_crypt_device_on_a_multipath_map_is_opened_at_boot_by_the_map_never_by_uuid():
    """Issue 33 (multipath first): every path of a LUN carries the LUKS header, so a ``UUID=``
    crypttab line opens whichever device /dev/disk/by-uuid names first - a single path when it
    comes up before multipathd claims it. A device on a map is named by the map's own link."""
    wwid_uuid = "mpath-3600a098038304437"
    assert stack.crypttab_source("1b4e28ba-2fa1-11d2-883f-0016d3cca427", wwid_uuid) == (
        f"/dev/disk/by-id/dm-uuid-{wwid_uuid}"
    )
    assert stack.crypttab_source("1b4e28ba", "LVM-abc") == "UUID=1b4e28ba"
    assert stack.crypttab_source("1b4e28ba", "") == "UUID=1b4e28ba"
    assert (
        stack.crypttab_source("1b4e28ba", f"part1-{wwid_uuid}")
        == f"/dev/disk/by-id/dm-uuid-part1-{wwid_uuid}"
    )
    facts = compliant()
    facts["devices"]["vdc"]["dm_uuid"] = wwid_uuid  # hana_log_0's LUKS lies on a map
    (finding,) = rules.audit(plan_of(PILLAR), facts)["findings"]
    assert (finding["rule"], finding["device"]) == ("HANA-PERSIST-001", "/dev/mapper/hana_log_0")
    assert finding["expected"]["device"] == f"/dev/disk/by-id/dm-uuid-{wwid_uuid}"
    assert finding["actual"]["device"].startswith("UUID=") and finding["remediation"] == "auto"
    entry = next(e for e in facts["crypttab"] if e["name"] == "hana_log_0")
    entry["device"] = f"/dev/disk/by-id/dm-uuid-{wwid_uuid}"
    assert rules.audit(plan_of(PILLAR), facts)["compliant"] is True


def test_a_crypt_opened_on_one_path_of_a_map_still_belongs_on_the_map_in_crypttab():
    """The state writes the line from the pillar's device (the map); the audit agrees when the
    crypt was opened on one of the map's paths (HANA-LAYOUT-005 names that), instead of asking
    for UUID= and fighting the state's line."""
    facts = compliant()
    facts["devices"]["dm-9"] = {
        **facts["devices"]["vdc"], "name": "dm-9", "dev": "253:9", "kind": "multipath", "path": "/dev/mapper/mpatha",
        "dm_name": "mpatha", "dm_uuid": "mpath-3600a098038304437", "slaves": ["sdz"], "holders": [], "table": [],
    }  # fmt: skip
    facts["devices"]["sdz"] = {**facts["devices"]["vdc"], "name": "sdz", "wwid": "naa.600a0980"}
    facts["devices"]["vdc"]["wwid"] = "naa.600a0980"  # hana_log_0 was opened on vdc, the map's other path
    entry = next(e for e in facts["crypttab"] if e["name"] == "hana_log_0")
    entry["device"] = "/dev/disk/by-id/dm-uuid-mpath-3600a098038304437"
    assert "HANA-PERSIST-001" not in {f["rule"] for f in rules.audit(plan_of(PILLAR), facts)["findings"]}


def test_during_an_encryption_in_place_the_volume_is_enc_001_with_its_progress_and_nothing_else():
    """cryptsetup's temporary stack (crypt and plaintext segments over hotzone and overlay
    devices) is not judged as a layout: what holds is that part of the volume is plaintext.
    Once nothing runs the encryption, a suspended device of that stack is the frozen I/O of a
    killed cryptsetup."""
    facts = compliant()
    progress = {"done": 1, "size": 4, "percent": 25, "eta_s": 600, "bytes_per_s": 1}
    facts["in_place"] = {"data": {"mode": "encrypt", "running": True, "progress": progress}}
    plan = plan_of(PILLAR)
    report = rules.audit(plan, facts)
    data = [f for f in report["findings"] if f["volume"] == "data"]
    assert [(f["rule"], f["actual"]) for f in data] == [("HANA-ENC-001", "25 % encrypted")]
    assert data[0]["message"].endswith("(encrypting hana_data: 25 %, about 10 min left)")
    assert report["volumes"]["data"]["layer"] == "in_place" and report["volumes"]["data"]["in_place"]
    assert not [f for f in report["findings"] if f["volume"] != "data"]
    facts["in_place"]["data"]["running"] = False
    facts["devices"]["dm-0"]["suspended"] = True
    stopped = [f for f in rules.audit(plan, facts)["findings"] if f["volume"] == "data"]
    assert [f["rule"] for f in stopped] == ["HANA-ENC-001", "HANA-LAYOUT-004"]
    assert "not running (stopped at 25 %): the next apply goes on" in stopped[0]["message"]


def test_while_its_pvs_move_onto_luks_a_volume_below_lvm_is_enc_001_saying_how_far():
    facts = compliant()
    text = "log: move 2 of 3 (/dev/vdd onto hana_log_0) 40 %"
    facts["in_place"] = {
        "log": {"mode": "moves", "running": True, "progress": {"percent": 46, "eta_s": None}, "text": text}
    }
    plan = plan_of(PILLAR)
    log = [f for f in rules.audit(plan, facts)["findings"] if f["volume"] == "log"]
    assert [(f["rule"], f["actual"]) for f in log] == [("HANA-ENC-001", "46 % encrypted")]
    assert log[0]["message"].endswith(f"({text})")
    facts["in_place"]["log"]["running"] = False
    log = [f for f in rules.audit(plan, facts)["findings"] if f["volume"] == "log"]
    assert log[0]["message"].endswith(f"({text}: not running, the next apply starts it again)")


def test_a_volume_key_past_its_cryptoperiod_or_of_unknown_age_is_key_010(make_luks, tmp_path):
    """On a real header: the formula's date token imported by cryptsetup, read by the parser,
    judged on the host's date. No cryptoperiod in the pillar: nothing is said."""
    import datetime
    import subprocess

    from hana_storage_core import reencrypt

    image = make_luks(kdf="pbkdf2")
    facts = compliant()
    facts["today"] = "2026-11-28"
    aged = dict(PILLAR, luks={"volume_key_max_age_days": 365})

    def key_010(pillar=aged):
        summary = luks.parse_header(luks.reader_for(image.read_bytes()))
        facts["headers"]["dm-0"] = dict(facts["headers"]["dm-0"], tokens=summary["tokens"])
        report = rules.audit(plan_of(pillar), facts)
        return [
            (f["device"], f["actual"])
            for f in report["findings"]
            if f["rule"] == "HANA-KEY-010" and f["device"] == "/dev/mapper/hana_data"
        ]

    assert key_010() == [("/dev/mapper/hana_data", "unknown")]
    assert key_010(PILLAR) == []
    subprocess.run(
        ["cryptsetup", "token", "import", str(image)],
        input=reencrypt.key_date_token(datetime.date(2025, 11, 28), facts["headers"]["dm-0"]["uuid"]),
        text=True,
        check=True,
    )
    assert key_010() == []  # 365 days: not older than the cryptoperiod
    facts["today"] = "2026-11-29"
    assert key_010() == [("/dev/mapper/hana_data", 366)]
    facts["today"] = "not a date"
    assert key_010() == []


def test_a_hotzone_a_running_re_encryption_holds_is_no_finding_and_a_frozen_one_is_layout_004():
    """cryptsetup suspends its hotzone device while it re-encrypts that part (about a second,
    reencrypt.hotzone_mib): an audit that lands then saw HANA-LAYOUT-004 "I/O stalls" on a
    healthy volume (the VM tier, below LVM). While the re-encryption runs it is no finding;
    once nothing runs it, it is the frozen I/O of a killed cryptsetup."""
    facts = compliant()
    hotzone = {**facts["devices"]["dm-2"], "name": "dm-9", "dev": "253:9", "kind": "linear",
               "dm_name": "hana_log_0-hotzone-forward", "path": "/dev/mapper/hana_log_0-hotzone-forward",
               "dm_uuid": "CRYPT-SUBDEV-x", "suspended": True, "holders": ["dm-2"], "table": []}  # fmt: skip
    facts["devices"]["dm-9"] = hotzone
    facts["devices"]["dm-2"]["slaves"] = ["vdc", "dm-9"]
    plan = plan_of(PILLAR)
    facts["reencrypting"] = {"hana_log_0": True}
    # the facts do not read a superblock through a suspended stack (host: superblocks)
    facts["superblocks"]["dm-4"] = {
        "error": "not read: a device of the stack is suspended",
        "unread": "suspended",
    }
    assert rules.audit(plan, facts)["findings"] == []
    facts["reencrypting"] = {"hana_log_0": False}
    frozen = [f for f in rules.audit(plan, facts)["findings"] if f["rule"] == "HANA-LAYOUT-004"]
    assert [f["actual"] for f in frozen] == [["suspended: /dev/mapper/hana_log_0-hotzone-forward"]], frozen
