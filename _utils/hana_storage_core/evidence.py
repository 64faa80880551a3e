"""The evidence report a person signs off: the fleet's audit, the keys' state and what triage
did, as one JSON document (its schema: SCHEMA) and as one self-contained HTML page. Pure code.

``host_evidence`` is a minion's part (hana_storage.evidence): its audit, each finding with the
facts it was judged on (the device's dm table, its LUKS header's summary - parsed, so never key
material), and the state of each volume's keys (source, key file mode and age, Tang servers and
the thumbprints each device's Clevis binding names, header backups and their dates).
``readiness_parts`` checks the minions' hana_storage.boot_readiness verdicts: whether each would
unlock its storage at its next boot.
``document`` is the master's (salt-run hana_storage.report format=json|html): every host's part,
the fleet summary, the rule table with the controls of each rule, the compliance history and the
actions the triage store recorded. ``html`` renders a document: inline CSS and SVG, no script,
no fetch (its Content-Security-Policy forbids both), every value escaped.
"""

import datetime
import html as html_module
import json

from . import controls as control_table
from . import events
from . import readiness as readiness_table
from . import rules as rule_table

SCHEMA_ID = "urn:hana-storage-formula:evidence:1"
MAX_ACTIONS_SHOWN = 500  # the newest actions in the HTML; the JSON has every one the store keeps
MAX_VOLUMES = 64  # a host's volumes (the pillar's volumes have the same bound)
MAX_FINDINGS = 4096
MAX_CRYPTTAB_LINES = 512  # a host's /etc/crypttab lines judged for boot readiness


# ---- a host's part --------------------------------------------------------------------------------


def host_evidence(plan, facts, report, host, audited):
    """A minion's evidence: ``report`` (core.rules.audit of ``plan`` over ``facts``) with each
    finding's facts, and the keys' state."""
    devices = facts.get("devices", {})
    by_path = {d["path"]: name for name, d in devices.items()}
    by_path.update({f"/dev/{name}": name for name in devices})
    findings = []
    for finding in report["findings"]:
        name = by_path.get(finding.get("device"))
        found = {k: finding.get(k) for k in events.FINDING_FIELDS}
        found["evidence"] = {
            "dm_table": (devices.get(name) or {}).get("table") or [],
            "luks_header": _header_summary(_header_at(facts, devices, name)),
        }
        findings.append(found)
    return {
        "host": host,
        "audited": int(audited),
        "compliant": report["compliant"],
        "volumes": {
            name: {
                "mountpoint": volume.get("mountpoint"),
                "compliant": volume.get("compliant"),
                "rules": list(volume.get("rules", [])),
            }
            for name, volume in sorted(report["volumes"].items())
        },
        "findings": findings,
        "keys": {
            name: _key_state(volume, facts, devices) for name, volume in sorted(plan["volumes"].items())
        },
    }


def _header_at(facts, devices, name):
    """The LUKS header behind the device ``name``: its own (a LUKS device), or its backing
    device's (a crypt mapping)."""
    if name is None:
        return None
    headers = facts.get("headers", {})
    if name in headers:
        return headers[name]
    device = devices.get(name) or {}
    for segment in device.get("table", []):
        if segment.get("target") == "crypt" and segment.get("device_name") in headers:
            return headers[segment["device_name"]]
    return None


def _header_summary(header):
    """What an auditor reads of a LUKS header: never a salt, digest or key."""
    if not header:
        return None
    if "error" in header:
        return {"error": str(header["error"])}
    return {
        "version": header.get("version"),
        "uuid": header.get("uuid"),
        "cipher": header.get("cipher"),
        "key_size": header.get("key_size"),
        "sector_size": header.get("sector_size"),
        "flags": list(header.get("flags", [])),
        "keyslots": [
            {"id": k.get("id"), "type": k.get("type"), "kdf": (k.get("kdf") or {}).get("type")}
            for k in header.get("keyslots", [])
        ],
        "clevis": [_binding(t) for t in header.get("tokens", []) if t.get("type") == "clevis"],
        "degraded": bool(header.get("degraded")),
    }


def _binding(token):
    clevis = token.get("clevis") or {}
    return {
        "keyslots": [str(k) for k in token.get("keyslots", [])],
        "threshold": clevis.get("threshold"),
        "servers": [
            {"url": s.get("url"), "thumbprints": list(s.get("thumbprints", []))}
            for s in clevis.get("servers", [])
        ],
        "tpm2": _tpm2(clevis.get("tpm2")),
    }


def _tpm2(policy):
    if not isinstance(policy, dict):
        return None
    return {"pcr_bank": policy.get("pcr_bank"), "pcr_ids": list(policy.get("pcr_ids") or [])}


def _key_state(volume, facts, devices):
    key = volume["key"]
    key_file = (facts.get("key_files") or {}).get(key.get("file")) if key.get("file") else None
    by_crypt = {d["dm_name"]: n for n, d in devices.items() if d.get("kind") == "crypt"}
    crypts = []
    for crypt in volume.get("crypt", []):
        name = by_crypt.get(crypt["name"])
        header = (
            _header_at(facts, devices, name)
            if name
            else (facts.get("closed_headers") or {}).get(crypt["name"])
        )
        backup_path = crypt.get("header_backup")
        backup = (facts.get("header_backups") or {}).get(backup_path) if backup_path else None
        problem = None
        if backup is not None and header and "error" not in header:
            slots = (facts.get("backup_keyslots") or {}).get(crypt["name"]) or {}
            problem = rule_table.header_backup_problem(
                backup,
                header,
                key.get("clevis"),
                slots.get("live_opens", []),
                slots.get("retired", []),
            )
        summary = _header_summary(header)
        crypts.append(
            {
                "crypt": crypt["name"],
                "device": crypt.get("device"),
                "open": name is not None,
                "luks_uuid": (summary or {}).get("uuid"),
                "keyslots": len((summary or {}).get("keyslots") or []),
                "clevis": (summary or {}).get("clevis") or [],
                "header_backup": None
                if backup_path is None
                else {
                    "path": backup_path,
                    "exists": bool(backup and backup.get("exists")),
                    "modified": _int_or_none((backup or {}).get("mtime")),
                    "state": "current"
                    if backup and problem is None
                    else (problem or {}).get("code", "unknown"),
                },
            }
        )
    return {
        "source": key.get("source"),
        "key_file": None
        if not key_file
        else {
            "path": key.get("file"),
            "exists": bool(key_file.get("exists")),
            "mode": f"{key_file['mode']:04o}" if isinstance(key_file.get("mode"), int) else None,
            "uid": key_file.get("uid"),
            "modified": _int_or_none(key_file.get("mtime")),
        },
        "rotating": bool(key.get("previous")),
        "tang": [
            {"url": s.get("url"), "thumbprint": s.get("thumbprint")}
            for s in (((key.get("clevis") or {}).get("tang") or {}).get("servers") or [])
        ],
        "tpm2": _tpm2((key.get("clevis") or {}).get("tpm2")),
        "devices": crypts,
    }


def _int_or_none(value):
    return int(value) if isinstance(value, int | float) else None


# ---- the fleet's document -------------------------------------------------------------------------


def document(returns, master, version, generated, history=(), actions=(), tallies=None, readiness=None):
    """The evidence document of a fleet: ``returns`` (LocalClient full returns of
    hana_storage.evidence), the store's ``history`` (compliance snapshots, oldest first),
    ``actions`` (what triage did, oldest first) and ``tallies``; ``generated`` epoch seconds.
    ``readiness``: ``readiness_parts``, each audited host's "readiness"."""
    hosts = host_parts(returns, "host")
    for minion, host in hosts.items():
        if readiness is not None and "error" not in host:
            host["readiness"] = readiness.get(minion) or {
                "ready": None,
                "error": "no answer to hana_storage.boot_readiness within readiness_timeout",
                "checked": int(generated),
            }
    return {
        "$schema": SCHEMA_ID,
        "generated": int(generated),
        "master": master,
        "formula": version,
        "summary": snapshot(hosts, generated),
        "rules": {
            rule_id: {
                "severity": rule.severity,
                "title": rule.title,
                "remediation": rule.remediation,
                "controls": list(rule.controls),
            }
            for rule_id, rule in rule_table.RULES.items()
        },
        "controls": {
            key: {"catalogue": c.catalogue, "ident": c.ident, "title": c.title, "note": c.note}
            for key, c in control_table.CONTROLS.items()
        },
        "hosts": hosts,
        "history": list(history),
        "actions": list(actions),
        "tallies": dict(tallies or {}),
    }


def host_parts(returns, kind):
    """Each minion's part of ``returns`` (LocalClient full returns), checked against the schema's
    ``kind`` ("host": hana_storage.evidence, "verdict": hana_storage.audit). A minion's return is
    whatever that minion sends: one that does not match (an older or newer formula, a bug, a
    compromised host) becomes that host's error - "not audited" - and never the fleet's report."""
    problem_of = _problem_finder(kind)
    hosts = {}
    for minion in sorted(returns):
        ret = returns[minion]
        part = ret.get("ret") if isinstance(ret, dict) else None
        if not isinstance(part, dict) or ret.get("retcode"):
            error = part if isinstance(part, str) else "no evidence returned"
            hosts[minion] = {"host": minion, "error": (error.strip().splitlines() or [""])[-1][:300]}
            continue
        # the id we know; a host's readiness is the master's own job's, never what its evidence says
        part = {key: value for key, value in part.items() if key != "readiness"}
        part, error = _checked(dict(part, host=minion), problem_of)
        hosts[minion] = part if error is None else {"host": minion, "error": error}
    return hosts


def readiness_parts(returns, checked):
    """{minion: its hana_storage.boot_readiness verdict with "checked": ``checked``, or {"ready":
    None, "error"} when it gave none or one that does not match the schema's "readiness"}: from
    ``returns`` (LocalClient full returns). Its retcode says only whether it is ready."""
    problem_of = _problem_finder("readiness")
    parts = {}
    for minion in sorted(returns):
        ret = returns[minion]
        part = ret.get("ret") if isinstance(ret, dict) else None
        if isinstance(part, dict):
            part, error = _checked(dict(part, checked=int(checked)), problem_of)
        else:
            error = (
                part.strip().splitlines()[-1][:300] if isinstance(part, str) and part.strip() else "no answer"
            )
        parts[minion] = (
            _believed(part) if error is None else {"ready": None, "error": error, "checked": int(checked)}
        )
    return parts


def _believed(readiness):
    """A minion's readiness verdict (matching the schema), ready only where its lines say so: a
    line is ready without problems only, and a host without an error, with every line ready. ("ready"
    None: no verdict.)"""
    lines = [
        dict(line, ready=line["ready"] and not line["problems"]) for line in readiness.get("lines") or []
    ]
    ready = readiness["ready"]
    if ready is not None:
        ready = ready and "error" not in readiness and all(line["ready"] for line in lines)
    believed = dict(readiness, ready=ready)
    if "lines" in readiness:
        believed["lines"] = lines
    return believed


def _checked(part, problem_of):
    """(``part`` as strict JSON - string keys only, no NaN, nothing nested past Python's limit -,
    None) when ``problem_of`` it finds none, else (None, why not)."""
    try:
        part = json.loads(json.dumps(part, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as error:
        return None, f"its return is no JSON document: {error}"[:300]
    problem = problem_of(part)
    if problem is None:
        return part, None
    where = "/".join(str(p) for p in problem.absolute_path) or "the return"
    return None, f"its return does not match the evidence schema at {where}: {problem.message}"[:300]


def _problem_finder(kind):
    """A function of a part: the schema's ``kind``'s error that says most about it (inside a oneOf
    too, where the part's error is), or None."""
    import jsonschema  # imported here so that the module loads without it (the minion's part)

    validator = jsonschema.Draft202012Validator({"$defs": SCHEMA["$defs"], "$ref": f"#/$defs/{kind}"})
    return lambda part: jsonschema.exceptions.best_match(validator.iter_errors(part))


def snapshot(hosts, when):
    """The fleet's compliance at ``when``: what the store's history keeps per report. Hosts weigh
    alike in ``compliant_share`` (the mean of each audited host's share of compliant volumes):
    a host that names more volumes does not outvote the others."""
    audited = [h for h in hosts.values() if "error" not in h]
    volumes = [v for h in audited for v in h["volumes"].values()]
    shares = [
        sum(1 for v in h["volumes"].values() if v["compliant"]) / len(h["volumes"])
        for h in audited
        if h["volumes"]
    ]
    return {
        "ts": int(when),
        "hosts": len(hosts),
        "compliant_hosts": sum(1 for h in audited if h["compliant"]),
        "errors": len(hosts) - len(audited),
        "volumes": len(volumes),
        "compliant_volumes": sum(1 for v in volumes if v["compliant"]),
        "compliant_share": round(sum(shares) / len(shares), 4) if shares else None,
    }


def valid_snapshot(entry):
    """A history entry as snapshot makes it (read back from a store anyone may have written to)."""
    ints = ("ts", "hosts", "compliant_hosts", "errors", "volumes", "compliant_volumes")
    return (
        isinstance(entry, dict)
        and all(type(entry.get(k)) is int and entry[k] >= 0 for k in ints)
        and entry["compliant_volumes"] <= entry["volumes"]
        and entry["compliant_hosts"] <= entry["hosts"]
    )


_NAME = {"type": "string", "maxLength": 512}
_OPTIONAL_NAME = {"type": ["string", "null"], "maxLength": 4096}
_TEXT = {"type": "string", "maxLength": 4096}
_COUNT = {"type": "integer", "minimum": 0}
_EPOCH = {
    "description": "epoch seconds (up to the year 9999)",
    "type": "integer",
    "minimum": 0,
    "maximum": 253402300799,
}
_OPTIONAL_EPOCH = dict(_EPOCH, type=["integer", "null"])
_SCALAR = {"type": ["string", "integer", "boolean", "null"], "maxLength": 4096}
_FIELD = dict(_SCALAR, type=[*_SCALAR["type"], "array"], maxItems=64, items=_SCALAR)
_RULE_ID = {"description": "a rule this master knows", "enum": list(rule_table.RULES)}
_SEVERITY = {"enum": ["critical", "high", "medium", "low"]}
_VOLUME_NAME = {"type": "string", "pattern": "^[a-z][a-z0-9_]{0,15}$"}

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": SCHEMA_ID,
    "title": "hana-storage-formula evidence report",
    "type": "object",
    "required": [
        "$schema",
        "generated",
        "master",
        "formula",
        "summary",
        "rules",
        "hosts",
        "history",
        "actions",
    ],
    "properties": {
        "$schema": {"const": SCHEMA_ID},
        "generated": {"description": "epoch seconds", **_COUNT},
        "master": _NAME,
        "formula": _NAME,
        "summary": {"$ref": "#/$defs/snapshot"},
        "rules": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["severity", "title", "remediation", "controls"],
                "properties": {
                    "severity": _SEVERITY,
                    "title": {"type": "string"},
                    "remediation": {"enum": ["auto", "manual"]},
                    "controls": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
        "controls": {"type": "object"},
        "hosts": {"type": "object", "additionalProperties": {"$ref": "#/$defs/host"}},
        "history": {"type": "array", "items": {"$ref": "#/$defs/snapshot"}},
        "actions": {"type": "array", "items": {"$ref": "#/$defs/action"}},
        "tallies": {"type": "object", "additionalProperties": _COUNT},
    },
    "$defs": {
        "snapshot": {
            "type": "object",
            "required": ["ts", "hosts", "compliant_hosts", "errors", "volumes", "compliant_volumes"],
            "properties": {
                "ts": _COUNT,
                "hosts": _COUNT,
                "compliant_hosts": _COUNT,
                "errors": _COUNT,
                "volumes": _COUNT,
                "compliant_volumes": _COUNT,
                "compliant_share": {
                    "description": "the mean of each audited host's share of compliant volumes (hosts weigh alike)",
                    "type": ["number", "null"],
                    "minimum": 0,
                    "maximum": 1,
                },
            },
        },
        "action": {
            "type": "object",
            "required": ["ts", "minion", "rule", "action"],
            "properties": {
                "ts": {"type": "number"},
                "minion": _NAME,
                "rule": _NAME,
                "action": {"enum": ["alerted", "remediated", "remediation-failed"]},
                "key": _NAME,
                "master": _NAME,
                "event_ids": {"type": "array", "items": _NAME},
            },
        },
        "host": {"oneOf": [{"$ref": "#/$defs/not_audited"}, {"$ref": "#/$defs/audited"}]},
        "not_audited": {
            "type": "object",
            "required": ["host", "error"],
            "properties": {"host": _NAME, "error": _TEXT},
            "additionalProperties": False,
        },
        "verdict": {
            "description": "what a fleet snapshot reads of a host's audit",
            "type": "object",
            "required": ["host", "compliant", "volumes"],
            "properties": {
                "host": _NAME,
                "compliant": {"type": "boolean"},
                "volumes": {"$ref": "#/$defs/volumes"},
            },
        },
        "audited": {
            "type": "object",
            "required": ["host", "audited", "compliant", "volumes", "findings", "keys"],
            "additionalProperties": False,
            "properties": {
                "host": _NAME,
                "audited": _EPOCH,
                "compliant": {"type": "boolean"},
                "volumes": {"$ref": "#/$defs/volumes"},
                "findings": {"type": "array", "maxItems": MAX_FINDINGS, "items": {"$ref": "#/$defs/finding"}},
                "keys": {
                    "type": "object",
                    "maxProperties": MAX_VOLUMES,
                    "propertyNames": _VOLUME_NAME,
                    "additionalProperties": {"$ref": "#/$defs/keys"},
                },
                "readiness": {"$ref": "#/$defs/readiness"},
            },
        },
        "readiness": {
            "description": "whether the host would unlock its storage at its next boot, checked live when "
            "the report was made (hana_storage.boot_readiness): a verdict per /etc/crypttab line",
            "type": "object",
            "required": ["ready", "checked"],
            "additionalProperties": False,
            "anyOf": [{"required": ["lines"]}, {"required": ["error"]}],
            "if": {"properties": {"ready": {"const": None}}},
            "then": {"required": ["error"]},
            "properties": {
                "ready": {
                    "description": "null: no verdict (no answer, or not one)",
                    "type": ["boolean", "null"],
                },
                "checked": _EPOCH,
                "error": _TEXT,
                "lines": {
                    "type": "array",
                    "maxItems": MAX_CRYPTTAB_LINES,
                    "items": {
                        "type": "object",
                        "required": ["name", "device", "at_boot", "blocks_boot", "ready", "problems"],
                        "additionalProperties": False,
                        "properties": {
                            "name": _NAME,
                            "device": _OPTIONAL_NAME,
                            "at_boot": {"type": "boolean"},
                            "blocks_boot": {"type": "boolean"},
                            "ready": {"type": "boolean"},
                            "problems": {
                                "type": "array",
                                "maxItems": 16,
                                "items": {
                                    "type": "object",
                                    "required": ["code", "cause", "fix"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "code": {"enum": sorted(readiness_table.PROBLEMS)},
                                        "cause": _TEXT,
                                        "fix": _TEXT,
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
        "volumes": {
            "type": "object",
            "maxProperties": MAX_VOLUMES,
            "propertyNames": _VOLUME_NAME,
            "additionalProperties": {
                "type": "object",
                "required": ["mountpoint", "compliant", "rules"],
                "properties": {
                    "mountpoint": _OPTIONAL_NAME,
                    "compliant": {"type": "boolean"},
                    "rules": {"type": "array", "maxItems": len(rule_table.RULES), "items": _RULE_ID},
                },
            },
        },
        "finding": {
            "type": "object",
            "required": [*events.FINDING_FIELDS, "evidence"],
            "additionalProperties": False,
            "properties": {
                "rule": _RULE_ID,
                "severity": _SEVERITY,
                "volume": _OPTIONAL_NAME,
                "mountpoint": _OPTIONAL_NAME,
                "device": _OPTIONAL_NAME,
                "expected": {"description": "what the pillar asks (any JSON value)"},
                "actual": {"description": "what the host has (any JSON value)"},
                "remediation": {"enum": ["auto", "manual", None]},
                "message": _TEXT,
                "evidence": {
                    "type": "object",
                    "required": ["dm_table", "luks_header"],
                    "additionalProperties": False,
                    "properties": {
                        "dm_table": {
                            "type": "array",
                            "maxItems": 1024,
                            "items": {"type": "object", "additionalProperties": _FIELD},
                        },
                        "luks_header": {
                            "oneOf": [
                                {"type": "null"},
                                {
                                    "type": "object",
                                    "required": ["error"],
                                    "properties": {"error": _TEXT},
                                    "additionalProperties": False,
                                },
                                {"$ref": "#/$defs/luks_header"},
                            ]
                        },
                    },
                },
            },
        },
        "luks_header": {
            "description": "a LUKS header as an auditor reads it: never a salt, digest or key",
            "type": "object",
            "required": [
                "version",
                "uuid",
                "cipher",
                "key_size",
                "sector_size",
                "flags",
                "keyslots",
                "clevis",
                "degraded",
            ],
            "additionalProperties": False,
            "properties": {
                "version": {"type": ["integer", "null"]},
                "uuid": _OPTIONAL_NAME,
                "cipher": _OPTIONAL_NAME,
                "key_size": {"type": ["integer", "null"]},
                "sector_size": {"type": ["integer", "null"]},
                "flags": {"type": "array", "maxItems": 64, "items": _NAME},
                "keyslots": {
                    "type": "array",
                    "maxItems": 32,
                    "items": {
                        "type": "object",
                        "required": ["id", "type", "kdf"],
                        "additionalProperties": False,
                        "properties": {
                            "id": {"type": ["integer", "string", "null"]},
                            "type": _OPTIONAL_NAME,
                            "kdf": _OPTIONAL_NAME,
                        },
                    },
                },
                "clevis": {"type": "array", "maxItems": 32, "items": {"$ref": "#/$defs/clevis"}},
                "degraded": {"type": "boolean"},
            },
        },
        "clevis": {
            "type": "object",
            "required": ["keyslots", "threshold", "servers"],
            "additionalProperties": False,
            "properties": {
                "keyslots": {"type": "array", "maxItems": 32, "items": _NAME},
                "threshold": {"type": ["integer", "null"]},
                "servers": {
                    "type": "array",
                    "maxItems": 64,
                    "items": {
                        "type": "object",
                        "required": ["url", "thumbprints"],
                        "additionalProperties": False,
                        "properties": {
                            "url": _OPTIONAL_NAME,
                            "thumbprints": {"type": "array", "maxItems": 64, "items": _NAME},
                        },
                    },
                },
                "tpm2": {"$ref": "#/$defs/tpm2"},
            },
        },
        "tpm2": {
            "description": "a TPM2 policy: the PCR bank and the PCRs a key is sealed to (null: no TPM2)",
            "oneOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "required": ["pcr_bank", "pcr_ids"],
                    "additionalProperties": False,
                    "properties": {
                        "pcr_bank": _OPTIONAL_NAME,
                        "pcr_ids": {
                            "type": "array",
                            "maxItems": 24,
                            "items": {"type": "integer", "minimum": 0, "maximum": 23},
                        },
                    },
                },
            ],
        },
        "keys": {
            "description": "the state of a volume's keys",
            "type": "object",
            "required": ["source", "key_file", "rotating", "tang", "devices"],
            "additionalProperties": False,
            "properties": {
                "source": {"enum": ["keyfile", "pillar", "tang", "tpm2", None]},
                "key_file": {
                    "oneOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "required": ["path", "exists", "mode", "uid", "modified"],
                            "additionalProperties": False,
                            "properties": {
                                "path": _NAME,
                                "exists": {"type": "boolean"},
                                "mode": {"type": ["string", "null"], "pattern": "^[0-7]{4}$"},
                                "uid": {"type": ["integer", "null"]},
                                "modified": _OPTIONAL_EPOCH,
                            },
                        },
                    ]
                },
                "rotating": {"type": "boolean"},
                "tang": {
                    "type": "array",
                    "maxItems": 16,
                    "items": {
                        "type": "object",
                        "required": ["url", "thumbprint"],
                        "additionalProperties": False,
                        "properties": {"url": _NAME, "thumbprint": _OPTIONAL_NAME},
                    },
                },
                "tpm2": {"$ref": "#/$defs/tpm2"},
                "devices": {
                    "type": "array",
                    "maxItems": 64,
                    "items": {
                        "type": "object",
                        "required": [
                            "crypt",
                            "device",
                            "open",
                            "luks_uuid",
                            "keyslots",
                            "clevis",
                            "header_backup",
                        ],
                        "additionalProperties": False,
                        "properties": {
                            "crypt": _NAME,
                            "device": _OPTIONAL_NAME,
                            "open": {"type": "boolean"},
                            "luks_uuid": _OPTIONAL_NAME,
                            "keyslots": _COUNT,
                            "clevis": {"type": "array", "maxItems": 32, "items": {"$ref": "#/$defs/clevis"}},
                            "header_backup": {
                                "oneOf": [
                                    {"type": "null"},
                                    {
                                        "type": "object",
                                        "required": ["path", "exists", "modified", "state"],
                                        "additionalProperties": False,
                                        "properties": {
                                            "path": _NAME,
                                            "exists": {"type": "boolean"},
                                            "modified": _OPTIONAL_EPOCH,
                                            "state": _NAME,
                                        },
                                    },
                                ]
                            },
                        },
                    },
                },
            },
        },
    },
}


# ---- the page -------------------------------------------------------------------------------------


def _e(value):
    return html_module.escape("" if value is None else str(value), quote=True)


def _date(epoch):
    if not isinstance(epoch, int | float):
        return "-"
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1b1f24;margin:0;background:#f6f7f9}
main{max-width:1200px;margin:0 auto;padding:24px}
h1{font-size:24px;margin:0 0 4px}h2{font-size:18px;margin:32px 0 8px;border-bottom:1px solid #d0d4da;padding-bottom:4px}
h3{font-size:15px;margin:20px 0 6px}
.meta{color:#57606a}.cards{display:flex;flex-wrap:wrap;gap:12px;margin:16px 0}
.card{background:#fff;border:1px solid #d0d4da;border-radius:6px;padding:12px 16px;min-width:150px}
.card b{display:block;font-size:22px}.ok{color:#1a7f37}.bad{color:#cf222e}.warn{color:#9a6700}
table{border-collapse:collapse;width:100%;background:#fff;margin:6px 0 12px;table-layout:auto}
th,td{border:1px solid #d0d4da;padding:4px 6px;text-align:left;vertical-align:top;overflow-wrap:break-word}
td code,td pre{overflow-wrap:anywhere}.nowrap{white-space:nowrap}
th{background:#eef0f3;font-weight:600}
td.pass{background:#dafbe1;text-align:center}td.fail{background:#ffebe9;text-align:center;font-weight:600}
td.err{background:#fff8c5;text-align:center}
.matrix{overflow-x:auto}.matrix th.rule{writing-mode:vertical-rl;transform:rotate(180deg);white-space:nowrap;font-size:12px}
code,pre{font:12px/1.35 ui-monospace,SFMono-Regular,Menlo,monospace}pre{white-space:pre-wrap;margin:0}
.charts{display:flex;flex-wrap:wrap;gap:16px}.chart{background:#fff;border:1px solid #d0d4da;border-radius:6px;padding:8px}
.signoff{background:#fff;border:1px solid #d0d4da;border-radius:6px;padding:16px;margin-top:24px}
.signoff td{height:36px}
@media print{body{background:#fff}main{max-width:none}.matrix{overflow:visible}}
"""


def html(doc):
    """The evidence document as one HTML page."""
    summary, hosts = doc["summary"], doc["hosts"]
    share = summary.get("compliant_share")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # nothing to fetch and nothing to run: the page is all there is
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>HANA storage evidence - {_e(doc['master'])} - {_e(_date(doc['generated']))}</title>",
        f"<style>{STYLE}</style></head><body><main>",
        "<h1>Encrypted SAP HANA storage: compliance evidence</h1>",
        f'<p class="meta">Generated {_e(_date(doc["generated"]))} by salt-master <b>{_e(doc["master"])}</b> with '
        f"hana-storage-formula {_e(doc['formula'])}. Each host was audited when the report was made; the audit "
        "reads the live system (device-mapper tables, LUKS headers, LVM, mounts) and never key material.</p>",
        '<section id="summary"><h2>Fleet summary</h2><div class="cards">',
        _card("Hosts", summary["hosts"]),
        _card(
            "Compliant hosts",
            summary["compliant_hosts"],
            "ok" if summary["compliant_hosts"] == summary["hosts"] else "bad",
        ),
        _card("Hosts not audited", summary["errors"], "warn" if summary["errors"] else "ok"),
        _card("Compliant volumes", f"{summary['compliant_volumes']} of {summary['volumes']}"),
        _card("Compliance per host, mean", _percent(share), "ok" if share == 1 else "bad"),
        _readiness_card(hosts),
        "</div></section>",
        '<section id="charts"><h2>Compliance over time and findings by rule</h2><div class="charts">',
        _history_chart(doc["history"]),
        _rule_chart(hosts, doc["rules"]),
        "</div></section>",
        _matrix(hosts, doc["rules"]),
        _findings(hosts, doc["rules"]),
        _keys(hosts),
        _readiness(hosts),
        _actions(doc["actions"]),
        _rules(doc["rules"], doc.get("controls", {})),
        _signoff(),
        "</main></body></html>",
    ]
    return "\n".join(parts) + "\n"


def _card(label, value, tone=""):
    return f'<div class="card">{_e(label)}<b class="{tone}">{_e(value)}</b></div>'


def _percent(share):
    return "-" if share is None else f"{share * 100:.1f} %"


def _history_chart(history, width=520, height=200):
    points = [h for h in history if h.get("compliant_share") is not None]
    title = "Compliance per host, mean, over time (each report run)"
    if len(points) < 2:
        return (
            f'<figure class="chart" id="history-chart"><figcaption>{title}</figcaption>'
            f"<p>{len(points)} report run(s) in the store's history so far: the chart starts at two.</p></figure>"
        )
    left, right, top, bottom = 44, 12, 10, 28
    first, last = points[0]["ts"], points[-1]["ts"]
    span = max(last - first, 1)

    def x(ts):
        return left + (ts - first) / span * (width - left - right)

    def y(share):
        return top + (1 - share) * (height - top - bottom)

    line = " ".join(f"{x(p['ts']):.1f},{y(p['compliant_share']):.1f}" for p in points)
    grid = "".join(
        f'<line x1="{left}" x2="{width - right}" y1="{y(s):.1f}" y2="{y(s):.1f}" stroke="#d0d4da"/>'
        f'<text x="{left - 6}" y="{y(s) + 4:.1f}" text-anchor="end" font-size="11">{int(s * 100)}%</text>'
        for s in (0, 0.5, 1)
    )
    dots = "".join(
        f'<circle cx="{x(p["ts"]):.1f}" cy="{y(p["compliant_share"]):.1f}" r="3" fill="#0969da">'
        f"<title>{_e(_date(p['ts']))}: {_percent(p['compliant_share'])}</title></circle>"
        for p in points
    )
    labels = (
        f'<text x="{left}" y="{height - 8}" font-size="11">{_e(_date(first)[:10])}</text>'
        f'<text x="{width - right}" y="{height - 8}" font-size="11" text-anchor="end">{_e(_date(last)[:10])}</text>'
    )
    return (
        f'<figure class="chart" id="history-chart"><figcaption>{title}</figcaption>'
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{title}">{grid}<polyline fill="none" stroke="#0969da" stroke-width="2" points="{line}"/>'
        f"{dots}{labels}</svg></figure>"
    )


def _rule_chart(hosts, rules, width=520):
    counts = {}
    for host in hosts.values():
        for finding in host.get("findings", []):
            counts[finding["rule"]] = counts.get(finding["rule"], 0) + 1
    title = "Findings by rule (volumes and devices failing it)"
    if not counts:
        return f'<figure class="chart" id="rule-chart"><figcaption>{title}</figcaption><p>No finding.</p></figure>'
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    bar, label, most = 18, 130, max(counts.values())
    height = len(ordered) * (bar + 6) + 10
    colour = {"critical": "#a40e26", "high": "#cf222e", "medium": "#bf8700", "low": "#57606a"}
    rows = []
    for index, (rule, count) in enumerate(ordered):
        y = 5 + index * (bar + 6)
        length = max(2, (width - label - 40) * count / most)
        severity = (rules.get(rule) or {}).get("severity", "low")
        rows.append(
            f'<text x="{label - 6}" y="{y + 13}" text-anchor="end" font-size="11">{_e(rule)}</text>'
            f'<rect x="{label}" y="{y}" width="{length:.1f}" height="{bar}" fill="{colour.get(severity, "#57606a")}">'
            f"<title>{_e(rule)}: {count} ({_e(severity)})</title></rect>"
            f'<text x="{label + length + 4:.1f}" y="{y + 13}" font-size="11">{count}</text>'
        )
    return (
        f'<figure class="chart" id="rule-chart"><figcaption>{title}</figcaption>'
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{title}">{"".join(rows)}</svg></figure>'
    )


def _matrix(hosts, rules):
    failing = sorted(
        {f["rule"] for h in hosts.values() for f in h.get("findings", [])}, key=list(rules).index
    )
    head = "".join(f'<th class="rule" title="{_e(rules[r]["title"])}">{_e(r)}</th>' for r in failing)
    rows = []
    for name, host in hosts.items():
        if "error" in host:
            cells = f'<td class="err" colspan="{len(failing) + 1}">not audited: {_e(host["error"])}</td>'
        else:
            fails = {f["rule"] for f in host["findings"]}
            verdict = (
                '<td class="pass">compliant</td>'
                if host["compliant"]
                else '<td class="fail">not compliant</td>'
            )
            cells = verdict + "".join(
                '<td class="fail">fail</td>' if r in fails else '<td class="pass">pass</td>' for r in failing
            )
        rows.append(f'<tr data-host="{_e(name)}"><th scope="row">{_e(name)}</th>{cells}</tr>')
    note = (
        f"Every other rule of the table ({len(rules) - len(failing)} of {len(rules)}) passes on every audited host."
        if failing
        else f"All {len(rules)} rules pass on every audited host."
    )
    return (
        '<section id="matrix"><h2>Hosts by rule</h2>'
        f"<p>{_e(note)}</p>"
        f'<div class="matrix"><table><thead><tr><th>host</th><th>verdict</th>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div></section>"
    )


def _findings(hosts, rules):
    parts = ['<section id="findings"><h2>Findings and their evidence</h2>']
    any_finding = False
    for name, host in hosts.items():
        findings = host.get("findings") or []
        if not findings:
            continue
        any_finding = True
        parts.append(
            f'<h3 id="findings-{_e(name)}">{_e(name)} (audited {_e(_date(host.get("audited")))})</h3>'
        )
        parts.append(
            "<table><thead><tr><th>rule</th><th>severity</th><th>volume</th><th>device</th><th>what was found</th>"
            "<th>remediation</th><th>evidence</th></tr></thead><tbody>"
        )
        for finding in findings:
            evidence = finding.get("evidence") or {}
            parts.append(
                "<tr>"
                f"<td><b>{_e(finding['rule'])}</b><br>{_e((rules.get(finding['rule']) or {}).get('title'))}</td>"
                f"<td>{_e(finding.get('severity'))}</td><td>{_e(finding.get('volume'))}</td>"
                f"<td><code>{_e(finding.get('device'))}</code></td>"
                f"<td>{_e(finding.get('message'))}</td><td>{_e(finding.get('remediation'))}</td>"
                f"<td>{_evidence(evidence)}</td></tr>"
            )
        parts.append("</tbody></table>")
    if not any_finding:
        parts.append("<p>No finding on any audited host.</p>")
    parts.append("</section>")
    return "".join(parts)


def _evidence(evidence):
    lines = []
    for segment in evidence.get("dm_table") or []:
        shown = {k: v for k, v in segment.items() if k not in ("device_name",)}
        lines.append("dm: " + " ".join(f"{k}={v}" for k, v in shown.items()))
    header = evidence.get("luks_header")
    if header:
        if "error" in header:
            lines.append(f"LUKS header: {header['error']}")
        else:
            slots = ", ".join(f"{k['id']}:{k['type']}/{k['kdf']}" for k in header["keyslots"])
            lines.append(
                f"LUKS{header['version']} {header['uuid']} {header['cipher']} {header['key_size']}-bit "
                f"{header['sector_size']} B sectors; flags {','.join(header['flags']) or 'none'}; keyslots {slots or 'none'}"
                + ("; DEGRADED" if header.get("degraded") else "")
            )
    return f"<pre>{_e(chr(10).join(lines))}</pre>" if lines else "-"


def _tpm2_text(policy):
    ids = ",".join(str(i) for i in policy.get("pcr_ids") or [])
    return f"TPM2 {policy.get('pcr_bank')}:{ids}" if ids else "TPM2 (no PCR)"


def _keys(hosts):
    rows = []
    for name, host in hosts.items():
        for volume, keys in (host.get("keys") or {}).items():
            key_file = keys.get("key_file") or {}
            tang = (
                "; ".join(
                    [f"{s['url']} ({s['thumbprint']})" for s in keys.get("tang", [])]
                    + ([_tpm2_text(keys["tpm2"])] if keys.get("tpm2") else [])
                )
                or "-"
            )
            for device in keys.get("devices") or [{}]:
                backup = device.get("header_backup") or {}
                bindings = "; ".join(
                    ", ".join(
                        [f"{s['url']} {'/'.join(s['thumbprints'])}" for s in b["servers"]]
                        + ([_tpm2_text(b["tpm2"])] if b.get("tpm2") else [])
                    )
                    for b in device.get("clevis", [])
                )
                rows.append(
                    f'<tr data-host="{_e(name)}"><td>{_e(name)}</td><td>{_e(volume)}</td><td>{_e(keys.get("source"))}'
                    + (" (rotation in progress)" if keys.get("rotating") else "")
                    + "</td>"
                    f"<td>{_e(key_file.get('path', '-'))} {_e(key_file.get('mode') or '')}<br>"
                    f"{_e(_date(key_file.get('modified')) if key_file else '')}</td>"
                    f"<td>{_e(tang)}</td><td><code>{_e(device.get('crypt', '-'))}</code> "
                    f"{_e(device.get('luks_uuid') or '')}<br>{_e(device.get('keyslots', '-'))} keyslot(s)</td>"
                    f"<td>{_e(bindings or '-')}</td>"
                    f"<td>{_e(backup.get('path', '-'))}<br>{_e(backup.get('state', ''))} "
                    f"{_e(_date(backup.get('modified')) if backup.get('modified') else '')}</td></tr>"
                )
    return (
        '<section id="keys"><h2>Keys</h2><p>Where each volume\'s key comes from, when its key file last changed '
        "(the key store's last write), the Tang servers the pillar names and the signing-key thumbprints each "
        "device's Clevis binding was made with, and each LUKS header backup. No key material is read into this "
        "report.</p><table><thead><tr><th>host</th><th>volume</th><th>key source</th><th>key file, mode, changed</th>"
        "<th>Tang servers (pillar)</th><th>device, LUKS UUID</th><th>Clevis bindings</th>"
        f"<th>header backup</th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def _readiness_card(hosts):
    if not any("readiness" in h for h in hosts.values()):
        return ""  # a document made without readiness
    ready = sum(1 for h in hosts.values() if (h.get("readiness") or {}).get("ready") is True)
    unknown = sum(1 for h in hosts.values() if (h.get("readiness") or {}).get("ready") is None)
    value = f"{ready} of {len(hosts)}" + (f" ({unknown} not known)" if unknown else "")
    return _card("Ready for their next boot", value, "ok" if ready == len(hosts) else "bad")


def _readiness(hosts):
    rows = []
    for name, host in hosts.items():
        readiness = host.get("readiness")
        if readiness is None or readiness["ready"] is None:
            why = (readiness or {}).get("error") or ("not audited" if "error" in host else "")
            rows.append(
                f'<tr data-host="{_e(name)}"><td>{_e(name)}</td><td>-</td><td class="err">not known</td>'
                f"<td colspan=4>{_e(why)}</td></tr>"
            )
            continue
        checked = _e(_date(readiness.get("checked")))
        if readiness["ready"]:
            lines = len(readiness.get("lines") or [])
            rows.append(
                f'<tr data-host="{_e(name)}"><td>{_e(name)}</td><td>{checked}</td><td class="pass">ready</td>'
                f"<td colspan=4>every one of {lines} crypttab line(s) opens as the boot will open it</td></tr>"
            )
            continue
        problems = [
            (line, found)
            for line in readiness.get("lines") or []
            if not line["ready"]
            for found in line["problems"]
        ]
        if "error" in readiness or not problems:
            rows.append(
                f'<tr data-host="{_e(name)}"><td>{_e(name)}</td><td>{checked}</td><td class="fail">not ready</td>'
                f"<td colspan=4>{_e(readiness.get('error') or 'a line is not ready, for no cause it names')}</td></tr>"
            )
        for line, found in problems:
            stops = "stops the boot" if line["blocks_boot"] else "stays locked (nofail)"
            rows.append(
                f'<tr data-host="{_e(name)}"><td>{_e(name)}</td><td>{checked}</td><td class="fail">not ready</td>'
                f"<td><code>{_e(line['name'])}</code> {_e(line.get('device'))}<br>{stops}</td>"
                f"<td><code>{_e(found['code'])}</code></td><td>{_e(found['cause'])}</td><td>{_e(found['fix'])}</td></tr>"
            )
    return (
        '<section id="readiness"><h2>Ready for the next boot</h2><p>Whether each host would unlock its '
        "storage at its next boot without Salt, checked when this report was made: each /etc/crypttab line "
        "systemd opens, its device, its key file opening the header (tried on a copy), or its Clevis binding "
        "unlocking now (which asks the Tang servers, as the boot will). Each line that would not open, why, "
        "and the fix.</p><table><thead><tr><th>host</th><th>checked</th><th>verdict</th><th>crypttab line</th>"
        f"<th>problem</th><th>cause</th><th>fix</th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def _actions(actions):
    shown = list(reversed(actions))[:MAX_ACTIONS_SHOWN]
    rows = "".join(
        f"<tr><td>{_e(_date(a.get('ts')))}</td><td>{_e(a.get('minion'))}</td><td>{_e(a.get('rule'))}</td>"
        f"<td>{_e(a.get('action'))}</td><td><code>{_e(a.get('key'))}</code></td><td>{_e(a.get('master'))}</td>"
        f"<td><code>{_e(' '.join(a.get('event_ids') or []))}</code></td></tr>"
        for a in shown
    )
    more = (
        f" (the newest {MAX_ACTIONS_SHOWN} of {len(actions)}; the JSON form has all)"
        if len(actions) > len(shown)
        else ""
    )
    return (
        '<section id="actions"><h2>Remediation and alert history</h2>'
        f"<p>What the master's triage did, newest first{_e(more)}: each remediation the minion ran "
        "(its outcome), each alert, with the event ids the bus carried.</p>"
        "<table><thead><tr><th>when</th><th>host</th><th>rule</th><th>action</th><th>finding</th><th>by master</th>"
        f"<th>event ids</th></tr></thead><tbody>{rows or '<tr><td colspan=7>none recorded</td></tr>'}</tbody></table></section>"
    )


def _rules(rules, controls):
    rows = "".join(
        f"<tr><td>{_e(rule_id)}</td><td>{_e(rule['severity'])}</td><td>{_e(rule['remediation'])}</td>"
        f"<td>{_e(rule['title'])}</td><td>{_e(', '.join(_control(c, controls) for c in rule['controls']))}</td></tr>"
        for rule_id, rule in rules.items()
    )
    return (
        '<section id="rules"><h2>Rules and the controls they give evidence for</h2>'
        "<table><thead><tr><th>rule</th><th>severity</th><th>remediation</th><th>fails when</th><th>controls</th>"
        f"</tr></thead><tbody>{rows}</tbody></table></section>"
    )


def _control(key, controls):
    control = controls.get(key)
    return f"{control['catalogue']} {control['ident']}" if control else key


def _signoff():
    return (
        '<section class="signoff" id="signoff"><h2>Sign-off</h2>'
        "<table><tbody><tr><th>Reviewed by</th><td></td><th>Role</th><td></td></tr>"
        "<tr><th>Date</th><td></td><th>Signature</th><td></td></tr></tbody></table></section>"
    )
