"""Issue 33: a host's boot readiness feeds the fleet - the evidence report (a section per host and
a summary card) and the exporter (``hana_storage_boot_ready{minion}``), through the runner's
``readiness`` and each report, fired signed by the master. A minion's verdict is its own word:
one that does not match the schema is no verdict, and "ready" beside a line that is not is not
ready. The runner and the exporter: tests/unit/test_events.py; the real daemons' run:
tests/integration/test_master_events.py and test_evidence_report.py."""

import time

import jsonschema
import pytest
from hana_storage_core import evidence, readiness, tab

from tests.unit.test_evidence import host_part, returns_of

KEY = "/etc/hana-storage/keys/hana.key"
CHECKED = 1_790_000_000


def verdict(key_exists=True):
    lines = tab.parse_crypttab(f"hana_data UUID=0c1d {KEY} luks\nhana_log /dev/vdc none luks,noauto\n")
    key = {"path": KEY, "exists": key_exists, "opens": True if key_exists else None, "error": None}
    facts = [{"source": "/dev/vdb", "key": key, "units": {}}, {"source": "/dev/vdc", "units": {}}]
    return readiness.verdict(lines, facts)


def part(host, ready=True, **changes):
    judged = dict(verdict(key_exists=ready), checked=CHECKED, **changes)
    return dict(host_part(host), readiness=judged)


def test_the_report_shows_each_hosts_readiness_and_believes_no_ready_host_with_a_line_that_is_not():
    liar = verdict(key_exists=False)
    liar["ready"] = True  # what a minion may send: its lines say otherwise
    hostile = verdict(key_exists=False)
    hostile["lines"][0]["problems"][0]["code"] = "<b>made_up</b>"
    parts = [
        part("hana-01"),
        part("hana-02", ready=False),
        dict(host_part("hana-03"), readiness=dict(liar, checked=CHECKED)),
        dict(host_part("hana-04"), readiness=dict(hostile, checked=CHECKED)),
        host_part("hana-05"),  # an older formula: no readiness
    ]
    doc = evidence.document(returns_of(parts), "salt-master-1", "0.4.0", time.time())
    jsonschema.validate(doc, evidence.SCHEMA)
    hosts = doc["hosts"]
    assert hosts["hana-01"]["readiness"]["ready"] is True
    assert hosts["hana-02"]["readiness"]["ready"] is False
    assert hosts["hana-03"]["readiness"]["ready"] is False
    assert "readiness/lines/0/problems/0/code" in hosts["hana-04"]["error"]
    assert "readiness" not in hosts["hana-05"]

    page = evidence.html(doc)
    assert 'id="readiness"' in page and "Ready for their next boot" in page
    assert "1 of 3" in page  # hana-01 of those checked (hana-04 is not audited, hana-05 not checked)
    section = page[page.index('id="readiness"') :]
    assert "key_file_missing" in section and KEY in section and "stops the boot" in section
    assert "not checked" in section and "<b>made_up" not in page


@pytest.mark.parametrize(
    "ret,expected",
    [
        ({"ret": verdict(), "retcode": 0}, True),
        ({"ret": verdict(key_exists=False), "retcode": 1}, False),  # the retcode says "not ready" only
        ({"ret": {"ready": False, "error": "/etc/crypttab: Permission denied"}, "retcode": 1}, False),
        ({"ret": "'hana_storage.boot_readiness' is not available.", "retcode": 254}, None),
        ({"ret": {"ready": True}, "retcode": 0}, None),  # neither lines nor an error: no verdict
        ({"ret": {**verdict(), "lines": "all fine"}, "retcode": 0}, None),
        ({"ret": {**verdict(), "ready": "yes"}, "retcode": 0}, None),
        ({"ret": {**verdict(), "extra": 1}, "retcode": 0}, None),
        ({"ret": {**verdict(), "lines": [{}] * (evidence.MAX_CRYPTTAB_LINES + 1)}, "retcode": 0}, None),
        ("no dict at all", None),
    ],
)
def test_a_minions_readiness_is_a_verdict_only_when_it_matches_the_schema(ret, expected):
    (found,) = evidence.readiness_parts({"hana-01": ret}, CHECKED).values()
    assert found["ready"] is expected
    if expected is None:
        assert found["error"] and "lines" not in found
    else:
        assert found["checked"] == CHECKED
