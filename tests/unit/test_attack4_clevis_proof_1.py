"""Attack 4 on the Clevis proofs (254c4ba): a TPM that cannot be reached for a moment now costs
the device its working Clevis binding.

A TPM2 device under FIPS, as an earlier apply killed after its bind left it: keyslot 1 an old
clevis's binding (argon2id, FIPS refuses it), keyslot 2 the new PBKDF2 binding that apply bound,
proved and recorded. Both have a PCR record and no PCR changed. Before 254c4ba the next apply
unbound keyslot 1 and kept keyslot 2. Now keyslot 2 must first pass ``clevis_opens``; with the TPM
unreachable (swtpm stopped: the TCTI fails at once, no timeout) it does not, so keyslot 2 is
taken for dead *without* ``tpm2_reseal``; the new bind fails (no TPM), and ``_bind_anew`` frees
room by unbinding every dead keyslot whose TPM2 share ``tpm2_unseals`` says is False - and an
unreachable TPM is False, not None. Keyslot 2 goes; the bind fails again. The device is left
with the argon2 binding only, which FIPS mode refuses: the next boot asks for the recovery key.

Real clevis, cryptsetup, swtpm on a LUKS2 header file; only the PCR read is given (sysfs on a
host, which a userspace TCTI failure does not touch)."""

# ruff: noqa: F811, F401

import json
import os
import shutil
import subprocess

import pytest
from hana_storage_core import commands, kdf, luks, tpm

from tests.unit.test_states import (
    HOST,
    configure_loader_modules,
    host_function,
    marks,
    opts,
    pillar_data,
    salt_functions,
    scratch,
    states,
)

pytestmark = pytest.mark.skipif(
    not shutil.which("swtpm") or not shutil.which("clevis-encrypt-tpm2"), reason="no swtpm/clevis tpm2"
)

POLICY = {"tang": None, "tpm2": {"pcr_bank": "sha256", "pcr_ids": [7]}}


def header(image):
    return luks.parse_header(luks.reader_for(image.read_bytes()))


def clevis_slots(image):
    return sorted(int(t["keyslots"][0]) for t in header(image)["tokens"] if t["type"] == "clevis")


def kdf_of(image, slot):
    (made,) = [s["kdf"] for s in header(image)["keyslots"] if int(s["id"]) == slot]
    return made


def test_a_tpm_that_cannot_be_reached_does_not_cost_the_device_its_working_binding(
    salt_functions, monkeypatch, tmp_path
):
    from swtpm_server import SwtpmServer

    image, key = tmp_path / "hdr.img", tmp_path / "recovery.key"
    key.write_bytes(b"r" * 64)
    key.chmod(0o400)
    subprocess.run(["truncate", "-s", "20M", str(image)], check=True)
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    subprocess.run(
        ["cryptsetup", "luksFormat", "-q", "--type", "luks2", *cheap, "--key-file", str(key), str(image)],
        check=True,
    )
    software = SwtpmServer(tmp_path / "tpm")
    with software as tpm_server:
        values = tpm.parse_pcrread(tpm_server.pcrs("sha256", [7]))["sha256"]

        def record(slot):
            done = tpm_server.run(
                *commands.luks_token_import(str(image)), stdin=tpm.pcr_token(slot, "sha256", values).encode()
            )
            assert done.returncode == 0, done.stderr

        # keyslot 1: an old clevis's binding (argon2id), recorded by the formula then
        done = tpm_server.run(*commands.clevis_bind(str(image), str(key), POLICY))
        assert done.returncode == 0, done.stderr
        assert clevis_slots(image) == [1]
        pipe = subprocess.run(
            f"clevis luks pass -d {image} -s 1 | cryptsetup luksConvertKey {image} --key-slot 1 "
            "--key-file - --pbkdf argon2id --pbkdf-memory 32 --pbkdf-force-iterations 4",
            shell=True,  # noqa: S602 - the test's own fixed pipeline
            capture_output=True,
            env=tpm_server.env,
            check=False,
        )
        assert pipe.returncode == 0, pipe.stderr
        record(1)
        # keyslot 2: the PBKDF2 binding an earlier FIPS apply bound, proved and recorded, then was killed
        done = tpm_server.run(*commands.clevis_bind(str(image), str(key), POLICY))
        assert done.returncode == 0, done.stderr
        assert clevis_slots(image) == [1, 2]
        record(2)
        assert kdf_of(image, 1)["type"] == "argon2id" and kdf.fips_usable(kdf_of(image, 2))
        assert tpm_server.run("clevis", "luks", "pass", "-d", str(image), "-s", "2").returncode == 0

        def run_all(
            argv, python_shell=False, output_loglevel=None, ignore_retcode=False, env=None, stdin=None
        ):
            done = subprocess.run(  # noqa: S603 - the state's own argv
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                env={**tpm_server.env, **(env or {})},
                check=False,
            )
            return {"retcode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}

        salt_functions["cmd.run_all"] = run_all
        for name in ("luks_header", "key_slots", "clevis_opens", "tpm2_unseals"):
            salt_functions[f"hana_storage_host.{name}"] = host_function(name, salt_functions)
        # the PCRs as sysfs gives them (the kernel's, whatever userspace's TCTI does)
        salt_functions["hana_storage_host.pcr_drift"] = lambda name: tpm.pcr_drift(
            header(image), {"sha256": dict(values)}
        )
        monkeypatch.setattr(
            HOST, "CLEVIS_ENV", {**HOST.CLEVIS_ENV, "TPM2TOOLS_TCTI": tpm_server.env["TPM2TOOLS_TCTI"]}
        )

        # the TPM cannot be reached for a moment (a resource manager restarting, a vTPM hiccup)
        tpm_server.stop()
        ret = states.clevis_bound(str(image), str(key), POLICY, fips=True)
        # failing would be fine (no TPM to prove with); before 254c4ba keyslot 1 went, keyslot 2 stayed
        left = clevis_slots(image)
        # the defect: keyslot 2, the only binding FIPS mode opens, was unbound without tpm2_reseal
        assert 2 in left, (left, ret)
