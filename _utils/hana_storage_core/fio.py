"""HANA I/O check: fio job lines modelled on SAP HCMT's file-system tests, and their verdicts.

Pure code: the execution module runs the commands. The profiles follow what HCMT measures on
a HANA volume - the log as sequential overwrite at queue depth 1 (every commit waits for it),
the data volume as random reads and writes with several I/Os in flight (savepoints, loads) - and
the KPIs are SAP's published minimums, overridable because real certification uses the numbers
of the storage vendor's HCMT report.
"""

import json

PROFILES = {
    "log": [
        {"rw": "write", "bs": "4k", "iodepth": 1},
        {"rw": "write", "bs": "16k", "iodepth": 1},
        {"rw": "write", "bs": "1m", "iodepth": 1},
    ],
    "data": [
        {"rw": rw, "bs": bs, "iodepth": 8}
        for bs in ("16k", "64k", "1m", "16m")
        for rw in ("randread", "randwrite")
    ],
}
# (profile, rw, bs) -> KPI: minimum MB/s or maximum mean completion latency in microseconds
DEFAULT_KPIS = {
    ("log", "write", "4k"): {"max_latency_us": 1000},
    ("log", "write", "16k"): {"max_latency_us": 1000},
    ("log", "write", "1m"): {"min_mb_s": 250},
    ("data", "randread", "16m"): {"min_mb_s": 400},
    ("data", "randwrite", "16m"): {"min_mb_s": 250},
}
MB = 1000 * 1000  # fio's and HCMT's MB/s are decimal


class FioError(ValueError):
    """fio's output is not what a finished run of these jobs prints."""


def profile_jobs(profile):
    """The fio jobs of a profile ('log' or 'data')."""
    return [dict(job) for job in PROFILES[profile]]


def kpi_key(text):
    """'log:write:1m' (pillar/CLI spelling) -> ('log', 'write', '1m')."""
    parts = tuple(str(text).lower().split(":"))
    if len(parts) != 3 or parts[0] not in PROFILES:
        raise FioError(f"KPI key {text!r}: expected '<log|data>:<rw>:<block size>'")
    return parts


def kpis(overrides=None):
    """Default KPIs with overrides like {'log:write:1m': {'min_mb_s': 400}} applied."""
    merged = {key: dict(value) for key, value in DEFAULT_KPIS.items()}
    for text, value in (overrides or {}).items():
        if not isinstance(value, dict) or not set(value) <= {"min_mb_s", "max_latency_us"}:
            raise FioError(f"KPI {text!r}: expected a mapping of min_mb_s and/or max_latency_us")
        merged.setdefault(kpi_key(text), {}).update(value)
    return merged


def fio_argv(path, job, size, runtime_s):
    """One fio job on one test file, direct I/O, JSON output on stdout."""
    return [
        "fio",
        "--name=hana-io-check",
        f"--filename={path}",
        f"--rw={job['rw']}",
        f"--bs={job['bs']}",
        f"--iodepth={job['iodepth']}",
        "--ioengine=libaio",
        "--direct=1",
        "--overwrite=1",  # lay the file out first: HANA overwrites allocated extents
        f"--size={size}",
        f"--runtime={runtime_s}",
        "--time_based",
        "--group_reporting",
        "--output-format=json",
    ]


def parse_result(text):
    """fio --output-format=json -> {'mb_s', 'iops', 'lat_us_mean', 'lat_us_p99', 'ios'}."""
    try:
        data = json.loads(text[text.index("{") :] if isinstance(text, str) and "{" in text else text)
        job = data["jobs"][0]
    except (ValueError, TypeError, KeyError, IndexError) as error:
        raise FioError(f"not fio JSON output: {error}") from None
    if not isinstance(job, dict):
        raise FioError("fio JSON output: a job is not an object")
    if job.get("error"):
        raise FioError(f"fio job failed with error {job['error']}")
    directions = [job.get(d) for d in ("read", "write")]
    side = max(
        (d for d in directions if isinstance(d, dict)),
        key=lambda d: d.get("total_ios", 0) if isinstance(d.get("total_ios", 0), int) else 0,
        default=None,
    )
    try:
        clat = side["clat_ns"]
        percentiles = clat.get("percentile") or {}
        p99 = percentiles.get("99.000000")
        return {
            "mb_s": round(float(side["bw_bytes"]) / MB, 1),
            "iops": round(float(side["iops"]), 1),
            "lat_us_mean": round(float(clat["mean"]) / 1000, 1),
            "lat_us_p99": round(float(p99) / 1000, 1) if p99 is not None else None,
            "ios": int(side["total_ios"]),
        }
    except (TypeError, KeyError, ValueError, AttributeError) as error:
        raise FioError(f"fio JSON output lacks {error}") from None


def verdict(profile, job, result, kpi_table):
    """The KPI line for one measured job: None when no KPI applies, else pass/fail with why."""
    kpi = kpi_table.get((profile, job["rw"], job["bs"]))
    if not kpi:
        return None
    failures = []
    if "min_mb_s" in kpi and result["mb_s"] < kpi["min_mb_s"]:
        failures.append(f"{result['mb_s']} MB/s < {kpi['min_mb_s']} MB/s")
    if "max_latency_us" in kpi and result["lat_us_mean"] > kpi["max_latency_us"]:
        failures.append(f"{result['lat_us_mean']} us > {kpi['max_latency_us']} us")
    return {"kpi": kpi, "passed": not failures, "why": "; ".join(failures) or "meets the KPI"}
