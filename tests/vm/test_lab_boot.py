"""The lab layout booted by the host without Salt, with a key file and with Tang, on a CPU without
AES instructions - so the audit has exactly one thing to say (HANA-PERF-005).

QEMU's "max" CPU (the lab's default) emulates AES-NI: the guest kernel loads aesni_intel and
dm-crypt gets ``xts-aes-aesni`` (tests/vm/test_audit.py checks it). Here the guest runs on
"max,aes=off": the same kernel builds xts(aes) from aes-generic.

The layout is the lab's (lab/pillar.sls.j2: data striped over four disks above LVM, log below LVM
over two, shared and backup). data and shared unlock with a key file; log and backup are bound
with Clevis to a real tangd on the host's loopback (the guest reaches it as 10.0.2.2 over QEMU's
user network), their recovery key a pillar key on a ramfs. The host's own boot path unlocks both
kinds with no Salt; with Tang unreachable only the Tang volumes stay locked. make test boots once,
without the key file; the boot with Tang down, the Tang server that deleted its rotated keys and
the last boot that opens every line are `long` (make test-all).
"""

import base64
import json

import pytest
import yaml
from tang_server import TangServer

from tests.vm.conftest import boot, boot_without_salt, close_storage, sampling_argv, write_lab_key

pytestmark = pytest.mark.vm

KEY_FILE = "/etc/hana-storage/keys/hana.key"
MOUNTPOINTS = ["/hana/data", "/hana/log", "/hana/shared", "/hana/backup"]
VGS = ["vg_hana_data", "vg_hana_log", "vg_hana_shared", "vg_hana_backup"]
CRYPTS = ["hana_data", "hana_log_0", "hana_log_1", "hana_shared", "hana_backup"]
DATA_LV = "/dev/vg_hana_data/lv_hana_data"
SHARED_LV = "/dev/vg_hana_shared/lv_hana_shared"
BACKUPS = "/etc/hana-storage/luks-headers"  # the guest's /var is the host's, read-only
STALE = "older than the header: keyslots, tokens or flags were added since"
TANG_CRYPTS = {
    "hana_log_0": "/dev/vde",
    "hana_log_1": "/dev/vdf",
    "hana_backup": "/dev/vg_hana_backup/lv_hana_backup",
}


@pytest.fixture(scope="module")
def tang(tmp_path_factory):
    with TangServer(tmp_path_factory.mktemp("tang")) as server:
        yield server


@pytest.fixture(scope="module")
def vm(request, tang):
    vm = boot(request, disks=8, disk_size="1G", cpu="max,aes=off", network=True)  # XFS needs 300 MB
    write_lab_key(vm, KEY_FILE)
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["key"] = {"source": "keyfile", "path": KEY_FILE}
    bound = {
        "source": "tang",
        "servers": [{"url": tang.guest_url, "thumbprint": tang.thumbprint}],
        "recovery": {"source": "pillar", "material": vm.key_b64()},
    }
    storage["volumes"]["log"]["key"] = bound
    storage["volumes"]["backup"]["key"] = bound
    storage["header_backup"] = {"directory": BACKUPS}
    vm.setup_salt(yaml.safe_dump({"hana": {"storage": storage}}))
    vm.storage = storage  # the rotation test names Tang's new key in it
    return vm


@pytest.fixture(scope="module")
def built(vm):
    with sampling_argv(vm):  # while clevis binds
        applied = vm.salt(
            "state.apply hana.storage", title="state.apply: the lab layout, key file and Tang, no AES-NI"
        )
    assert applied.retcode == 0, [s["comment"] for s in applied.ret.values() if s["result"] is not True]
    return applied


def audit(vm):
    return vm.salt("hana_storage.audit", check=True).ret


def only_the_generic_driver(report):
    assert [(f["rule"], f["actual"]) for f in report["findings"]] == [
        ("HANA-PERF-005", "xts(ecb(aes-generic))")
    ] * len(CRYPTS), [f["message"] for f in report["findings"]]
    assert sorted(f["device"] for f in report["findings"]) == sorted(f"/dev/mapper/{c}" for c in CRYPTS)
    assert all(f["remediation"] == "manual" for f in report["findings"])


def test_the_guest_cpu_has_no_aes_instructions(vm):
    assert vm.run("grep -c -w aes /proc/cpuinfo", echo=False).output.strip() == "0"


def test_the_lab_layout_is_compliant_but_for_its_generic_aes_driver(vm, built):
    only_the_generic_driver(audit(vm))  # its header backups current too (HANA-KEY-006)
    listing = vm.run(f"stat -c '%a %U %n' {BACKUPS} {BACKUPS}/*", check=True, echo=False).output.split()
    assert listing == ["700", "root", BACKUPS] + [
        part for c in sorted(CRYPTS) for part in ("400", "root", f"{BACKUPS}/{c}.luks-header")
    ], listing
    again = vm.salt("state.apply hana.storage", check=True, title="state.apply again: nothing to change")
    assert not [s["__id__"] for s in again.ret.values() if s["changes"]]


def test_the_tang_volumes_are_bound_and_unlock_without_a_key_file(vm, built, tang):
    bound = sorted(s["name"] for s in built.ret.values() if s["__id__"].split("-")[-2] == "clevis")
    assert bound == sorted(TANG_CRYPTS.values()), bound
    for device in TANG_CRYPTS.values():
        tokens = vm.salt(f"hana_storage.luks_header {device}", check=True).ret["tokens"]
        (clevis,) = [t["clevis"] for t in tokens if t["type"] == "clevis"]
        server = clevis["servers"][0]
        assert server["url"] == tang.guest_url and tang.thumbprint in server["thumbprints"]
    lines = vm.run("cat /etc/crypttab", echo=False).output.splitlines()
    crypttab = {line.split()[0]: line.split() for line in lines if line.strip() and not line.startswith("#")}
    for name in CRYPTS:
        keyfile, options = crypttab[name][2], crypttab[name][3].split(",")
        assert (keyfile, "_netdev" in options) == (
            ("none", True) if name in TANG_CRYPTS else (KEY_FILE, False)
        )
    # the recovery key (the pillar's) and the key file's key are nowhere but their files: not in
    # an argv while clevis bound the devices, the minion's debug log, crypttab, fstab, the returns
    cmdlines = vm.run("cat /run/cmdlines.txt", echo=False).output
    assert "clevis" in cmdlines  # sampled while it bound
    text = (
        json.dumps(built.ret)
        + cmdlines
        + vm.run("cat /etc/crypttab /etc/fstab /run/salt/minion.log", echo=False).output
    )
    raw = base64.b64decode(vm.key_b64())
    for needle in (vm.key_b64(), raw.hex(), raw.hex().upper()):
        assert needle not in text


def test_key_findings_are_found_and_the_auto_ones_remediated(vm, built, tang):
    """A removed binding (HANA-KEY-002), bindings made with a rotated-away Tang key (HANA-KEY-004)
    and a second passphrase added by hand (HANA-KEY-005, for people), each header changed since
    its backup (HANA-KEY-006): one audit and one remediation for all, as the lab's emulated guest
    makes each cost a minute."""
    device = TANG_CRYPTS["hana_backup"]
    vm.run(f"clevis luks unbind -f -d {device} -s 1", check=True, title="removing the backup LV's binding")
    vm.run(
        f"head -c 64 /dev/urandom >/run/other.key && cryptsetup luksAddKey -q --pbkdf argon2id --pbkdf-memory 8192 "
        f"--pbkdf-force-iterations 4 --key-file {KEY_FILE} {DATA_LV} /run/other.key",
        check=True,
        title="adding a second passphrase to the data LV",
    )
    old = tang.thumbprint
    tang.rotate()
    assert tang.thumbprint != old
    for volume in ("log", "backup"):
        vm.storage["volumes"][volume]["key"]["servers"][0]["thumbprint"] = tang.thumbprint
    vm.set_pillar(yaml.safe_dump({"hana": {"storage": vm.storage}}))
    found = sorted(
        (f["rule"], f["device"], f["remediation"], f["actual"])
        for f in audit(vm)["findings"]
        if f["rule"] != "HANA-PERF-005"
    )
    assert found == [
        ("HANA-KEY-002", "/dev/mapper/hana_backup", "auto", "none"),
        ("HANA-KEY-004", "/dev/mapper/hana_log_0", "auto", [old]),
        ("HANA-KEY-004", "/dev/mapper/hana_log_1", "auto", [old]),
        ("HANA-KEY-005", "/dev/mapper/hana_data", "manual", ["keyslot 0", "keyslot 1"]),
        ("HANA-KEY-006", "/dev/mapper/hana_backup", "auto", STALE),
        ("HANA-KEY-006", "/dev/mapper/hana_data", "auto", STALE),
    ], found
    # with the passphrase gone the data LV's header has the keyslots of its backup again: the
    # backup restores exactly them, so it is current (and not made again)
    vm.run(f"cryptsetup luksKillSlot -q {DATA_LV} 1 && rm /run/other.key", check=True)
    remediated = vm.salt(
        "hana_storage.remediate rules=HANA-KEY-002,HANA-KEY-004,HANA-KEY-006", check=True
    ).ret
    assert (
        sorted((f["rule"], f["device"]) for f in remediated["fixed"])
        == [(rule, dev) for rule, dev, how, _ in found if how == "auto" and dev != "/dev/mapper/hana_data"]
        and not remediated["remaining"]
    ), remediated
    for device in TANG_CRYPTS.values():
        tokens = vm.salt(f"hana_storage.luks_header {device}", check=True).ret["tokens"]
        (clevis,) = [t["clevis"] for t in tokens if t["type"] == "clevis"]
        assert tang.thumbprint in clevis["servers"][0]["thumbprints"], clevis
    only_the_generic_driver(audit(vm))


# How each auto rule is broken on the built lab layout; KEY-002 and KEY-004 are broken (a binding
# removed, Tang's keys rotated) and fixed in the test above, LAYOUT-009 in tests/vm/test_grow.py. Every auto rule of the rule table
# must be here: a new auto rule without a fix proven on a real minion fails the suite.
BREAKERS = {
    # the flags dropped, active and stored (a refresh takes the stored ones unless told otherwise)
    "HANA-PERF-002": f"cryptsetup refresh --persistent --key-file {KEY_FILE} hana_shared",
    "HANA-PERF-003": (  # stored flags dropped, active ones put back
        f"cryptsetup refresh --persistent --key-file {KEY_FILE} hana_data && cryptsetup refresh "
        f"--key-file {KEY_FILE} --perf-no_read_workqueue --perf-no_write_workqueue hana_data"
    ),
    "HANA-PERF-004": (  # discards on, the flags as they were
        f"cryptsetup refresh --key-file {KEY_FILE} --allow-discards --perf-no_read_workqueue "
        "--perf-no_write_workqueue hana_data"
    ),
    "HANA-PERSIST-001": "sed -i '/^hana_shared /d' /etc/crypttab",
    "HANA-PERSIST-002": "sed -i '/ \\/hana\\/shared /s/nodiratime,//' /etc/fstab",
    "HANA-KEY-001": f"chmod 0644 {KEY_FILE}",
    "HANA-KEY-002": None,
    "HANA-KEY-004": None,
    "HANA-KEY-006": f"rm {BACKUPS}/hana_log_1.luks-header",
    "HANA-LAYOUT-009": None,  # needs room the lab's disks lack: tests/vm/test_grow.py grows an LV by hand
}


def test_every_auto_rules_fix_works_through_remediate_on_a_real_minion(vm, built):
    """Regression (issue 29, item 14): the KEY-001 fix failed on every minion ("Pillar data must
    be formatted as a dictionary"), and no test had run it. Each auto rule is broken, found by the
    audit, fixed by hana_storage.remediate (the call triage makes) and gone from the audit after."""
    from hana_storage_core import rules as hana_storage_rules

    assert set(BREAKERS) == set(hana_storage_rules.auto_rules())
    vm.run(
        "set -e\n" + "\n".join(shell for shell in BREAKERS.values() if shell),
        check=True,
        title=f"breaking {len([b for b in BREAKERS.values() if b])} auto rules on the lab layout",
    )
    found = {f["rule"] for f in audit(vm)["findings"]} - {"HANA-PERF-005"}
    broken = {rule for rule, shell in BREAKERS.items() if shell}
    assert found == broken, found
    remediated = vm.salt("hana_storage.remediate", title="hana_storage.remediate: every auto rule").ret
    assert {f["rule"] for f in remediated["fixed"]} == broken, remediated
    assert remediated["failed"] == [] and remediated["remaining"] == [] and remediated["result"] is True, (
        remediated
    )
    only_the_generic_driver(audit(vm))


def test_a_destroyed_header_is_restored_from_its_backup(vm, built):
    """The README's restore procedure: the data behind a zeroed LUKS header comes back."""
    vm.run("head -c 4M /dev/urandom >/hana/shared/restore.bin && sync", check=True)
    before = vm.run("sha256sum /hana/shared/restore.bin", check=True, echo=False).output
    vm.run(
        f"umount /hana/shared && cryptsetup close hana_shared && "
        # both copies of the header: the formula's LUKS2 metadata is 128 KiB a copy
        f"dd if=/dev/zero of={SHARED_LV} bs=128k count=2 conv=fsync status=none",
        check=True,
        title="destroying the shared LV's LUKS header (both copies)",
    )
    assert vm.run(f"cryptsetup isLuks {SHARED_LV}", echo=False).rc != 0
    vm.run(
        f"cryptsetup luksHeaderRestore -q {SHARED_LV} --header-backup-file {BACKUPS}/hana_shared.luks-header && "
        f"cryptsetup open --key-file {KEY_FILE} {SHARED_LV} hana_shared && mount /hana/shared",
        check=True,
        title="restoring it from its backup",
    )
    assert vm.run("sha256sum /hana/shared/restore.bin", check=True, echo=False).output == before


# seconds Clevis may take for a keyslot in the lab's guests: they run under emulation, each
# process start 20-50 times slower than on a real host, where the default (30 s) holds
LAB_CLEVIS_TIMEOUT = 150


def readiness_result(vm):
    """What hana_storage.boot_readiness returns; each cause of a line not ready is printed (a
    failing test shows them)."""
    result = vm.salt(
        f"hana_storage.boot_readiness clevis_timeout={LAB_CLEVIS_TIMEOUT}",
        title="hana_storage.boot_readiness",
    ).ret
    for line in result.get("lines", []):
        for problem in line["problems"]:
            print(f"readiness: {line['name']}: {problem['code']}: {problem['cause']}")
    return result


def codes(result):
    """(ready, {crypttab name: [problem codes]} of the lines not ready) of a readiness result."""
    assert all(line["at_boot"] for line in result["lines"]), result
    return result["ready"], {
        line["name"]: [p["code"] for p in line["problems"]] for line in result["lines"] if not line["ready"]
    }


def readiness(vm):
    return codes(readiness_result(vm))


KEPT = " ".join(f"{m}/keep.bin" for m in MOUNTPOINTS)


@pytest.fixture(scope="module")
def kept(vm, built):
    """A checksummed file on each volume, written before the boots without Salt; its sha256sum
    output."""
    vm.run(f"for f in {KEPT}; do head -c 1M /dev/urandom >$f; done; sync", check=True)
    return vm.run(f"sha256sum {KEPT}", check=True, echo=False).output


# Three boots without Salt, each after readiness said what it would leave locked: the key file
# gone (its lines), Tang down (Tang's lines), then, Tang's rotated keys deleted and the apply bound
# anew, every line. A binding Tang can no longer decrypt fails at boot as one whose server is down
# (Clevis fails either way), so that cause is foreseen by readiness and not booted a fourth time.


def test_without_the_key_file_only_its_lines_stay_locked_as_readiness_foresees(vm, built, kept):
    """Issue 33: the readiness check says yes; with the key file gone it says which lines will not
    open, and a boot without Salt leaves exactly those locked (Clevis's agent opens the others)."""
    assert readiness(vm) == (True, {})
    vm.run(f"mv {KEY_FILE} {KEY_FILE}.away", check=True)
    key_lines = sorted(set(CRYPTS) - set(TANG_CRYPTS))
    try:
        assert readiness(vm) == (False, dict.fromkeys(key_lines, ["key_file_missing"]))
        close_storage(vm, MOUNTPOINTS, VGS)
        assert vm.run("dmsetup ls --target crypt", echo=False).output.strip() in ("", "No devices found")
        out = boot_without_salt(vm, expect_locked=key_lines)
    finally:
        vm.run(f"mv {KEY_FILE}.away {KEY_FILE}", check=True)
    unlocked = vm.run("cat /tmp/clevis-askpass.log", echo=False).output
    assert unlocked.count("Unlocked") == len(TANG_CRYPTS), unlocked  # Clevis's agent, from Tang
    assert sorted(m for m in MOUNTPOINTS if f"mounted {m}" in out) == ["/hana/backup", "/hana/log"], out


@pytest.mark.long  # make test-all
def test_without_tang_only_the_tang_volumes_stay_locked_as_readiness_foresees(vm, built, tang, kept):
    """The key file back and Tang down: readiness names the Tang lines, and the boot opens the
    key file's lines and leaves the Tang ones locked; the audit names their mountpoints."""
    tang.stop()
    try:
        assert readiness(vm) == (False, dict.fromkeys(TANG_CRYPTS, ["clevis_fails"]))
        close_storage(vm, MOUNTPOINTS, VGS)
        out = boot_without_salt(vm, expect_locked=TANG_CRYPTS, clevis_timeout=10)
    finally:
        tang.start()
    mounted = sorted(m for m in MOUNTPOINTS if f"mounted {m}" in out)
    assert mounted == ["/hana/data", "/hana/shared"], out
    assert {(f["rule"], f["mountpoint"]) for f in audit(vm)["findings"] if f["rule"] == "HANA-MOUNT-001"} == {
        ("HANA-MOUNT-001", "/hana/log"),
        ("HANA-MOUNT-001", "/hana/backup"),
    }


@pytest.mark.long  # make test-all
def test_a_tang_server_that_deleted_its_rotated_keys_is_foreseen_and_the_apply_binds_anew(
    vm, built, tang, kept
):
    """Issue 33: Tang's keys rotated and the old ones deleted while the bindings still name them.
    Readiness says the Tang lines will not open (Clevis cannot decrypt); they are locked, as the
    boot above left them. The pillar given the new thumbprint, an apply opens them with the
    recovery key and binds them anew (clevis luks regen could not: it needs the old binding to
    unlock); readiness says yes and the next boot opens every line, every file as it was."""
    tang.rotate()
    tang.forget_rotated()
    assert readiness(vm) == (False, dict.fromkeys(TANG_CRYPTS, ["clevis_fails"]))
    locked = vm.run("dmsetup ls --target crypt", echo=False).output
    assert not any(name in locked for name in TANG_CRYPTS), locked
    for volume in ("log", "backup"):
        vm.storage["volumes"][volume]["key"]["servers"][0]["thumbprint"] = tang.thumbprint
    vm.set_pillar(yaml.safe_dump({"hana": {"storage": vm.storage}}))
    applied = vm.salt("state.apply hana.storage", title="state.apply: Tang's new key in the pillar")
    assert applied.retcode == 0, [s["comment"] for s in applied.ret.values() if s["result"] is not True]
    for device in TANG_CRYPTS.values():
        tokens = vm.salt(f"hana_storage.luks_header {device}", check=True).ret["tokens"]
        (clevis,) = [t["clevis"] for t in tokens if t["type"] == "clevis"]  # the old binding is gone
        assert tang.thumbprint in clevis["servers"][0]["thumbprints"], clevis
    assert readiness(vm) == (True, {})
    close_storage(vm, MOUNTPOINTS, VGS)
    out = boot_without_salt(vm)
    assert all(f"attach {c} " in out for c in CRYPTS) and all(f"mounted {m}" in out for m in MOUNTPOINTS), out
    assert vm.run(f"sha256sum {KEPT}", check=True, echo=False).output == kept
    only_the_generic_driver(audit(vm))
