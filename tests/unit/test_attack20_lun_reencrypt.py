"""Attack 20: a LUN grown below LVM while its PV's LUKS2 device is being re-encrypted online
(now allowed below LVM). The state runs through Salt's loader dunders (tests/unit/test_states).
The test docstring says which commit it was found against and which fixed it."""

# ruff: noqa: F811 - the fixtures imported from test_states are parameters of the tests

from tests.unit.test_lun_growth import BELOW, CRYPT_PV, DONE, KEY, MPATH
from tests.unit.test_states import (  # noqa: F401  (fixtures: pytest finds them by name here)
    argvs_run,
    configure_loader_modules,
    dry_run,
    marks,
    opts,
    pillar_data,
    salt_functions,
    scratch,
    states,
)

UNDER_WAY = {"uuid": "u-1", "flags": [], "tokens": [], "version": 2,
             "reencryption": {"mode": "reencrypt", "target": {"sector_size": 4096}}}  # fmt: skip


def test_lun_grown_leaves_a_pv_under_online_re_encryption_alone(salt_functions, monkeypatch):
    """HOLE (fixed in d996d40, found here against effe833): below LVM a PV's crypt device is
    now re-encrypted online for days, and lun_grown had no _under_reencryption guard (crypt_grown,
    luks_flags, lv_extended have one): a LUN grown meanwhile got `multipathd resize map` and then
    `cryptsetup resize hana_log_<i>` against cryptsetup's hotzone stack (refused: every apply
    failed). Now the LUN is left alone until the re-encryption ends, and the comment says why."""
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)
    ran = salt_functions["cmd.run_all"]
    salt_functions["hana_storage_host.lun_growth"] = lambda device, pv: DONE if ran.call_count >= 3 else BELOW
    salt_functions["hana_storage_host.luks_header"].return_value = UNDER_WAY
    ret = states.lun_grown(MPATH, CRYPT_PV, KEY)
    assert argvs_run(salt_functions) == [] and "under LUKS2 re-encryption" in ret["comment"], ret
