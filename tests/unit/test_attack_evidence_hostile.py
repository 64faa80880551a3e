"""Attack: one compromised minion's evidence return against the fleet's evidence report.

A minion's ``hana_storage.evidence`` return is whatever that minion sends: the master must treat
it as untrusted input. A report that raises on it gives no evidence for any host of the fleet.
"""

import pytest
from hana_storage_core import evidence

from tests.unit.test_evidence import host_part, returns_of


def _hostile(**changes):
    part = dict(host_part("hana-evil"), **changes)
    first = part["findings"][0]
    return part, first


def _cases():
    part, first = _hostile()
    yield (
        "a finding of a rule the master does not know",
        dict(part, findings=[dict(first, rule="HANA-FAKE-999")]),
    )
    yield "an audit time no calendar holds", dict(part, audited=10**20)
    yield "volumes as a list", dict(part, volumes=[{"compliant": True}])
    yield (
        "a LUKS header summary whose keyslots are text",
        dict(part, findings=[dict(first, evidence={"luks_header": {"keyslots": "x"}})]),
    )
    yield "a Tang server without a url", dict(part, keys={"data": {"tang": [{"thumbprint": "t"}]}})


@pytest.mark.parametrize("why,hostile", list(_cases()), ids=[c[0] for c in _cases()])
def test_one_hostile_minion_cannot_deny_the_whole_fleet_its_evidence_report(why, hostile):
    """salt-run hana_storage.report format=html|json renders every host's return together: a
    single compromised (or merely buggy, older or newer) minion whose evidence return has an
    unknown rule id, a huge timestamp, a list where a mapping was expected ... makes
    ``evidence.document`` or ``evidence.html`` raise (ValueError from ``list(rules).index``,
    OverflowError from ``_date``, AttributeError in ``snapshot``, KeyError/TypeError in
    ``_keys``/``_evidence``). The runner then writes no report at all: the auditors get no
    evidence for the hundreds of honest hosts either, and the hourly snapshot's history stops.
    One host's return must at worst mark that host as not audited."""
    good = host_part("hana-01")
    returns = returns_of([good])
    returns["hana-evil"] = {"ret": hostile, "retcode": 0}
    doc = evidence.document(returns, "salt-master-1", "0.3.0", 1_790_000_000)
    page = evidence.html(doc)
    assert 'data-host="hana-01"' in page, why
    assert 'data-host="hana-evil"' in page, why
