"""Attack 21 on the audit during a re-encryption (8f6cd3c, 806d7b8): rules._health_rules leaves out
the suspended devices whose dm name is in inplace.leftovers(crypt) of any crypt whose
re-encryption runs (facts["reencrypting"]), and _xfs_rules reads nothing into a superblock a
suspended stack kept unread. Tests whose docstring starts with "HOLE" fail on 3deadb9."""

import copy

from hana_storage_core import rules

from tests.unit.test_audit import PILLAR, compliant, plan_of

UNREAD = {"error": "not read: a device of the stack is suspended", "unread": "suspended"}


def layout_004(plan, facts):
    return [
        (f["volume"], f["actual"])
        for f in rules.audit(plan, facts)["findings"]
        if f["rule"] == "HANA-LAYOUT-004"
    ]


def findings_of(plan, facts, volume):
    return sorted(f["rule"] for f in rules.audit(plan, facts)["findings"] if f["volume"] == volume)


def test_another_volumes_frozen_crypt_named_like_a_running_stack_is_no_finding_at_all():
    """HOLE (fixed, high) [a frozen volume the audit and the beacon call compliant]: `working` in
    _health_rules is every device of the host whose dm name is `<crypt>-overlay|-hotzone-*` for
    any crypt in facts["reencrypting"] that runs; it is not limited to this volume's crypts, nor
    to devices *below* the running crypt. crypt_name is any dm name (schema: [A-Za-z0-9_.+-]),
    and the pillar only checks that names are unique: a data volume (above LVM) whose
    crypt_name is `hana_log_0-overlay`. While the log volume's PV hana_log_0 is re-encrypted
    (days, under a MiB/s cap), data's own top crypt device suspended (a stuck luksSuspend, a
    dmsetup suspend nobody resumed: all HANA data I/O stalls) is left out of HANA-LAYOUT-004,
    and its superblock is `unread` so HANA-LAYOUT-003 is skipped too: no finding for /hana/data.
    (host._reencryptions_running also asks systemctl at every tick for hana_log_0, since
    leftovers() matches data's crypt by name.)
    Fix: exempt only devices that are slaves in the stack of the crypt that runs (the running
    crypt of *this* volume, below it: its table references them), never a crypt of the plan, and
    better by dm UUID (cryptsetup gives its stack `CRYPT-SUBDEV-...` / the LUKS UUID) than by name."""
    pillar = copy.deepcopy(PILLAR)
    pillar["volumes"]["data"]["crypt_name"] = "hana_log_0-overlay"
    plan = plan_of(pillar)
    facts = compliant()
    top = facts["devices"]["dm-1"]
    top.update(dm_name="hana_log_0-overlay", path="/dev/mapper/hana_log_0-overlay", suspended=True)
    facts["crypttab"][0]["name"] = "hana_log_0-overlay"
    facts["superblocks"]["dm-1"] = dict(UNREAD)
    facts["reencrypting"] = {"hana_log_0": False}
    assert findings_of(plan, facts, "data") == ["HANA-LAYOUT-004"]
    facts["reencrypting"] = {"hana_log_0": True}  # the log volume's PV is re-encrypted meanwhile
    assert findings_of(plan, facts, "data") == ["HANA-LAYOUT-004"]  # on 3deadb9: [], nothing at all


def test_a_stack_named_device_that_is_not_under_the_running_crypt_is_still_a_finding():
    """HOLE (fixed, medium) [a frozen device hidden]: the exemption is by name only. A suspended
    `hana_log_0-hotzone-forward` that is in the log volume's stack but is not under hana_log_0
    (here: under hana_log_1, a stale or foreign mapping of that name in the second PV's path)
    is left out while hana_log_0's re-encryption runs, though I/O of hana_log_1 stalls on it and
    hana_log_0's cryptsetup will never resume it. Fix: as above (only slaves of the running crypt)."""
    plan = plan_of(PILLAR)
    facts = compliant()
    hotzone = {**facts["devices"]["dm-3"], "name": "dm-9", "dev": "253:9", "kind": "linear",
               "dm_name": "hana_log_0-hotzone-forward", "path": "/dev/mapper/hana_log_0-hotzone-forward",
               "dm_uuid": "", "suspended": True, "holders": ["dm-3"], "slaves": ["vdd"], "table": []}  # fmt: skip
    facts["devices"]["dm-9"] = hotzone
    facts["devices"]["dm-3"]["slaves"] = ["dm-9"]
    facts["superblocks"]["dm-4"] = dict(UNREAD)
    facts["reencrypting"] = {"hana_log_0": True}
    assert layout_004(plan, facts) == [("log", ["suspended: /dev/mapper/hana_log_0-hotzone-forward"])]


def test_a_suspended_top_crypt_or_lv_is_still_layout_004_while_a_re_encryption_runs():
    """Held: only the stack's names are left out; the running crypt itself suspended (a
    luksSuspend), or the LV over it, is HANA-LAYOUT-004 whatever runs."""
    plan = plan_of(PILLAR)
    for name, path in (("dm-2", "/dev/mapper/hana_log_0"), ("dm-4", "/dev/mapper/vg_l-lv_l")):
        facts = compliant()
        facts["devices"][name]["suspended"] = True
        facts["superblocks"]["dm-4"] = dict(UNREAD)
        facts["reencrypting"] = {"hana_log_0": True, "hana_log_1": True}
        assert layout_004(plan, facts) == [("log", [f"suspended: {path}"])], name


def test_an_unread_superblock_for_any_other_reason_is_still_layout_003():
    """Held: only `unread: suspended` skips the stripe rule; an error without it (xfs_db failed,
    a superblock that does not parse) is HANA-LAYOUT-003 as before."""
    plan = plan_of(PILLAR)
    facts = compliant()
    facts["superblocks"]["dm-4"] = {"error": "xfs_db failed"}
    assert "HANA-LAYOUT-003" in findings_of(plan, facts, "log")
    facts["superblocks"]["dm-4"] = {"error": "x", "unread": "something else"}
    assert "HANA-LAYOUT-003" in findings_of(plan, facts, "log")
