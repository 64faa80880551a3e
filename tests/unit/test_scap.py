"""The SCAP data stream and the status file its checks read, evaluated by the real ``oscap``
(Debian's openscap-scanner): what SUSE Manager's Audit > OpenSCAP runs on a minion."""

import re
import subprocess
import time
import xml.etree.ElementTree as ET

import pytest
from hana_storage_core import controls, rules, scap

PROFILE = scap.PROFILE
XCCDF = "{http://checklists.nist.gov/xccdf/1.2}"


def boot():
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
        boot_id = handle.read().strip()
    with open("/proc/uptime", encoding="ascii") as handle:
        return boot_id, float(handle.read().split()[0])


def finding(rule, volume, device):
    return {"rule": rule, "volume": volume, "device": device}


@pytest.fixture
def scan(tmp_path):
    """scan(findings, **status) -> {rule: result} of `oscap xccdf eval` over a status file made from
    ``findings``; the ARF and XCCDF results are validated by oscap and kept in tmp_path."""
    status = tmp_path / "audit.status"
    stream = tmp_path / "hana-storage-ds.xml"
    stream.write_text(scap.datastream("0.0-test", status=str(status)))

    def run(findings=(), checked=None, boot_id=None, uptime=None, max_age=900, text=None):
        real_boot, real_uptime = boot()
        if text is None:
            text = scap.status_text(
                {"findings": list(findings)},
                checked=list(rules.RULES) if checked is None else checked,
                host="lab",
                audited=time.time(),
                boot_id=boot_id or real_boot,
                uptime=real_uptime if uptime is None else uptime,
                max_age=max_age,
            )
        if text is not False:
            status.write_text(text)
        elif status.exists():
            status.unlink()
        arf, results = tmp_path / "arf.xml", tmp_path / "results.xml"
        done = subprocess.run(
            ["oscap", "xccdf", "eval", "--profile", PROFILE, "--results-arf", str(arf), "--results",
             str(results), str(stream)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode in (0, 2), done.stderr  # 2: a rule failed
        for check in (
            ["oscap", "ds", "rds-validate", str(arf)],
            ["oscap", "xccdf", "validate", str(results)],
        ):
            valid = subprocess.run(check, capture_output=True, text=True)
            assert valid.returncode == 0, (check, valid.stdout, valid.stderr)
        outcome = {}
        for result in ET.parse(results).getroot().iter(f"{XCCDF}rule-result"):
            rule_id = result.get("idref").rsplit("_rule_", 1)[1]
            outcome[rule_id] = result.find(f"{XCCDF}result").text
        run.arf = arf.read_text()
        return outcome

    return run


def test_the_data_stream_is_valid_scap_1_3_with_one_rule_per_audit_rule(tmp_path):
    stream = tmp_path / "ds.xml"
    stream.write_text(scap.datastream("0.0-test"))
    valid = subprocess.run(["oscap", "ds", "sds-validate", str(stream)], capture_output=True, text=True)
    assert valid.returncode == 0, valid.stdout + valid.stderr
    info = subprocess.run(["oscap", "info", str(stream)], capture_output=True, text=True, check=True).stdout
    assert f"Id: {PROFILE}" in info
    ids = re.findall(
        r'<xccdf:Rule id="xccdf_org\.hana-storage-formula_rule_([A-Z0-9-]+)"', stream.read_text()
    )
    assert sorted(ids) == sorted(rules.RULES)


@pytest.mark.parametrize("drop", [0, 1], ids=["every rule", "one rule fewer"])
def test_oscap_evaluates_every_rule_whatever_their_number(tmp_path, monkeypatch, drop):
    """oscap 1.3.7 lost the profile's first select when the selects stood side by side with no
    whitespace between them and their number was odd: HANA-ENC-001, the rule that finds an
    unencrypted volume, was then never evaluated, and no scan said so."""
    table = dict(list(rules.RULES.items())[: len(rules.RULES) - drop])
    monkeypatch.setattr(rules, "RULES", table)
    stream, results = tmp_path / "ds.xml", tmp_path / "results.xml"
    stream.write_text(scap.datastream("0.0-test", status=str(tmp_path / "audit.status")))
    done = subprocess.run(
        ["oscap", "xccdf", "eval", "--profile", PROFILE, "--results", str(results), str(stream)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert "does not exist" not in done.stderr, done.stderr
    evaluated = [
        r.get("idref").rsplit("_rule_", 1)[1] for r in ET.parse(results).getroot().iter(f"{XCCDF}rule-result")
    ]
    assert sorted(evaluated) == sorted(table)


def test_a_compliant_audit_passes_every_rule(scan):
    assert set(scan().values()) == {"pass"}


def test_findings_fail_their_rules_and_the_results_name_each_volume_and_device(scan):
    """A plain LUN, a missing perf flag and a stray keyslot: the rules fail, the others pass, and
    the ARF carries each finding's volume and device (what SUSE Manager shows per rule)."""
    found = [
        finding("HANA-ENC-001", "log", "/dev/vdc"),
        finding("HANA-PERF-002", "data", "/dev/mapper/hana_data"),
        finding("HANA-KEY-005", "data", "/dev/mapper/hana_data"),
        finding("HANA-KEY-005", "shared", "/dev/mapper/hana_shared"),
    ]
    outcome = scan(found)
    failed = {rule for rule, result in outcome.items() if result == "fail"}
    assert failed == {"HANA-ENC-001", "HANA-PERF-002", "HANA-KEY-005"}
    assert {result for rule, result in outcome.items() if rule not in failed} == {"pass"}
    for item in found:
        assert f"finding {item['rule']} {item['volume']} {item['device']}" in scan.arf


@pytest.mark.parametrize(
    "why,status",
    [
        ("no status file", {"text": False}),
        ("a status cut short (no 'complete' line)", {"text": "format 1\nchecked HANA-ENC-001\n"}),
        ("a status past its validity", {"uptime": 0, "max_age": 1}),
        ("a status from another boot", {"boot_id": "00000000-0000-0000-0000-000000000000"}),
    ],
)
def test_a_missing_or_stale_audit_fails_every_rule_never_passes_one(scan, why, status):
    assert set(scan(**status).values()) == {"fail"}, why


def test_a_rule_the_audit_did_not_check_fails(scan):
    """An ignored rule (compliance:ignore_rules), or one the formula that wrote the status did not
    know: no evidence, no pass. The auditor tailors the profile for a waived rule."""
    outcome = scan(checked=[r for r in rules.RULES if r != "HANA-LAYOUT-003"])
    assert outcome.pop("HANA-LAYOUT-003") == "fail"
    assert set(outcome.values()) == {"pass"}


def test_every_rule_names_the_controls_it_evidences():
    """A rule cannot ship without saying which control it gives evidence for; the encryption rules
    carry SC-28 and the SCAP Security Guide's encrypt_partitions CCEs, the key rules SC-12."""
    for rule_id, rule in rules.RULES.items():
        assert rule.controls and rule.rationale, rule_id
        assert set(rule.controls) <= set(controls.CONTROLS), rule_id
    assert {"SC-28", "SC-28(1)", "CCE-85719-3", "CCE-80789-1", "CCE-90849-1"} <= set(
        rules.RULES["HANA-ENC-001"].controls
    )
    assert all("SC-12" in rules.RULES[r].controls for r in rules.RULES if r.startswith("HANA-KEY-"))
    assert "supporting control" in controls.CONTROLS["PCI-3.5.1.2"].note


def test_each_xccdf_rule_carries_severity_rationale_references_and_idents():
    root = ET.fromstring(scap.datastream("0.0-test"))
    by_id = {r.get("id").rsplit("_rule_", 1)[1]: r for r in root.iter(f"{XCCDF}Rule")}
    enc = by_id["HANA-ENC-001"]
    assert enc.get("severity") == "high"
    assert enc.find(f"{XCCDF}rationale").text == rules.RULES["HANA-ENC-001"].rationale
    references = [r.text for r in enc.findall(f"{XCCDF}reference")]
    assert any(r.startswith("NIST SP 800-53 Rev. 5 SC-28:") for r in references)
    assert any("3.5.1.2" in r and "supporting control" in r for r in references)
    assert sorted(i.text for i in enc.findall(f"{XCCDF}ident")) == [
        "CCE-80789-1",
        "CCE-85719-3",
        "CCE-90849-1",
    ]


def test_oval_numbers_are_fixed_by_rule_id_not_by_table_order():
    numbers = {rule: scap.rule_number(rule) for rule in rules.RULES}
    assert len(set(numbers.values())) == len(numbers)
    assert numbers["HANA-ENC-001"] == 101 and numbers["HANA-KEY-008"] == 308


def test_the_status_holds_names_only_one_word_each():
    """A device or volume name with spaces or control characters cannot add a line or a finding."""
    text = scap.status_text(
        {"findings": [finding("HANA-ENC-001", "data\nfinding HANA-KEY-001 x y", "/dev/a b")]},
        checked=["HANA-ENC-001"], host="h", audited=0, boot_id="b", uptime=0, max_age=60,
    )  # fmt: skip
    findings = [line for line in text.splitlines() if line.startswith("finding")]
    assert findings == ["finding HANA-ENC-001 data_finding_HANA-KEY-001_x_y /dev/a_b"]


def test_a_data_stream_remade_at_the_time_it_names_is_the_same_text():
    text = scap.datastream("0.0-test")
    assert scap.datastream("0.0-test", generated=scap.generated_at(text)) == text
    assert scap.generated_at("<not a data stream/>") is None
