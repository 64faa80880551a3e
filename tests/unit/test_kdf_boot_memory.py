"""The argon2 memory of a keyslot against what the host gives each LUKS device at boot (issue 33,
many LUNs): the share the formula makes keyslots with, the pillar check that refuses a policy the
share cannot meet, and HANA-PERSIST-003. The keyslot is made by the real cryptsetup."""

import copy
import subprocess

import pytest
from hana_storage_core import commands, kdf, luks, rules, tab
from hana_storage_core import pillar as hp

from tests.unit.test_audit import PILLAR, compliant
from tests.unit.test_audit import plan_of as audit_plan
from tests.unit.test_pillar import DEFAULTS, GOOD, HOST, errors_of

GIB_KIB = 1 << 20
EIGHT = [f"/dev/mapper/lun{i}" for i in range(8)]


def sixteen_luns():
    """The seed's Power10 layout twice: two volumes below LVM on eight LUNs each, their key on a
    file the boot reads."""
    pillar = copy.deepcopy(GOOD)
    pillar["key"] = {"source": "keyfile", "path": "/etc/hana-storage/keys/hana.key"}
    pillar["volumes"] = {
        "data": {"mountpoint": "/hana/data", "devices": EIGHT, "encryption": "below_lvm"},
        "log": {"mountpoint": "/hana/log", "devices": [d + "b" for d in EIGHT], "encryption": "below_lvm"},
    }
    return pillar


def plan_of(pillar, ram_kib, crypttab=None):
    return hp.normalize(hp.merge(DEFAULTS, pillar), None, ram_kib, crypttab)


def host_of(pillar):
    host = copy.deepcopy(HOST)
    devices = [d for volume in pillar["volumes"].values() for d in volume["devices"]]
    host["devices"] = {d: {"exists": True, "block": True, "realpath": d} for d in devices}
    return host


def crypttab(*lines):
    return tab.parse_crypttab("\n".join(lines))


def persist_003(plan, facts):
    return [f for f in rules.audit(plan, facts)["findings"] if f["rule"] == "HANA-PERSIST-003"]


def test_sixteen_luns_in_2_gib_get_64_mib_each_not_cryptsetups_1_gib():
    plan = plan_of(sixteen_luns(), 2 * GIB_KIB)
    assert plan["luks"]["boot"] == {"ram_kib": 2 * GIB_KIB, "devices": 16, "share_kib": 65536}
    assert plan["luks"]["pbkdf"] == {"type": "argon2id", "memory_kib": 65536}
    argv = commands.luks_format("/dev/vda", "/k", plan["luks"])
    assert argv[argv.index("--pbkdf-memory") + 1] == "65536"


def test_a_host_with_room_keeps_the_pillars_memory_and_an_unknown_ram_changes_nothing():
    pillar = sixteen_luns()
    pillar["luks"] = {"pbkdf": {"type": "argon2id", "memory_kib": 262144}}
    assert plan_of(pillar, 512 * GIB_KIB)["luks"]["pbkdf"]["memory_kib"] == 262144
    assert plan_of(pillar, None)["luks"]["pbkdf"] == {"type": "argon2id", "memory_kib": 262144}
    assert plan_of(pillar, None)["luks"]["boot"]["share_kib"] is None


def test_pbkdf2_has_no_memory_to_share():
    pillar = sixteen_luns()
    pillar["luks"] = {"pbkdf": {"type": "pbkdf2", "iter_time_ms": 2000}}
    assert plan_of(pillar, 2 * GIB_KIB)["luks"]["pbkdf"] == {"type": "pbkdf2", "iter_time_ms": 2000}


def test_other_crypttab_lines_opened_at_boot_take_their_share_and_noauto_ones_do_not():
    table = crypttab(
        "hana_data_0 UUID=a /k luks",  # the plan's own: counted once
        "backup UUID=b /k luks",
        "swap /dev/sda3 /dev/urandom swap",  # no keyslot: no memory
        "archive /dev/sdz /k luks,noauto",
    )
    plan = plan_of(sixteen_luns(), 2 * GIB_KIB, table)
    assert plan["luks"]["boot"]["devices"] == 17
    assert plan["luks"]["boot"]["share_kib"] == GIB_KIB // 17
    assert kdf.boot_crypt_names({"a"}, {"error": "unreadable"}) == {"a"}


def test_volumes_salt_opens_after_the_boot_are_not_counted():
    """A pillar key is written by Salt after the boot: its crypttab lines are noauto, and Salt's
    states open its devices one after another."""
    pillar = sixteen_luns()
    pillar["key"] = copy.deepcopy(GOOD["key"])
    boot = plan_of(pillar, 2 * GIB_KIB)["luks"]["boot"]
    assert boot == {"ram_kib": 2 * GIB_KIB, "devices": 0, "share_kib": GIB_KIB}


def test_a_policy_minimum_the_share_cannot_meet_is_refused_before_anything_runs():
    pillar = sixteen_luns()
    pillar["compliance"] = {"min_pbkdf": {"type": "argon2id", "memory_kib": 131072, "time": 4}}
    host = host_of(pillar)
    assert errors_of(pillar, {**host, "memory": {"total_kib": 64 * GIB_KIB}}) == []
    (error,) = errors_of(pillar, {**host, "memory": {"total_kib": 2 * GIB_KIB}})
    assert error.startswith("hana:storage:compliance:min_pbkdf:memory_kib: 16 LUKS devices open together")
    assert "2048 MiB of RAM gives each keyslot 65536 KiB, less than the 131072 KiB" in error
    assert errors_of(pillar, {**host, "memory": {"error": "/proc/meminfo: unreadable"}}) == []
    # a PBKDF2 minimum still holds argon2 keyslots to its memory (kdf.weaker, HANA-ENC-006)
    pillar["compliance"]["min_pbkdf"] = {"type": "pbkdf2", "iterations": 1000, "memory_kib": 131072}
    assert len(errors_of(pillar, {**host, "memory": {"total_kib": 2 * GIB_KIB}})) == 1
    pillar["luks"] = {"pbkdf": {"type": "pbkdf2", "iter_time_ms": 2000}}
    assert errors_of(pillar, {**host, "memory": {"total_kib": 2 * GIB_KIB}}) == []


def test_the_share_never_goes_below_what_cryptsetup_accepts():
    """0 on cryptsetup's command line means "not told" (its 1 GiB default), and below 32 KiB it
    refuses a forced cost: a share that small is a pillar error and never reaches luksFormat."""
    pillar = sixteen_luns()
    pillar["compliance"] = {"min_pbkdf": {"type": "pbkdf2", "iterations": 1000, "memory_kib": 0}}
    for ram_kib in (1000, 30):
        assert plan_of(pillar, ram_kib)["luks"]["pbkdf"]["memory_kib"] == kdf.ARGON2_MIN_KIB
        (error,) = errors_of(pillar, {**host_of(pillar), "memory": {"total_kib": ram_kib}})
        assert "less than the 32 KiB asked here" in error


def test_the_audit_names_each_keyslot_above_its_share_with_the_numbers():
    facts = compliant()
    plan = audit_plan(PILLAR, 2 * GIB_KIB, facts["crypttab"])  # 3 devices at boot: 349525 KiB each
    keyslots = facts["headers"]["dm-0"]["keyslots"]
    keyslots[0]["kdf"].update(type="argon2id", memory=GIB_KIB)
    keyslots.append(dict(keyslots[0], id=3, kdf=dict(keyslots[0]["kdf"], memory=349525)))
    (finding,) = persist_003(plan, facts)
    assert finding["device"] == "/dev/mapper/hana_data" and finding["actual"] == ["keyslot 0: 1048576 KiB"]
    assert finding["expected"] == "at most 349525 KiB of argon2 memory per keyslot"
    assert "3 LUKS devices open together at boot" in finding["message"]
    device = facts["devices"]["dm-0"]["path"]
    assert f"cryptsetup luksConvertKey {device} --key-slot 0 --pbkdf-memory 349525" in finding["message"]
    # a scoped audit (the beacon's, of one volume) holds the keyslots to the whole plan's share
    scoped = dict(plan, volumes={"data": plan["volumes"]["data"]})
    assert persist_003(scoped, facts) == [finding]
    assert persist_003(audit_plan(PILLAR, None), facts) == []  # the RAM unknown: no share to hold


def test_keyslots_a_boot_never_derives_are_not_named():
    """systemd-cryptsetup skips keyslots of priority ignore and unbound ones (no volume key)."""
    facts = compliant()
    plan = audit_plan(PILLAR, 2 * GIB_KIB, facts["crypttab"])
    slots = facts["headers"]["dm-0"]["keyslots"]
    heavy = dict(slots[0]["kdf"], type="argon2id", memory=4 << 20)
    slots.append(dict(slots[0], id=1, priority=0, kdf=heavy))  # cryptsetup config --priority ignore
    slots.append(dict(slots[0], id=2, kdf=heavy, volume_key=None))  # luksAddKey --unbound
    assert persist_003(plan, facts) == []
    slots.append(dict(slots[0], id=4, kdf=heavy))
    assert [f["actual"] for f in persist_003(plan, facts)] == [["keyslot 4: 4194304 KiB"]]


def test_a_keyslot_the_real_cryptsetup_makes_with_the_plan_has_the_share(tmp_path):
    plan = plan_of(sixteen_luns(), 2 * GIB_KIB)
    policy = dict(plan["luks"], pbkdf={**plan["luks"]["pbkdf"], "force_iterations": 4, "parallel": 1})
    image, key = tmp_path / "lun.img", tmp_path / "lun.key"
    key.write_bytes(b"k" * 64)
    subprocess.run(["truncate", "-s", "20M", str(image)], check=True)
    subprocess.run(commands.luks_format(str(image), str(key), policy), check=True, capture_output=True)
    header = luks.parse_header(luks.reader_for(image.read_bytes()[: 16 << 20]))
    assert [s["kdf"]["memory"] for s in header["keyslots"]] == [65536]
    assert kdf.above_share(header["keyslots"], plan["luks"]["boot"]["share_kib"]) == []
    assert kdf.above_share(header["keyslots"], 65535) == [(0, 65536)]


@pytest.mark.parametrize(
    "pbkdf,text",
    [
        ({"type": "argon2id", "memory_kib": 65536}, "argon2id, at most 65536 KiB of memory"),
        ({"type": "argon2id"}, "argon2id"),
        ({"type": "pbkdf2"}, "pbkdf2"),
    ],
)
def test_a_states_comment_says_the_most_memory_a_keyslot_is_made_with(pbkdf, text):
    assert kdf.describe(pbkdf) == text
