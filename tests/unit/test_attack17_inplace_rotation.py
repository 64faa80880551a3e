"""Attack 17: a key rotation (key:previous) that begins while a volume is encrypted in place."""

from tests.unit.test_pillar import errors_of, mutate
from tests.unit.test_sls import rendered, requires, storage

OLD = {"source": "keyfile", "path": "/etc/hana-storage/keys/old.key"}
NEW = {"source": "keyfile", "path": "/etc/hana-storage/keys/new.key", "previous": OLD}


def test_a_rotation_during_an_encryption_in_place_deadlocks_it(tmp_path):
    """HOLE (encryption stuck for good, and a crypttab that does not unlock). The encryption of
    a multi-TB volume runs for hours or days; a rotation begun meanwhile (key:previous) is
    accepted by the pillar. The volume's only keyslot is the previous key's, but the in-place
    state gets the new key only: ``paused`` starts a unit ``cryptsetup reencrypt --resume-only
    --key-file <new>`` that fails at once (systemd-run still returns 0, so the state says it
    started), ``closed``/``crashed`` fail to open. key_enrolled, which would add the new key,
    defers while the re-encryption is under way, with result True; so flags and then crypttab
    run, and crypttab names the new key, which opens no keyslot: a reboot leaves the volume
    locked. Neither side can move: the encryption waits for the key, the key waits for the
    encryption. Fix: give encrypted_in_place the previous key file and use the key that opens
    (as luks_opened does), and have the unit use it; or refuse key:previous in the pillar while
    a volume has encrypt_in_place and is not done."""
    pillar = mutate("volumes:data:encrypt_in_place", True)
    pillar["key"] = {"source": "pillar", "material": pillar["key"]["material"], "previous": OLD}
    refused = [e for e in errors_of(pillar) if "encrypt_in_place" in e]
    if refused:
        return
    states = rendered(tmp_path, storage(key=NEW, volumes={**storage()["volumes"], "data": {
        **storage()["volumes"]["data"], "encrypt_in_place": True}}))  # fmt: skip
    in_place = states["hana-storage-data-in-place"]["hana_storage.encrypted_in_place"]
    assert {"previous_key_file": OLD["path"]} in in_place, (
        f"the in-place state knows only the new key: {[a for a in in_place if 'key_file' in a]}"
    )


def test_closed_the_in_place_state_runs_after_the_key_is_written(tmp_path):
    """CLOSED. The in-place state requires lv-extended, whose chain goes back through the guard
    to the key state: the key file is in place before the init names it."""
    from tests.unit.test_sls import transitive

    plan = storage(
        volumes={**storage()["volumes"], "data": {**storage()["volumes"]["data"], "encrypt_in_place": True}}
    )
    everything = {}
    for sls in ("keys.sls", "guard.sls", "lvm.sls", "luks.sls"):
        everything.update(rendered(tmp_path, plan, sls))
    assert "hana-storage-data-lv-extended" in requires(
        everything["hana-storage-data-in-place"]["hana_storage.encrypted_in_place"]
    )
    assert "hana-storage-key-default" in transitive(everything, "hana-storage-data-in-place")


def test_closed_encrypt_in_place_is_refused_below_lvm_through_volume_defaults_and_with_tang_on_top():
    """CLOSED. below_lvm from volume_defaults, and a Tang key from the pillar's top key, are
    both refused for encrypt_in_place."""
    pillar = mutate("volumes:shared:encrypt_in_place", True)
    pillar["volume_defaults"] = {"encryption": "below_lvm"}
    assert any("pvmove" in e and "volumes:shared:encrypt_in_place" in e for e in errors_of(pillar))
    pillar = mutate("volumes:data:encrypt_in_place", True)
    pillar["key"] = {
        "source": "tang",
        "servers": [{"url": "http://tang.example:7500", "thumbprint": "x" * 43}],
        "recovery": {"source": "pillar", "material": pillar["key"]["material"]},
    }
    assert any("binds through Clevis" in e for e in errors_of(pillar))
