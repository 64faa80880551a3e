"""The HANA I/O check's pure half: HCMT-like job lines, fio JSON parsing, KPI verdicts."""

import json
import os
import shutil
import stat
import subprocess

import pytest
from hana_storage_core import fio as fio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.conftest import DATA

SAMPLE = (DATA / "fio-write-1m.json").read_text()  # fio 3.33, written on this project's CI image


def test_profiles_follow_hcmt_log_sequential_qd1_and_data_random():
    assert [j["bs"] for j in fio.PROFILES["log"]] == ["4k", "16k", "1m"]
    assert {j["rw"] for j in fio.PROFILES["log"]} == {"write"}
    assert {j["iodepth"] for j in fio.PROFILES["log"]} == {1}
    assert {(j["rw"], j["bs"]) for j in fio.PROFILES["data"]} >= {("randread", "16m"), ("randwrite", "16k")}


def test_argv_uses_direct_io_and_json_on_one_file():
    argv = fio.fio_argv("/hana/log/.io", fio.PROFILES["log"][2], "64M", 5)
    assert argv[0] == "fio" and "--direct=1" in argv and "--output-format=json" in argv
    assert "--filename=/hana/log/.io" in argv and "--bs=1m" in argv and "--runtime=5" in argv


def test_parse_real_fio_output():
    result = fio.parse_result(SAMPLE)
    raw = json.loads(SAMPLE)["jobs"][0]["write"]
    assert result["mb_s"] == round(raw["bw_bytes"] / 1e6, 1)
    assert result["ios"] == raw["total_ios"] > 0
    assert result["lat_us_mean"] == round(raw["clat_ns"]["mean"] / 1000, 1)


def test_parse_skips_fio_warnings_before_the_json():
    assert fio.parse_result("fio: note: something\n" + SAMPLE)["ios"] > 0


@pytest.mark.parametrize(
    "text",
    ["", "not json", "{}", '{"jobs": []}', '{"jobs": [1]}', '{"jobs": [{"error": 5}]}', '{"jobs": [{}]}'],
)
def test_malformed_output_is_a_fio_error(text):
    with pytest.raises(fio.FioError):
        fio.parse_result(text)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.binary().map(lambda b: b.decode("latin-1"))))
def test_random_text_raises_only_fio_error(text):
    try:
        fio.parse_result(text)
    except fio.FioError:
        pass


def test_default_kpis_are_sap_minimums_and_can_be_overridden():
    table = fio.kpis({"log:write:1m": {"min_mb_s": 400}})
    assert table[("log", "write", "1m")] == {"min_mb_s": 400}
    assert table[("data", "randread", "16m")] == {"min_mb_s": 400}
    assert table[("data", "randwrite", "16m")] == {"min_mb_s": 250}
    with pytest.raises(fio.FioError, match="expected"):
        fio.kpis({"disk:write:1m": {"min_mb_s": 1}})
    with pytest.raises(fio.FioError, match="min_mb_s"):
        fio.kpis({"log:write:1m": {"fast": True}})


def test_verdicts():
    table = fio.kpis()
    job = {"rw": "write", "bs": "1m"}
    slow = {"mb_s": 120.0, "lat_us_mean": 8000.0}
    assert fio.verdict("log", job, slow, table)["passed"] is False
    assert "120.0 MB/s < 250 MB/s" in fio.verdict("log", job, slow, table)["why"]
    assert fio.verdict("log", job, {"mb_s": 300.0, "lat_us_mean": 1.0}, table)["passed"] is True
    assert fio.verdict("data", {"rw": "randread", "bs": "64k"}, slow, table) is None


@pytest.mark.skipif(not shutil.which("fio"), reason="fio not installed")
def test_argv_runs_under_real_fio(tmp_path):
    argv = fio.fio_argv(str(tmp_path / "io"), {"rw": "randwrite", "bs": "16k", "iodepth": 4}, "4M", 1)
    argv[argv.index("--direct=1")] = "--direct=0"  # tmpfs has no O_DIRECT
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert fio.parse_result(out)["ios"] > 0


def test_io_check_hands_fio_the_file_it_made_never_a_planted_link(tmp_path, monkeypatch):
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location("io_check_module", REPO / "_modules" / "hana_storage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__grains__, module.__context__ = {"virtual": "kvm"}, {}
    monkeypatch.setattr(module.salt.utils.path, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(
        module, "_plan", lambda pillar=None: {"volumes": {"log": {"mountpoint": str(tmp_path)}}}
    )
    st_dev = os.stat(tmp_path).st_dev
    module.__salt__ = {
        "hana_storage_host.mounted_at": lambda mountpoint: f"{os.major(st_dev)}:{os.minor(st_dev)}"
    }
    # whoever can write the mount root plants symlinks under the names an old version used
    victim = tmp_path.parent / "victim"
    victim.write_text("keep")
    (tmp_path / ".hana_storage_io_check").symlink_to(victim)
    argvs, seen = [], []

    def run(argv):
        argvs.append(argv)
        target = next(a for a in argv if a.startswith("--filename=")).split("=", 1)[1]
        info = os.stat(target)  # the file fio is told to use: made here, root-only, in the mount
        real = os.path.realpath(target)
        seen.append(
            (stat.S_IMODE(info.st_mode), info.st_dev == st_dev, os.path.dirname(os.path.dirname(real)))
        )
        return SAMPLE, ""

    monkeypatch.setattr(module, "_run", run)
    report = module.io_check(volumes=["log"], size="1M", runtime=1)
    assert [job["bs"] for job in report["volumes"]["log"]["jobs"]] == ["4k", "16k", "1m"]
    assert len(argvs) == 3 and all(argv[0] == "fio" for argv in argvs)
    assert "hypervisor" in report["note"]
    assert all(arg.startswith("--filename=/proc/") for argv in argvs for arg in argv if "--filename" in arg)
    assert seen == [(0o600, True, str(tmp_path))] * 3
    assert victim.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hana_storage_io_check"]  # ours are gone
