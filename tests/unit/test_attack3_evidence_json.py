"""Attack: a minion's evidence return that passes the host schema breaks the JSON report.

A minion's return reaches the master as msgpack, which Salt unpacks with ``strict_map_key=False``:
a mapping may have integer keys, and a float may be NaN or Infinity. The host schema checks
volume names with ``propertyNames: {pattern}``, and a JSON Schema ``pattern`` ignores what is not
a string, so ``volumes: {1: ...}`` (or ``keys: {1: ...}``) matches it; ``expected``/``actual`` and a
dm table segment take any value. ``report format=json`` then runs ``json.dumps(doc,
sort_keys=True)``: a mapping with an int and a str key raises TypeError (no report for the whole
fleet), NaN is written as the bare word ``NaN`` (not JSON: an auditor's JSON.parse or jsonschema
tooling rejects the filed document), and an int volume name comes out as ``"1"``, which fails the
document's own schema. Expected: such a part is that host's error (or is made JSON-safe), and the
written file parses as strict JSON and is valid against ``evidence.SCHEMA``.
"""

import json

import jsonschema
import pytest
from hana_storage_core import evidence

from tests.unit.test_evidence import host_part, report_runner, returns_of


def _int_volume(part):
    part["volumes"][1] = {"compliant": True}


def _only_int_volume(part):
    part["volumes"] = {1: {"compliant": False}}


def _int_key_in_expected(part):
    part["findings"][0]["expected"] = {"a": 1, 2: 3}


def _int_field_in_dm_table(part):
    part["findings"][0]["evidence"]["dm_table"] = [{"target": "crypt", 2: "x"}]


def _nan_expected(part):
    part["findings"][0]["expected"] = float("nan")


def _infinite_actual(part):
    part["findings"][0]["actual"] = [float("inf")]


@pytest.mark.parametrize(
    "change",
    [
        _int_volume,
        _only_int_volume,
        _int_key_in_expected,
        _int_field_in_dm_table,
        _nan_expected,
        _infinite_actual,
    ],
    ids=lambda f: f.__name__,
)
def test_the_json_report_is_strict_json_valid_against_its_schema(change, tmp_path, monkeypatch):
    hostile = host_part("hana-evil")
    change(hostile)
    returns = returns_of([host_part("hana-01")])
    returns["hana-evil"] = {"ret": hostile, "retcode": 0}
    runner = report_runner(tmp_path, monkeypatch, returns, "runner_attack3_json")
    out = tmp_path / "evidence.json"
    runner.report(format="json", out=str(out))  # TypeError today for mixed keys

    def not_json(word):
        raise ValueError(f"{word} is not JSON")

    doc = json.loads(out.read_text(), parse_constant=not_json)
    jsonschema.validate(doc, evidence.SCHEMA)
    assert "hana-01" in doc["hosts"] and "error" not in doc["hosts"]["hana-01"]
