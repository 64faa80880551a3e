"""Attack 20 on the re-encryption online below LVM (each PV's LUKS2 device re-encrypted side by
side, hana-storage-<volume>-reencrypt-<i>, reencrypt.wants(..., below_lvm)).

The host facts are hana_storage_host.reencrypt_facts read from real LUKS2 images (cryptsetup
2.6.1); /sys, systemd and the XFS read are stubbed (no device-mapper here). Tests whose
docstring starts with "HOLE" fail on the code they were written against (effe833)."""

import datetime
import subprocess

import pytest
from hana_storage_core import luks, reencrypt

from tests.support.real_commands import real_run_all
from tests.unit.conftest import cryptsetup
from tests.unit.test_events import load
from tests.unit.test_reencrypt import facts_of, header_of
from tests.unit.test_sls import luks_states, storage

states = load("_states/hana_storage.py", "hana_storage_state_attack20")
host = load("_modules/hana_storage_host.py", "hana_storage_host_attack20")

TODAY = datetime.date.today()
OLD = datetime.date(2020, 1, 1)
LUKS = {"cipher": "aes-xts-plain64", "key_size": 512, "sector_size": 4096,
        "pbkdf": {"type": "pbkdf2", "force_iterations": 1000}}  # fmt: skip
LV = "/dev/vg_hana_log/lv_hana_log"
OK = {"retcode": 0, "stdout": "", "stderr": ""}


def parse(path):
    return luks.parse_header(luks.reader_for(path.read_bytes()))


def block(dev, dm=None, slaves=(), holders=()):
    return {"dev": dev, "size": 2097152, "slaves": list(slaves), "holders": list(holders),
            "partition_of": None, "dm": dm, "wwid": ""}  # fmt: skip


def dm(name, suspended=False):
    return {"name": name, "uuid": "", "suspended": suspended}


# PV 0 (hana_log_0 on sdb) was being re-encrypted when its cryptsetup was killed: its mapping and
# hotzone stay suspended, I/O to them hangs. PV 1 (hana_log_1 on sdc) is fine. The LV spans both.
FROZEN_SIBLING = {
    "sdb": block("8:16", holders=["dm-1", "dm-2"]),
    "sdc": block("8:32", holders=["dm-3"]),
    "dm-0": block("254:0", dm("hana_log_0", suspended=True), slaves=["dm-1"], holders=["dm-4"]),
    "dm-1": block("254:1", dm("hana_log_0-overlay"), slaves=["sdb", "dm-2"], holders=["dm-0"]),
    "dm-2": block(
        "254:2", dm("hana_log_0-hotzone-forward", suspended=True), slaves=["sdb"], holders=["dm-1"]
    ),
    "dm-3": block("254:3", dm("hana_log_1"), slaves=["sdc"], holders=["dm-4"]),
    "dm-4": block("254:4", dm("vg_hana_log-lv_hana_log"), slaves=["dm-0", "dm-3"]),
}


@pytest.fixture
def pv1(make_luks):
    """PV 1's LUKS2 image (4096-byte sectors, the policy's), its volume key dated 2020."""
    path = make_luks(sector_size=4096, kdf="pbkdf2")
    subprocess.run(["cryptsetup", "token", "import", str(path)], check=True, text=True,
                   input=reencrypt.key_date_token(OLD, parse(path)["uuid"]))  # fmt: skip
    return path


def test_a_pv_s_facts_read_the_lv_through_a_sibling_pv_left_suspended_by_a_killed_run(
    pv1, keyfile, monkeypatch
):
    """HOLE (fixed) [hang of the apply, uninterruptible]: below LVM, reencrypt_facts of PV 1 reads the XFS
    superblock of fs_device (the LV) whenever *its own* stack (hana_log_1 and its leftovers) is
    not suspended (_modules/hana_storage_host.py::reencrypt_facts, `if not facts["suspended"]`).
    The LV also sits on PV 0: after a kill of PV 0's unit, hana_log_0 and its hotzone stay
    suspended ("frozen"), and a read of the LV's first extent (on PV 0) blocks in D state until
    a reboot. reencrypt-0 says "frozen, reboot"; reencrypt-1 (no requisite on -0) then hangs the
    whole apply, even with test=True. Below LVM the sector size never changes, so fs_sector is not
    even needed. Fix: read fs_sector only when no device of fs_device's stack is suspended
    (as audit facts do: core.stack.stack + suspended), or not at all below LVM."""
    read = []
    monkeypatch.setattr(host, "_sysfs", lambda: FROZEN_SIBLING)
    monkeypatch.setattr(host, "_unit_active", lambda unit: False)
    monkeypatch.setattr(host, "_reencrypt_running", lambda crypt_name, device: False)
    monkeypatch.setattr(host, "xfs_superblock", lambda device: read.append(device) or {"sectsize": 4096})
    monkeypatch.setattr(host, "__salt__", {"cmd.run_all": real_run_all}, raising=False)
    monkeypatch.setattr(states, "__salt__", {"hana_storage_host.reencrypt_facts": host.reencrypt_facts,
                                             "cmd.run_all": lambda *a, **k: OK}, raising=False)  # fmt: skip
    monkeypatch.setattr(states, "__opts__", {"test": True}, raising=False)
    monkeypatch.setattr(states, "__context__", {}, raising=False)
    ret = states.reencrypted_online("hana_log_1", str(pv1), str(keyfile), LUKS, LV, 365, None, below_lvm=True)
    assert read == [], f"{read} read through the suspended hana_log_0 (the apply would hang): {ret}"


def test_side_by_side_pv_units_multiply_the_volume_s_bandwidth_cap(tmp_path, monkeypatch):
    """HOLE (fixed) [performance: HANA starved]: in_place:max_mib_s is "at most this many MiB/s read and
    written by the encryption of each volume" (schema.json), README: the unit is "capped by
    in_place:max_mib_s". Below LVM luks.sls hands every PV's reencrypt-<i> the whole cap and
    each PV's unit runs side by side with IOReadBandwidthMax/IOWriteBandwidthMax=<its PV> <cap>:
    a volume on 4 PVs is re-encrypted at 4x the cap (and 4 hotzones hold I/O at once). Fix:
    divide the cap (and the hotzone) by the number of PVs in luks.sls, or start one PV's unit
    only once no sibling's unit runs."""
    volumes = storage()["volumes"]
    volumes["log"]["devices"] += ["/dev/mapper/mpathd", "/dev/mapper/mpathe", "/dev/mapper/mpathf"]
    volumes["log"]["reencrypt_online"] = True
    cap = 100
    rendered = luks_states(tmp_path, {"volumes": volumes, "key": {"source": "keyfile", "path": "/k"},
                                      "in_place": {"max_mib_s": cap}})  # fmt: skip
    steps = [dict(kv for arg in s["hana_storage.reencrypted_online"] for kv in arg.items())
             for sid, s in sorted(rendered.items()) if sid.startswith("hana-storage-log-reencrypt-")]  # fmt: skip
    assert len(steps) == 4
    started = []

    def run_all(argv, **_):
        if argv[0] == "systemd-run":
            started.append(list(argv))
        return OK

    def facts(device, crypt_name, key_file, fs_device):  # each PV paused: the unit is started
        header = header_of(
            4096, "2020-01-01", underway={"mode": "reencrypt", "target": {"sector_size": 4096}}
        )
        return {**facts_of(header), "unit": f"hana-storage-encrypt-{crypt_name}.service", "progress": None}

    monkeypatch.setattr(states, "__salt__", {"hana_storage_host.reencrypt_facts": facts, "cmd.run_all": run_all},
                        raising=False)  # fmt: skip
    monkeypatch.setattr(states, "__opts__", {"test": False}, raising=False)
    monkeypatch.setattr(states, "__context__", {}, raising=False)
    for step in steps:
        step = {k: v for k, v in step.items() if k != "require"}
        assert states.reencrypted_online(**step)["result"] is True
    caps = [
        int(a.split(" ")[-1].rstrip("M")) for argv in started for a in argv if "IOWriteBandwidthMax=" in a
    ]
    assert len(started) == 4 and sum(caps) <= cap, f"4 units side by side at {caps} MiB/s each, cap {cap}"


def test_below_lvm_the_sector_refusal_advises_a_sector_the_lv_s_xfs_cannot_mount_on():
    """HOLE (fixed) [availability, by advice]: below LVM a PV with 512-byte sectors (policy 4096) is
    refused with "re-encrypt each PV by hand with the LV unmounted (cryptsetup reencrypt
    --sector-size 4096)" (reencrypt.wants, below_lvm branch), whatever the XFS on the LV has:
    the below_lvm branch comes before the fs_sector check. With a 512-byte-sector XFS (what a
    512-byte stack was made with) the advice gives each crypt device, so the LV, a 4096-byte
    logical block size and the XFS no longer mounts (above LVM the same case is refused with
    "make the filesystem anew"). Fix: check fs_sector first below LVM too, and say so."""
    young = header_of(512, TODAY.isoformat())
    stage, why, _ = reencrypt.stage(facts_of(young, fs_sector=512), 4096, 365, TODAY, below_lvm=True)
    assert stage == "refused"
    assert "--sector-size 4096" not in why or "mkfs.xfs" in why, why


# ---- what held -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header,words",
    [
        (header_of(4096, None, version=1), "LUKS1"),
        (header_of(4096, "2020-01-01", clevis=True), "clevis token"),
        ({**header_of(4096, "2020-01-01"), "keyslots": [{"id": 0, "type": "luks2"}, {"id": 3, "type": "luks2"}]},
         "keyslot 3"),
    ],
    ids=["luks1", "clevis", "other-keyslot"],
)  # fmt: skip
def test_a_pv_that_differs_is_refused_alone_and_its_sibling_still_goes(header, words):
    """One PV refused (LUKS1, a Clevis token, a keyslot of another key) changes nothing there; the
    sibling at the policy's sector with an old key is wanted at its own sector."""
    refused = reencrypt.stage(facts_of(header), 4096, 365, TODAY, below_lvm=True)
    assert refused[0] == "refused" and words in refused[1], refused
    sibling = reencrypt.stage(facts_of(header_of(4096, "2020-01-01")), 4096, 365, TODAY, below_lvm=True)
    assert sibling[0] == "wanted" and sibling[2] == 4096


def test_below_lvm_test_mode_writes_nothing_and_the_init_keeps_the_pv_s_sector(
    make_luks, keyfile, monkeypatch
):
    path = make_luks(sector_size=512, kdf="pbkdf2")
    cryptsetup("--version")
    subprocess.run(["cryptsetup", "token", "import", str(path)], check=True, text=True,
                   input=reencrypt.key_date_token(OLD, parse(path)["uuid"]))  # fmt: skip
    monkeypatch.setattr(host, "_sysfs", lambda: {"dm-3": block("254:3", dm("hana_log_1"))})
    monkeypatch.setattr(host, "_unit_active", lambda unit: False)
    monkeypatch.setattr(host, "_reencrypt_running", lambda crypt_name, device: False)
    monkeypatch.setattr(host, "xfs_superblock", lambda device: {"sectsize": 512})
    monkeypatch.setattr(host, "__salt__", {"cmd.run_all": real_run_all}, raising=False)
    ran = []
    monkeypatch.setattr(states, "__salt__", {"hana_storage_host.reencrypt_facts": host.reencrypt_facts,
                                             "cmd.run_all": lambda argv, **k: ran.append(argv) or OK},
                        raising=False)  # fmt: skip
    monkeypatch.setattr(states, "__opts__", {"test": True}, raising=False)
    monkeypatch.setattr(states, "__context__", {}, raising=False)
    image = path.read_bytes()
    ret = states.reencrypted_online("hana_log_1", str(path), str(keyfile), LUKS, LV, 365, 4, below_lvm=True)
    assert ret["result"] is None and ret["changes"] == {} and ran == [] and path.read_bytes() == image, ret
    assert "512-byte sectors" in ret["comment"] and "sector size stays" in ret["comment"], ret
