"""Attack 21 on the data-loss guard's re-encryption stack (safety._with_reencryption, 3deadb9):
a device-mapper holder named `<own crypt>-overlay|-hotzone-forward|-hotzone-backward` is counted
as the volume's own by its name alone. Tests whose docstring starts with "HOLE" fail on 3deadb9."""

from hana_storage_core import safety

from tests.unit.test_safety import probe, sig, volume

# cryptsetup ciphertext / someone's data: no signature blkid knows, non-zero bytes
PLAIN_DM_CRYPT = {"signatures": [], "data_at": 0}


def test_a_foreign_mapping_named_like_our_overlay_is_wiped_where_allow_format_lists_the_disk():
    """HOLE (fixed, high) [wipefs/luksFormat of a live device]: below LVM, /dev/vda held only by a mapping
    `hana_data_0-overlay` that is not cryptsetup's (a plain dm-crypt, a dm-linear someone made by
    that name) and holding no LUKS header: `held` is in NEVER_WIPE ("the device is live"), but the
    name puts the holder in _with_reencryption(own_holders), so _foreign_disk goes on to
    _unknown_data -> `unknown_data`, which allow_format turns into `wipe` (devices_safe runs
    wipefs --all, then luks_formatted luksFormat). Before 3deadb9: refuse, held.
    cryptsetup's stack can only sit on a LUKS2 device under re-encryption (its header is on the
    disk), and the top mapping `hana_data_0` holds it. Fix: count a stack name as own only when
    the disk is crypto_LUKS with a reencryption in its header, or the holder's dm UUID is
    cryptsetup's (`CRYPT-SUBDEV-<the disk's LUKS UUID>-...`) / it is held by our own mapping."""
    allowed = volume("below_lvm", allow=["/dev/vda"])
    got = safety.disk_verdict(allowed, probe(holders=["hana_data_0-overlay"], **PLAIN_DM_CRYPT))
    assert (got["verdict"], got["code"]) == ("refuse", "held"), got


def test_a_foreign_mapping_named_like_our_hotzone_on_a_zeroed_disk_is_luksformatted():
    """HOLE (fixed, high) [luksFormat of a live device, no leave needed]: without allow_format, a disk held
    only by `hana_data_0-hotzone-forward` (not cryptsetup's; its first sampled areas read zero:
    a fresh scratch mapping someone uses) is `use`/`blank`; the next state luksFormats it.
    Before 3deadb9: refuse, held (NEVER_WIPE). Same fix as above."""
    got = safety.disk_verdict(
        volume("below_lvm"), probe(holders=["hana_data_0-hotzone-forward"], signatures=[], data_at=None)
    )
    assert (got["verdict"], got["code"]) == ("refuse", "held"), got


def test_a_foreign_luks_disk_held_by_a_stack_named_mapping_is_ours_without_a_key_test():
    """HOLE (fixed, low) [misclassification, no write found]: below LVM, a LUKS disk our key does not open,
    held only by a mapping named `hana_data_0-overlay`: the probe skips the key test for any disk
    with holders (hana_storage_host.probe: `not result["holders"]`), and _foreign_disk returns
    None for a LUKS disk with (now "own") holders -> `use`, `own_luks_open`, "open as
    hana_data_0-overlay". Nothing is written after it (luks_opened's cryptsetup open fails on the
    wrong key), but the guard reports a foreign disk as the volume's own. Fix: as above; a stack
    holder without our top mapping is not "open as" anything of ours."""
    got = safety.disk_verdict(
        volume("below_lvm"),
        probe(signatures=sig("crypto_LUKS"), holders=["hana_data_0-overlay"], luks={"keyslots": 1}),
    )
    assert got["verdict"] == "refuse", got


def test_an_lvs_name_gets_a_re_encryption_stack_in_the_pv_and_luks_layers_it_never_has():
    """HOLE (fixed, medium) [pvcreate / wipefs of a live device]: _with_reencryption is applied to every
    own_holders list, also where the holder is an LV (pv_safe: own_holders=[lv_dm_name]) or the
    volume's LV above LVM (_foreign_disk: {lv_dm_name}). cryptsetup never puts a stack under an
    LV's name, and `vg-lv-overlay` (one hyphen) cannot even be an LVM name (LVM doubles '-'), so
    such a holder is always someone else's. With it, an opened LUKS PV reading zero is `create`
    (pvcreate --yes), and an above-LVM disk with data and allow_format is `wipe`.
    Fix: extend only crypt names (below LVM the disks, above it the LV's `luks` layer)."""
    lv = "vg_hana_data-lv_hana_data"
    pv = safety.layer_verdict("pv", probe("/dev/mapper/hana_data_0", holders=[f"{lv}-overlay"]), False,
                              own_holders=[lv], own_vg="vg_hana_data")  # fmt: skip
    assert (pv["verdict"], pv["code"]) == ("refuse", "held"), pv
    above = volume("above_lvm", allow=["/dev/vda"])
    assert above["lv_dm_name"] == lv
    disk = safety.disk_verdict(above, probe(holders=[f"{lv}-hotzone-forward"], **PLAIN_DM_CRYPT))
    assert (disk["verdict"], disk["code"]) == ("refuse", "held"), disk


def test_the_luks_layer_above_lvm_wipes_an_lv_a_stack_named_foreign_mapping_holds():
    """HOLE (fixed, high) [wipefs/luksFormat of a live LV]: above LVM, luks_formatted judges the LV with
    own_holders=[label]; a non-LUKS LV held by `hana_data-overlay` (not cryptsetup's: the LV has
    no LUKS header, so no re-encryption of ours can be on it) with data and may_wipe is `wipe`.
    Before 3deadb9: refuse, held."""
    got = safety.layer_verdict(
        "luks", probe("/dev/vg_hana_data/lv_hana_data", holders=["hana_data-overlay"], **PLAIN_DM_CRYPT),
        True, own_holders=["hana_data"],
    )  # fmt: skip
    assert (got["verdict"], got["code"]) == ("refuse", "held"), got


def test_what_held_our_stack_under_our_luks_is_ours_and_another_crypts_is_not():
    """Held: the genuine case (a LUKS disk, the stack of the volume's own crypt) is `use`; another
    crypt's stack, a suffix the stack never has, and a prefix match are foreign and never wiped."""
    ok = safety.disk_verdict(
        volume("below_lvm"),
        probe(signatures=sig("crypto_LUKS"), holders=["hana_data_0-hotzone-backward", "hana_data_0-overlay"],
              luks={"version": 2, "keyslots": 2, "reencryption": True}),  # the probe reads it off the header
    )  # fmt: skip
    assert ok["verdict"] == "use", ok
    allowed = volume("below_lvm", allow=["/dev/vda"])
    for holder in ("hana_data_1x-overlay", "hana_data_0-overlay2", "hana_data_0-hotzone", "xhana_data_0-overlay",
                   "hana_data_0-hotzone-forward-x", "hana_data_0"[:-1] + "-overlay"):  # fmt: skip
        got = safety.disk_verdict(allowed, probe(holders=[holder], **PLAIN_DM_CRYPT))
        assert (got["verdict"], got["code"]) == ("refuse", "held"), (holder, got)
