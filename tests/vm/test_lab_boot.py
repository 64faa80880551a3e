"""The lab layout with a key file: built, booted by the host without Salt, audited - on a CPU
without AES instructions, so the audit has exactly one thing to say (HANA-PERF-005).

QEMU's "max" CPU (the lab's default) emulates AES-NI: the guest kernel loads aesni_intel and
dm-crypt gets ``xts-aes-aesni`` (tests/vm/test_audit.py checks it). Here the guest runs on
"max,aes=off": the same kernel builds xts(aes) from aes-generic. The layout is the lab's
(lab/pillar.sls.j2: data striped over four disks above LVM, log below LVM over two, shared and
backup) with the key in a file, the key source that unlocks at boot.
"""

import pytest
import yaml

from tests.vm.conftest import boot, boot_without_salt, close_storage

pytestmark = pytest.mark.vm

KEY_FILE = "/etc/hana-storage/keys/hana.key"
MOUNTPOINTS = ["/hana/data", "/hana/log", "/hana/shared", "/hana/backup"]
CRYPTS = ["hana_data", "hana_log_0", "hana_log_1", "hana_shared", "hana_backup"]


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=8, disk_size="1G", cpu="max,aes=off")  # XFS needs 300 MB
    vm.run(
        f"mkdir -p /etc/hana-storage/keys && echo {vm.key_b64()} | base64 -d >{KEY_FILE} && chmod 0400 {KEY_FILE}",
        check=True,
        echo=False,
    )
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["key"] = {"source": "keyfile", "path": KEY_FILE}
    vm.setup_salt(yaml.safe_dump({"hana": {"storage": storage}}))
    return vm


@pytest.fixture(scope="module")
def built(vm):
    applied = vm.salt(
        "state.apply hana.storage", title="state.apply: the lab layout, on a CPU without AES-NI"
    )
    assert applied.retcode == 0, [s["comment"] for s in applied.ret.values() if s["result"] is not True]
    return applied


def only_the_generic_driver(audit):
    assert [(f["rule"], f["actual"]) for f in audit["findings"]] == [
        ("HANA-PERF-005", "xts(ecb(aes-generic))")
    ] * len(CRYPTS), [f["message"] for f in audit["findings"]]
    assert sorted(f["device"] for f in audit["findings"]) == sorted(f"/dev/mapper/{c}" for c in CRYPTS)
    assert all(f["remediation"] == "manual" for f in audit["findings"])


def test_the_guest_cpu_has_no_aes_instructions(vm):
    assert vm.run("grep -c -w aes /proc/cpuinfo", echo=False).output.strip() == "0"


def test_the_lab_layout_is_compliant_but_for_its_generic_aes_driver(vm, built):
    only_the_generic_driver(vm.salt("hana_storage.audit", check=True).ret)


def test_the_host_boots_the_lab_layout_without_salt(vm, built):
    files = " ".join(f"{m}/keep.bin" for m in MOUNTPOINTS)
    vm.run(
        f"for m in {' '.join(MOUNTPOINTS)}; do head -c 1M /dev/urandom >$m/keep.bin; done; sync", check=True
    )
    before = vm.run(f"sha256sum {files}", check=True, echo=False).output
    close_storage(vm, MOUNTPOINTS, ["vg_hana_data", "vg_hana_log", "vg_hana_shared", "vg_hana_backup"])
    assert vm.run("dmsetup ls --target crypt", echo=False).output.strip() in ("", "No devices found")
    out = boot_without_salt(vm)
    assert all(f"attach {c} " in out for c in CRYPTS) and all(f"mounted {m}" in out for m in MOUNTPOINTS), out
    assert vm.run(f"sha256sum {files}", check=True, echo=False).output == before
    only_the_generic_driver(vm.salt("hana_storage.audit", check=True).ret)
