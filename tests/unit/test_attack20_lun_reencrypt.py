"""Attack 20: a LUN grown below LVM while its PV's LUKS2 device is being re-encrypted online
(now allowed below LVM). The state runs through Salt's loader dunders (tests/unit/test_states).
Tests whose docstring starts with "HOLE" fail on the code they were written against (effe833)."""

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


def test_lun_grown_resizes_a_pv_s_crypt_device_under_online_re_encryption(salt_functions, monkeypatch):
    """HOLE (low-medium) [a resize racing cryptsetup's work]: every step that writes a header or a
    mapping leaves a device under LUKS2 re-encryption alone (_under_reencryption: crypt_grown,
    luks_flags, lv_extended, header backups ...), but lun_grown, below LVM, runs
    `cryptsetup resize hana_log_<i>` (and multipathd resize before it) without asking. Below LVM
    a PV's crypt device is now re-encrypted online for days under a cap, so a LUN grown meanwhile
    meets it: a reload of the crypt mapping while the unit has it stacked over its hotzone and
    overlay devices (libcryptsetup refuses a multi-segment table, so at best every apply fails
    with "cryptsetup resize failed" after the map was resized; while it is paused the single
    crypt segment is reloaded under a header that records the re-encryption's size). Fix: in
    lun_grown, `if key_file and _under_reencryption(ret, name): return ret` before any step."""
    monkeypatch.setattr(states.os.path, "exists", lambda path: True)
    ran = salt_functions["cmd.run_all"]
    salt_functions["hana_storage_host.lun_growth"] = lambda device, pv: DONE if ran.call_count >= 3 else BELOW
    salt_functions["hana_storage_host.luks_header"].return_value = UNDER_WAY
    ret = states.lun_grown(MPATH, CRYPT_PV, KEY)
    print(ret, argvs_run(salt_functions))
    assert not [a for a in argvs_run(salt_functions) if a[:2] == ["cryptsetup", "resize"]], ret
