"""`state.apply hana.storage` on a real kernel: both layouts built from the lab pillar and verified
through dmsetup and cryptsetup, test=True exact, idempotent, no key bytes anywhere, and devices
with foreign data (ext4 with files, a foreign PV, a foreign LUKS, a partition table) refused with
their bytes unchanged. Then a reboot on the same disk images: opened and mounted, not formatted.

The lab layout (lab/pillar.sls.j2) without its backup volume, which repeats shared's path (one
disk, above LVM) at a minute per boot: data above LVM over vda-vdd (256 KiB stripes), log below
LVM over vde-vdf (64 KiB), shared on vdg. vdi-vdl carry foreign data.
"""

import base64
import json
import re

import pytest
import yaml
from hana_storage_core.rules import RULES

from tests.conftest import REPO
from tests.vm.conftest import boot, sampling_argv, scap_scan, why_it_ended

pytestmark = pytest.mark.vm

LAB_DISKS = 8
FOREIGN = {"vdi": "ext4 with files", "vdj": "PV of vg_other", "vdk": "LUKS with another key", "vdl": "GPT"}
SPARE = ["/dev/vdm", "/dev/vdn"]  # blank: the interrupted applies build a volume on them
DISKS = LAB_DISKS + len(FOREIGN) + len(SPARE)
KEY_FILE = "/run/hana-storage/keys/hana.key"


def layout(vm):
    """The lab pillar's hana:storage without the backup volume (vdh stays blank)."""
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    del storage["volumes"]["backup"]
    return storage


def pillar_yaml(storage):
    return yaml.safe_dump({"hana": {"storage": storage}})


def ordered(states):
    return sorted(states.values(), key=lambda s: s["__run_num__"])


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=DISKS, disk_size="1G")
    vm.run(
        "set -e\n"
        "mkfs.ext4 -q /dev/vdi && mkdir -p /run/x && mount /dev/vdi /run/x && seq 100000 >/run/x/data.txt "
        "&& umount /run/x\n"
        "pvcreate -q /dev/vdj && vgcreate -q vg_other /dev/vdj && lvcreate -q -y -L 100m -n keep vg_other "
        "&& vgchange -q -an vg_other\n"
        "head -c 64 /dev/urandom >/run/other.key && cryptsetup luksFormat -q --type luks2 --pbkdf pbkdf2 "
        "--pbkdf-force-iterations 1000 --key-file /run/other.key /dev/vdk\n"
        "printf 'label: gpt\\n,200M\\n' | sfdisk -q /dev/vdl\n",
        check=True,
        title="putting foreign data on vdi-vdl",
    )
    vm.foreign_sums = {name: vm.checksum(LAB_DISKS + i) for i, name in enumerate(FOREIGN)}
    vm.layout = pillar_yaml(layout(vm))
    vm.setup_salt(vm.layout)
    return vm


@pytest.fixture(scope="module")
def dry_run(vm):
    return vm.salt("state.apply hana.storage test=True")


@pytest.fixture(scope="module")
def first_apply(vm, dry_run):
    with sampling_argv(vm):
        return vm.salt("state.apply hana.storage", title="state.apply hana.storage (formats the lab disks)")


# ---- the lab itself, before anything is built ----------------------------------------------


def test_lab_disks_and_device_mapper(vm):
    result = vm.run("lsblk -dn -o NAME /dev/vd?; dmsetup targets")
    assert result.ok, result.output
    words = result.output.split()
    assert words[: LAB_DISKS + len(FOREIGN)] == [
        f"vd{chr(ord('a') + i)}" for i in range(LAB_DISKS + len(FOREIGN))
    ]
    assert {"crypt", "striped", "linear"} <= set(words)


def test_lab_step_failure_is_reported(vm):
    result = vm.run("echo to-stderr >&2; exit 7")
    assert result.rc == 7 and "to-stderr" in result.output


def test_lab_pillar_valid(vm):
    # (the fast path's fidelity to real Salt processes: tests/vm/test_events.py applies through a
    # real salt-minion daemon, tests/integration through real master and minion daemons)
    assert vm.salt("hana_storage.validate_pillar").ret == []


def test_invalid_pillar_touches_no_device(vm):
    """A pillar naming the ext4 disk and a disk that does not exist: refused, bytes identical."""
    bad = layout(vm)
    bad["volumes"]["log"]["devices"] = ["/dev/vdi", "/dev/vdz"]
    vm.set_pillar(pillar_yaml(bad))
    try:
        missing = "hana:storage:volumes:log:devices:1: /dev/vdz does not exist on this host"
        assert vm.salt("hana_storage.validate_pillar").ret == [missing]
        result = vm.salt("state.apply hana.storage")
        assert result.retcode != 0
        states = {s["__id__"]: s for s in ordered(result.ret)}
        gate = states.pop("hana-storage-pillar-valid")
        assert gate["result"] is False and missing in gate["comment"]
        assert states.pop("hana-storage-packages")["changes"] == {}  # the lab pillar: install: false
        assert all(
            s["changes"] == {} and s["result"] is not True for i, s in states.items() if "beacon" not in i
        )
        assert vm.checksum(LAB_DISKS) == vm.foreign_sums["vdi"]
    finally:
        vm.set_pillar(vm.layout)


# ---- the lab layout -------------------------------------------------------------------------


def test_dry_run_on_blank_disks_changes_nothing(vm, dry_run):
    assert dry_run.retcode == 0, dry_run.text()[-3000:]
    states = ordered(dry_run.ret)
    assert all(s["changes"] == {} for s in states)
    assert all(s["result"] in (True, None) for s in states)
    would = [s["__id__"] for s in states if s["result"] is None]
    # everything that builds something says it would: keys, LUKS, LVM, crypttab, mkfs, mounts
    for step in (
        "key-default",
        "data-pv-3",
        "data-lv",
        "data-luks-0",
        "log-luks-1",
        "log-open-1",
        "log-vg",
        "shared-mkfs",
        "shared-mount",
        "log-crypttab-1",
    ):
        assert f"hana-storage-{step}" in would, step
    assert vm.run("blkid -p /dev/vda /dev/vde /dev/vdg").rc == 2  # no signature on any lab disk yet
    assert not vm.run("ls /dev/mapper | grep hana_", echo=False).output.strip()


def test_first_apply_builds_everything(first_apply):
    assert first_apply.retcode == 0, first_apply.text()[-3000:]
    states = ordered(first_apply.ret)
    assert all(s["result"] is True for s in states), [s["comment"] for s in states if s["result"] is not True]
    changed = {s["__id__"] for s in states if s["changes"]}
    assert {
        "hana-storage-data-luks-0",
        "hana-storage-log-luks-0",
        "hana-storage-log-luks-1",
        "hana-storage-data-mkfs",
        "hana-storage-log-mkfs",
        "hana-storage-data-mount",
    } <= changed


def test_dm_tables_show_stripes_and_crypt_flags(vm, first_apply):
    tables = vm.salt("hana_storage.dm_tables", check=True).ret
    data_lv = tables["vg_hana_data-lv_hana_data"][0]
    assert data_lv["target"] == "striped" and data_lv["stripes"] == 4 and data_lv["chunk_bytes"] == 256 * 1024
    log_lv = tables["vg_hana_log-lv_hana_log"][0]
    assert log_lv["stripes"] == 2 and log_lv["chunk_bytes"] == 64 * 1024
    for name in ("hana_data", "hana_log_0", "hana_log_1", "hana_shared"):
        (crypt,) = tables[name]
        assert crypt["cipher"] == "aes-xts-plain64" and crypt["key_bits"] == 512, name
        assert crypt["sector_size"] == 4096 and crypt["flags"] == [
            "no_read_workqueue",
            "no_write_workqueue",
        ], name
    # the raw table too, not only our parser's view of it
    raw = vm.run("dmsetup table hana_data", check=True, echo=False).output
    assert "no_read_workqueue no_write_workqueue sector_size:4096" in raw
    assert re.search(r"striped 4 512 ", vm.run("dmsetup table vg_hana_data-lv_hana_data", echo=False).output)


def test_luks_headers_per_cryptsetup(vm, first_apply):
    for device in (
        "/dev/vg_hana_data/lv_hana_data",
        "/dev/vde",
        "/dev/vdf",
        "/dev/vg_hana_shared/lv_hana_shared",
    ):
        meta = json.loads(
            vm.run(f"cryptsetup luksDump --dump-json-metadata {device}", check=True, echo=False).output
        )
        segment = meta["segments"]["0"]
        assert segment["encryption"] == "aes-xts-plain64" and segment["sector_size"] == 4096, device
        assert {s["key_size"] for s in meta["keyslots"].values()} == {64}, device  # 512 bits
        assert sorted(meta["config"]["flags"]) == ["no-read-workqueue", "no-write-workqueue"], device
        assert {s["kdf"]["type"] for s in meta["keyslots"].values()} == {"argon2id"}
        dump = vm.run(f"cryptsetup luksDump {device} | head -3", echo=False).output
        assert "Version:       \t2" in dump


def test_crypttab_and_fstab(vm, first_apply):
    crypttab = vm.run("cat /etc/crypttab", check=True, echo=False).output
    uuid = vm.run("cryptsetup luksUUID /dev/vde", echo=False).output.strip()
    options = "luks,no-read-workqueue,no-write-workqueue,noauto"  # pillar key: Salt opens it, not the boot
    assert re.search(rf"^hana_log_0\s+UUID={uuid}\s+{KEY_FILE}\s+{options}$", crypttab, re.M), crypttab
    for name in ("hana_data", "hana_log_1", "hana_shared"):
        assert re.search(rf"^{name}\s+UUID=\S+\s+{KEY_FILE}\s+{options}$", crypttab, re.M), name
    fstab = vm.run("cat /etc/fstab", check=True, echo=False).output
    fs_uuid = vm.run("blkid -o value -s UUID /dev/mapper/hana_data", echo=False).output.strip()
    assert re.search(
        rf"^UUID={fs_uuid}\s+/hana/data\s+xfs\s+noatime,nodiratime,logbsize=256k,noauto\s+0 0$", fstab, re.M
    ), fstab
    mounts = vm.run("findmnt -rn -o TARGET,SOURCE,OPTIONS -t xfs", echo=False).output
    assert re.search(r"^/hana/log /dev/mapper/vg_hana_log-lv_hana_log \S*noatime", mounts, re.M), mounts
    xfs = vm.salt("hana_storage.xfs_superblock /dev/mapper/hana_data", check=True).ret
    assert (xfs["sunit_bytes"], xfs["swidth_bytes"]) == (256 * 1024, 4 * 256 * 1024)


def test_audit_is_clean_after_apply(vm, first_apply):
    audit = vm.salt("hana_storage.audit", check=True).ret
    assert audit["compliant"] is True, [f["message"] for f in audit["findings"]]


def test_an_oscap_scan_of_the_compliant_layout_passes_every_rule(vm, first_apply):
    """The apply put the SCAP data stream in place; the real oscap, reading the recorded audit,
    passes every rule of it (what SUSE Manager's Audit > OpenSCAP shows for this host)."""
    outcome = scap_scan(vm, "compliant")
    assert len(outcome) == len(RULES) and set(outcome.values()) == {"pass"}, outcome


def test_key_file_on_ramfs_root_only(vm, first_apply):
    """ramfs, not tmpfs: tmpfs pages can be swapped out to disk, ramfs pages never are."""
    out = vm.run(f"stat -c '%a %u' {KEY_FILE}; findmnt -n -o FSTYPE --target {KEY_FILE}", echo=False).output
    assert out.split() == ["400", "0", "ramfs"]


def test_second_apply_changes_nothing(vm, first_apply):
    second = vm.salt("state.apply hana.storage")
    assert second.retcode == 0
    changed = {s["__id__"]: s["changes"] for s in ordered(second.ret) if s["changes"]}
    assert changed == {}
    assert all(s["result"] is True for s in ordered(second.ret))
    vm.second_apply_seconds = second.seconds


def test_dry_run_on_built_system_is_clean(vm, first_apply):
    dry = vm.salt("state.apply hana.storage test=True")
    assert dry.retcode == 0
    assert [s["__id__"] for s in ordered(dry.ret) if s["result"] is not True or s["changes"]] == []


def test_no_key_bytes_in_argv_logs_or_returns(vm, first_apply, dry_run):
    raw = bytes.fromhex(vm.run(f"od -An -tx1 -v {KEY_FILE} | tr -d ' \\n'", echo=False).output.strip())
    needles = {raw.hex(), raw.hex().upper(), base64.b64encode(raw).decode()}
    cmdlines = vm.run("cat /run/cmdlines.txt", echo=False).output
    assert "cryptsetup" in cmdlines or len(cmdlines.splitlines()) > 100  # the sampler ran during the apply
    log = vm.run("cat /run/salt/minion.log", echo=False).output
    assert "DEBUG" in log  # the minion really logs at debug level
    returns = first_apply.text() + dry_run.text()
    for needle in needles:
        assert needle not in cmdlines and needle not in log and needle not in returns
    assert raw not in vm.run("cat /run/salt/minion.log /etc/crypttab /etc/fstab", echo=False).output.encode(
        "utf-8", "surrogateescape"
    )


def safe_mode_pillar(vm, allow=()):
    storage = layout(vm)
    storage["volumes"] = {
        "fs": {"mountpoint": "/hana/fs", "devices": ["/dev/vdi"], "allow_format": list(allow)},
        "pv": {"mountpoint": "/hana/pv", "devices": ["/dev/vdj"]},
        "luks": {"mountpoint": "/hana/luks", "devices": ["/dev/vdk"], "encryption": "below_lvm"},
        "gpt": {"mountpoint": "/hana/gpt", "devices": ["/dev/vdl"]},
    }
    return pillar_yaml(storage)


def test_safe_mode_refuses_foreign_data_and_leaves_it_byte_identical(vm, first_apply):
    vm.set_pillar(safe_mode_pillar(vm))
    result = vm.salt("state.apply hana.storage")
    assert result.retcode != 0
    guards = {s["__id__"]: s for s in ordered(result.ret) if s["__id__"].endswith("-guard")}
    assert all(g["result"] is False and g["changes"] == {} for g in guards.values())
    expect = {
        "fs": "/dev/vdi carries a ext4 signature",
        "pv": "/dev/vdj is a PV of volume group 'vg_other'",
        "luks": "/dev/vdk is LUKS that the volume's key cannot open",
        "gpt": "/dev/vdl carries a gpt partition table",
    }
    for volume, words in expect.items():
        assert words in guards[f"hana-storage-{volume}-guard"]["comment"], guards[
            f"hana-storage-{volume}-guard"
        ]
        assert "Nothing was changed" in guards[f"hana-storage-{volume}-guard"]["comment"]
    assert all(s["changes"] == {} for s in ordered(result.ret))
    for i, name in enumerate(FOREIGN):
        assert vm.checksum(LAB_DISKS + i) == vm.foreign_sums[name], f"{name} ({FOREIGN[name]}) changed"
    assert "100000" in vm.run("mount -o ro /dev/vdi /run/x && tail -1 /run/x/data.txt; umount /run/x").output


def test_allow_format_lets_the_formula_take_a_used_device(vm, first_apply):
    vm.set_pillar(safe_mode_pillar(vm, allow=["/dev/vdi"]))
    dry = vm.salt("state.apply hana.storage test=True")
    guard = dry.ret[next(k for k in dry.ret if "hana-storage-fs-guard" in k)]
    assert guard["result"] is None and "would wipe /dev/vdi" in guard["comment"]
    assert vm.checksum(LAB_DISKS) == vm.foreign_sums["vdi"]
    result = vm.salt("state.apply hana.storage")
    fs_states = [s for s in ordered(result.ret) if s["__id__"].startswith("hana-storage-fs-")]
    assert all(s["result"] is True for s in fs_states), [s["comment"] for s in fs_states]
    assert "/dev/vdi" in fs_states[0]["changes"]["wiped"]
    for i, name in enumerate(list(FOREIGN)[1:], 1):  # the others: still refused, still intact
        assert vm.checksum(LAB_DISKS + i) == vm.foreign_sums[name]
    vm.set_pillar(vm.layout)


# ---- interrupted applies: killed after luksFormat, pvcreate, lvcreate and mkfs -----------------

EXTRA = "/dev/vg_hana_extra/lv_hana_extra"
# (the step the apply has passed, what holds from then on: lab/guest_watch.py's tests, read
# every 20 ms)
INTERRUPTS = [
    ("luksFormat", "luks:/dev/vdm"),
    ("pvcreate", "pv:/dev/mapper/hana_extra_0"),
    ("lvcreate", f"exists:{EXTRA}"),
    # a finished mkfs: an interrupted one (sb_inprogress set) is made again, by design
    ("mkfs", f"xfs:{EXTRA}"),
]
IDENTITY = (
    # a LUKS header counts once the key opens it: luksFormat killed before its keyslot leaves
    # one nobody can open, which the formula formats again (nothing behind it can be read)
    f"for d in /dev/vdm /dev/vdn; do cryptsetup open --test-passphrase --key-file {KEY_FILE} $d 2>/dev/null "
    "&& echo luks $d $(cryptsetup luksUUID $d); done\n"
    "echo pv $(pvs --noheadings -o pv_uuid /dev/mapper/hana_extra_0 2>/dev/null)\n"
    "echo lv $(lvs --noheadings -o lv_uuid vg_hana_extra/lv_hana_extra 2>/dev/null)\n"
    f"xfs_db -r -c 'sb 0' -c 'p inprogress' {EXTRA} 2>/dev/null | grep -q '= 0' "
    f"&& echo xfs $(blkid -p -o value -s UUID {EXTRA})"
)


def identities(vm):
    """What a second format would change: LUKS, PV, LV and XFS UUIDs of the extra volume."""
    out = vm.run(IDENTITY, echo=False).output
    return {
        " ".join(line.split()[:-1]): line.split()[-1] for line in out.splitlines() if len(line.split()) > 1
    }


def test_interrupted_applies_converge_without_formatting_twice(vm, first_apply):
    """An apply in a forked job process (as salt-minion runs one), SIGKILLed with its children
    just after each step; the next apply goes on from there. Data already on another volume
    survives; nothing is formatted twice."""
    storage = layout(vm)
    storage["volumes"] = {
        "shared": storage["volumes"]["shared"],
        "extra": {
            "mountpoint": "/hana/extra",
            "devices": SPARE,
            "encryption": "below_lvm",
            "stripe_size": 64,
        },
    }
    vm.set_pillar(pillar_yaml(storage))
    before = vm.run(
        "head -c 3M /dev/urandom >/hana/shared/keep.bin && sync && sha256sum /hana/shared/keep.bin",
        check=True,
        echo=False,
    ).output
    seen = {}
    try:
        for n, (step, passed) in enumerate(INTERRUPTS):
            title = f"apply {n + 1}/{len(INTERRUPTS)}, killed right after {step}"
            pid = vm.salt("state.apply hana.storage", detach=True, title=title).ret["pid"]
            out = vm.run(
                f"python3 {REPO}/lab/guest_watch.py kill {pid} holds {passed}",  # its process group
                echo=False,
                timeout=1200,
            ).output
            assert "KILLED" in out, f"the apply ended before {step} ({out[-300:]}): {why_it_ended(vm, pid)}"
            for what, uuid in identities(vm).items():
                assert seen.setdefault(what, uuid) == uuid, f"{what} changed after the kill after {step}"
        final = vm.salt("state.apply hana.storage", title="the apply that finishes the job")
        assert isinstance(final.ret, dict), final.ret  # a list: another apply still running
        assert final.retcode == 0, [s["comment"] for s in final.ret.values() if s["result"] is not True]
        assert "xfs" in seen  # every layer existed before the last kill: nothing is left to format
        formatted = [s["__id__"] for s in final.ret.values() if {"formatted", "wiped"} & set(s["changes"])]
        assert not formatted, formatted
        after = identities(vm)
        for what, uuid in seen.items():
            assert after[what] == uuid, f"{what} was formatted again"
        assert len(after) == 5
        assert (
            vm.run("findmnt -n -o SOURCE /hana/extra", echo=False).output.strip()
            == "/dev/mapper/vg_hana_extra-lv_hana_extra"
        )
        assert vm.run("sha256sum /hana/shared/keep.bin", echo=False).output == before
    finally:
        vm.set_pillar(vm.layout)


# ---- reboot: the same disk images, a new kernel, /etc/crypttab and /etc/fstab kept --------------

DATA_FILES = {"/hana/data/a.bin": 8, "/hana/log/b.bin": 4, "/hana/shared/c.bin": 2}


@pytest.fixture(scope="module")
def rebooted(request, vm, first_apply):
    script = (
        "set -e\n"
        + "".join(f"head -c {mib}M /dev/urandom >{path}\n" for path, mib in DATA_FILES.items())
        + f"sync; sha256sum {' '.join(DATA_FILES)}"
    )
    before = vm.run(script, check=True, echo=False).output
    vm.run(
        "set -e; cp /etc/crypttab /etc/fstab $SHARED/; umount /hana/data /hana/log /hana/shared\n"
        "for m in hana_data hana_shared; do cryptsetup close $m; done\n"
        "vgchange -q -an vg_hana_log vg_hana_data vg_hana_shared\n"
        "cryptsetup close hana_log_0; cryptsetup close hana_log_1".replace("$SHARED", str(vm.shared)),
        check=True,
        title="closing everything before the reboot",
    )
    kept = {name: (vm.shared / name).read_text() for name in ("crypttab", "fstab")}
    vm.stop()
    again = boot(request, disks=DISKS, disk_size="1G", fresh=False)
    for name, text in kept.items():
        again.write(f"/etc/{name}", text)
    again.setup_salt(vm.layout)
    again.before = before
    again.kept = kept
    again.apply = again.salt("state.apply hana.storage", title="state.apply after the reboot")
    return again


def test_after_reboot_apply_opens_and_mounts_without_formatting(rebooted):
    result = rebooted.apply
    assert result.retcode == 0, result.text()[-3000:]
    states = ordered(result.ret)
    changed = {s["__id__"]: sorted(s["changes"]) for s in states if s["changes"]}
    assert not [i for i, keys in changed.items() if "formatted" in keys or "wiped" in keys], changed
    assert changed["hana-storage-key-default"] == ["key_file", "mounted"]  # the pillar key: back on ramfs
    for step in ("data-open-0", "log-open-0", "log-open-1", "data-mount", "log-mount"):
        assert f"hana-storage-{step}" in changed, step
    assert "crypttab" not in json.dumps(changed) and "fstab" not in json.dumps(changed)


def test_after_reboot_data_is_intact(rebooted):
    after = rebooted.run(f"sha256sum {' '.join(DATA_FILES)}", check=True, echo=False).output
    assert after == rebooted.before
    for name, text in rebooted.kept.items():
        assert rebooted.run(f"cat /etc/{name}", echo=False).output == text
    assert rebooted.salt("hana_storage.audit", check=True).ret["compliant"] is True
