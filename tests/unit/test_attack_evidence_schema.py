"""Attack: the JSON evidence document is only as valid as the least honest minion."""

import jsonschema
import pytest
from hana_storage_core import evidence

from tests.unit.test_evidence import host_part, returns_of


@pytest.mark.parametrize(
    "why,changes",
    [
        ("an audit time that is text", {"audited": "yesterday"}),
        ("a verdict that is text", {"compliant": "yes"}),
        ("a negative audit time", {"audited": -5}),
    ],
)
def test_the_json_report_matches_its_own_schema_whatever_a_minion_returns(why, changes):
    """``report format=json`` promises a document valid against docs/evidence.schema.json (what
    an auditor's tooling checks it with). ``evidence.document`` copies a minion's return into it
    as it came (``dict(part, host=minion)``), so a compromised minion that answers with
    ``"compliant": "yes"`` or an ``audited`` that is text makes the filed evidence document
    invalid against its schema (and a string "yes" reads as a compliant host in the summary).
    The master must check each part against the host schema and mark a part that fails it as
    not audited."""
    hostile = dict(host_part("hana-evil"), **changes)
    returns = returns_of([host_part("hana-01")])
    returns["hana-evil"] = {"ret": hostile, "retcode": 0}
    doc = evidence.document(returns, "salt-master-1", "0.3.0", 1_790_000_000)
    jsonschema.validate(doc, evidence.SCHEMA)
