"""Attack: the SCAP status file records what the caller says, not what the host is."""

import importlib.util
import subprocess
import xml.etree.ElementTree as ET

import pytest
from hana_storage_core import rules, scap

from tests.conftest import REPO

XCCDF = "{http://checklists.nist.gov/xccdf/1.2}"
FAILING = {
    "compliant": False,
    "findings": [{"rule": "HANA-ENC-001", "volume": "log", "device": "/dev/vdc"}],
    "volumes": {},
}


def test_scap_record_does_not_take_a_callers_word_for_the_audit(monkeypatch, tmp_path):
    """``hana_storage.scap_record`` is an ordinary execution-module function, and its ``report``
    argument is written to /var/lib/hana-storage/audit.status as the host's audit, unchecked.
    Anyone who may publish ``hana_storage.*`` (an operator whose publisher_acl allows the
    audit, a SUSE Manager user who may run remote commands on the minion) can run
    ``salt hana-01 hana_storage.scap_record report='{compliant: true, findings: []}'`` and every
    rule of the SCAP scan passes on a host whose plain /hana/log is not encrypted. The scan is
    the evidence auditors sign off; what it reads must come from the host's own audit (the
    beacon can pass its report in-process, not through a publishable argument)."""
    spec = importlib.util.spec_from_file_location("hana_storage_mod", REPO / "_modules" / "hana_storage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    status = tmp_path / "audit.status"
    monkeypatch.setattr(module.core.scap, "STATUS", str(status))
    module.__opts__ = {"id": "hana-01"}
    module.__context__ = {}
    plan = {"compliance": {"scap": {"enabled": True, "max_age": 900}, "ignore_rules": []}}
    monkeypatch.setattr(module, "_plan", lambda pillar=None: plan)
    monkeypatch.setattr(module, "audit", lambda pillar=None, volumes=None: FAILING)  # the host's truth

    with pytest.raises(TypeError):
        module.scap_record(report={"compliant": True, "findings": [], "volumes": {}})
    with pytest.raises(TypeError):
        module.scap_record(pillar={"volumes": {}})  # nor its word for the pillar
    module.scap_record()

    stream = tmp_path / "ds.xml"
    stream.write_text(scap.datastream("0.0-test", status=str(status)))
    results = tmp_path / "results.xml"
    subprocess.run(
        ["oscap", "xccdf", "eval", "--profile", scap.PROFILE, "--results", str(results), str(stream)],
        capture_output=True,
        check=False,
    )
    outcome = {
        r.get("idref").rsplit("_rule_", 1)[1]: r.find(f"{XCCDF}result").text
        for r in ET.parse(results).getroot().iter(f"{XCCDF}rule-result")
    }
    assert set(outcome) == set(rules.RULES)
    assert outcome["HANA-ENC-001"] != "pass", "an unencrypted /hana/log passed the SCAP scan"


def test_scap_record_takes_the_beacons_full_audit_of_this_process(monkeypatch, tmp_path):
    """The beacon's full audit leaves its report in the loader's context; scap_record, called
    right after in the same process, records that one instead of auditing the host again, and
    audits afresh once it is a minute old. Only ``audit`` with no pillar and no volumes leaves it."""
    spec = importlib.util.spec_from_file_location("hana_storage_mod", REPO / "_modules" / "hana_storage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module.core.scap, "STATUS", str(tmp_path / "audit.status"))
    module.__opts__ = {"id": "hana-01"}
    module.__context__ = {}
    plan = {"compliance": {"scap": {"enabled": True, "max_age": 900}, "ignore_rules": []}, "volumes": {}}
    monkeypatch.setattr(module, "_plan", lambda pillar=None: plan)
    monkeypatch.setattr(module, "_host", lambda name: lambda plan, reuse_lvm: {"disks": {}})
    audits = []
    monkeypatch.setattr(module.core.rules, "audit", lambda plan, facts: audits.append(1) or dict(FAILING))

    module.audit(volumes="log")  # a partial audit is no host's audit
    module.audit(pillar={"volumes": {}})  # nor one against another pillar
    assert module.LAST_FULL_AUDIT not in module.__context__
    module.audit()
    assert module.scap_record()["compliant"] is False and len(audits) == 3, "the stashed audit"
    when, report = module.__context__[module.LAST_FULL_AUDIT]
    module.__context__[module.LAST_FULL_AUDIT] = (when - module.FRESH_AUDIT_SECONDS - 1, report)
    module.scap_record()
    assert len(audits) == 4, "a stale one is audited afresh"
