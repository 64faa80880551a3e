"""A volume installed unencrypted below LVM, encrypted in place by `state.apply hana.storage`:
each PV's extents moved (pvmove, online) onto a LUKS PV through a spare LUN, on a real kernel,
with fio writing and verifying, the runner killed and the power cut along the way.

The data volume as a host installed before the auditor asked: a striped LV over three 256 MiB
disks (3 x 64 KiB, 56 of each PV's 63 extents), an XFS of 640 MiB on it, mounted and in
/etc/fstab, holding a checksummed file, and 32 MiB of checksummed random bytes in the LV's last
32 MiB, beyond the XFS. A fourth disk is the spare. The pillar says ``encryption: below_lvm``,
``encrypt_in_place: true`` and names the spare. The guest runs a real systemd (in a PID
namespace), which runs the moves as a transient unit.

A spare holding data is refused, named, with nothing written; test=True names the route and
writes nothing. The apply starts the unit and returns; the runner is killed (SIGKILL) in the
middle of a pvmove, and the next apply starts it again, which resumes the move; the power is cut
in the middle of another, and the boot (crypttab, fstab and /var/lib as the host had them) opens the new
PVs, the apply goes on. At the end: every device a LUKS2 PV of the VG under the crypt name of its
position, one stripe per PV, the spare blank, fio saw no error, the file's and the raw area's
checksums, the audit compliant, a second apply changes nothing, and the storage comes back at a
boot without Salt.
"""

import json
import time

import pytest
import yaml
from hana_storage_core import inplace

from tests.vm.conftest import (
    boot,
    boot_without_salt,
    close_storage,
    failures,
    wait_for_unit_end,
    write_lab_key,
)

pytestmark = pytest.mark.vm

KEY_FILE = "/etc/hana-storage/keys/hana.key"
DISKS = ["/dev/vda", "/dev/vdb", "/dev/vdc"]
SPARE = "/dev/vdd"
VG, LV = "vg_hana_data", "/dev/vg_hana_data/lv_hana_data"
MOUNT = "/hana/data"
UNIT = inplace.unit_name("hana_data")
CRYPTS = ["hana_data_0", "hana_data_1", "hana_data_2"]
DISK_SIZE = "256M"
LV_MIB, FS_MIB = 672, 640  # 3 x 56 extents: each LUKS PV (59 extents) keeps room
FILE = f"{MOUNT}/a.bin"
OPTIONS = "noatime,nodiratime,logbsize=256k"  # SAP's, as the host was installed (the pillar's default)
MIB = 1 << 20
LEDGER = "/var/lib/hana-storage/moves/data.ledger.json"
FIO = (
    f"fio --name=moves --filename={MOUNT}/fio.bin --size=32M --rw=randwrite --bs=64k --rate=1m --ioengine=psync "
    "--direct=1 --verify=crc32c --verify_backlog=16 --verify_fatal=1 --time_based --runtime=3600 "
    "--output=/run/fio.out >/dev/null 2>&1 & echo $! >/run/fio.pid"
)


def pillar(vm):
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["key"] = {"source": "keyfile", "path": KEY_FILE}
    storage["volumes"] = {
        "data": {
            "mountpoint": MOUNT,
            "devices": DISKS,
            "encryption": "below_lvm",
            "stripe_size": 64,
            "size": f"{LV_MIB}M",
            "encrypt_in_place": True,
            "in_place_spare": SPARE,
        }
    }
    return yaml.safe_dump({"hana": {"storage": storage}})


def moves_state(applied):
    (state,) = [s for s in applied.ret.values() if s["__id__"] == "hana-storage-data-moves"]
    return state


def sums(vm, device=LV):
    out = vm.run(
        f"sha256sum {FILE} | cut -d' ' -f1; "
        f"dd if={device} bs=1M skip={FS_MIB} count={LV_MIB - FS_MIB} iflag=direct status=none | sha256sum | cut -d' ' -f1",
        check=True,
        echo=False,
    ).output.split()
    return tuple(out)


def build_plain(vm):
    vm.run(
        "set -e\n"
        f"pvcreate -q {' '.join(DISKS)}\n"
        f"vgcreate -q {VG} {' '.join(DISKS)}\n"
        f"lvcreate -q -y -i 3 -I 64k -L {LV_MIB}M -n lv_hana_data {VG}\n"
        f"mkfs.xfs -q -s size=4096 -d su=64k,sw=3,size={FS_MIB}m {LV}\n"
        f"dd if=/dev/urandom of={LV} bs=1M seek={FS_MIB} count={LV_MIB - FS_MIB} oflag=direct status=none\n"
        f"mkdir -p {MOUNT} && mount -o {OPTIONS} {LV} {MOUNT}\n"
        f'echo "UUID=$(blkid -s UUID -o value {LV}) {MOUNT} xfs {OPTIONS} 0 0" >>/etc/fstab\n'
        f"head -c 64M /dev/urandom >{FILE} && sync",
        check=True,
        title="an unencrypted 3-stripe LV below nothing, XFS mounted, 64 MiB of data and a raw area",
    )


def pv_table(vm):
    """{PV: (VG, allocated extents)} as LVM reports them."""
    out = vm.run("pvs --noheadings -o pv_name,vg_name,pv_pe_alloc_count", check=True, echo=False).output
    return {f[0]: (f[1], int(f[2])) for f in (line.split() for line in out.splitlines()) if len(f) == 3}


def move_percent(vm):
    """The pvmove's copy percent, or None when none runs."""
    out = vm.run(f"lvs -a --noheadings -o lv_attr,copy_percent {VG}", echo=False).output
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0].startswith("p"):
            return float(fields[1]) if len(fields) > 1 else 0.0
    return None


def wait_for_move(vm, source, at_least=10.0, timeout=900):
    """Until the pvmove of ``source`` (its PV named in the unit's log) is at ``at_least`` %."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = vm.run(f"journalctl --unit {UNIT} --output cat --no-pager | tail -n 5", echo=False).output
        percent = move_percent(vm)
        if f"{source} onto" in log and percent is not None and percent >= at_least:
            return percent
        time.sleep(3)
    log = vm.run(
        f"journalctl --unit {UNIT} --output cat --no-pager | tail -n 30; cat {LEDGER}", echo=False
    ).output
    raise AssertionError(f"the move of {source} did not reach {at_least} % within {timeout} s:\n{log}")


def journal(vm):
    """The lines the moves' unit wrote, every run of it."""
    return vm.run(
        f"journalctl --unit {UNIT} --output cat --no-pager", check=True, echo=False
    ).output.splitlines()


def ledger(vm):
    return json.loads(vm.run(f"cat {LEDGER}", check=True, echo=False).output)


def plain_lab(request):
    """A lab booted with this module's volume as a host installed it (build_plain), the spare
    blank, the key file in place and a service manager for the unit; Salt not started yet."""
    vm = boot(request, disks=4, disk_size=DISK_SIZE)
    vm.start_service_manager()
    write_lab_key(vm, KEY_FILE)
    build_plain(vm)
    return vm


@pytest.fixture(scope="module")
def vm(request):
    vm = plain_lab(request)
    vm.sums = sums(vm)
    vm.setup_salt(pillar(vm))
    return vm


def test_a_spare_holding_data_is_refused_named_and_nothing_is_written(vm):
    vm.run(f"dd if=/dev/urandom of={SPARE} bs=1M seek=127 count=2 oflag=direct status=none", check=True)
    vm.run(f"sync && xfs_freeze -f {MOUNT}", check=True)  # the mounted XFS writes nothing of its own
    disks = [vm.checksum(n) for n in range(4)]
    refused = vm.salt("state.apply hana.storage", title="state.apply with a spare that holds data")
    after = [vm.checksum(n) for n in range(4)]
    vm.run(f"xfs_freeze -u {MOUNT}", check=True)
    assert after == disks
    state = moves_state(refused)
    assert state["result"] is False and f"the spare {SPARE} holds data" in state["comment"], state
    assert "Nothing was changed" in state["comment"]
    vm.run(f"dd if=/dev/zero of={SPARE} bs=1M seek=127 count=2 oflag=direct status=none", check=True)


def test_test_mode_names_the_route_and_writes_nothing(vm):
    vm.run(f"sync && xfs_freeze -f {MOUNT}", check=True)
    disks = [vm.checksum(n) for n in range(4)]
    dry = vm.salt("state.apply hana.storage test=True", title="state.apply test=True: encrypt by moves")
    after = [vm.checksum(n) for n in range(4)]
    vm.run(f"xfs_freeze -u {MOUNT}", check=True)
    state = moves_state(dry)
    assert state["result"] is None, state
    assert (
        f"would format the spare {SPARE}" in state["comment"]
        and "/dev/vdb onto hana_data_0" in state["comment"]
    )
    assert after == disks
    assert not [
        s
        for s in dry.ret.values()
        if "hana-storage-data-" in s["__id__"] and s["__id__"] != "hana-storage-data-moves"
    ]


@pytest.fixture(scope="module")
def started(vm):
    vm.run(FIO, check=True, title="fio writing and verifying on /hana/data")
    for disk in range(4):  # each move takes about half a minute: the kill and the cut land in one
        vm.throttle_writes(disk, 8 * MIB)
    vm.started = vm.salt("state.apply hana.storage", title="state.apply: encrypt below LVM by moves")
    return vm


def test_the_apply_starts_the_moves_and_returns_while_they_run(started):
    vm = started
    assert vm.started.retcode == 0, failures(vm.started)
    state = moves_state(vm.started)
    assert state["changes"]["encrypting"]["unit"] == UNIT, state
    assert "started" in state["comment"]
    assert (
        vm.run(f"findmnt -n -o SOURCE {MOUNT}", echo=False).output.strip() == f"/dev/mapper/{VG}-lv_hana_data"
    )


def test_a_killed_runner_is_started_again_and_its_move_resumes(started):
    vm = started
    # the move's target, /dev/vda, slowed before the move is far: with lvmpolld (use_lvmpolld=1,
    # as on SLES and RHEL) the kill ends the runner, not the copy, and the move must still run
    # when the runner is back for it to be resumed (attached to) rather than found done
    vm.throttle_writes(0, 2 * MIB)
    wait_for_move(vm, "/dev/vdb", at_least=20)
    vm.throttle_writes(0, MIB)
    vm.run(f"systemctl kill -s KILL {UNIT}; sleep 1; systemctl is-active {UNIT} || true", echo=False)
    again = vm.salt("state.apply hana.storage", title="state.apply after the runner was killed")
    deadline = time.monotonic() + 300
    while not [line for line in journal(vm)[-5:] if '"step": "resume"' in line]:
        assert time.monotonic() < deadline, "\n".join([moves_state(again)["comment"], *journal(vm)[-25:]])
        time.sleep(3)
    vm.throttle_writes(0, 8 * MIB)
    assert again.retcode == 0, failures(again)
    state = moves_state(again)
    assert "started again" in state["comment"] and "move 2 of 4" in state["comment"], state
    # the new run's first step polls the interrupted pvmove on (LVM's checkpoint), not a new one
    deadline = time.monotonic() + 600
    while "/dev/vdb" not in ledger(vm)["freed"]:
        assert time.monotonic() < deadline, vm.run(
            f"journalctl --unit {UNIT} -o cat --no-pager | tail", echo=False
        ).output
        time.sleep(5)
    steps = [json.loads(line) for line in journal(vm) if line.startswith("{")]
    killed = max(i for i, s in enumerate(steps) if s["step"] == "move" and s["move"] == 1)
    assert steps[killed + 1]["step"] == "resume" and steps[killed + 1]["move"] == 1, steps[killed:]
    assert [s for s in steps if s["step"] == "move" and s["move"] == 1] == [steps[killed]]


@pytest.fixture(scope="module")
def after_power_cut(request, started):
    """The power cut in the middle of the third move, the boot on the same disks with the host's
    crypttab, fstab and the moves' plan and ledger as they were, the storage opened as a boot
    does, the apply."""
    vm = started
    wait_for_move(vm, "/dev/vdc", at_least=20)
    fio = vm.run(
        "kill -INT $(cat /run/fio.pid); while kill -0 $(cat /run/fio.pid) 2>/dev/null; do sleep 0.5; done; cat /run/fio.out",
        echo=False,
    ).output
    # what a host keeps on its disks, and the lab's guest, whose / is new at each boot, does not
    kept = ("/etc/crypttab", "/etc/fstab", LEDGER, LEDGER.replace(".ledger", ""))
    etc = {path: vm.run(f"cat {path}", check=True, echo=False).output for path in kept}
    vm.power_off()
    again = boot(request, disks=4, disk_size=DISK_SIZE, fresh=False)
    again.start_service_manager()
    write_lab_key(again, KEY_FILE)
    for path, text in etc.items():
        again.run(
            f"mkdir -p -m 0700 $(dirname {path}) && cat >{path} <<'EOF'\n{text}\nEOF", check=True, echo=False
        )
    again.run(f"mkdir -p {MOUNT}", check=True, echo=False)
    again.booted = boot_without_salt(again)
    again.sums, again.fio, again.etc = vm.sums, fio, etc
    again.setup_salt(pillar(again))
    again.resumed = again.salt("state.apply hana.storage", title="state.apply after the power cut")
    return again


def test_fio_saw_no_error_while_the_pvs_moved(after_power_cut):
    fio = after_power_cut.fio
    assert fio.count("err= 0") == 1 and "verify" not in fio.lower().replace("verify_backlog", ""), fio


def test_after_a_power_cut_the_boot_opens_the_new_pvs_and_the_apply_goes_on(after_power_cut):
    vm = after_power_cut
    assert "hana_data_spare" in vm.etc["/etc/crypttab"] and "hana_data_0" in vm.etc["/etc/crypttab"]
    assert f"mounted {MOUNT}" in vm.booted, vm.booted
    assert vm.resumed.retcode == 0, failures(vm.resumed)
    assert "move 3 of 4" in moves_state(vm.resumed)["comment"], moves_state(vm.resumed)
    wait_for_unit_end(vm, UNIT, timeout=1200, every=5)
    done = ledger(vm)
    assert done["done"] and done["error"] is None and done["filled"] == CRYPTS, done


def test_each_device_ends_a_luks_pv_of_its_name_one_stripe_each_and_the_spare_blank(after_power_cut):
    vm = after_power_cut
    assert pv_table(vm) == {f"/dev/mapper/{c}": (VG, 56) for c in CRYPTS}
    for crypt, disk in zip(CRYPTS, DISKS, strict=True):
        status = vm.run(f"cryptsetup status {crypt}", check=True, echo=False).output
        assert f"device:  {disk}" in status and "sector size:  4096" in status, status
    assert vm.run(f"blkid -p {SPARE}; echo rc=$?", echo=False).output.strip().endswith("rc=2")
    segments = vm.run(
        f"lvs --noheadings --segments -o stripes,devices {LV}", check=True, echo=False
    ).output.split()
    assert segments[0] == "3" and len(set(d.split("(")[0] for d in segments[1].split(","))) == 3, segments
    assert "hana_data_spare" not in vm.run("cat /etc/crypttab", echo=False).output
    # what names each disk the moves vouched for (found blank, or freed), whatever its path
    assert {SPARE, *DISKS} <= set(ledger(vm)["identity"]), ledger(vm)


def test_once_moved_the_apply_finishes_the_volume_and_a_second_changes_nothing(after_power_cut):
    vm = after_power_cut
    done = vm.salt("state.apply hana.storage", title="state.apply after the moves ended")
    assert done.retcode == 0, failures(done)
    assert not [s for s in done.ret.values() if s["__id__"] == "hana-storage-data-moves"]
    again = vm.salt("state.apply hana.storage", title="state.apply again")
    assert again.retcode == 0, failures(again)
    changed = {s["__id__"]: s["changes"] for s in again.ret.values() if s["changes"]}
    assert changed == {}, changed
    audit = vm.salt("hana_storage.audit", check=True).ret
    assert audit["compliant"] is True, audit["findings"]


def test_every_byte_is_as_it_was_and_it_boots_without_salt(after_power_cut):
    vm = after_power_cut
    assert sums(vm) == vm.sums
    close_storage(vm, [MOUNT], [VG])
    boot_without_salt(vm)
    assert sums(vm) == vm.sums
    audit = vm.salt("hana_storage.audit", check=True).ret
    assert audit["compliant"] is True, audit["findings"]
