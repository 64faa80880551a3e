"""Attack on the proof the FIPS replacement relies on: hana_storage_host.clevis_opens(device, N)
("does Clevis open keyslot N", via _clevis_pass / _clevis_child) is True whenever the passphrase
in the token on keyslot N opens *any* keyslot: clevis 19's `clevis luks pass -s N` checks the
passphrase with `cryptsetup open --test-passphrase` without --key-slot.

So a proof of "the new binding opens" does not prove its keyslot opens, and a fix for
test_attack3_fips_clevis_1 (prove the current binding before unbinding the refused one) that
uses clevis_opens would still unbind the only keyslot the current binding's passphrase opens.
Here: two real Tang bindings whose tokens were swapped; keyslot 1 argon2 (the FIPS-refused one).
The token on keyslot 2 holds the passphrase of keyslot 1 only; clevis_opens says keyslot 2 opens.

Real clevis, cryptsetup and tangd on a LUKS2 header file."""

# ruff: noqa: F811, F401

import json
import subprocess

from tests.unit.test_fips_clevis import (
    clevis_slots,
    commands,
    configure_loader_modules,
    kdf_of,
    marks,
    old_clevis_binding,
    opens,
    opts,
    pillar_data,
    policy_of,
    real,
    run_all,
    salt_functions,
    states,
    tang,
)


def dump(image):
    done = subprocess.run(
        ["cryptsetup", "luksDump", "--dump-json-metadata", str(image)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def swap_clevis_tokens(image, a, b):
    tokens = {t["keyslots"][0]: (i, t) for i, t in dump(image)["tokens"].items() if t["type"] == "clevis"}
    for slot in (a, b):
        subprocess.run(
            ["cryptsetup", "token", "remove", "--token-id", tokens[str(slot)][0], str(image)], check=True
        )
    for slot, other in ((a, b), (b, a)):
        token = dict(tokens[str(slot)][1], keyslots=[str(other)])
        subprocess.run(
            ["cryptsetup", "token", "import", str(image)], input=json.dumps(token), text=True, check=True
        )


def opens_keyslot(image, slot, tmp_path):
    """Does the passphrase in the Clevis token on ``slot`` open keyslot ``slot`` itself?"""
    done = subprocess.run(
        f"clevis luks pass -d {image} -s {slot} | cryptsetup open --test-passphrase {image} --key-slot {slot} "
        "--key-file -",
        shell=True,  # noqa: S602 - the test's own fixed pipeline
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def test_clevis_opens_means_its_own_keyslot_opens(real, tang, tmp_path):
    image, key, old = old_clevis_binding(tmp_path, tang)  # keyslot 1, argon2id
    assert run_all(commands.clevis_bind(str(image), str(key), policy_of(tang)))["retcode"] == 0
    (other,) = set(clevis_slots(image)) - {old}  # keyslot 2, pbkdf2
    swap_clevis_tokens(image, old, other)
    assert not opens_keyslot(image, other, tmp_path)  # the token on 2 holds keyslot 1's passphrase
    # the defect: the host module says Clevis opens keyslot 2
    assert real["hana_storage_host.clevis_opens"](str(image), other)["opens"] is False


def test_under_fips_the_replacement_leaves_a_clevis_binding_whose_keyslot_opens(real, tang, tmp_path):
    image, key, old = old_clevis_binding(tmp_path, tang)
    assert run_all(commands.clevis_bind(str(image), str(key), policy_of(tang)))["retcode"] == 0
    (other,) = set(clevis_slots(image)) - {old}
    swap_clevis_tokens(image, old, other)
    assert kdf_of(image, old)["type"] == "argon2id"
    # fixed: the proof pipes the passphrase into cryptsetup for that keyslot alone
    assert not real["hana_storage_host.clevis_opens"](str(image), other)["opens"]
    ret = states.clevis_bound(str(image), str(key), policy_of(tang), fips=True)
    left = clevis_slots(image)
    assert any(opens(image, slot) for slot in left), (ret, left)
