"""A volume key rotated by `state.apply hana.storage`, killed at every step on a real kernel.

The pillar names the new key and, as ``previous``, the key being rotated away. An apply then
gives each LUKS device a keyslot for the new key (authorised by the previous one, proven to
open), points crypttab at the new key, removes the previous key's keyslot and backs the header
up again. Each apply here runs in a forked job process (as salt-minion runs one) and is
SIGKILLed with its children right after one of those steps, on each device in turn. After every
kill each device still opens with the previous key or the new one, and a key-file volume with
the key its crypttab names (what a boot would use); the next apply goes on from there.

The layout: data above LVM over vda-vdb with key files (the path changes, so crypttab changes),
log below LVM over vdc-vdd with the pillar key (two crypt devices: the interleaving of one
device's steps with the other's). The applies killed after each step are `long` (make test-all):
make test rotates in one apply.
"""

import base64
import json
import os

import pytest
import yaml

from tests.conftest import REPO
from tests.vm.conftest import boot, sampling_argv

pytestmark = pytest.mark.vm

DATA_LV = "/dev/vg_hana_data/lv_hana_data"
KEY_DIR = "/etc/hana-storage/keys"
DATA_OLD, DATA_NEW = f"{KEY_DIR}/data-1.key", f"{KEY_DIR}/data-2.key"
LOG_OLD, LOG_NEW = "/run/rotation/log-1.key", "/run/rotation/log-2.key"  # the test's own copies
DEVICES = {DATA_LV: (DATA_OLD, DATA_NEW), "/dev/vdc": (LOG_OLD, LOG_NEW), "/dev/vdd": (LOG_OLD, LOG_NEW)}
BACKUPS = "/etc/hana-storage/luks-headers"  # the guest's /var is the host's, read-only
DATA_FILES = {"/hana/data/a.bin": 6, "/hana/log/b.bin": 3}  # MiB of random bytes
KEYSLOTS = "cryptsetup luksDump {} | grep -cE '^ +[0-9]+: luks2'"
# Everything a rotation step changes: each device's LUKS2 metadata (its first 4 KiB carry the
# header's sequence number, raised by every keyslot change), crypttab, the key files on the
# ramfs (a pillar key's source), the header backups. lab/guest_watch.py polls them every 20 ms
# and kills an apply as soon as they differ from what they were when it started: right after
# its next step, whichever Salt runs next.
WATCHED = " ".join([*DEVICES, "/etc/crypttab", "/run/hana-storage/keys", BACKUPS])
WATCH = f"python3 {REPO}/lab/guest_watch.py"
# the same in words, for the test's report: keyslots per device instead of header bytes
READABLE = (
    "".join(f"echo {d} has $({KEYSLOTS.format(d)}) keyslots\n" for d in DEVICES)
    + "awk '$1 !~ /^#/ {print \"crypttab:\", $1, $3}' /etc/crypttab\n"
    + f"sha256sum /run/hana-storage/keys/* {BACKUPS}/* 2>/dev/null | sed 's/^/written: /'; true"
)
MAX_APPLIES = 16  # data: 4 steps; log: the ramfs keys, then 3 steps on each of 2 devices


def new_key():
    return base64.b64encode(os.urandom(64)).decode()


@pytest.fixture(scope="module")
def keys():
    return {"data-1": new_key(), "data-2": new_key(), "log-1": new_key(), "log-2": new_key()}


def storage(vm, keys, rotating=False, rotated=False):
    """The pillar before, during (``rotating``) and after (``rotated``) the rotation."""
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    data_key = {"source": "keyfile", "path": DATA_NEW if rotating or rotated else DATA_OLD}
    log_key = {"source": "pillar", "material": keys["log-2" if rotating or rotated else "log-1"]}
    if rotating:
        data_key["previous"] = {"source": "keyfile", "path": DATA_OLD}
        log_key["previous"] = {"source": "pillar", "material": keys["log-1"]}
    storage["key"] = log_key
    storage["header_backup"] = {"directory": BACKUPS}
    storage["volumes"] = {
        "data": {"mountpoint": "/hana/data", "devices": ["/dev/vda", "/dev/vdb"], "key": data_key},
        "log": {
            "mountpoint": "/hana/log",
            "devices": ["/dev/vdc", "/dev/vdd"],
            "encryption": "below_lvm",
            "stripe_size": 64,
        },
    }
    return yaml.safe_dump({"hana": {"storage": storage}})


def failures(applied):
    return [s["comment"] for s in applied.ret.values() if s["result"] is not True]


@pytest.fixture(scope="module")
def vm(request, keys):
    vm = boot(request, disks=4, disk_size="1G")  # mkfs.xfs needs volumes over 300 MB
    put = "".join(
        f"echo {keys[name]} | base64 -d >{path} && chmod 0400 {path}\n"
        for name, path in (("data-1", DATA_OLD), ("data-2", DATA_NEW), ("log-1", LOG_OLD), ("log-2", LOG_NEW))
    )
    vm.run(f"set -e\numask 077\nmkdir -p {KEY_DIR} /run/rotation\n{put}", check=True, echo=False)
    vm.setup_salt(storage(vm, keys))
    built = vm.salt("state.apply hana.storage", title="state.apply: data and log with the first keys")
    assert built.retcode == 0, failures(built)
    vm.run(
        "set -e\n"
        + "".join(f"head -c {mib}M /dev/urandom >{path}\n" for path, mib in DATA_FILES.items())
        + "sync",
        check=True,
        echo=False,
    )
    vm.sums = sums(vm)
    return vm


def sums(vm):
    return vm.run(f"sha256sum {' '.join(DATA_FILES)}", check=True, echo=False).output


def opening_keys(vm):
    """{device: [the keys of old/new that open it]}."""
    script = "".join(
        f"cryptsetup open --test-passphrase --key-file {key} {device} >/dev/null 2>&1; echo {device} {key} $?\n"
        for device, pair in DEVICES.items()
        for key in pair
    )
    opens = {device: [] for device in DEVICES}
    for line in vm.run(script, check=True, echo=False).output.splitlines():
        device, key, rc = line.split()
        assert rc in ("0", "2"), line  # 2: no keyslot opens with this key; anything else is a failure
        if rc == "0":
            opens[device].append(key)
    return opens


def crypttab_key(vm, name):
    lines = vm.run("cat /etc/crypttab", check=True, echo=False).output.splitlines()
    return next(line.split()[2] for line in lines if line.split() and line.split()[0] == name)


# What a rotation writes: the LUKS2 headers (16 MiB: both copies and the keyslot area), the LVM
# labels and metadata, crypttab. The mounted XFS writes its own log now and then, so whole-disk
# checksums are not stable here (tests/vm/test_guard.py checksums whole disks, nothing mounted).
METADATA = (
    "".join(f"echo {d} $(head -c 16M {d} | sha256sum)\n" for d in DEVICES)
    + "".join(f"echo {d} $(head -c 1M {d} | sha256sum)\n" for d in ("/dev/vda", "/dev/vdb"))
    + "sha256sum /etc/crypttab /etc/fstab"
)


def test_test_mode_says_what_the_rotation_would_do_and_changes_nothing(vm, keys):
    vm.set_pillar(storage(vm, keys, rotating=True))
    try:
        before = vm.run(METADATA, check=True, echo=False).output
        dry = vm.salt("state.apply hana.storage test=True", title="state.apply test=True, rotating")
        after = vm.run(METADATA, check=True, echo=False).output
    finally:
        vm.set_pillar(storage(vm, keys))
    assert after == before
    would = {s["__id__"]: s["comment"] for s in dry.ret.values() if s["result"] is None}
    assert would["hana-storage-data-rekey-0"].startswith(f"would add a keyslot for {DATA_NEW}"), would
    for n in range(2):  # the ramfs holds the first key under the key's name until the apply writes it
        comment = would[f"hana-storage-log-rekey-{n}"]
        assert "/run/hana-storage/keys/hana.key not in place yet" in comment, would
    assert all(not s["changes"] for s in dry.ret.values())


@pytest.mark.long  # make test-all
def test_a_rotation_killed_after_each_step_always_leaves_devices_that_open(vm, keys):
    vm.set_pillar(storage(vm, keys, rotating=True))
    with sampling_argv(vm):
        steps = rotate_killing_after_each_step(vm)
    print("\nkilled right after:\n  " + "\n  ".join(steps))
    # each device's new keyslot, then its removal, seen right after a kill; crypttab's new key
    for device in DEVICES:
        added = next(i for i, step in enumerate(steps) if f"{device} has 2 keyslots" in step)
        assert any(f"{device} has 1 keyslots" in step for step in steps[added + 1 :]), steps
    assert any(f"crypttab: hana_data {DATA_NEW}" in step for step in steps), steps


def rotate_killing_after_each_step(vm):
    """Applies killed right after their next step until one finds nothing left to do: what each
    step changed, checked after each kill."""
    steps = []
    for n in range(MAX_APPLIES):
        vm.run(
            f"{WATCH} snapshot {WATCHED} >/run/rotation/before; {{ {READABLE}; }} >/run/rotation/readable",
            echo=False,
        )
        title = f"rotation apply {n + 1}, killed after its next step"
        pid = vm.salt("state.apply hana.storage", detach=True, title=title).ret["pid"]
        out = vm.run(
            f"{WATCH} kill {pid} changed /run/rotation/before {WATCHED}\n"
            f"{{ {READABLE}; }} | diff /run/rotation/readable - | sed -n 's/^> //p'",
            echo=False,
            timeout=1200,
        ).output
        step = "; ".join(line for line in out.splitlines() if line not in ("KILLED", "ENDED"))
        if step:
            steps.append(step)
            opens = opening_keys(vm)
            assert all(opens.values()), f"after {step} no key opens: {opens}"
            # what a boot now would unlock data with (log's pillar key is on a ramfs: noauto)
            assert crypttab_key(vm, "hana_data") in opens[DATA_LV], (step, opens)
        if "ENDED" in out:  # nothing was left to do, or its last step was its end
            return steps
    pytest.fail(f"{MAX_APPLIES} applies did not finish the rotation: {steps}")


@pytest.fixture(scope="module")
def finished(vm, keys):
    """The apply that finishes the rotation (all of it, when make test leaves out the killed ones)."""
    vm.set_pillar(storage(vm, keys, rotating=True))
    with sampling_argv(vm):
        final = vm.salt("state.apply hana.storage", title="the apply that finishes the rotation")
    assert isinstance(final.ret, dict), final.ret  # a list: another apply still running
    assert final.retcode == 0, failures(final)
    return final


def test_after_the_rotation_only_the_new_key_opens_each_device(vm, finished):
    opens = opening_keys(vm)
    assert opens == {device: [new] for device, (_old, new) in DEVICES.items()}
    for device in DEVICES:
        assert vm.run(KEYSLOTS.format(device), echo=False).output.strip() == "1", device
    assert crypttab_key(vm, "hana_data") == DATA_NEW
    formatted = [s["__id__"] for s in finished.ret.values() if {"formatted", "wiped"} & set(s["changes"])]
    assert not formatted, formatted
    assert sums(vm) == vm.sums


def test_the_audit_finds_only_the_previous_key_left_in_the_pillar(vm, finished):
    """Header backups are current; what is left is the pillar's ``previous`` key, which opens no
    keyslot any more: HANA-KEY-008 on each rotated device (issue 29, item 8), until the pillar
    drops it (the next test)."""
    report = vm.salt("hana_storage.audit", check=True).ret
    found = sorted((f["rule"], f["device"]) for f in report["findings"])
    crypts = ["/dev/mapper/hana_data", "/dev/mapper/hana_log_0", "/dev/mapper/hana_log_1"]
    assert found == [("HANA-KEY-008", crypt) for crypt in crypts], json.dumps(report["findings"], indent=1)[
        :3000
    ]


def test_no_key_material_in_argv_the_minion_log_or_the_returns(vm, keys, finished):
    cmdlines = vm.run("cat /run/cmdlines.txt", echo=False).output
    assert "cryptsetup" in cmdlines  # sampled while the rotation ran
    log = vm.run("cat /run/salt/minion.log", echo=False).output
    assert "DEBUG" in log  # the minion really logs at debug level
    text = cmdlines + log + json.dumps(finished.ret)
    for material in keys.values():
        raw = base64.b64decode(material)
        for needle in (material, raw.hex(), raw.hex().upper()):
            assert needle not in text


def test_once_the_pillar_drops_the_previous_key_an_apply_changes_nothing(vm, keys, finished):
    vm.set_pillar(storage(vm, keys, rotated=True))
    again = vm.salt("state.apply hana.storage", title="state.apply without the previous key")
    assert again.retcode == 0, failures(again)
    changed = {s["__id__"]: s["changes"] for s in again.ret.values() if s["changes"]}
    assert changed == {}, changed
    assert vm.salt("hana_storage.audit", check=True).ret["compliant"] is True
