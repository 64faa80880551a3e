"""HANA-PERF-005 on a real kernel: a CPU without AES instructions gets a generic AES driver.

QEMU's "max" CPU (the lab's default) emulates AES-NI, so the guest kernel loads aesni_intel and
dm-crypt gets ``xts-aes-aesni`` (tests/vm/test_audit.py: its compliant volume has no finding).
Here the guest runs on "max,aes=off": the same kernel finds no AES-NI, builds xts(aes) from
aes-generic, and the audit of a volume the formula has just built names that and only that.
"""

import pytest
import yaml

from tests.vm.conftest import boot

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=1, disk_size="512M", cpu="max,aes=off")
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    storage["volumes"] = {"data": {"mountpoint": "/hana/data", "devices": ["/dev/vda"]}}
    vm.setup_salt(yaml.safe_dump({"hana": {"storage": storage}}))
    return vm


def test_the_guest_cpu_has_no_aes_instructions(vm):
    assert vm.run("grep -c -w aes /proc/cpuinfo", echo=False).output.strip() == "0"


def test_a_volume_built_on_it_is_compliant_but_for_its_generic_aes_driver(vm):
    applied = vm.salt("state.apply hana.storage", title="state.apply on a CPU without AES-NI")
    assert applied.retcode == 0, [s["comment"] for s in applied.ret.values() if s["result"] is not True]
    audit = vm.salt("hana_storage.audit", check=True).ret
    assert [(f["rule"], f["device"], f["actual"]) for f in audit["findings"]] == [
        ("HANA-PERF-005", "/dev/mapper/hana_data", "xts(ecb(aes-generic))")
    ]
    assert audit["findings"][0]["remediation"] == "manual"
