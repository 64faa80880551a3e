"""A volume installed unencrypted, encrypted in place by `state.apply hana.storage`, on a real
kernel, with the encryption stopped, killed and its power cut along the way.

The data volume as a host installed before the auditor asked: a striped LV over two disks
(2 x 64 KiB) of 1088 MiB, an XFS of 1056 MiB on it made with 4 KiB sectors, mounted at /hana/data
and in /etc/fstab, holding a checksummed file, and 32 MiB of checksummed random bytes in the
LV's last 32 MiB, beyond the XFS (a raw area: the formula must keep every byte of the LV, not
only the filesystem's). The pillar gives
it ``encrypt_in_place: true`` and caps the encryption at 1 MiB/s, so that each interruption
lands in the middle of it. The guest runs a real systemd (in a PID namespace: the lab's init is
not systemd), which runs the encryption as a transient unit.

test=True names each step and writes nothing; a process holding a file on the volume stops the
apply, named, with nothing written. The power cut in the middle of the apply's own copy of the
LV's first 16 MiB into the header's room (the disks' writes throttled so that the copy takes
seconds): the boot on the same disks, the XFS mounted from the LV again as the host's fstab
would, every byte as it was, and the next apply goes on (a tail half copied once read as a torn
header write, and the advice was to copy it over the head). The apply extends the LV in its two
stripes, copies the head into the room, writes the LUKS2 header, mounts the XFS from the crypt
device (the downtime) and returns with the unit running. Then: the unit stopped (SIGINT), and the next apply starts it again; the unit killed
(SIGKILL), and the next apply recovers offline or, when the kill left cryptsetup's hotzone
suspended, refuses and names a reboot; the power cut, and after the boot the apply opens the
device (libcryptsetup's recovery) and goes on, now uncapped. At the end: the file's checksum,
the raw area's checksum read through the crypt device, the LUKS2 sector size 4096,
the audit compliant, a second apply changes nothing, and the storage comes back at a boot
without Salt.
"""

import json
import time

import pytest
import yaml
from hana_storage_core import inplace, reencrypt

from tests.vm.conftest import (
    boot,
    boot_without_salt,
    close_storage,
    days_since_start,
    failures,
    reencryption_underway,
    unit_progress,
    wait_for_progress,
    wait_for_unit_end,
    write_lab_key,
)

pytestmark = pytest.mark.vm

KEY_FILE = "/etc/hana-storage/keys/hana.key"
DISKS = ["/dev/vda", "/dev/vdb"]
LV = "/dev/vg_hana_data/lv_hana_data"
MOUNT = "/hana/data"
UNIT = inplace.unit_name("hana_data")
# the raw area: the LV's last 32 MiB, beyond the XFS (less than 64 MiB: an XFS that much smaller
# than its device is a finding, HANA-LAYOUT-009, and the crypt device grows by 16 MiB at the end)
LV_MIB, FS_MIB = 1088, 1056  # mkfs.xfs ignores su/sw on an XFS under 1 GiB
FILE = f"{MOUNT}/a.bin"
MIB = 1 << 20


def pillar(vm, max_mib_s=1):
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["key"] = {"source": "keyfile", "path": KEY_FILE}
    storage["volumes"] = {
        "data": {
            "mountpoint": MOUNT,
            "devices": DISKS,
            "stripes": 2,
            "stripe_size": 64,
            "size": f"{LV_MIB}M",
            "encrypt_in_place": True,
        }
    }
    if max_mib_s:
        storage["in_place"] = {"max_mib_s": max_mib_s}
    return yaml.safe_dump({"hana": {"storage": storage}})


def in_place_state(applied):
    (state,) = [s for s in applied.ret.values() if s["__id__"] == "hana-storage-data-in-place"]
    return state


def file_sum(vm):
    return vm.run(f"sha256sum {FILE}", check=True, echo=False).output.split()[0]


def raw_sum(vm, device):
    """sha256 of the raw area, read from ``device`` (the LV before, the crypt device after)."""
    return vm.run(
        f"dd if={device} bs=1M skip={FS_MIB} count={LV_MIB - FS_MIB} iflag=direct status=none | sha256sum",
        check=True,
        echo=False,
    ).output.split()[0]


def reads_back(vm):
    """The file reads back (page cache dropped) within 60 s: I/O to the volume is not frozen."""
    return vm.run(
        f"echo 3 >/proc/sys/vm/drop_caches; timeout 60 sha256sum {FILE}", echo=False
    ).output.split()[:1]


def build_plain(vm):
    vm.run(
        "set -e\n"
        f"pvcreate -q {' '.join(DISKS)}\n"
        f"vgcreate -q vg_hana_data {' '.join(DISKS)}\n"
        f"lvcreate -q -y -i 2 -I 64k -L {LV_MIB}M -n lv_hana_data vg_hana_data\n"
        f"mkfs.xfs -q -s size=4096 -d su=64k,sw=2,size={FS_MIB}m {LV}\n"
        f"dd if=/dev/urandom of={LV} bs=1M seek={FS_MIB} count={LV_MIB - FS_MIB} oflag=direct status=none\n"
        f"mkdir -p {MOUNT} && mount -o noatime {LV} {MOUNT}\n"
        f'echo "UUID=$(blkid -s UUID -o value {LV}) {MOUNT} xfs noatime 0 0" >>/etc/fstab\n'
        f"head -c 96M /dev/urandom >{FILE} && sync",
        check=True,
        title="an unencrypted striped LV with XFS, mounted, 96 MiB of data and a raw area",
    )


def plain_lab(request):
    """A lab booted with this module's volume as a host installed it (build_plain), the key file
    in place and a service manager for the unit; Salt not started yet."""
    vm = boot(request, disks=len(DISKS), disk_size="1G")
    vm.start_service_manager()
    write_lab_key(vm, KEY_FILE)
    build_plain(vm)
    return vm


@pytest.fixture(scope="module")
def vm(request):
    vm = plain_lab(request)
    vm.sums = (file_sum(vm), raw_sum(vm, LV))
    vm.setup_salt(pillar(vm))
    return vm


def boot_again(request, old, max_mib_s=1):
    """The boot on the same disks after a power cut: the guest's /etc is new (no crypttab, no
    fstab), its service manager, the key file, Salt with the pillar (and the cap) given."""
    again = boot(request, disks=len(DISKS), disk_size="1G", fresh=False)
    again.start_service_manager()
    write_lab_key(again, KEY_FILE)
    again.sums = old.sums
    again.setup_salt(pillar(again, max_mib_s=max_mib_s))
    return again


def cut_power_after(vm, mib, title):
    """An apply started, and the power cut once the guest has written ``mib`` MiB more to the
    volume's disks, their writes capped at 1 MiB/s each (the cut lands within a fraction of a
    MiB of that point)."""
    disks = range(len(DISKS))
    for disk in disks:
        vm.throttle_writes(disk, MIB)
    before = vm.written_bytes(disks)
    pid = vm.salt("state.apply hana.storage", detach=True, title=title).ret["pid"]
    deadline = time.monotonic() + 900
    while vm.written_bytes(disks) - before < mib * MIB:
        ended = vm.detached_reply(pid)
        assert ended is None, f"the apply ended before {mib} MiB were written: {failures(ended)}"
        assert time.monotonic() < deadline, f"{mib} MiB not written within 900 s"
        time.sleep(0.1)
    vm.power_off()


def as_it_was(vm):
    """What an apply that changes nothing leaves: the LV as it was (size, no tag, an XFS), mounted
    from the LV, no unit, the data and the raw area unchanged."""
    out = vm.run(
        f"lvs --noheadings --units b -o lv_size,lv_tags {LV}; blkid -p -s TYPE -o value {LV}; "
        f"findmnt -n -o SOURCE {MOUNT}; systemctl is-active {UNIT}",
        echo=False,
    ).output.split()
    return (
        out == [f"{LV_MIB << 20}B", "xfs", "/dev/mapper/vg_hana_data-lv_hana_data", "inactive"]
        and (
            file_sum(vm),
            raw_sum(vm, LV),
        )
        == vm.sums
    )


def test_test_mode_names_each_step_and_writes_nothing(vm):
    # frozen, the mounted XFS writes nothing of its own either (it covers its log when idle)
    vm.run(f"sync && xfs_freeze -f {MOUNT}", check=True)
    disks = [vm.checksum(n) for n in range(len(DISKS))]
    dry = vm.salt("state.apply hana.storage test=True", title="state.apply test=True: encrypt in place")
    after = [vm.checksum(n) for n in range(len(DISKS))]
    vm.run(f"xfs_freeze -u {MOUNT}", check=True)
    state = in_place_state(dry)
    assert state["result"] is None, state
    for words in (
        f"would extend {LV} by 33554432 bytes for the LUKS2 header",
        f"zero its room beyond {LV_MIB << 20} bytes",
        f"record {LV}'s size",
        f"unmount {MOUNT}",
        "write the LUKS2 header (4096-byte sectors)",
        f"mount /dev/mapper/hana_data at {MOUNT}",
        f"start {UNIT}",
    ):
        assert words in state["comment"], state["comment"]
    assert after == disks


def test_a_process_with_a_file_open_stops_it_named_and_nothing_is_written(vm):
    vm.run(f"setsid sleep 3600 <{FILE} >/dev/null 2>&1 & echo $! >/run/holder.pid", check=True)
    refused = vm.salt("state.apply hana.storage", title="state.apply with a file open on /hana/data")
    vm.run("kill $(cat /run/holder.pid)", check=True)
    state = in_place_state(refused)
    assert state["result"] is False and "sleep (pid " in state["comment"], state
    assert as_it_was(vm)


@pytest.fixture(scope="module")
def cut_in_the_copy(request, vm):
    """The power cut 8 MiB into the apply's copy of the LV's first 16 MiB (after the 32 MiB of
    the room zeroed), the boot, and the XFS mounted from the LV as the host's fstab would."""
    cut_power_after(vm, 32 + 8, "state.apply, its power cut in the middle of the head's copy")
    again = boot_again(request, vm)
    again.run(
        f"mkdir -p {MOUNT} && mount -o noatime {LV} {MOUNT} && "
        f'echo "UUID=$(blkid -s UUID -o value {LV}) {MOUNT} xfs noatime 0 0" >>/etc/fstab',
        check=True,
        title="mounting the XFS from the LV, as the boot's fstab would",
    )
    shift = inplace.data_shift(32 * MIB)
    again.facts = again.salt(
        f"hana_storage_host.in_place_facts {LV} hana_data {MOUNT} {shift}", check=True
    ).ret
    return again


def test_a_power_cut_in_the_copy_of_the_head_leaves_every_byte_as_it_was(cut_in_the_copy):
    vm = cut_in_the_copy
    # the copy was cut part-way (the tail part copy, part zeros, the head whole): once called torn
    assert (vm.facts["head_copy"], vm.facts["tail"], vm.facts["signature"]) == ("begun", "partial", "xfs"), (
        vm.facts
    )
    assert (file_sum(vm), raw_sum(vm, LV)) == vm.sums


@pytest.fixture(scope="module")
def started(cut_in_the_copy):
    vm = cut_in_the_copy
    vm.applied = vm.salt("state.apply hana.storage", title="state.apply: encrypt /hana/data in place")
    return vm


def test_the_apply_encrypts_in_place_and_returns_while_it_runs(started):
    vm, applied = started, started.applied
    assert applied.retcode == 0, failures(applied)
    state = in_place_state(applied)
    assert state["changes"]["encrypting"] == {"device": LV, "unit": UNIT, "from": "plain"}, state
    assert 0 < state["changes"]["downtime_s"] < 120, state
    assert vm.systemctl(f"is-active {UNIT}").output.strip() == "active"
    assert reencryption_underway(vm, LV)
    segments = vm.run(
        f"lvs --noheadings --segments -o stripes,stripe_size {LV}", check=True, echo=False
    ).output.split()
    assert segments == ["2", "64.00k"] * (len(segments) // 2) and len(segments) >= 2, segments
    assert vm.run(f"findmnt -n -o SOURCE {MOUNT}", echo=False).output.strip() == "/dev/mapper/hana_data"
    assert file_sum(vm) == vm.sums[0] and raw_sum(vm, "/dev/mapper/hana_data") == vm.sums[1]
    # part of the volume is still plaintext: the audit says so, and how far the encryption is
    audit = vm.salt("hana_storage.audit volumes=data", check=True).ret
    assert [f["rule"] for f in audit["findings"]] == ["HANA-ENC-001"], audit["findings"]
    assert "encrypting hana_data" in audit["findings"][0]["message"], audit["findings"]
    assert audit["volumes"]["data"]["in_place"]["running"] is True


def test_a_stopped_encryption_is_started_again(started):
    vm = started
    wait_for_progress(vm, UNIT, 1)
    vm.systemctl(f"stop {UNIT}", title="systemctl stop: SIGINT to cryptsetup")
    assert reencryption_underway(vm, LV) and reads_back(vm) == [vm.sums[0]]
    again = vm.salt("state.apply hana.storage", title="state.apply after the unit was stopped")
    assert again.retcode == 0, failures(again)
    assert in_place_state(again)["changes"]["encrypting"]["from"] == "paused"


def test_a_killed_encryption_is_recovered_or_named(started):
    vm = started
    before = wait_for_progress(vm, UNIT, unit_progress(vm, UNIT)["percent"] + 2)
    vm.systemctl(f"kill --signal=KILL {UNIT}", title="SIGKILL to cryptsetup")
    wait_for_unit_end(vm, UNIT, timeout=60)
    frozen = vm.run("dmsetup info -c --noheadings -o name,attr | grep '^hana_data-.*:..s'", echo=False).ok
    again = vm.salt("state.apply hana.storage", title="state.apply after cryptsetup was killed")
    state = in_place_state(again)
    if frozen:
        assert state["result"] is False and "Reboot the host" in state["comment"], state
    else:
        assert again.retcode == 0, failures(again)
        assert state["changes"]["encrypting"]["from"] == "crashed", state
        assert file_sum(vm) == vm.sums[0]
    vm.killed = (before, frozen)


@pytest.fixture(scope="module")
def after_power_cut(request, started):
    """The power cut in the middle of the encryption, the boot on the same disks, the apply with
    the cap lifted."""
    vm = started
    if not getattr(vm, "killed", (None, True))[1]:
        wait_for_progress(vm, UNIT, unit_progress(vm, UNIT)["percent"] + 2)
    vm.power_off()
    again = boot_again(request, vm, max_mib_s=None)
    again.resumed = again.salt("state.apply hana.storage", title="state.apply after the power cut")
    return again


def test_after_a_power_cut_the_apply_opens_and_goes_on(after_power_cut):
    vm = after_power_cut
    assert vm.resumed.retcode == 0, failures(vm.resumed)
    assert in_place_state(vm.resumed)["changes"]["encrypting"]["from"] == "closed"
    wait_for_unit_end(vm, UNIT, timeout=900, every=5)
    assert not reencryption_underway(vm, LV), unit_progress(vm, UNIT)
    assert file_sum(vm) == vm.sums[0]


def test_once_encrypted_the_apply_finishes_the_volume_and_a_second_changes_nothing(after_power_cut):
    vm = after_power_cut
    done = vm.salt("state.apply hana.storage", title="state.apply after the encryption ended")
    assert done.retcode == 0, failures(done)
    assert "no re-encryption under way" in in_place_state(done)["comment"]
    # the day the encryption made the key, from the LV's tag into the header once it ended
    assert in_place_state(done)["changes"]["key_date"]["created"] in days_since_start()
    meta = json.loads(vm.run(f"cryptsetup luksDump --dump-json-metadata {LV}", check=True, echo=False).output)
    dated = [t for t in meta["tokens"].values() if t["type"] == reencrypt.KEY_DATE_TOKEN]
    assert len(dated) == 1 and dated[0]["created"] in days_since_start() and dated[0]["replaces"] == [], dated
    again = vm.salt("state.apply hana.storage", title="state.apply again")
    assert again.retcode == 0, failures(again)
    changed = {s["__id__"]: s["changes"] for s in again.ret.values() if s["changes"]}
    assert changed == {}, changed
    dump = vm.run(f"cryptsetup luksDump {LV}", check=True, echo=False).output
    assert "sector: 4096 [bytes]" in dump and "hana_data" in dump, dump
    audit = vm.salt("hana_storage.audit", check=True).ret
    assert audit["compliant"] is True, audit["findings"]


def test_every_byte_of_the_filesystem_is_as_it_was_and_it_boots_without_salt(after_power_cut):
    vm = after_power_cut
    assert raw_sum(vm, "/dev/mapper/hana_data") == vm.sums[1]
    close_storage(vm, [MOUNT], ["vg_hana_data"])
    boot_without_salt(vm)
    assert file_sum(vm) == vm.sums[0]
    audit = vm.salt("hana_storage.audit", check=True).ret
    assert audit["compliant"] is True, audit["findings"]
