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


def test_a_module_the_marks_leave_without_a_test_passes_and_the_others_run_what_they_select(tmp_path, capsys):
    """make test runs the VM modules with "not long": a module of long scenarios only boots nothing
    and passes (pytest's exit code 5), a module with one selected test runs that one."""
    long_only, mixed = tmp_path / "test_long_only.py", tmp_path / "test_mixed.py"
    long_only.write_text("import pytest\n\n\n@pytest.mark.long\ndef test_long():\n    pass\n")
    mixed.write_text(
        "import pytest\n\n\n@pytest.mark.long\ndef test_long():\n    raise AssertionError\n\n\n"
        "def test_short():\n    pass\n"
    )
    results = []
    jobs = [(vm_lanes.NEWEST, str(long_only)), (vm_lanes.NEWEST, str(mixed))]
    vm_lanes.run_lane("A", jobs, results, 1, vm_lanes.threading.Lock(), "not long")
    assert [(module, rc) for _n, _line, module, rc, _s, _why in results] == [
        (str(long_only), 0),
        (str(mixed), 0),
    ]
    said = capsys.readouterr().out
    assert f"{long_only} on Salt {vm_lanes.NEWEST}: no test selected" in said
    assert f"{mixed} on Salt {vm_lanes.NEWEST}: passed" in said and "1 passed, 1 deselected" in said
    results.clear()
    vm_lanes.run_lane("A", [(vm_lanes.NEWEST, str(mixed))], results, 1, vm_lanes.threading.Lock(), "")
    assert results[0][3] == 1  # every test: the long one fails
    results.clear()
    empty = tmp_path / "test_empty.py"
    empty.write_text("")
    vm_lanes.run_lane("A", [(vm_lanes.NEWEST, str(empty))], results, 1, vm_lanes.threading.Lock(), "")
    assert results[0][3] == vm_lanes.NOTHING_SELECTED  # no marks: a module without a test fails
