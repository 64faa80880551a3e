"""TPM2 beside Tang on a real kernel with a real TPM 2.0 (issue 33 §1 and §2): swtpm behind
QEMU's tpm-tis, the guest's /dev/tpmrm0, its PCRs measured by the firmware.

data (above LVM, two disks) is bound to the TPM2 alone, sealed to PCR 7; log (below LVM, two
disks) to the TPM2 and a real Tang server on the host's loopback in one sss policy. Both keep a
recovery key (a pillar key). The apply binds them, the audit compares the bindings with the
pillar, readiness says yes and a boot without Salt opens every line. Then PCR 7 is extended, as
a Secure Boot change would: readiness names PCR 7 on every line, the boot without Salt leaves
every line locked, an apply refuses to seal to the changed PCR until told the change was planned
(tpm2_reseal), then binds again with the recovery key to the PCRs as they are now, readiness says
yes and the boot opens everything, the data's checksums unchanged. Last, the host is to enter
FIPS mode (compliance:fips) while its Clevis keyslots are argon2id, as clevis before 19 made
them: the apply binds each anew in a PBKDF2-SHA256 keyslot, and the boot opens everything.
make test runs the first apply and its audit; the PCR change and FIPS are `long` (make test-all).
"""

import json

import pytest
import yaml
from tang_server import TangServer

from tests.vm.conftest import boot, boot_without_salt, close_storage
from tests.vm.test_lab_boot import codes, readiness, readiness_result

pytestmark = pytest.mark.vm

MOUNTPOINTS = ["/hana/data", "/hana/log"]
VGS = ["vg_hana_data", "vg_hana_log"]
CRYPTS = {
    "hana_data": "/dev/vg_hana_data/lv_hana_data",
    "hana_log_0": "/dev/vdc",
    "hana_log_1": "/dev/vdd",
}
BACKUPS = "/etc/hana-storage/luks-headers"  # the guest's /var is the host's, read-only
TPM2 = {"pcr_bank": "sha256", "pcr_ids": [7]}


@pytest.fixture(scope="module")
def tang(tmp_path_factory):
    with TangServer(tmp_path_factory.mktemp("tang")) as server:
        yield server


@pytest.fixture(scope="module")
def vm(request, tang):
    vm = boot(request, disks=4, disk_size="1G", network=True, tpm=True)  # XFS needs 300 MB
    storage = yaml.safe_load(vm.pillar())["hana"]["storage"]
    recovery = {"source": "pillar", "material": vm.key_b64()}
    volumes = storage["volumes"]
    storage["volumes"] = {
        "data": {**volumes["data"], "devices": ["/dev/vda", "/dev/vdb"]},
        "log": {**volumes["log"], "devices": ["/dev/vdc", "/dev/vdd"]},
    }
    storage["volumes"]["data"]["key"] = {"source": "tpm2", "tpm2": TPM2, "recovery": recovery}
    storage["volumes"]["log"]["key"] = {
        "source": "tang",
        "servers": [{"url": tang.guest_url, "thumbprint": tang.thumbprint}],
        "tpm2": TPM2,
        "recovery": recovery,
    }
    storage["header_backup"] = {"directory": BACKUPS}
    vm.setup_salt(yaml.safe_dump({"hana": {"storage": storage}}))
    vm.storage = storage
    return vm


def apply(vm, title, command="state.apply hana.storage"):
    applied = vm.salt(command, title=title)
    assert applied.retcode == 0, [s["comment"] for s in applied.ret.values() if s["result"] is not True]
    return applied


@pytest.fixture(scope="module")
def built(vm):
    return apply(vm, "state.apply: TPM2 alone (data), TPM2 and Tang (log)")


def bindings(vm, keyslots=False):
    """{crypt name: [Clevis bindings]} as the formula reads them from each LUKS header; with
    ``keyslots``, {crypt name: ([Clevis keyslots], [keyslot KDFs])}."""
    found = {}
    for name, device in CRYPTS.items():
        header = vm.salt(f"hana_storage_host.luks_header {device}", check=True).ret
        clevis = [t for t in header["tokens"] if t["type"] == "clevis"]
        found[name] = (
            ([int(t["keyslots"][0]) for t in clevis], [s["kdf"] for s in header["keyslots"]])
            if keyslots
            else [t["clevis"] for t in clevis]
        )
    return found


def test_the_apply_binds_the_tpm2_alone_and_with_tang_and_the_audit_finds_nothing(vm, built, tang):
    bound = bindings(vm)
    assert [(b["pin"], b["tpm2"], b["servers"]) for b in bound["hana_data"]] == [("tpm2", TPM2, [])]
    for name in ("hana_log_0", "hana_log_1"):
        ((binding),) = bound[name]
        assert binding["pin"] == "sss" and binding["tpm2"] == TPM2 and binding["threshold"] == 1
        assert [s["url"] for s in binding["servers"]] == [tang.guest_url]
    crypttab = vm.run("cat /etc/crypttab", check=True, echo=False).output
    data_line = next(line for line in crypttab.splitlines() if line.startswith("hana_data "))
    assert data_line.split()[2] == "none" and "_netdev" not in data_line  # opens before the network
    assert all("_netdev" in line for line in crypttab.splitlines() if line.startswith("hana_log_"))
    report = vm.salt("hana_storage.audit", check=True).ret
    assert report["findings"] == [], [f["message"] for f in report["findings"]]
    again = apply(vm, "state.apply again: nothing to change")
    assert [k for k, s in again.ret.items() if s["changes"]] == []


@pytest.mark.long  # make test-all
def test_a_changed_pcr_is_named_the_boot_fails_as_foreseen_and_an_apply_binds_anew(vm, built):
    """Issue 33 §2: readiness says yes; PCR 7 extended (what a Secure Boot change does),
    readiness names PCR 7 on each line and a boot without Salt leaves them all locked; an apply
    binds again with the recovery key, readiness says yes and the boot opens everything, the data
    intact. (The bindings the first apply made are not booted: the apply makes these the same
    way, and the boot after it is the proof.)"""
    files = " ".join(f"{m}/keep.bin" for m in MOUNTPOINTS)
    vm.run(
        f"for m in {' '.join(MOUNTPOINTS)}; do head -c 1M /dev/urandom >$m/keep.bin; done; sync", check=True
    )
    before = vm.run(f"sha256sum {files}", check=True, echo=False).output
    assert readiness(vm) == (True, {})

    vm.run(
        "TPM2TOOLS_TCTI=device:/dev/tpmrm0 tpm2_pcrextend 7:sha256=" + "ab" * 32,
        check=True,
        title="extending PCR 7, as a change to Secure Boot would",
    )
    result = readiness_result(vm)
    ready, problems = codes(result)
    assert ready is False and problems == dict.fromkeys(CRYPTS, ["pcr_changed", "clevis_fails"]), problems
    causes = [p["cause"] for line in result["lines"] for p in line["problems"] if p["code"] == "pcr_changed"]
    assert len(causes) == len(CRYPTS) and all("PCR 7" in c for c in causes), causes
    close_storage(vm, MOUNTPOINTS, VGS)
    out = boot_without_salt(vm, expect_locked=CRYPTS, clevis_timeout=20)
    assert not any(f"mounted {m}" in out for m in MOUNTPOINTS), out

    refused = vm.salt("state.apply hana.storage", title="state.apply: nobody said the PCR change was planned")
    clevis = [s for s in refused.ret.values() if "-clevis-" in s["__id__"]]
    assert len(clevis) == len(CRYPTS) and all(s["result"] is False and not s["changes"] for s in clevis), (
        clevis
    )
    assert all("PCR 7" in s["comment"] and "tpm2_reseal" in s["comment"] for s in clevis), clevis
    assert all(len(b) == 1 for b in bindings(vm).values())  # the old bindings, untouched
    reseal = json.dumps({"hana": {"storage": {"tpm2_reseal": True}}})
    applied = apply(
        vm,
        "state.apply with tpm2_reseal: the change was planned",
        f"state.apply hana.storage pillar='{reseal}'",
    )
    rebound = [s for s in applied.ret.values() if "-clevis-" in s["__id__"]]
    assert len(rebound) == len(CRYPTS) and all("PCR 7" in s["comment"] for s in rebound), rebound
    assert all(len(b) == 1 for b in bindings(vm).values())  # the old bindings are gone
    assert readiness(vm) == (True, {})
    close_storage(vm, MOUNTPOINTS, VGS)
    out = boot_without_salt(vm)
    assert all(f"mounted {m}" in out for m in MOUNTPOINTS), out
    assert vm.run(f"sha256sum {files}", check=True, echo=False).output == before
    report = vm.salt("hana_storage.audit", check=True).ret
    assert report["findings"] == [], [f["message"] for f in report["findings"]]


@pytest.mark.long  # make test-all
def test_clevis_keyslots_an_old_clevis_made_are_bound_anew_for_fips_mode_and_the_boot_works(vm, built):
    """Issue 33 §4: clevis before 19 made its keyslots argon2id, which a host in FIPS mode cannot
    open at boot (each binding's keyslot is made so here, with the passphrase Clevis decrypts,
    piped). The pillar says the host is to enter FIPS mode: the audit names every such keyslot,
    the apply binds each device anew (a PBKDF2-SHA256 keyslot, proven to open) and removes the old
    binding, the recovery keys' keyslots made PBKDF2 too; the boot opens everything, data intact."""
    files = " ".join(f"{m}/keep.bin" for m in MOUNTPOINTS)
    before = vm.run(f"sha256sum {files}", check=True, echo=False).output
    old = {name: slots for name, (slots, _kdfs) in bindings(vm, keyslots=True).items()}
    vm.run(
        "set -e\n"
        + "".join(
            f"clevis luks pass -d {CRYPTS[name]} -s {slot} | cryptsetup luksConvertKey {CRYPTS[name]} "
            f"--key-slot {slot} --key-file - --pbkdf argon2id --pbkdf-memory 8192 --pbkdf-force-iterations 4\n"
            for name, (slot,) in old.items()
        ),
        check=True,
        title="making each Clevis keyslot argon2id, as clevis before 19 did",
    )
    storage = dict(
        vm.storage, luks=dict(vm.storage["luks"], pbkdf={"type": "pbkdf2", "force_iterations": 1000})
    )
    storage["compliance"] = dict(
        storage.get("compliance", {}), fips=True, min_pbkdf={"type": "pbkdf2", "iterations": 1000}
    )
    vm.set_pillar(yaml.safe_dump({"hana": {"storage": storage}}))
    findings = vm.salt("hana_storage.audit", check=True).ret["findings"]
    named = {f["device"]: f["actual"] for f in findings if f["rule"] == "HANA-ENC-008"}
    for name, (slot,) in old.items():
        (actual,) = [a for d, a in named.items() if d.endswith(name) or d == CRYPTS[name]]
        assert f"keyslot {slot}: argon2id" in actual, (name, named)
    applied = apply(vm, "state.apply: the host is to enter FIPS mode")
    rebound = [s for s in applied.ret.values() if "-clevis-" in s["__id__"]]
    assert len(rebound) == len(CRYPTS) and all("FIPS mode refuses" in s["comment"] for s in rebound), rebound
    for name, (slots, kdfs) in bindings(vm, keyslots=True).items():
        assert len(slots) == 1 and slots != old[name], (name, slots)
        assert {(k["type"], k.get("hash")) for k in kdfs} == {("pbkdf2", "sha256")}, (name, kdfs)
    close_storage(vm, MOUNTPOINTS, VGS)  # the boot is the proof (readiness is the test above's)
    out = boot_without_salt(vm)
    assert all(f"mounted {m}" in out for m in MOUNTPOINTS), out
    assert vm.run(f"sha256sum {files}", check=True, echo=False).output == before
    report = vm.salt("hana_storage.audit", check=True).ret
    assert report["findings"] == [], [f["message"] for f in report["findings"]]
