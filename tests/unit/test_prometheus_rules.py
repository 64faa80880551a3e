"""The shipped Prometheus alerting rules, checked and unit-tested by promtool itself."""

import shutil
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed (Debian package prometheus)")
def test_alerting_rules_pass_promtool():
    check = subprocess.run(
        ["promtool", "check", "rules", str(REPO / "conf/prometheus/hana-storage.rules.yml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run(
        ["promtool", "test", "rules", "hana-storage.test.yml"],
        cwd=REPO / "tests/prometheus",
        capture_output=True,
        text=True,
    )
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr
