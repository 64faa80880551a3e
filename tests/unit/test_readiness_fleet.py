"""Issue 33: a host's boot readiness feeds the fleet - the evidence report (a section per host and
a summary card) and the exporter (``hana_storage_boot_ready{minion}``), through the runner's
``readiness`` and each report, fired signed by the master. A minion's verdict is its own word:
one that does not match the schema is no verdict, and "ready" beside a line that is not is not
ready. The report asks in a job of its own, so a minion whose formula is older still gives its
evidence. The runner and the exporter: tests/unit/test_events.py; the real daemons' run:
tests/integration/test_master_events.py and test_evidence_report.py."""

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
    doc = evidence.document(returns_of([*parts, forged]), "salt-master-1", "0.4.0", CHECKED, readiness=ready)
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
    assert hosts["hana-07"]["readiness"]["ready"] is None  # its own word is not the master's check
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


PLAN = {
    "volumes": {
        "data": {"key": {"source": "keyfile"}, "crypt": [{"name": "hana_data", "device": "/dev/vdb"}]},
        "shared": {"key": {"source": "pillar"}, "crypt": [{"name": "hana_shared", "device": "/dev/vdd"}]},
    }
}


def test_a_noauto_line_of_a_volume_the_boot_should_open_is_not_ready():
    """Re-review: a key-file or Tang volume whose line still has noauto (a volume moved from a
    pillar key, before the next apply) was ready: the boot skips it."""
    lines = tab.parse_crypttab(
        f"hana_data UUID=0c1d {KEY} luks,noauto\nhana_shared /dev/vdd none luks,noauto\n"
    )
    facts = [{"source": "/dev/vdb", "units": {}}, {"source": "/dev/vdd", "units": {}}]
    judged = readiness.verdict(lines, facts, PLAN)
    assert judged["ready"] is False
    assert [(j["name"], j["ready"], [p["code"] for p in j["problems"]]) for j in judged["lines"]] == [
        ("hana_data", False, ["noauto"]),
        ("hana_shared", True, []),  # a pillar key's: Salt opens it
    ]
    assert readiness.verdict(lines, facts)["ready"] is True  # no plan: crypttab alone


def test_the_host_is_not_ready_with_an_invalid_pillar_and_judged_on_crypttab_without_one(tmp_path):
    from tests.unit.test_remediate import loaded

    module = loaded(tmp_path)
    module._host = lambda name: {"boot_path": lambda: {"lines": [], "facts": []}}[name]
    module.__pillar__ = {}
    assert module.boot_readiness() == {"ready": True, "lines": []}

    def invalid(pillar=None):
        raise module.CommandExecutionError("hana:storage:volumes: must be a mapping")

    module._plan = invalid
    module.__pillar__ = {"hana": {"storage": {"volumes": "not a mapping"}}}
    found = module.boot_readiness()
    assert found["ready"] is False and found["error"].startswith("the hana:storage pillar is invalid")
    assert module.__context__["retcode"] == 1


def test_a_report_whose_readiness_job_had_no_answer_says_so_per_host():
    doc = evidence.document(returns_of([host_part("db1")]), "m", "0.4.0", CHECKED, readiness={})
    jsonschema.validate(doc, evidence.SCHEMA)
    assert doc["hosts"]["db1"]["readiness"] == {
        "ready": None,
        "error": "no answer to hana_storage.boot_readiness within readiness_timeout",
        "checked": CHECKED,
    }
    page = evidence.html(doc)
    assert "0 of 1 (1 not known)" in page and "no answer to hana_storage.boot_readiness" in page
    assert (
        "readiness"
        not in evidence.document(returns_of([host_part("db1")]), "m", "0.4.0", CHECKED)["hosts"]["db1"]
    )


def test_a_bad_readiness_in_a_minions_evidence_costs_it_nothing_but_is_not_believed():
    part = dict(host_part("db1"), readiness={"ready": "yes"})
    doc = evidence.document(returns_of([part]), "m", "0.4.0", CHECKED)
    assert "error" not in doc["hosts"]["db1"] and "readiness" not in doc["hosts"]["db1"]
