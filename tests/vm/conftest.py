"""The VM tier: a real kernel (QEMU + virtme-ng) with real dm-crypt, LVM and XFS.

Each test module boots one VM for all its tests (software emulation is slow) in its own lab
directory under build/vm-tests/; VMs never run concurrently (the lab holds a machine-wide lock).
"""

import contextlib
import datetime
import os
import re
import time

import pytest
from hana_lab import Lab
from hana_storage_core import inplace

from tests.conftest import REPO

# the day each VM module's process started: a key dated since then is dated "today" by a module
# that ran past midnight (a module takes up to half an hour)
STARTED = datetime.date.today()


def days_since_start():
    """The ISO days from the module's start to now."""
    days, day = [], STARTED
    while day <= datetime.date.today():
        days.append(day.isoformat())
        day += datetime.timedelta(days=1)
    return days


pytestmark = pytest.mark.vm


@contextlib.contextmanager
def sampling_argv(vm):
    """Every process's argv sampled into the guest's /run/cmdlines.txt meanwhile
    (lab/guest_watch.py): a key must never be in one."""
    vm.run(
        f"rm -f /run/stop-sampling; python3 {REPO}/lab/guest_watch.py argv /run/cmdlines.txt /run/stop-sampling "
        ">/dev/null 2>&1 &",
        check=True,
        echo=False,
    )
    try:
        yield
    finally:
        vm.run("touch /run/stop-sampling", echo=False)


def boot(request, disks=8, disk_size="2G", fresh=True, **options):
    name = request.module.__name__.rsplit(".", 1)[-1]
    vm = Lab(
        disks=disks,
        disk_size=disk_size,
        workdir=REPO / "build" / "vm-tests" / name,
        fresh=fresh,
        verbose=request.config.getoption("verbose") > 0,
        **options,
    )
    request.addfinalizer(vm.stop)  # first: a failed start leaves no VM behind
    vm.start()
    return vm


def write_lab_key(vm, path):
    """The lab's key in a root-only file ``path`` in the guest, for a pillar whose key source is
    a key file (what a key store would have put there)."""
    vm.run(
        f"mkdir -p {os.path.dirname(path)} && echo {vm.key_b64()} | base64 -d >{path} && chmod 0400 {path}",
        check=True,
        echo=False,
    )


def unit_progress(vm, unit):
    """The last progress a re-encryption unit logged (inplace.parse_progress), or None."""
    out = vm.run(f"journalctl --unit {unit} --output cat --no-pager | tail -n 20", echo=False).output
    return inplace.last_progress(out)


def wait_for_progress(vm, unit, percent, timeout=600):
    """Waits until ``unit`` logged at least ``percent`` %; its last progress."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        now = unit_progress(vm, unit)
        if now and now["percent"] >= percent:
            return now
        time.sleep(5)
    raise AssertionError(f"{unit} did not reach {percent} % within {timeout} s: {unit_progress(vm, unit)}")


def reencryption_underway(vm, device):
    """The LUKS2 header of ``device`` still has a re-encryption keyslot."""
    return "reencrypt" in vm.run(f"cryptsetup luksDump {device}", check=True, echo=False).output


def wait_for_unit_end(vm, unit, timeout=1800, every=0.5):
    """Waits (in the guest) until ``unit`` is inactive or failed, asking systemd ``every``
    seconds: each systemctl costs the emulated guest a tenth of a second of the CPU the unit's
    cryptsetup needs, so a long wait asks seldom."""
    vm.run(
        f"for i in $(seq {int(timeout / every) + 1}); do case $(systemctl is-active {unit}) in "
        f"inactive|failed) exit 0;; esac; sleep {every}; done; exit 1",
        check=True,
        timeout=timeout + 100,
        title=f"waiting for {unit} to end",
    )


def failures(applied):
    """Each state of an apply that did not succeed, as ``<id>: <comment>`` lines."""
    return "\n".join(
        f"{s['__id__']}: {s['comment']}" for s in applied.ret.values() if s["result"] is not True
    )


def why_it_ended(vm, pid):
    """What a detached apply that ended by itself returned: the comment of each state that did
    not succeed, or the whole return (a traceback, a render error)."""
    reply = vm.detached_reply(pid)
    if reply is None:
        return f"no reply from the detached call {pid} (read /run/salt/caller.out in the guest)"
    if isinstance(reply.ret, dict) and all(isinstance(s, dict) for s in reply.ret.values()):
        failed = {
            (key.split("_|-") + [key])[1]: s.get("comment")
            for key, s in reply.ret.items()
            if s.get("result") is not True
        }
        return f"retcode {reply.retcode}, not successful: {failed}"
    return f"retcode {reply.retcode}: {str(reply.ret)[-3000:]}"


def beacon_tick(vm):
    """One beacon tick (a full audit) through Salt's loader in the guest: its events, or its crash."""
    return vm.beacon_once()


SCAP_PROFILE = "xccdf_org.hana-storage-formula_profile_hana_storage"
SCAP_DATASTREAM = "/usr/share/xml/scap/hana-storage/hana-storage-ds.xml"


def scap_scan(vm, name):
    """What SUSE Manager's scan reads on the guest: the audit recorded (hana_storage.scap_record),
    then the real `oscap xccdf eval` of the formula's data stream (put in place by an apply).
    Returns {rule: result}; the ARF, validated by `oscap ds rds-validate`, is kept in the lab
    directory as ``<name>.arf.xml``."""
    recorded = vm.salt(
        "hana_storage.scap_record", check=True, title=f"recording the audit for SCAP ({name})"
    ).ret
    assert recorded["written"] and recorded["error"] is None, recorded
    arf = vm.shared / f"{name}.arf.xml"
    results = vm.shared / f"{name}.results.xml"
    vm.run(
        f"oscap xccdf eval --profile {SCAP_PROFILE} --results-arf {arf} --results {results} "
        f"{SCAP_DATASTREAM} >/dev/null; rc=$?; [ $rc = 0 ] || [ $rc = 2 ]",
        check=True,
        title=f"oscap xccdf eval ({name})",
    )
    for check in (f"oscap ds rds-validate {arf}", f"oscap xccdf validate {results}"):
        vm.run(check, check=True, echo=False)
    outcome = dict(
        re.findall(
            r'<rule-result idref="xccdf_org\.hana-storage-formula_rule_([A-Z0-9-]+)"[^>]*>.*?<result>(\w+)</result>',
            results.read_text(),
            re.S,
        )
    )
    (vm.workdir / f"{name}.arf.xml").write_bytes(arf.read_bytes())
    return outcome


# The host's boot path, no Salt: the /dev/disk/by-id/dm-uuid-* link of each device-mapper device
# (udev's 13-dm-disk.rules; the guest runs no udev), LVM activation, systemd-cryptsetup for every
# crypttab line (a UUID= resolved to the first device blkid finds with it: nothing prefers a
# multipath map over its paths, as nothing does at a real boot), LVM again (below LVM the PVs
# appear only now), then every XFS mount of /etc/fstab.
BOOT_WITHOUT_SALT = r"""set -u
attach_one() {
  # a Clevis line waits for its agent, which may never answer (Tang down, a PCR changed): its own
  # limit; a key file line runs its KDF, slow under emulation on a busy machine: the long one
  limit=${ATTACH_TIMEOUT:-180}; [ "$3" = none ] && limit=${CLEVIS_TIMEOUT:-$limit}
  timeout "$limit" /lib/systemd/systemd-cryptsetup attach "$1" "$2" "$3" "$4" 2>&1 \
    || echo "ATTACH FAILED $1"
}
attach() {
  pids=
  while read -r name dev key opts; do
    case "$name" in ''|'#'*) continue;; esac
    [ -e "/dev/mapper/$name" ] && continue
    case "$dev" in UUID=*) found=$(blkid -t "$dev" -o device | head -n1);; *) found=$dev;; esac
    [ -n "$found" ] || continue
    echo "attach $name $found $opts"
    # a key file that does not open falls back to a passphrase prompt nobody answers at an
    # unattended boot: headless says so at once (a Clevis line's prompt is its agent's to answer)
    case "$key" in none|-) ;; *) opts="$opts,headless";; esac
    if [ -n "${PARALLEL:-}" ]; then attach_one "$name" "$found" "$key" "$opts" & pids="$pids $!"
    else attach_one "$name" "$found" "$key" "$opts"; fi
  done </etc/crypttab
  for pid in $pids; do wait "$pid"; done  # not the Clevis agent's
}
# A key field "none" (a Tang volume): Clevis's password agent answers systemd-cryptsetup, as
# clevis-luks-askpass.path starts it at boot. A boot starts with no passphrase cached:
# systemd-cryptsetup keeps the ones it was given in the kernel keyring for 150 s and tries them
# first. The agent runs once per pass while a question is pending (what the path unit's trigger
# does), not in its own loop (-l): that loop lists the Clevis bindings of every crypttab line
# twice a second, and on the emulated guest's one vCPU it took half the CPU from the unlocks
# it waits for (4 Tang lines: 99-108 s with -l, 44-46 s once per pass). Same unlock code.
dm_links() {
  mkdir -p /dev/disk/by-id
  for dm in /sys/block/dm-*; do
    [ -e "$dm" ] || continue
    uuid=$(cat "$dm/dm/uuid"); [ -n "$uuid" ] && ln -sfn "../../${dm##*/}" "/dev/disk/by-id/dm-uuid-$uuid"
  done
}
keyctl purge user cryptsetup >/dev/null
agent=
if awk '$1 !~ /^#/ && $3 == "none"' /etc/crypttab | grep -q .; then
  mkdir -p /run/systemd/ask-password
  ( while :; do
      ls /run/systemd/ask-password/ask.* >/dev/null 2>&1 && /usr/libexec/clevis-luks-askpass
      sleep 0.5
    done ) >/tmp/clevis-askpass.log 2>&1 &
  agent=$!
fi
dm_links; vgchange -q -ay >/dev/null 2>&1; attach; vgchange -q -ay >/dev/null 2>&1
[ -n "$agent" ] && { kill "$agent"; pkill -f /usr/libexec/clevis-luks-askpass; } 2>/dev/null
for point in $(awk '$3 == "xfs" {print $2}' /etc/fstab); do mount "$point" && echo "mounted $point"; done
"""


def close_storage(vm, mountpoints, vgs, then=""):
    """Unmount what is mounted, close every crypt device and deactivate the VGs, as a shutdown
    does (a test that failed half-way leaves the next one a host it can still shut down);
    ``then``: more shell to run after (the multipath module removes and re-creates its maps)."""
    vm.run(
        "set -e\n"
        + "".join(f"if mountpoint -q {m}; then umount {m}; fi\n" for m in mountpoints)
        # above LVM the crypt device sits on the LV, below it under it: close, deactivate, close
        + "crypts() { dmsetup ls --target crypt | awk '$1 != \"No\" {print $1}'; }\n"
        "for m in $(crypts); do cryptsetup close $m 2>/dev/null || true; done\n"
        f"vgchange -q -an {' '.join(vgs)}\n"
        "for m in $(crypts); do cryptsetup close $m; done\n" + then,
        check=True,
        title=f"shutting the storage down: {', '.join(mountpoints)}",
    )


def boot_without_salt(vm, expect_locked=(), attach_timeout=180, clevis_timeout=None, parallel=False):
    """BOOT_WITHOUT_SALT in the guest; fails unless every crypttab line but ``expect_locked``
    attached (each within ``attach_timeout`` seconds, a Clevis line within ``clevis_timeout`` when
    given: the wait for an agent that cannot answer) with every option accepted. ``parallel``:
    every line at once, as systemd's units do at a boot. Returns its output."""
    limits = f"ATTACH_TIMEOUT={int(attach_timeout)}\n"
    if clevis_timeout is not None:
        limits += f"CLEVIS_TIMEOUT={int(clevis_timeout)}\n"
    out = vm.run(
        limits + f"PARALLEL={'1' if parallel else ''}\n" + BOOT_WITHOUT_SALT,
        title="booting the storage without Salt: systemd-cryptsetup, LVM, fstab",
    ).output
    failed = sorted(re.findall(r"ATTACH FAILED (\S+)", out))
    assert failed == sorted(expect_locked), out
    lowered = out.lower()
    assert "unknown" not in lowered and "ignoring" not in lowered, out  # every crypttab option accepted
    return out
