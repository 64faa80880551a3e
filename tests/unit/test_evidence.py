"""The evidence report's pieces: a host's part from the audit's facts, the fleet document against
its JSON schema, the page (escaped, self-contained), and the store's journal and history (local
and a real Redis)."""

import json
import re
import time

import jsonschema
import pytest
from hana_storage_core import events, evidence, rules, store

from tests.unit.test_audit import PILLAR, compliant, plan_of, recorded_facts

SECRET = b"\x07" * 32


def host_part(host, facts=None, when=1_790_000_000):
    plan = plan_of(PILLAR)
    facts = facts if facts is not None else recorded_facts()
    return evidence.host_evidence(plan, facts, rules.audit(plan, facts), host, when)


def report_runner(tmp_path, monkeypatch, returns, name, readiness=None):
    """The hana_storage runner, its LocalClient answering hana_storage.boot_readiness with
    ``readiness`` (by default no minion answers) and every other call with ``returns``."""
    from tests.unit.test_events import load

    class Client:
        def cmd(self, _tgt, fun, **_kwargs):
            return (readiness or {}) if fun == "hana_storage.boot_readiness" else returns

    runner = load("_runners/hana_storage.py", name)
    runner.__opts__ = {"cachedir": str(tmp_path / "cache"), "conf_file": "/dev/null", "id": "salt-master-1"}
    monkeypatch.setattr(runner.salt.client, "get_local_client", lambda _conf: Client())
    return runner


def returns_of(parts, errors=()):
    found = {p["host"]: {"ret": p, "retcode": 0} for p in parts}
    found.update(
        {minion: {"ret": "'hana_storage.evidence' is not available.", "retcode": 254} for minion in errors}
    )
    return found


def test_a_host_part_carries_each_finding_with_the_facts_it_was_judged_on():
    part = host_part("hana-01")
    assert part["findings"] and not part["compliant"]
    for finding in part["findings"]:
        assert set(events.FINDING_FIELDS) <= set(finding) and "evidence" in finding
    crypt = [f for f in part["findings"] if (f["evidence"]["luks_header"] or {}).get("uuid")]
    assert crypt, "a finding on a crypt device shows its LUKS header"
    header = crypt[0]["evidence"]["luks_header"]
    assert set(header) >= {"version", "cipher", "keyslots", "flags"}
    assert all(set(k) == {"id", "type", "kdf"} for k in header["keyslots"])  # no salt, no digest


def test_a_host_part_names_each_volumes_key_state():
    part = host_part("hana-01", compliant())
    assert part["compliant"] is True and part["findings"] == []
    keys = part["keys"]["data"]
    assert keys["source"] == "keyfile" and keys["key_file"]["path"] == PILLAR["key"]["path"]
    assert keys["devices"] and all("crypt" in d and "luks_uuid" in d for d in keys["devices"])


def test_the_document_matches_its_schema_with_errors_history_and_actions():
    parts = [host_part("hana-01"), host_part("hana-02", compliant())]
    history = [
        evidence.snapshot({"a": {"compliant": True, "volumes": {"v": {"compliant": True}}}}, 1_789_990_000)
    ]
    actions = [
        {"ts": 1_789_995_000.5, "minion": "hana-01", "rule": "HANA-PERF-002", "action": "remediated",
         "key": "HANA-PERF-002|data|/dev/mapper/hana_data", "master": "m1/x", "event_ids": ["ab12"]},
    ]  # fmt: skip
    doc = evidence.document(
        returns_of(parts, ["hana-03"]), "salt-master-1", "0.3.0", 1_790_000_000, history, actions
    )
    jsonschema.validate(doc, evidence.SCHEMA)
    assert doc["summary"]["hosts"] == 3 and doc["summary"]["errors"] == 1
    assert doc["summary"]["compliant_hosts"] == 1
    assert doc["hosts"]["hana-03"]["error"].endswith("is not available.")
    assert set(doc["rules"]) == set(rules.RULES) and all(r["controls"] for r in doc["rules"].values())


def test_the_page_shows_every_host_escapes_every_value_and_fetches_nothing():
    evil = '<script>alert("x")</script>'
    part = host_part("hana-01")
    part["findings"][0]["message"] = evil
    doc = evidence.document(
        returns_of([part, host_part(f"{evil}host", compliant())], ["hana-down"]), evil, "0.3.0", time.time()
    )
    page = evidence.html(doc)
    assert "<script" not in page and "&lt;script&gt;" in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page), "the page fetches nothing"
    for host in doc["hosts"]:
        assert f'data-host="{evidence._e(host)}"' in page
    for section in ("summary", "charts", "matrix", "findings", "keys", "actions", "rules", "signoff"):
        assert f'id="{section}"' in page


def test_the_history_chart_draws_from_two_snapshots():
    hosts = {"a": {"compliant": False, "volumes": {"v": {"compliant": False}, "w": {"compliant": True}}}}
    history = [evidence.snapshot(hosts, 1_700_000_000), evidence.snapshot(hosts, 1_700_003_600)]
    chart = evidence._history_chart(history)
    assert "<polyline" in chart and chart.count("<circle") == 2
    assert "<polyline" not in evidence._history_chart(history[:1])


# ---- the store's journal and history ----------------------------------------------------------------


@pytest.fixture(params=["local", "redis"])
def kept(request, tmp_path, redis_url):
    if request.param == "local":
        return store.LocalStore(str(tmp_path))
    return store.RedisStore(redis_url, f"evidence-{time.monotonic_ns()}:", SECRET)


def act(kept, minion, rule, action, key):
    event = {"event_id": f"e{time.monotonic_ns()}", "tag": "hana/storage/remediation", "data": {}}
    return kept.update(
        minion,
        rule,
        lambda record, now: True,
        tally=lambda _r: store.tally_name(action, rule),
        outbox=lambda _r: [event],
        journal=lambda _r: {"key": key, "master": "m1/triage"},
    ), event


def test_each_tallied_action_is_journaled_with_its_events(kept):
    _, event = act(kept, "hana-01", "HANA-PERF-002", "remediated", "HANA-PERF-002|data|/dev/mapper/hana_data")
    kept.update("hana-01", "HANA-PERF-003", lambda record, now: None)  # not tallied: not journaled
    (entry,) = kept.actions()
    assert (
        entry["minion"] == "hana-01" and entry["action"] == "remediated" and entry["rule"] == "HANA-PERF-002"
    )
    assert entry["event_ids"] == [event["event_id"]] and entry["master"] == "m1/triage"


def test_snapshots_are_kept_oldest_first(kept):
    for n in range(3):
        kept.add_snapshot(evidence.snapshot({"a": {"compliant": bool(n), "volumes": {}}}, 1_700_000_000 + n))
    assert [s["ts"] for s in kept.history()] == [1_700_000_000, 1_700_000_001, 1_700_000_002]


def test_a_redis_writer_cannot_add_or_change_a_journal_entry(redis_url):
    kept = store.RedisStore(redis_url, f"forge-{time.monotonic_ns()}:", SECRET)
    act(kept, "hana-01", "HANA-KEY-001", "remediated", "HANA-KEY-001|data|/etc/k")
    forged = json.dumps(
        {"ts": 1, "minion": "hana-02", "rule": "HANA-KEY-001", "action": "remediated", "event_ids": []}
    )
    kept.client.lpush(kept.prefix + store.JOURNAL, "0" * 64 + forged)
    kept.client.lpush(kept.prefix + store.HISTORY, json.dumps({"ts": 1}))
    assert [e["minion"] for e in kept.actions()] == ["hana-01"]
    assert kept.history() == []


def test_the_local_journal_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "JOURNAL_BYTES", 2000)
    kept = store.LocalStore(str(tmp_path))
    for n in range(60):
        act(kept, "hana-01", "HANA-PERF-002", "alerted", f"HANA-PERF-002|v{n}|/dev/x")
    files = {p.name for p in tmp_path.rglob("journal.log*")}
    assert "journal.log.1" in files and files <= {"journal.log", "journal.log.1"}
    assert sum(p.stat().st_size for p in tmp_path.rglob("journal.log*")) < 3 * 2000 + 400
    assert kept.actions()[-1]["key"] == "HANA-PERF-002|v59|/dev/x"


def test_the_documented_schema_is_the_codes():
    from tests.conftest import REPO

    assert json.loads((REPO / "docs" / "evidence.schema.json").read_text()) == evidence.SCHEMA
