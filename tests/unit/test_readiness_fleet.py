"""Issue 33: a host's boot readiness feeds the fleet - the evidence report (a section per host and
a summary card) and the exporter (``hana_storage_boot_ready{minion}``), through the runner's
``readiness`` and each report, fired signed by the master. A minion's verdict is its own word:
one that does not match the schema is no verdict, and "ready" beside a line that is not is not
ready. The report asks in a job of its own, so a minion whose formula is older still gives its
evidence. The runner and the exporter: tests/unit/test_events.py; the real daemons' run:
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


def answered(*verdicts):
    """readiness_parts of LocalClient returns of boot_readiness: {minion: verdict or return}."""
    returns = {
        m: {"ret": v, "retcode": 254 if isinstance(v, str) else 0 if v.get("ready") else 1}
        for m, v in verdicts
    }
    return evidence.readiness_parts(returns, CHECKED)


def test_the_report_shows_each_hosts_readiness_and_believes_no_ready_host_with_a_line_that_is_not():
    liar = verdict(key_exists=False)
    liar["ready"] = True  # what a minion may send: its lines say otherwise
    quiet = verdict(key_exists=False)
    quiet["lines"][0]["ready"] = True  # a line "ready" beside its problem
    hostile = verdict(key_exists=False)
    hostile["lines"][0]["problems"][0]["code"] = "<b>made_up</b>"
    ready = answered(
        ("hana-01", verdict()),
        ("hana-02", verdict(key_exists=False)),
        ("hana-03", liar),
        ("hana-04", hostile),
        ("hana-06", quiet),
        ("hana-05", "'hana_storage.boot_readiness' is not available."),  # an older formula
    )
    forged = dict(host_part("hana-07"), readiness=dict(verdict(), checked=CHECKED))  # in its evidence
    parts = [host_part(h) for h in ("hana-01", "hana-02", "hana-03", "hana-04", "hana-05", "hana-06")]
    doc = evidence.document(
        returns_of([*parts, forged]), "salt-master-1", "0.4.0", time.time(), readiness=ready
    )
    jsonschema.validate(doc, evidence.SCHEMA)
    hosts = doc["hosts"]
    assert hosts["hana-01"]["readiness"]["ready"] is True
    assert {h: hosts[h]["readiness"]["ready"] for h in ("hana-02", "hana-03", "hana-06")} == dict.fromkeys(
        ("hana-02", "hana-03", "hana-06"), False
    )
    assert hosts["hana-04"]["readiness"]["ready"] is None  # no verdict: its evidence still counts
    assert "at lines/0/problems/0/code" in hosts["hana-04"]["readiness"]["error"]
    assert hosts["hana-04"]["compliant"] is False and "error" not in hosts["hana-04"]
    assert hosts["hana-05"]["readiness"] == {
        "ready": None,
        "error": ready["hana-05"]["error"],
        "checked": CHECKED,
    }
    assert "readiness" not in hosts["hana-07"]  # the minion's own word is not the master's check
    assert all(h["readiness"]["checked"] == CHECKED for h in hosts.values() if "readiness" in h)

    page = evidence.html(doc)
    assert 'id="readiness"' in page and "Ready for their next boot" in page
    assert "1 of 7 (3 not known)" in page  # hana-04, hana-05 no verdict; hana-07 not checked
    section = page[page.index('id="readiness"') :].split("<section", 1)[0]
    assert (
        section.count("<code>key_file_missing</code>") == 3 and KEY in section and "stops the boot" in section
    )
    assert "not available" in section and "<b>made_up" not in page


def test_a_cause_is_cut_and_a_missing_crypttab_is_no_reason_to_say_yes():
    huge = readiness.problem("clevis_fails", error="x" * 20_000, device="/dev/vde")
    assert len(huge["cause"]) == readiness.MAX_TEXT
    plan = {"volumes": {
        "data": {"key": {"source": "keyfile"}, "crypt": [{"name": "hana_data", "device": "/dev/vdb"}]},
        "log": {"key": {"source": "pillar"}, "crypt": [{"name": "hana_log", "device": "/dev/vdc"}]},
        "backup": {"key": {"source": "tang"}, "crypt": [{"name": "hana_backup", "device": "/dev/vdd"}]},
    }}  # fmt: skip
    judged = readiness.verdict([], [], plan)
    assert judged["ready"] is False
    assert [(j["name"], [p["code"] for p in j["problems"]]) for j in judged["lines"]] == [
        ("hana_data", ["not_in_crypttab"]),
        ("hana_backup", ["not_in_crypttab"]),
    ]  # the pillar key's volume Salt opens
    assert readiness.verdict([], [])["ready"] is True  # no plan: crypttab alone
    lines = tab.parse_crypttab(f"hana_data UUID=0c1d {KEY} luks\n")
    key = {"path": KEY, "exists": True, "opens": True, "error": None}
    found = readiness.verdict(lines, [{"source": "/dev/vdb", "key": key, "units": {}}], plan)
    assert [j["name"] for j in found["lines"] if not j["ready"]] == ["hana_backup"]


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
