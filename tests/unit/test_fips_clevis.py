"""Issue 33 §4: a Clevis keyslot FIPS mode refuses, made again by the state. clevis before version
19 made its keyslots with cryptsetup's default KDF (argon2id); a host about to enter FIPS mode
(compliance:fips) could then not unlock them at boot. Under FIPS the state binds anew (clevis 19
and later make PBKDF2-SHA256 keyslots), proves the new binding opens, then removes the old one.

The binding, the KDF conversion that makes an old clevis's keyslot, the header reads and every
command of the state are the real clevis, cryptsetup and tangd, on a LUKS2 header file."""

# ruff: noqa: F811 - the fixtures imported from test_states are parameters of the tests

import os
import shutil
import subprocess

import pytest
from hana_storage_core import commands, kdf, luks

from tests.unit.test_states import (  # noqa: F401 - fixtures
    configure_loader_modules,
    dry_run,
    host_function,
    marks,
    opts,
    pillar_data,
    salt_functions,
    scratch,
    states,
)

pytestmark = pytest.mark.skipif(not shutil.which("clevis"), reason="clevis is not installed")


@pytest.fixture(scope="module")
def tang(tmp_path_factory):
    from tang_server import TangServer

    with TangServer(tmp_path_factory.mktemp("tang")) as server:
        yield server


def run_all(argv, python_shell=False, output_loglevel=None, ignore_retcode=False, env=None, stdin=None):
    """cmd.run_all as Salt runs it: the environment given on top of the process's own."""
    done = subprocess.run(  # noqa: S603 - the state's own argv
        argv, input=stdin, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=False
    )
    return {"retcode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


@pytest.fixture
def real(salt_functions):
    """The state's commands and the host module's reads, all real."""
    salt_functions["cmd.run_all"] = run_all
    for name in ("luks_header", "key_slots", "clevis_opens", "tpm2_unseals", "pcr_drift"):
        salt_functions[f"hana_storage_host.{name}"] = host_function(name, salt_functions)
    return salt_functions


def policy_of(server):
    return {
        "tang": {"servers": [{"url": server.url, "thumbprint": server.thumbprint}], "threshold": 1},
        "tpm2": None,
    }


def header(image):
    return luks.parse_header(luks.reader_for(image.read_bytes()))


def clevis_slots(image):
    return [int(t["keyslots"][0]) for t in header(image)["tokens"] if t["type"] == "clevis"]


def kdf_of(image, slot):
    (made,) = [s["kdf"] for s in header(image)["keyslots"] if int(s["id"]) == slot]
    return made


def old_clevis_binding(tmp_path, server):
    """A header bound to ``server`` as clevis before 19 left it: its keyslot argon2id (the real
    binding's keyslot converted with the passphrase Clevis decrypts, piped, never in a file)."""
    image, key = tmp_path / "hdr.img", tmp_path / "recovery.key"
    key.write_bytes(b"r" * 64)
    key.chmod(0o400)
    subprocess.run(["truncate", "-s", "20M", str(image)], check=True)
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    subprocess.run(
        ["cryptsetup", "luksFormat", "-q", "--type", "luks2", *cheap, "--key-file", str(key), str(image)],
        check=True,
    )
    done = run_all(commands.clevis_bind(str(image), str(key), policy_of(server)))
    assert done["retcode"] == 0, done["stderr"]
    (slot,) = clevis_slots(image)
    assert kdf.fips_usable(kdf_of(image, slot)), kdf_of(image, slot)  # clevis 18+: PBKDF2-SHA256
    made_argon2(image, slot)
    assert kdf_of(image, slot)["type"] == "argon2id"
    return image, key, slot


def made_argon2(image, slot):
    """Keyslot ``slot`` of ``image`` made again argon2id, as clevis before 19 made it, with the
    passphrase Clevis decrypts piped (never in a file)."""
    pipe = subprocess.run(
        f"clevis luks pass -d {image} -s {slot} | cryptsetup luksConvertKey {image} --key-slot {slot} "
        "--key-file - --pbkdf argon2id --pbkdf-memory 32 --pbkdf-force-iterations 4",
        shell=True,  # noqa: S602 - the test's own fixed pipeline
        capture_output=True,
        text=True,
        check=False,
    )
    assert pipe.returncode == 0, pipe.stderr


def opens(image, slot):
    return run_all(["clevis", "luks", "pass", "-d", str(image), "-s", str(slot)])["retcode"] == 0


def test_under_fips_an_argon2_clevis_keyslot_is_bound_anew_in_pbkdf2_and_the_old_one_goes(
    real, tang, tmp_path
):
    image, key, old = old_clevis_binding(tmp_path, tang)
    ret = states.clevis_bound(str(image), str(key), policy_of(tang), fips=True)
    assert ret["result"] is True, ret
    assert "argon2id, which FIPS mode refuses" in ret["comment"], ret
    (new,) = clevis_slots(image)
    assert new != old and kdf.fips_usable(kdf_of(image, new)), kdf_of(image, new)
    assert opens(image, new)
    assert [int(s["id"]) for s in header(image)["keyslots"]] == sorted([0, new])  # the recovery key's stays
    assert real["hana_storage_host.key_slots"](str(image), str(key))["keyslots"] == [0]
    again = states.clevis_bound(str(image), str(key), policy_of(tang), fips=True)
    assert again["result"] is True and not again["changes"], again


def test_without_fips_the_argon2_clevis_keyslot_is_the_pillars_binding_and_stays(real, tang, tmp_path):
    image, key, old = old_clevis_binding(tmp_path, tang)
    before = image.read_bytes()
    ret = states.clevis_bound(str(image), str(key), policy_of(tang))
    assert ret["result"] is True and not ret["changes"], ret
    assert image.read_bytes() == before


def test_in_test_mode_it_says_it_would_bind_anew_and_no_byte_changes(real, dry_run, tang, tmp_path):
    image, key, old = old_clevis_binding(tmp_path, tang)
    before = image.read_bytes()
    ret = states.clevis_bound(str(image), str(key), policy_of(tang), fips=True)
    assert ret["result"] is None, ret
    assert f"keyslot {old} is argon2id, which FIPS mode refuses" in ret["comment"], ret
    assert image.read_bytes() == before


def test_a_clevis_that_makes_argon2_again_has_its_new_keyslot_removed_and_the_old_binding_kept(
    real, tang, tmp_path
):
    """clevis before 19 on the host: the new binding's keyslot is refused too. The state removes
    what it just made and fails, the old binding as it was (the real clevis 19 is made to bind
    with argon2 by converting its keyslot the moment the bind returns)."""
    image, key, old = old_clevis_binding(tmp_path, tang)

    def old_clevis(argv, **kwargs):
        done = run_all(argv, **kwargs)
        if argv[:3] == ["clevis", "luks", "bind"] and done["retcode"] == 0:
            (slot,) = set(clevis_slots(image)) - {old}
            made_argon2(image, slot)
        return done

    real["cmd.run_all"] = old_clevis
    ret = states.clevis_bound(str(image), str(key), policy_of(tang), fips=True)
    assert ret["result"] is False, ret
    assert "clevis before version 19" in ret["comment"] and "Removed it again" in ret["comment"], ret
    assert clevis_slots(image) == [old] and opens(image, old)
    assert kdf_of(image, old)["type"] == "argon2id"
