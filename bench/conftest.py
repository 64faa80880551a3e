"""`make bench`: what the checker costs, how fast it sees drift, how far it scales.

Each benchmark records its rows through the ``bench`` fixture, with repetitions and their
spread, because these machines are shared and noisy; costs are ratios against a baseline
measured in the same run wherever one exists. A row with a target is a check: when the target
is missed, the test that recorded it fails, naming the row, after all its rows are recorded
(so `make bench` exits non-zero). The table is printed at the end and kept in
build/bench/results.{json,md}.
"""

import dataclasses
import datetime
import json
import operator
import os
import platform
import statistics

import pytest

from tests.conftest import (  # noqa: F401 - the Salt roots per venv; quiet Salt's deferred log handler
    REPO,
    pytest_sessionfinish,
    salt_factories_default_root_dir,
)

OUT = REPO / "build" / "bench"
ROWS = []


def spread(samples):
    """min/median/max of a list of numbers, rounded for the table."""
    if not samples:
        return {"min": None, "median": None, "max": None, "n": 0}

    def r(x):
        return round(x, 6 if abs(x) < 0.01 else 3)

    return {
        "min": r(min(samples)),
        "median": r(statistics.median(samples)),
        "max": r(max(samples)),
        "n": len(samples),
    }


def p95(samples):
    """The 95th percentile (the last of 20 quantiles; the largest sample when there are few)."""
    return statistics.quantiles(samples, n=20)[-1] if len(samples) >= 2 else samples[0]


STATISTICS = {"median": statistics.median, "min": min, "max": max, "p95": p95}
COMPARISONS = {"<": operator.lt, "<=": operator.le, ">=": operator.ge, ">": operator.gt, "==": operator.eq}


@dataclasses.dataclass(frozen=True)
class Target:
    """What a row must reach: ``statistic`` of its samples ``op`` ``value``."""

    op: str
    value: float
    statistic: str = "median"

    def __post_init__(self):
        assert self.op in COMPARISONS and self.statistic in STATISTICS, self

    def met(self, samples):
        return bool(samples) and COMPARISONS[self.op](STATISTICS[self.statistic](samples), self.value)

    def __str__(self):
        return f"{self.statistic} {self.op} {self.value:g}"


class Bench:
    """The rows of one benchmark test; ``missed`` lists the rows whose target was not reached."""

    def __init__(self):
        self.missed = []

    def record(self, name, unit, samples, target=None, note="", **extra):
        """One row: a measured quantity with its spread, and the Target it must reach (if any)."""
        met = target.met(samples) if target else None
        row = {"name": name, "unit": unit, **spread(samples), "target": str(target) if target else None}
        row.update(met=met, note=note, **extra)
        if target:
            row["value"] = round(STATISTICS[target.statistic](samples), 6) if samples else None
        ROWS.append(row)
        if met is False:
            self.missed.append(row)
        print(f"\n[bench] {name}: median {row['median']} {unit} (n={row['n']}) {note}", flush=True)
        return row


@pytest.fixture
def bench():
    """Rows for this test; the test fails at teardown when one of them missed its target."""
    rows = Bench()
    yield rows
    if rows.missed:
        pytest.fail(
            "target missed: "
            + "; ".join(
                f"{r['name']!r}: {r['value']} {r['unit']}, target {r['target']}" for r in rows.missed
            ),
            pytrace=False,
        )


def machine():
    cpus = os.cpu_count()
    model = ""
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo", encoding="utf-8")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return f"{platform.node()}: {cpus} x {model or platform.machine()}, Linux {platform.release()}"


def table(rows):
    head = "| benchmark | median | min | max | n | unit | target | met |"
    lines = [head, "|" + "---|" * 8]
    for row in rows:
        met = {True: "yes", False: "NO", None: "-"}[row["met"]]
        lines.append(
            f"| {row['name']} | {row['median']} | {row['min']} | {row['max']} | {row['n']} "
            f"| {row['unit']} | {row['target'] or '-'} | {met} |"
        )
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    OUT.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    # a run of some benchmarks (pytest bench/test_fleet.py) updates their rows, keeps the others
    path, rows = OUT / "results.json", list(ROWS)
    if path.exists():
        names = {r["name"] for r in ROWS}
        rows = [r for r in json.loads(path.read_text()).get("rows", []) if r["name"] not in names] + rows
    doc = {"date": stamp, "machine": machine(), "rows": rows}
    path.write_text(json.dumps(doc, indent=2))
    notes = "\n".join(f"- {r['name']}: {r['note']}" for r in rows if r["note"])
    markdown = f"Measured {stamp} on {doc['machine']}.\n\n{table(rows)}\n\n{notes}\n"
    (OUT / "results.md").write_text(markdown)
    terminalreporter.write_sep("=", "hana-storage benchmarks")
    terminalreporter.write_line(markdown)
    terminalreporter.write_line(f"(kept in {OUT / 'results.json'} and results.md)")
