"""The lab itself: a real kernel with dm-crypt, and Salt running in the guest."""

import pytest

from tests.vm.conftest import boot, salt_json

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def vm(request):
    vm = boot(request, disks=3, disk_size="1G")
    vm.setup_salt()
    return vm


def test_disks_and_device_mapper(vm):
    result = vm.run("lsblk -dn -o NAME /dev/vd?; dmsetup targets")
    assert result.ok, result.output
    words = result.output.split()
    assert words[:3] == ["vda", "vdb", "vdc"]
    assert {"crypt", "striped", "linear"} <= set(words)


def test_step_failure_is_reported(vm):
    result = vm.run("echo to-stderr >&2; exit 7")
    assert result.rc == 7 and "to-stderr" in result.output


EXPECTED_HOST_ERRORS = [
    "hana:storage:volumes:backup:devices:0: /dev/vdh does not exist on this host",
    "hana:storage:volumes:data:devices:3: /dev/vdd does not exist on this host",
    "hana:storage:volumes:log:devices:0: /dev/vde does not exist on this host",
    "hana:storage:volumes:log:devices:1: /dev/vdf does not exist on this host",
    "hana:storage:volumes:shared:devices:0: /dev/vdg does not exist on this host",
]


def test_validate_lab_pillar_in_guest(vm):
    """The lab pillar names 8 disks; this VM has 3: host checks name the 5 missing ones."""
    assert vm.salt("hana_storage.validate_pillar").ret == EXPECTED_HOST_ERRORS


def test_real_salt_call_process_agrees(vm):
    """The fast path (one loaded Salt) and a real salt-call process return the same."""
    assert salt_json(vm.salt_call("hana_storage.validate_pillar")) == EXPECTED_HOST_ERRORS


def test_invalid_pillar_touches_no_device(vm):
    """A real disk with data, a pillar naming it with a bad stripe size: apply fails, bytes identical."""
    vm.run("mkfs.xfs -q -f /dev/vdc", check=True)
    seed = vm.checksum(2)
    bad = (
        vm.pillar()
        .replace("stripe_size: 64", "stripe_size: 100")
        .replace("[/dev/vde, /dev/vdf]", "[/dev/vdc]")
    )
    vm.set_pillar(bad)
    result = vm.salt("state.apply hana.storage")
    assert result.retcode != 0
    (state,) = result.ret.values()
    assert state["result"] is False and state["changes"] == {}
    assert "hana:storage:volumes:log:stripe_size: must be a power of two" in state["comment"]
    assert vm.checksum(2) == seed
    assert vm.run("blkid -o value -s TYPE /dev/vdc").output.strip() == "xfs"
