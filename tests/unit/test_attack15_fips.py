"""Attack 15: FIPS mode for keyslots (HANA-ENC-008) against HANA-ENC-006, the remediation texts,
and the pillar checks. Each test fails on the change as it stands, for the reason its docstring
gives."""

import copy
import subprocess

from hana_storage_core import commands, rules
from hana_storage_core import pillar as hp

from tests.unit.test_audit import PILLAR, RAM_KIB, compliant
from tests.unit.test_pillar import DEFAULTS, errors_of

FIPS_POLICY = {
    "luks": {"pbkdf": {"type": "pbkdf2", "iter_time_ms": 2000}},
    "compliance": {"fips": True, "min_pbkdf": {"type": "pbkdf2", "iterations": 100000}},
}


def kdf_findings(plan, facts, device="/dev/mapper/hana_data"):
    return [
        f
        for f in rules.audit(plan, facts)["findings"]
        if f["rule"] in ("HANA-ENC-006", "HANA-ENC-008") and f["device"] == device
    ]


def with_slot0(kdf):
    facts = compliant()
    facts["headers"]["dm-0"]["keyslots"][0]["kdf"] = kdf
    return facts


def test_a_fips_host_with_the_default_pillar_has_a_keyslot_the_audit_accepts():
    """The read-only audit (hana_storage._plan: host checks off) on a host in FIPS mode with the
    default policy (argon2id, min_pbkdf argon2i): the pillar passes, the plan has luks.fips. An
    argon2id keyslot is HANA-ENC-008 ("convert to pbkdf2 --hash sha256"); the keyslot that advice
    makes is HANA-ENC-006 ("convert to --pbkdf argon2id"). No keyslot passes both: the beacon and
    SCAP fail this host forever, each rule's fix raising the other."""
    assert errors_of(PILLAR) == []  # what _plan validates with: no host facts
    plan = hp.normalize(hp.merge(DEFAULTS, PILLAR), None, RAM_KIB, None, True)
    assert plan["luks"]["fips"] is True
    argon2 = kdf_findings(plan, with_slot0({"type": "argon2id", "time": 4, "memory": 32768, "cpus": 1}))
    assert [f["rule"] for f in argon2] == ["HANA-ENC-008"]  # convert it, as the finding says...
    converted = {"type": "pbkdf2", "hash": "sha256", "iterations": 2_000_000}
    after = kdf_findings(plan, with_slot0(converted))
    assert after == [], [(f["rule"], f["message"]) for f in after]  # ...and it is HANA-ENC-006


def test_under_fips_enc_006_does_not_tell_to_make_an_argon2_keyslot():
    """A valid FIPS pillar (README's example) and a PBKDF2-SHA256 keyslot below min_pbkdf's
    iterations: HANA-ENC-006 says 'luksConvertKey --pbkdf argon2id', a keyslot FIPS mode cannot
    open (and HANA-ENC-008 then names). An argon2 keyslot below the merged argon2 minimum (the
    defaults' memory_kib 32768 stays under a pbkdf2 min_pbkdf) gets both: ENC-006 and ENC-008 on
    one keyslot ask for opposite conversions."""
    pillar = {**copy.deepcopy(PILLAR), **copy.deepcopy(FIPS_POLICY)}
    assert errors_of(pillar) == []
    plan = hp.normalize(hp.merge(DEFAULTS, pillar), None, RAM_KIB, None, False)
    weak = kdf_findings(plan, with_slot0({"type": "pbkdf2", "hash": "sha256", "iterations": 50000}))
    assert [f["rule"] for f in weak] == ["HANA-ENC-006"]
    assert "argon2" not in weak[0]["message"], weak[0]["message"]


def test_the_enc_008_command_names_the_luks_device():
    """The finding's command, 'cryptsetup luksConvertKey --key-slot <n> --pbkdf pbkdf2 --hash
    sha256', names no device (the finding's device is the open mapping, not the LUKS device
    luksConvertKey needs); HANA-PERSIST-003's names it. Run as written, cryptsetup refuses it."""
    pillar = {**copy.deepcopy(PILLAR), **copy.deepcopy(FIPS_POLICY)}
    plan = hp.normalize(hp.merge(DEFAULTS, pillar), None, RAM_KIB, None, False)
    facts = compliant()
    found = [f for f in kdf_findings(plan, facts) if f["rule"] == "HANA-ENC-008"]
    assert found
    luks_device = facts["devices"]["dm-0"]["path"]  # under /dev/mapper/hana_data (dm-1)
    assert facts["devices"]["dm-1"]["table"][0]["device_name"] == "dm-0"
    assert f"cryptsetup luksConvertKey {luks_device} --key-slot 0 " in found[0]["message"], found[0][
        "message"
    ]


def test_a_fips_pbkdf2_policy_the_pillar_accepts_is_one_cryptsetup_formats_with(tmp_path):
    """compliance:fips makes luks:pbkdf:type pbkdf2 mandatory, and the schema lets
    force_iterations go down to 4 (argon2's floor). cryptsetup's floor for PBKDF2 is 1000 (NIST
    SP 800-132, also what a FIPS provider enforces): the pillar passes, then every luksFormat
    and luksAddKey of the plan fails at apply time."""
    pillar = copy.deepcopy(PILLAR)
    pillar["luks"] = {"pbkdf": {"type": "pbkdf2", "force_iterations": 500}}
    pillar["compliance"] = {"fips": True, "min_pbkdf": {"type": "pbkdf2", "iterations": 500}}
    errors = errors_of(pillar)
    plan = hp.normalize(hp.merge(DEFAULTS, pillar), None, RAM_KIB, None, False)
    image, key = tmp_path / "lun.img", tmp_path / "lun.key"
    key.write_bytes(b"k" * 64)
    subprocess.run(["truncate", "-s", "20M", str(image)], check=True)
    made = subprocess.run(
        commands.luks_format(str(image), str(key), plan["luks"]), capture_output=True, text=True
    )
    assert errors or made.returncode == 0, made.stderr
