"""Each test module's wall time, against its budget: a pytest plugin (tests/conftest.py loads it).

The time of a module is the sum of its tests' setup, call and teardown, module-scoped fixtures
(a VM boot, a Salt start) included. At the end of a session every module's time is printed
beside its budget (tests/budgets.json, seconds) and written to build/test-logs/times-<name>.json
(the Makefile prints them all at the end of ``make test``). A module over its budget is marked
OVER BUDGET; with HANA_STORAGE_BUDGETS=strict it also fails the session. Strict is for a quiet
machine (a module that grows is found the day it grows): on a shared CI machine a module's wall
time measures its neighbours as much as itself, and a green suite that ran slow must still land.
"""

import json
import os
import pathlib
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
BUDGETS = REPO / "tests" / "budgets.json"
LOGS = REPO / "build" / "test-logs"


class ModuleBudget:
    def __init__(self):
        self.spent = {}
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report):
        module = report.nodeid.split("::", 1)[0]
        self.spent[module] = self.spent.get(module, 0.0) + report.duration

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        """Judge the modules before the summary is printed and the exit status is read."""
        budgets = json.loads(BUDGETS.read_text()) if BUDGETS.exists() else {}
        self.rows = [
            (module, seconds, budgets.get(module))
            for module, seconds in sorted(self.spent.items(), key=lambda item: -item[1])
        ]
        self.over = [m for m, seconds, budget in self.rows if budget is not None and seconds > budget]
        if self.rows:
            LOGS.mkdir(parents=True, exist_ok=True)
            name = os.environ.get("HANA_STORAGE_TIMES") or f"{_tier(self.rows)}-{_line()}"
            (LOGS / f"times-{name}.json").write_text(
                json.dumps({m: {"seconds": round(s, 1), "budget": b} for m, s, b in self.rows}, indent=1)
                + "\n"
            )
        if self.over and session.exitstatus == 0 and os.environ.get("HANA_STORAGE_BUDGETS") == "strict":
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if not getattr(self, "rows", None):
            return
        write = terminalreporter.write_line
        write(f"module times (Salt {_line()}), {time.monotonic() - self.started:.0f} s in all:")
        for module, seconds, budget in self.rows:
            mark = "  OVER BUDGET" if module in self.over else ""
            shown = f"{budget:.0f}" if budget is not None else "-"
            write(f"  {seconds:7.1f} s  (budget {shown:>5} s)  {module}{mark}")
        if self.over:
            write(
                f"MODULES OVER THEIR BUDGET (tests/budgets.json): {', '.join(self.over)}", red=True, bold=True
            )


def _line():
    """The Salt line this session runs (the venv's name: .venv is the newest)."""
    try:
        import salt.version

        return str(salt.version.__saltstack_version__.major)
    except ImportError:
        return pathlib.Path(sys.prefix).name


def _tier(rows):
    tiers = {module.split("/")[1] for module, _s, _b in rows if module.count("/") >= 2}
    return "+".join(sorted(tiers)) or "tests"
