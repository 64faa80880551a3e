"""form.yml (SUSE Manager / Uyuni Formulas with Forms) in step with schema.json: every key of the
schema has a field, no field names a key the schema lacks, every default and every choice is
valid for the schema."""

import json

import jsonschema
import pytest
import yaml
from hana_storage_core import rules as rules

from tests.conftest import REPO

SCHEMA = json.loads((REPO / "salt" / "hana" / "storage" / "schema.json").read_text())
FORM = yaml.safe_load((REPO / "form.yml").read_text())["hana"]["storage"]


def resolve(node):
    while "$ref" in node:
        target = SCHEMA
        for part in node["$ref"].lstrip("#/").split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def schema_leaves(node=SCHEMA, path=()):
    """{path: subschema} of every key the pillar can have ('*' for a volume's name)."""
    node = resolve(node)
    found = {}
    for key, sub in node.get("properties", {}).items():
        found[(*path, key)] = resolve(sub)
        found.update(schema_leaves(sub, (*path, key)))
    if isinstance(node.get("additionalProperties"), dict):
        found[(*path, "*")] = resolve(node["additionalProperties"])
        found.update(schema_leaves(node["additionalProperties"], (*path, "*")))
    return found


def form_fields(node=FORM, path=()):
    """{path: field} of every field of the form (an edit-group keyed by $key is a mapping)."""
    found = {}
    for key, field in node.items():
        if key.startswith("$") or not isinstance(field, dict):
            continue
        found[(*path, key)] = field
        prototype = field.get("$prototype", {})
        if field.get("$type") == "edit-group" and "$key" in prototype:
            found[(*path, key, "*")] = prototype
            found.update(form_fields(prototype, (*path, key, "*")))
        elif field.get("$type") in ("group", "namespace"):
            found.update(form_fields(field, (*path, key)))
    return found


def test_every_schema_key_has_a_field_and_every_field_a_schema_key():
    assert sorted(set(schema_leaves()) - set(form_fields())) == []
    assert sorted(set(form_fields()) - set(schema_leaves())) == []


@pytest.mark.parametrize("path", sorted(p for p, f in form_fields().items() if "$default" in f), ids=".".join)
def test_defaults_are_valid_for_the_schema(path):
    jsonschema.validate(form_fields()[path]["$default"], {**schema_leaves()[path], "$defs": SCHEMA["$defs"]})


def test_choices_are_the_schemas_and_types_match():
    for path, field in form_fields().items():
        sub = schema_leaves()[path]
        if field.get("$type") == "select":
            assert set(field["$values"]) <= set(sub["enum"]), path
        if field.get("$type") == "edit-group" and path[-1] != "volumes":
            assert sub.get("type") == "array", path
            choices = field["$prototype"].get("$values")
            for choice in choices or []:
                jsonschema.validate(choice, {**resolve(sub["items"]), "$defs": SCHEMA["$defs"]})
        if field.get("$type") == "boolean":
            assert sub.get("type") == "boolean", path
        if field.get("$type") == "number":
            kinds = {sub.get("type")} | {resolve(o).get("type") for o in sub.get("oneOf", [])}
            assert (
                "integer" in kinds
                or set(sub.get("enum", []))
                and all(isinstance(v, int) for v in sub["enum"])
            ), path


def test_the_material_field_is_a_password_field():
    assert form_fields()[("key", "material")]["$type"] == "password"
    assert form_fields()[("volumes", "*", "key", "material")]["$type"] == "password"


def test_the_remediation_choices_are_the_rules_with_a_fix():
    """The form cannot compute its list: it is kept equal to the rule table's here."""
    field = form_fields()[("compliance", "remediation", "rules")]
    assert field["$prototype"]["$values"] == field["$default"] == rules.auto_rules()
