"""tools/vm-lanes: its closing summary says which VM modules failed and why, in their own
words, because a CI log is read from its tail (where `make test` prints the summary again)."""

import importlib.machinery
import importlib.util

from tests.conftest import REPO

loader = importlib.machinery.SourceFileLoader("vm_lanes", str(REPO / "tools" / "vm-lanes"))
spec = importlib.util.spec_from_loader("vm_lanes", loader)
vm_lanes = importlib.util.module_from_spec(spec)
loader.exec_module(vm_lanes)

FAILED_OUTPUT = [
    "....F...",
    "    def test_after_reboot_apply_opens_and_mounts_without_formatting(vm):",
    ">       assert applied.retcode == 0, failures(applied)",
    "E       AssertionError: ['hana-storage-data-open-0: cryptsetup open failed: timeout']",
    "=========================== short test summary info ============================",
    "FAILED tests/vm/test_enforce.py::test_after_reboot_apply_opens_and_mounts_without_formatting",
    "1 failed, 19 passed in 1900.00s",
]


def test_a_failed_modules_summary_names_its_failures_in_their_own_words():
    why = vm_lanes.why_failed(FAILED_OUTPUT)
    assert why == [FAILED_OUTPUT[3], FAILED_OUTPUT[5]]
    results = [
        ("A", "3008", "tests/vm/test_enforce.py", 1, 1900.0, why),
        ("B", "3008", "tests/vm/test_audit.py", 0, 600.0, []),
    ]
    text = vm_lanes.summary(results, 1900.0)
    assert "lane A   31.7 min  FAILED  tests/vm/test_enforce.py (Salt 3008)" in text
    assert "lane B   10.0 min  ok      tests/vm/test_audit.py (Salt 3008)" in text
    assert "== why tests/vm/test_enforce.py (Salt 3008) failed:\n  E       AssertionError" in text
    assert text.rstrip().endswith("the lab logs are under build/vm-tests/<module>/")


def test_a_module_that_died_without_a_failure_line_shows_its_last_lines():
    output = [f"line {n}" for n in range(100)] + ["Killed"]
    assert vm_lanes.why_failed(output) == output[-vm_lanes.WHY_LINES :]


def test_all_passed_is_the_tier_and_the_table_alone():
    text = vm_lanes.summary([("A", "3006", "tests/vm/test_events.py", 0, 60.0, [])], 61.0)
    assert text == (
        "VM tier: 1.0 min (lane A 1.0; its target 36 min)\n"
        "VM tier by module:\n  lane A    1.0 min  ok      tests/vm/test_events.py (Salt 3006)\n"
    )


def test_a_tier_past_its_target_says_so_loudly():
    results = [
        ("A", "3008", "tests/vm/test_grow.py", 0, 1500.0, []),
        ("B", "3008", "tests/vm/test_audit.py", 0, 2300.0, []),
    ]
    text = vm_lanes.summary(results, 2310.0)
    assert text.startswith("VM tier: 38.5 min (lane A 25.0, lane B 38.3; its target 36 min)")
    assert "VM TIER OVER ITS TIME TARGET: 38.5 min, target 36 min" in text
