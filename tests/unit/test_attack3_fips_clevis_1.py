"""Attack on the FIPS Clevis replacement: a binding the state itself found not to open is trusted
on the next apply, which then unbinds the old (argon2) binding, the only Clevis binding that opens.

Run 1 (fips): bind anew; the new binding does not open (here made so for real: its keyslot's
passphrase is no longer the one its JWE holds); the state fails "kept the old binding" and leaves
both bindings. Run 2 (fips): the pbkdf2 binding is `current` (never proven), the argon2 one is
`refused`, so it is unbound; the state says True. The device ends with no Clevis binding that
opens: the next boot waits for the recovery key.

Fixed: a new binding that does not open is removed at once, and an earlier run's binding must
open its own keyslot before the one it replaces goes (else both are replaced by a new one).

Real clevis, cryptsetup and tangd on a LUKS2 header file, as tests/unit/test_fips_clevis.py."""

# ruff: noqa: F811, F401

import subprocess

from tests.unit.test_fips_clevis import (
    clevis_slots,
    commands,
    configure_loader_modules,
    kdf,
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


def test_a_binding_found_not_to_open_is_not_trusted_by_the_next_apply(real, tang, tmp_path):
    image, key, old = old_clevis_binding(tmp_path, tang)

    def bind_that_does_not_open(argv, **kwargs):
        done = run_all(argv, **kwargs)
        if argv[:3] == ["clevis", "luks", "bind"] and done["retcode"] == 0:
            (slot,) = set(clevis_slots(image)) - {old}
            other = tmp_path / "other.pass"
            other.write_bytes(b"x" * 32)
            pipe = subprocess.run(
                f"clevis luks pass -d {image} -s {slot} | cryptsetup luksChangeKey {image} --key-slot {slot} "
                f"--key-file - --pbkdf pbkdf2 --pbkdf-force-iterations 1000 {other}",
                shell=True,  # noqa: S602 - the test's own fixed pipeline
                capture_output=True,
                text=True,
                check=False,
            )
            assert pipe.returncode == 0, pipe.stderr
        return done

    real["cmd.run_all"] = bind_that_does_not_open
    first = states.clevis_bound(str(image), str(key), policy_of(tang), fips=True)
    assert first["result"] is False and "does not open" in first["comment"], first
    # fixed: the binding that does not open goes again at once; the old one stays
    assert clevis_slots(image) == [old] and opens(image, old), first
    assert "bound" not in first["changes"] and first["changes"]["bound_then_removed"]["keyslots"], first

    # a run killed between its bind and its proof leaves such a binding: made here by hand
    real["cmd.run_all"] = run_all
    bind_that_does_not_open(commands.clevis_bind(str(image), str(key), policy_of(tang)))
    (new,) = set(clevis_slots(image)) - {old}
    second = states.clevis_bound(str(image), str(key), policy_of(tang), fips=True)
    assert second["result"] is True, second
    (left,) = clevis_slots(image)
    assert left not in (old, new) and kdf.fips_usable(kdf_of(image, left))
    assert real["hana_storage_host.clevis_opens"](str(image), left)["opens"], second
