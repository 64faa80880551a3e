"""Attack on the FIPS refusal path of _bind_anew: when the host's clevis makes an argon2 keyslot
again, the state removes the keyslot it just made and fails, but its return still reports
`changes: {"bound": {servers, threshold}}` and nothing of the removal: the highstate shows the
device as bound to the pillar's servers by this run while no new binding exists.

Real clevis, cryptsetup and tangd, the old clevis simulated as tests/unit/test_fips_clevis.py does."""

# ruff: noqa: F811, F401

import subprocess

from tests.unit.test_fips_clevis import (
    clevis_slots,
    configure_loader_modules,
    marks,
    old_clevis_binding,
    opts,
    pillar_data,
    policy_of,
    real,
    run_all,
    salt_functions,
    states,
    tang,
)


def test_the_refused_new_binding_is_not_reported_as_bound(real, tang, tmp_path):
    image, key, old = old_clevis_binding(tmp_path, tang)

    def old_clevis(argv, **kwargs):
        done = run_all(argv, **kwargs)
        if argv[:3] == ["clevis", "luks", "bind"] and done["retcode"] == 0:
            (slot,) = set(clevis_slots(image)) - {old}
            subprocess.run(
                f"clevis luks pass -d {image} -s {slot} | cryptsetup luksConvertKey {image} --key-slot "
                f"{slot} --key-file - --pbkdf argon2id --pbkdf-memory 32 --pbkdf-force-iterations 4",
                shell=True,  # noqa: S602 - the test's own fixed pipeline
                check=True,
            )
        return done

    real["cmd.run_all"] = old_clevis
    ret = states.clevis_bound(str(image), str(key), policy_of(tang), fips=True)
    assert ret["result"] is False and "Removed it again" in ret["comment"], ret
    assert clevis_slots(image) == [old]  # nothing new is bound
    # the defect: the return says this run bound the device
    assert "bound" not in ret["changes"], ret["changes"]
