"""The data-loss guard, read-only paths and least privilege on a real kernel (issue 13).

One boot, six disks, each prepared with what a careful review found the guard let through:

- vda: LUKS2 formatted on the host with the volume's key, its keyslot's argon2id memory then
  written as 1.5 GiB into the header's JSON (so the key no longer derives, but no host can tell
  without 1.5 GiB): in the 1 GiB guest the key test fails allocating it, "out of memory" (exit 3),
  which is not "a foreign LUKS" - even with allow_format the device must be refused, never wiped;
- vdb: LUKS2 the volume's key opens, holding XFS with files (below LVM: pvcreate would wipe it);
- vdc: a PV of the volume's own VG whose existing LV holds plain dm-crypt data (no signature);
- vdd: zeroed at the start, data 400 MiB in;
- vde: LUKS2 the key opens, its secondary header copy damaged (cryptsetup repairs on load);
- vdf: blank: the one volume that is built, with userspace-only mount options;
- vdg, vdh: blank: a below-LVM volume with header backups, built, written to, closed, and then
  its first disk's header erased (``cryptsetup luksErase``, issue 29): the audit says restore,
  remediation and ``state.apply`` write nothing, the backup stays, and restoring it gives the
  data back.

Every refused disk keeps every byte (sha256 of the image on the host); read-only functions and
``test=True`` change no byte of any disk.
"""

import base64
import json
import subprocess

import pytest
import yaml

from tests.unit.conftest import rewrite_luks2_json
from tests.vm.conftest import boot

pytestmark = pytest.mark.vm

KEY_FILE = "/run/hana-storage/keys/hana.key"
# The guest's RAM and the keyslot's memory cost: the key test in the guest cannot allocate it.
GUEST_MEMORY = "1G"
OOM_MEMORY_KIB = 3 << 19
DISKS = {"oom": 0, "inner": 1, "plain": 2, "deep": 3, "degraded": 4, "good": 5, "erased": 6, "erased1": 7}
BACKUPS = "/etc/hana-storage/luks-headers"  # the guest's /var is the host's, read-only
GOOD_OPTIONS = ["noatime", "nodiratime", "logbsize=256k", "nofail", "x-systemd.device-timeout=30"]


def dev(volume):
    return f"/dev/vd{'abcdefgh'[DISKS[volume]]}"


def storage(vm, volumes):
    layout = yaml.safe_load(vm.pillar())["hana"]["storage"]
    everything = {
        "oom": {"mountpoint": "/hana/oom", "devices": [dev("oom")], "encryption": "below_lvm"},
        "inner": {"mountpoint": "/hana/inner", "devices": [dev("inner")], "encryption": "below_lvm"},
        "plain": {"mountpoint": "/hana/plain", "devices": [dev("plain")]},
        "deep": {"mountpoint": "/hana/deep", "devices": [dev("deep")]},
        "degraded": {"mountpoint": "/hana/degraded", "devices": [dev("degraded")], "encryption": "below_lvm"},
        "good": {"mountpoint": "/hana/good", "devices": [dev("good")], "mount_options": GOOD_OPTIONS},
        "erased": {"mountpoint": "/hana/erased", "devices": [dev("erased"), dev("erased1")],
                   "encryption": "below_lvm"},
    }  # fmt: skip
    # allowed to be formatted: a failed key test must still never lead to a wipe
    everything["oom"]["allow_format"] = [dev("oom")]
    layout["volumes"] = {name: everything[name] for name in volumes if name in everything}
    layout["header_backup"] = {"directory": BACKUPS}
    return yaml.safe_dump({"hana": {"storage": layout}})


def ordered(states):
    return sorted(states.values(), key=lambda s: s["__run_num__"])


def by_id(result):
    return {s["__id__"]: s for s in ordered(result.ret)}


def oom_header(vm, tmp_path):
    """A LUKS2 header (first 16 MiB) whose keyslot asks more argon2id memory than the guest has,
    written into its JSON after the format: on a host without swap, cryptsetup caps the memory it
    writes at half the host's free memory, which the page cache of the lab's disks keeps low.
    The guest's key test fails allocating it, before any key is derived."""
    image, key = tmp_path / "oom.img", tmp_path / "lab.key"
    key.write_bytes(base64.b64decode(vm.key_b64()))
    subprocess.run(["truncate", "-s", "32M", str(image)], check=True)
    subprocess.run(
        ["cryptsetup", "luksFormat", "-q", "--type", "luks2", "--pbkdf", "argon2id", "--pbkdf-memory", "32768",
         "--pbkdf-force-iterations", "4", "--pbkdf-parallel", "1", "--key-file", str(key), str(image)],
        check=True,
    )  # fmt: skip
    rewrite_luks2_json(image, lambda meta: meta["keyslots"]["0"]["kdf"].__setitem__("memory", OOM_MEMORY_KIB))
    dump = subprocess.run(["cryptsetup", "luksDump", "--dump-json-metadata", str(image)],
                          check=True, capture_output=True, text=True)  # fmt: skip
    assert json.loads(dump.stdout)["keyslots"]["0"]["kdf"]["memory"] == OOM_MEMORY_KIB
    (vm.shared / "oom.hdr").write_bytes(image.read_bytes()[: 16 << 20])


@pytest.fixture(scope="module")
def vm(request, tmp_path_factory):
    vm = boot(request, disks=len(DISKS), disk_size="1G", memory=GUEST_MEMORY)
    oom_header(vm, tmp_path_factory.mktemp("oom"))
    vm.run(
        "set -e\n"
        f"echo {vm.key_b64()} | base64 -d >/run/lab.key\n"
        "head -c 64 /dev/urandom >/run/other.key\n"
        "cheap='--type luks2 --pbkdf pbkdf2 --pbkdf-force-iterations 1000'\n"
        f"dd if={vm.shared}/oom.hdr of={dev('oom')} bs=1M conv=notrunc,fsync status=none\n"
        # vdb: the volume's key opens it, XFS with files inside, no flags stored in its header: an
        # open --persistent would rewrite it (issue 29, item 3)
        f"cryptsetup luksFormat -q $cheap --key-file /run/lab.key {dev('inner')}\n"
        f"cryptsetup open --key-file /run/lab.key {dev('inner')} prep\n"
        "mkfs.xfs -q /dev/mapper/prep && mkdir -p /run/x && mount /dev/mapper/prep /run/x\n"
        "seq 100000 >/run/x/data.txt && umount /run/x && cryptsetup close prep\n"
        # vdc: our VG, our LV name, plain dm-crypt data in it
        f"pvcreate -q {dev('plain')} && vgcreate -q vg_hana_plain {dev('plain')}\n"
        "lvcreate -q -y -l 100%FREE -n lv_hana_plain vg_hana_plain\n"
        "cryptsetup open --type plain --cipher aes-xts-plain64 --key-size 512 --key-file /run/other.key "
        "/dev/vg_hana_plain/lv_hana_plain prep\n"
        "seq 2000000 | dd of=/dev/mapper/prep bs=1M iflag=fullblock conv=fsync status=none\n"
        "cryptsetup close prep && vgchange -q -an vg_hana_plain\n"
        # vdd: the first 400 MiB zero, then data
        f"seq 5000000 | dd of={dev('deep')} bs=1M seek=400 iflag=fullblock conv=notrunc,fsync status=none\n"
        # vde: the key opens it, the secondary header copy's JSON damaged
        f"cryptsetup luksFormat -q $cheap --key-file /run/lab.key {dev('degraded')}\n"
        f"printf XX | dd of={dev('degraded')} bs=1 seek=$((16384 + 4096 + 100)) conv=notrunc,fsync status=none\n"
        "sync",
        check=True,
        title="putting the reviewed cases on vda-vde",
    )
    vm.sums = {name: vm.checksum(index) for name, index in DISKS.items()}
    vm.setup_salt(storage(vm, [name for name in DISKS if name != "erased"]))
    return vm


def unchanged(vm, names):
    return [name for name in names if vm.checksum(DISKS[name]) != vm.sums[name]]


@pytest.fixture(scope="module")
def read_only_calls(vm):
    """The key already in place (as after an earlier apply), then every read-only path."""
    vm.run(f"mkdir -p -m 0700 /run/hana-storage/keys && install -m 0400 /run/lab.key {KEY_FILE}", check=True)
    devices = ",".join(dev(name) for name in DISKS)
    return {
        "probe": vm.salt(f"hana_storage.probe {devices} key_file={KEY_FILE}", check=True).ret,
        "audit": vm.salt("hana_storage.audit", check=True).ret,
        "inspect": vm.salt("hana_storage.inspect", check=True).ret,
        "header": vm.salt(f"hana_storage.luks_header {dev('degraded')}", check=True).ret,
        "dry_run": vm.salt("state.apply hana.storage test=True", title="state.apply test=True"),
    }


def test_read_only_paths_change_no_byte_of_any_disk(vm, read_only_calls):
    """cryptsetup open --test-passphrase repairs a damaged LUKS2 header copy: the key is tried on
    a copy of the header in memory, so the damage (HANA-ENC-007's evidence) stays as it was."""
    assert unchanged(vm, DISKS) == []
    header = read_only_calls["header"]
    assert header["degraded"] is True and header["copies"]["primary"] == "ok"
    assert read_only_calls["probe"][dev("degraded")]["key_opens"] is True
    dry = by_id(read_only_calls["dry_run"])
    assert all(s["changes"] == {} for s in dry.values())


def test_a_failed_key_test_is_not_a_foreign_device(vm, read_only_calls):
    oom = read_only_calls["probe"][dev("oom")]
    assert oom["key_opens"] is None and "exited 3" in oom["key_error"], oom
    assert read_only_calls["probe"][dev("inner")]["key_opens"] is True


def test_data_far_from_the_start_is_found(read_only_calls):
    # sampled: the first window that falls in the data (they are 16 MiB apart on this disk)
    assert 400 << 20 <= read_only_calls["probe"][dev("deep")]["data_at"] < 440 << 20


@pytest.fixture(scope="module")
def apply(vm, read_only_calls):
    vm.set_pillar(storage(vm, [name for name in DISKS if name not in ("degraded", "erased")]))
    return vm.salt("state.apply hana.storage", title="state.apply: four disks to refuse, one to build")


def test_refused_volumes_keep_every_byte(vm, apply):
    states = by_id(apply)
    expect = {
        "hana-storage-oom-guard": "testing the volume's key on it failed: cryptsetup exited 3 (out of memory)",
        "hana-storage-inner-inside-0": "/dev/mapper/hana_inner_0 a PV of vg_hana_inner: it carries a xfs signature",
        "hana-storage-plain-luks-0": "holds data without a known signature",
        "hana-storage-deep-guard": "/dev/vdd holds data without a known signature (non-zero bytes at offset",
    }
    for state_id, words in expect.items():
        assert states[state_id]["result"] is False and words in states[state_id]["comment"], states[state_id]
        assert (
            "Nothing was changed" in states[state_id]["comment"]
            or "Nothing was written to any device" in states[state_id]["comment"]
        )
    assert not [s["__id__"] for s in states.values() if {"wiped", "formatted"} & set(s["changes"])
                and not s["__id__"].startswith("hana-storage-good-")]  # fmt: skip
    assert unchanged(vm, ["oom", "inner", "plain", "deep"]) == []
    # issue 29, item 3: the refused device was opened to look inside and closed again, not opened
    # --persistent (its header rewritten) and left open, and no crypttab line makes a boot open it
    assert vm.run("dmsetup info hana_inner_0", echo=False).rc != 0
    assert "hana_inner" not in vm.run("cat /etc/crypttab", echo=False).output
    assert "was closed again" in states["hana-storage-inner-inside-0"]["comment"]
    assert (
        "100000"
        in vm.run(
            f"cryptsetup open --key-file /run/lab.key {dev('inner')} check && mount -o ro /dev/mapper/check /run/x "
            "&& tail -1 /run/x/data.txt; umount /run/x; cryptsetup close check"
        ).output
    )


def test_the_blank_disk_is_built(apply):
    good = [s for s in ordered(apply.ret) if s["__id__"].startswith("hana-storage-good-")]
    assert good and all(s["result"] is True for s in good), [
        s["comment"] for s in good if s["result"] is not True
    ]


def test_pillar_key_sits_on_ramfs_root_only(vm, apply):
    key = by_id(apply)["hana-storage-key-default"]
    assert key["changes"]["removed"] == [KEY_FILE]  # the copy left on tmpfs is gone
    out = vm.run(
        f"stat -c '%a %u' {KEY_FILE}; findmnt -n -o FSTYPE,OPTIONS /run/hana-storage/keys; "
        "stat -c '%a' /run/hana-storage/keys",
        echo=False,
    ).output.split()
    assert out[:3] == ["400", "0", "ramfs"] and out[-1] == "700", out


def test_userspace_mount_options_and_an_empty_mount_source_change_nothing(vm, apply):
    """nofail and x-systemd.* never show in the kernel's options: no remount on every apply.
    A tmpfs mounted with an empty source writes an empty mountinfo field: still parsed."""
    vm.run("mkdir -p /run/empty && mount -t tmpfs '' /run/empty", check=True)
    try:
        again = vm.salt("state.apply hana.storage", title="state.apply again")
        good = [s for s in ordered(again.ret) if s["__id__"].startswith("hana-storage-good-")]
        assert [s["__id__"] for s in good if s["changes"]] == []
        assert all(s["result"] is True for s in good), [s["comment"] for s in good if s["result"] is not True]
        audit = vm.salt("hana_storage.audit volumes=good", check=True).ret
        assert audit["compliant"] is True, [f["message"] for f in audit["findings"]]
    finally:
        vm.run("umount /run/empty", echo=False)


def test_io_check_never_writes_through_a_planted_symlink(vm, apply):
    # the victim on the same XFS, where fio's O_DIRECT writes would land (any file root can write)
    victim = "/hana/good/keep/victim"
    vm.run(
        f"set -e; mkdir -p /hana/good/keep; seq 1000 >{victim}; ln -s {victim} /hana/good/.hana_storage_io_check; "
        f"ln -s {victim} /hana/good/io_check",
        check=True,
    )
    before = vm.run(f"sha256sum {victim}", echo=False).output
    result = vm.salt("hana_storage.io_check volumes=good size=64M runtime=1", title="io_check (fio, 8 jobs)")
    assert isinstance(result.ret, dict) and result.ret["volumes"]["good"]["jobs"], result.text()[-2000:]
    assert vm.run(f"sha256sum {victim}", echo=False).output == before
    left = vm.run("ls -A /hana/good", echo=False).output.split()
    assert sorted(left) == [".hana_storage_io_check", "io_check", "keep"], left  # the planted links stay


def test_key_file_fix_never_follows_a_symlink_into_a_directory_others_own(vm, apply):
    vm.run(
        "set -e; mkdir -p /run/sidadm /etc/hana-storage/keys; seq 10 >/run/sidadm/target; "
        "chown -R 1000:1000 /run/sidadm; chmod 0644 /run/sidadm/target; "
        "ln -sf /run/sidadm/target /etc/hana-storage/keys/linked.key",
        check=True,
    )
    result = vm.salt(
        "state.single hana_storage.key_present name=/etc/hana-storage/keys/linked.key source=keyfile"
    )
    (state,) = result.ret.values()
    assert state["result"] is False and "can be changed by users other than root" in state["comment"], state
    assert vm.run("stat -c '%a %u' /run/sidadm/target", echo=False).output.split() == ["644", "1000"]


def test_a_header_under_reencryption_parses_and_audits_as_a_fact(vm, apply):
    lv = "/dev/vg_hana_good/lv_hana_good"
    vm.run(f"cryptsetup reencrypt --init-only -q --key-file {KEY_FILE} {lv}", check=True)
    header = vm.salt(f"hana_storage.luks_header {lv}", check=True).ret
    assert header.get("reencryption"), json.dumps(header)[:2000]
    audit = vm.salt("hana_storage.audit volumes=good", check=True).ret
    assert "HANA-ENC-005" not in json.dumps(audit), audit["findings"]
    crypttab = vm.salt(
        f"state.single hana_storage.crypttab_present name=hana_good device={lv} key_file={KEY_FILE} "
        "options='[luks, no-read-workqueue, no-write-workqueue, noauto]'"
    )
    (state,) = crypttab.ret.values()
    assert state["result"] is True, state


# ---- issue 29, item 1: an erased header is damage, never blank, and its backup stays ------------


ERASED_LV = "/dev/vg_hana_erased/lv_hana_erased"


@pytest.fixture(scope="module")
def erased(vm, apply):
    """The two-disk volume built with header backups, 24 MiB of data written and summed, closed
    as at a shutdown, then its first disk's header erased (every keyslot)."""
    vm.set_pillar(storage(vm, ["erased"]))
    built = vm.salt("state.apply hana.storage", title="state.apply: a below-LVM volume with header backups")
    assert built.retcode == 0, [s["comment"] for s in built.ret.values() if s["result"] is not True]
    vm.run("head -c 24M /dev/urandom >/hana/erased/keep.bin && sync", check=True)
    data = vm.run("sha256sum /hana/erased/keep.bin", check=True, echo=False).output.split()[0]
    vm.run(
        "umount /hana/erased && vgchange -q -an vg_hana_erased && cryptsetup close hana_erased_0 && "
        f"cryptsetup close hana_erased_1 && cp {BACKUPS}/hana_erased_0.luks-header /run/backup-before && "
        f"cryptsetup luksErase -q {dev('erased')} && sync",
        check=True,
        title="closing the volume, then cryptsetup luksErase on its first disk",
    )
    sums = {name: vm.checksum(DISKS[name]) for name in ("erased", "erased1")}
    return {"data": data, "sums": sums}


def test_an_erased_header_is_restored_from_its_backup_and_nothing_else_is_written(vm, erased):
    audit = vm.salt("hana_storage.audit volumes=erased", check=True).ret
    found = {(f["rule"], f["device"]) for f in audit["findings"]}
    assert ("HANA-KEY-007", "/dev/mapper/hana_erased_0") in found, audit["findings"]  # read while closed
    remediated = vm.salt("hana_storage.remediate", title="remediate: nothing of it is safe to fix").ret
    assert not [f for f in remediated["fixed"] if f["volume"] == "erased"], remediated
    applied = vm.salt("state.apply hana.storage", title="state.apply on the erased disk (no allow_format)")
    guard = by_id(applied)["hana-storage-erased-guard"]
    assert guard["result"] is False and "not one this formula began" in guard["comment"], guard
    assert not [s["__id__"] for s in applied.ret.values() if s["changes"] and "erased" in s["__id__"]]
    assert {name: vm.checksum(DISKS[name]) for name in ("erased", "erased1")} == erased["sums"]
    assert vm.run(f"cmp {BACKUPS}/hana_erased_0.luks-header /run/backup-before", echo=False).rc == 0
    # the README's restore: the backup brings the key's keyslot, and the data, back
    vm.run(
        f"cryptsetup luksHeaderRestore -q {dev('erased')} --header-backup-file {BACKUPS}/hana_erased_0.luks-header",
        check=True,
        title="restoring the erased header from its backup",
    )
    again = vm.salt("state.apply hana.storage", title="state.apply: opens and mounts what was restored")
    assert again.retcode == 0, [s["comment"] for s in again.ret.values() if s["result"] is not True]
    assert (
        vm.run("sha256sum /hana/erased/keep.bin", check=True, echo=False).output.split()[0] == erased["data"]
    )
