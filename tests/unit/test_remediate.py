"""hana_storage.remediate's order and passes, over scripted audits (the fixes themselves run on
real minions: tests/vm/test_lab_boot.py drives every auto rule's fix)."""

import importlib.util

from tests.conftest import REPO
from tests.unit.test_audit import PILLAR, plan_of


def finding(rule, volume, device):
    return {"rule": rule, "volume": volume, "device": device, "severity": "medium"}


def test_a_backup_is_made_after_the_fixes_that_rewrite_its_header_and_once_more_after(monkeypatch):
    """Regression (VM: the lab boot module's remediation of every auto rule left HANA-KEY-006):
    the header backup was refreshed before the flags fix rewrote the header, and a backup that a
    fix made stale was left for the next full audit. Backups go last, and what the fixes
    themselves raise is worked through once more."""
    spec = importlib.util.spec_from_file_location(
        "hana_storage_remediate", REPO / "_modules" / "hana_storage.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__context__ = {}
    plan = plan_of(PILLAR)
    monkeypatch.setattr(module, "_plan", lambda pillar=None: plan)
    monkeypatch.setattr(module, "_host", lambda name: lambda plan: {})
    volumes = {name: {"mounted": True} for name in plan["volumes"]}
    audits = iter(
        [
            [finding("HANA-KEY-006", "data", "/dev/mapper/hana_data"),
             finding("HANA-PERF-003", "data", "/dev/mapper/hana_data")],
            [finding("HANA-KEY-006", "log", "/dev/mapper/hana_log_0")],  # made stale by a fix
            [],
        ]
    )  # fmt: skip
    monkeypatch.setattr(
        module.core.rules,
        "audit",
        lambda plan, facts: (lambda found: {"compliant": not found, "findings": found, "volumes": volumes})(
            next(audits)
        ),
    )
    calls = []

    def single(fun, queue, **kwargs):
        calls.append((fun, kwargs["name"]))
        return {"id": {"result": True, "changes": {"x": 1}, "comment": "done"}}

    module.__salt__ = {"state.single": single}
    result = module.remediate()
    assert calls == [
        ("hana_storage.luks_flags", "hana_data"),
        ("hana_storage.header_backed_up", plan["volumes"]["data"]["crypt"][0]["device"]),
        ("hana_storage.header_backed_up", plan["volumes"]["log"]["crypt"][0]["device"]),
    ]
    assert result["result"] is True and result["remaining"] == [] and len(result["fixed"]) == 3
