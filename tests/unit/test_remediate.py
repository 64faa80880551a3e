"""hana_storage.remediate's order, passes and turns, over scripted audits (the fixes themselves
run on real minions: tests/vm/test_lab_boot.py drives every auto rule's fix)."""

import importlib.util
import os
import threading
import time

import pytest

from tests.conftest import REPO
from tests.unit.test_audit import PILLAR, plan_of


def finding(rule, volume, device):
    return {"rule": rule, "volume": volume, "device": device, "severity": "medium"}


def loaded(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "hana_storage_remediate", REPO / "_modules" / "hana_storage.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__context__ = {}
    module.__opts__ = {"cachedir": str(tmp_path)}
    return module


def test_a_backup_is_made_after_the_fixes_that_rewrite_its_header_and_once_more_after(monkeypatch, tmp_path):
    """Regression (VM: the lab boot module's remediation of every auto rule left HANA-KEY-006):
    the header backup was refreshed before the flags fix rewrote the header, and a backup that a
    fix made stale was left for the next full audit. Backups go last, and what the fixes
    themselves raise is worked through once more."""
    module = loaded(tmp_path)
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

    module.__salt__ = {"state.single": single, "state.running": lambda: []}
    result = module.remediate()
    assert calls == [
        ("hana_storage.luks_flags", "hana_data"),
        ("hana_storage.header_backed_up", plan["volumes"]["data"]["crypt"][0]["device"]),
        ("hana_storage.header_backed_up", plan["volumes"]["log"]["crypt"][0]["device"]),
    ]
    assert result["result"] is True and result["remaining"] == [] and len(result["fixed"]) == 3


FLAGS = finding("HANA-PERF-002", "data", "/dev/mapper/hana_data")
QUEUED = {  # what state.single(queue=True) returns on Salt 3006.30, 3007.17 and 3008.5 while a state runs
    "result": True,
    "comment": "Job queued for execution",
    "queued": True,
    "changes": {},
    "__no_return__": True,
}


@pytest.fixture
def drifted(monkeypatch, tmp_path):
    """remediate() on a host whose data volume lost its flags until a fix ran (``module.fixed``)."""
    module = loaded(tmp_path)
    plan = plan_of(PILLAR)
    monkeypatch.setattr(module, "_plan", lambda pillar=None: plan)
    monkeypatch.setattr(module, "_host", lambda name: lambda plan: {})
    monkeypatch.setattr(module, "REMEDIATION_WAIT", 5, raising=False)
    monkeypatch.setattr(module, "_pause", lambda seconds: None, raising=False)
    volumes = {name: {"mounted": True} for name in plan["volumes"]}
    module.fixed = threading.Event()
    monkeypatch.setattr(
        module.core.rules,
        "audit",
        lambda plan, facts: (lambda found: {"compliant": not found, "findings": found, "volumes": volumes})(
            [] if module.fixed.is_set() else [FLAGS]
        ),
    )
    return module


def test_a_fix_waits_for_a_running_state_instead_of_letting_salt_queue_it(drifted):
    """Regression (CI, the events module on Salt 3006: an alert and a second remediation for one
    finding): remediate asked state.single for queue=True, which the locked Salt releases answer,
    while any state or queued job exists, by filing the call for later and returning at once.
    remediate read that return as a state and failed. A fix now runs with queue=False and waits
    out Salt's conflicts (a list) itself."""
    calls, apply_runs = [], iter([True, True, False, True, False, False])  # ...then it ends
    conflict = ['The function "state.apply" is running as PID 4242 and was started at ... with jid 1']

    def single(fun, queue=None, **kwargs):
        calls.append(queue)
        if queue:
            return QUEUED
        if len(calls) < 2:
            return conflict  # an apply that began between the look and the call
        drifted.fixed.set()
        return {"id": {"result": True, "changes": {"flags": 1}, "comment": "refreshed"}}

    drifted.__salt__ = {
        "state.single": single,
        "state.running": lambda: conflict if next(apply_runs, False) else [],
    }
    result = drifted.remediate(rules="HANA-PERF-002")
    assert calls == [False, False]
    assert result["result"] is True and [f["rule"] for f in result["fixed"]] == ["HANA-PERF-002"]


def test_a_state_error_is_a_failed_fix_at_once_not_a_wait(drifted):
    """state.single answers a list for its own errors too (verify_data: a state module not
    synced): no state job runs, so there is nothing to wait for."""
    errors = ["Specified state 'hana_storage.luks_flags' was not found"]
    calls = []
    drifted.__salt__ = {
        "state.single": lambda fun, queue=None, **kwargs: calls.append(1) or errors,
        "state.running": lambda: [],
    }
    result = drifted.remediate(rules="HANA-PERF-002")
    assert calls == [1] and result["result"] is False
    assert "was not found" in result["failed"][0]["comment"]


def test_a_state_job_that_outlasts_the_wait_fails_every_fix_without_waiting_again(drifted):
    """One budget for the whole remediation (inside the master's 600 s): once a running state
    has used it up, the next fix fails at once instead of waiting its own turn."""
    calls, clock = [], iter(range(0, 1000, 3))
    drifted.time = type("Clock", (), {"monotonic": staticmethod(lambda: next(clock))})
    drifted.__salt__ = {
        "state.single": lambda fun, queue=None, **kwargs: calls.append(fun),
        "state.running": lambda: ['The function "state.apply" is running as PID 4242'],
    }
    result = drifted.remediate(rules="HANA-PERF-002")
    assert calls == [] and result["result"] is False
    assert "a state job ran for all of the remediation's 5 s" in result["failed"][0]["comment"]


def test_a_state_single_that_raises_is_a_failed_fix_not_a_traceback(drifted):
    def single(fun, queue=None, **kwargs):
        raise RuntimeError("the pillar could not be fetched")

    drifted.__salt__ = {"state.single": single, "state.running": lambda: []}
    result = drifted.remediate(rules="HANA-PERF-002")
    assert result["result"] is False and "RuntimeError" in result["failed"][0]["comment"]


def test_a_fix_that_ran_no_state_fails_with_what_salt_said(drifted):
    drifted.__salt__ = {"state.single": lambda fun, queue=None, **kwargs: QUEUED, "state.running": lambda: []}
    result = drifted.remediate(rules="HANA-PERF-002")
    assert result["result"] is False and result["fixed"] == []
    assert "ran no state" in result["failed"][0]["comment"] and "queued" in result["failed"][0]["comment"]


def test_two_remediations_of_one_host_take_turns_and_the_second_finds_the_fix_made(drifted):
    """Two masters (or one, for two rules of one drift) call remediate at once: the second
    audits after the first's fix, so the finding is fixed once and the second reports it gone."""
    running, overlaps, fixes = [], [], []

    def single(fun, queue=None, **kwargs):
        running.append(1)
        overlaps.append(len(running))
        time.sleep(0.2)  # the real sleep: long enough for the other thread to arrive
        fixes.append(kwargs["name"])
        drifted.fixed.set()
        running.pop()
        return {"id": {"result": True, "changes": {"flags": 1}, "comment": "refreshed"}}

    drifted.__salt__ = {"state.single": single, "state.running": lambda: []}
    results = []
    threads = [threading.Thread(target=lambda: results.append(drifted.remediate(rules="HANA-PERF-002")))]
    threads.append(threading.Thread(target=lambda: results.append(drifted.remediate(rules="HANA-PERF-002"))))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert fixes == ["hana_data"] and overlaps == [1]
    assert sorted(len(r["fixed"]) for r in results) == [0, 1] and all(r["result"] for r in results)
    lock = os.path.join(drifted.__opts__["cachedir"], "hana_storage", drifted.REMEDIATION_LOCK)
    assert (os.stat(os.path.dirname(lock)).st_mode & 0o777, os.stat(lock).st_mode & 0o777) == (0o700, 0o600)


def test_without_the_lock_the_two_would_overlap(drifted, monkeypatch):
    """The test above proves the turns: with the lock made a no-op the fixes overlap."""
    import contextlib

    monkeypatch.setattr(drifted.core.files, "exclusive", lambda *a, **k: contextlib.nullcontext(True))
    overlaps = []

    def single(fun, queue=None, **kwargs):
        overlaps.append(threading.active_count())
        time.sleep(0.3)
        drifted.fixed.set()
        return {"id": {"result": True, "changes": {"flags": 1}, "comment": "refreshed"}}

    drifted.__salt__ = {"state.single": single, "state.running": lambda: []}
    threads = [
        threading.Thread(target=drifted.remediate, kwargs={"rules": "HANA-PERF-002"}) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(overlaps) == 2  # both fixed: each audited before the other's fix


def test_a_remediation_that_cannot_have_its_turn_does_nothing_and_says_why(drifted, tmp_path):
    import fcntl

    lock = os.path.join(drifted.__opts__["cachedir"], "hana_storage", drifted.REMEDIATION_LOCK)
    os.makedirs(os.path.dirname(lock), mode=0o700, exist_ok=True)
    holder = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    drifted.REMEDIATION_WAIT = 0.3
    drifted.__salt__ = {"state.single": lambda *a, **k: pytest.fail("a fix ran without its turn")}
    try:
        result = drifted.remediate(rules="HANA-PERF-002")
    finally:
        os.close(holder)
    assert result["result"] is False and result["fixed"] == []
    (failed,) = result["failed"]
    assert failed["rule"] == "HANA-PERF-002" and "held" in failed["comment"]


def test_a_lock_that_is_a_symlink_or_anothers_is_refused_and_nothing_is_done(drifted):
    folder = os.path.join(drifted.__opts__["cachedir"], "hana_storage")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.symlink("/etc/passwd", os.path.join(folder, drifted.REMEDIATION_LOCK))
    drifted.__salt__ = {"state.single": lambda *a, **k: pytest.fail("a fix ran without its turn")}
    result = drifted.remediate(rules="HANA-PERF-002")
    assert result["result"] is False and "its lock cannot be taken" in result["failed"][0]["comment"]
    os.unlink(os.path.join(folder, drifted.REMEDIATION_LOCK))
    os.chmod(folder, 0o777)  # a folder others may write to is not ours alone
    result = drifted.remediate(rules="HANA-PERF-002")
    assert result["result"] is False and "not this user's alone" in result["failed"][0]["comment"]
