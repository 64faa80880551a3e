"""The audit as SCAP: a source data stream whose rules are the formula's rules, and the status file
its checks read. Pure code (XML text in, XML text out).

Why OVAL over a status file, not a script check (SCE): every ``oscap`` evaluates OVAL, the one
SUSE Manager / Uyuni runs through Salt's ``openscap.xccdf`` included; SCE needs an extra engine
(RHEL's openscap-engine-sce, not always installed) and runs its scripts from /tmp, which the
hardened hosts these scans are for mount ``noexec``. So the formula writes what its audit found
to a status file (``STATUS``, after every full audit of the beacon and by
``hana_storage.scap_status``), and each XCCDF rule's OVAL definition reads it:

* the file is complete and was written in this boot (``boot_id``), and the host's uptime is not
  past ``valid_until_uptime`` (the audit plus ``max_age`` seconds): a stale or missing status
  fails every rule, never passes it (OVAL has no clock of its own; openscap 1.3's
  ``time_difference`` and ``arithmetic`` over file contents do not work, the uptime does);
* the rule was checked (``checked <rule>``): a rule the pillar ignores, or that the formula that
  wrote the status did not know, fails;
* no ``finding <rule> <volume> <device>`` line: each such line is an OVAL item of the failed
  check, so the results name every volume and device that fails it.
"""

import datetime
import re
import xml.etree.ElementTree as ET

from . import controls as control_table
from . import rules as rule_table

NAMESPACE = "org.hana-storage-formula"
BENCHMARK = f"xccdf_{NAMESPACE}_benchmark_hana_storage"
PROFILE = f"xccdf_{NAMESPACE}_profile_hana_storage"
STATUS = "/var/lib/hana-storage/audit.status"
DATASTREAM = "/usr/share/xml/scap/hana-storage/hana-storage-ds.xml"
FORMAT = 1

XCCDF_NS = "http://checklists.nist.gov/xccdf/1.2"
OVAL_NS = "http://oval.mitre.org/XMLSchema/oval-definitions-5"
OVAL_COMMON = "http://oval.mitre.org/XMLSchema/oval-common-5"
OVAL_IND = "http://oval.mitre.org/XMLSchema/oval-definitions-5#independent"
DS_NS = "http://scap.nist.gov/schema/scap/source/1.2"
XLINK = "http://www.w3.org/1999/xlink"
CATALOG = "urn:oasis:names:tc:entity:xmlns:xml:catalog"
for prefix, uri in (("xccdf", XCCDF_NS), ("oval", OVAL_COMMON), ("ind", OVAL_IND), ("ds", DS_NS),
                    ("xlink", XLINK), ("cat", CATALOG), ("oval-def", OVAL_NS)):  # fmt: skip
    ET.register_namespace(prefix, uri)

XCCDF_SEVERITY = {"critical": "high", "high": "high", "medium": "medium", "low": "low"}
CCE_SYSTEM = "http://cce.mitre.org"
OVAL_CHECK = "http://oval.mitre.org/XMLSchema/oval-definitions-5"
OVAL_FILE = "hana-storage-oval.xml"


# ---- the status file ------------------------------------------------------------------------------


def status_text(report, checked, host, audited, boot_id, uptime, max_age):
    """The status file for an audit ``report`` (hana_storage.audit's) of the rules ``checked``:
    ``audited`` (epoch seconds) for people, ``boot_id`` and ``uptime`` (seconds, the host's now)
    for the checks. Device and volume names only: no key material."""
    lines = [
        "# hana-storage audit status, read by its SCAP data stream (hana_storage.scap_status)",
        f"format {FORMAT}",
        f"host {_word(host)}",
        f"audited {int(audited)}",
        f"boot_id {_word(boot_id)}",
        f"valid_until_uptime {int(uptime) + int(max_age)}",
        *(f"checked {rule}" for rule in sorted(checked)),
        *sorted(f"finding {f['rule']} {_word(f['volume'])} {_word(f['device'])}" for f in report["findings"]),
        "complete",
    ]
    return "\n".join(lines) + "\n"


def _word(text):
    """One whitespace-free token (the status file is split on spaces)."""
    return "".join(c if c.isprintable() and not c.isspace() else "_" for c in str(text)) or "-"


def generated_at(text):
    """The timestamp of a data stream ``datastream`` made (a datetime), or None: a state compares
    the file in place with one made at the same time."""
    match = re.search(r'<ds:data-stream [^>]*timestamp="([0-9T:-]{19})"', text)
    if not match:
        return None
    try:
        return datetime.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        return None


# ---- the data stream ------------------------------------------------------------------------------


def datastream(version, generated=None, status=STATUS):
    """The SCAP 1.3 source data stream (text) of every rule of the rule table: an XCCDF 1.2
    benchmark with the profile PROFILE, and its OVAL 5.11 checks over the status file ``status``.
    ``generated``: the data stream's timestamp (a datetime; now by default)."""
    when = (generated or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S")
    rules = list(rule_table.RULES.items())
    collection = ET.Element(
        f"{{{DS_NS}}}data-stream-collection",
        {"id": f"scap_{NAMESPACE}_collection_hana_storage", "schematron-version": "1.3"},
    )
    stream = ET.SubElement(
        collection,
        f"{{{DS_NS}}}data-stream",
        {
            "id": f"scap_{NAMESPACE}_datastream_hana_storage",
            "scap-version": "1.3",
            "use-case": "CONFIGURATION",
            "timestamp": when,
        },
    )
    xccdf_ref = ET.SubElement(
        ET.SubElement(stream, f"{{{DS_NS}}}checklists"),
        f"{{{DS_NS}}}component-ref",
        {
            "id": f"scap_{NAMESPACE}_cref_hana-storage-xccdf.xml",
            f"{{{XLINK}}}href": f"#scap_{NAMESPACE}_comp_xccdf",
        },
    )
    catalog = ET.SubElement(xccdf_ref, f"{{{CATALOG}}}catalog")
    ET.SubElement(
        catalog, f"{{{CATALOG}}}uri", {"name": OVAL_FILE, "uri": f"#scap_{NAMESPACE}_cref_{OVAL_FILE}"}
    )
    ET.SubElement(
        ET.SubElement(stream, f"{{{DS_NS}}}checks"),
        f"{{{DS_NS}}}component-ref",
        {"id": f"scap_{NAMESPACE}_cref_{OVAL_FILE}", f"{{{XLINK}}}href": f"#scap_{NAMESPACE}_comp_oval"},
    )
    oval = ET.SubElement(
        collection, f"{{{DS_NS}}}component", {"id": f"scap_{NAMESPACE}_comp_oval", "timestamp": when}
    )
    oval.append(_oval(rules, when, status))
    xccdf = ET.SubElement(
        collection, f"{{{DS_NS}}}component", {"id": f"scap_{NAMESPACE}_comp_xccdf", "timestamp": when}
    )
    xccdf.append(_benchmark(rules, version, when, status))
    # indented: oscap 1.3.7 skips the first of an odd number of profile selects that stand side
    # by side without whitespace, and that rule is then never evaluated
    ET.indent(collection)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(collection, encoding="unicode") + "\n"


def _text(parent, tag, text, **attributes):
    element = ET.SubElement(parent, tag, attributes)
    element.text = text
    return element


def _benchmark(rules, version, when, status):
    x = f"{{{XCCDF_NS}}}"
    benchmark = ET.Element(
        f"{x}Benchmark", {"id": BENCHMARK, "resolved": "1", "xml:lang": "en-US", "style": "SCAP_1.2"}
    )
    _text(benchmark, f"{x}status", "draft", date=when[:10])
    _text(benchmark, f"{x}title", "Encrypted, striped SAP HANA storage (hana-storage-formula)")
    _text(
        benchmark,
        f"{x}description",
        "The audit rules of hana-storage-formula: /hana/data, /hana/log, /hana/shared (and /hana/backup) on "
        "LUKS2 above or below a striped LVM volume, their keys, header backups, dm-crypt flags and mounts. "
        f"Each rule reads the formula's own audit from {status}, recorded after every full audit; a "
        "record past the validity it was written with (hana:storage:compliance:scap:max_age) or from "
        "another boot fails every rule.",
    )
    _text(benchmark, f"{x}version", str(version))
    profile = ET.SubElement(benchmark, f"{x}Profile", {"id": PROFILE})
    _text(profile, f"{x}title", "Encrypted SAP HANA storage: every rule of the formula")
    _text(profile, f"{x}description", "Every rule of hana-storage-formula's audit, at its severity.")
    for rule_id, _rule in rules:
        ET.SubElement(profile, f"{x}select", {"idref": _rule_id(rule_id), "selected": "true"})
    for rule_id, rule in rules:
        element = ET.SubElement(
            benchmark,
            f"{x}Rule",
            {"id": _rule_id(rule_id), "selected": "true", "severity": XCCDF_SEVERITY[rule.severity]},
        )
        _text(element, f"{x}title", f"{rule_id}: {rule.title}")
        _text(
            element,
            f"{x}description",
            f"{rule_id} ({rule.severity}, {rule.remediation} remediation) fails when {rule.title}. The formula's "
            "audit evaluates it on every HANA volume; the results name each volume and device that fails it.",
        )
        for ref in control_table.references(rule.controls):
            if ref.catalogue == control_table.CCE:
                continue  # an ident, below
            label = f"{ref.catalogue} {ref.ident}: {ref.title}" + (f" ({ref.note})" if ref.note else "")
            _text(element, f"{x}reference", label, **({"href": ref.href} if ref.href else {}))
        _text(element, f"{x}rationale", rule.rationale)
        for ref in control_table.references(rule.controls):
            if ref.catalogue == control_table.CCE:
                _text(element, f"{x}ident", ref.ident, system=CCE_SYSTEM)
        fix = (
            "state.apply hana.storage, or the master's triage, repairs it" if rule.fix else "a person decides"
        )
        _text(
            element,
            f"{x}fixtext",
            f"{fix}; the audit finding's message names what to do (salt '<minion>' hana_storage.audit).",
        )
        check = ET.SubElement(element, f"{x}check", {"system": OVAL_CHECK})
        ET.SubElement(
            check, f"{x}check-content-ref", {"href": OVAL_FILE, "name": _definition(rule_number(rule_id))}
        )
    return benchmark


def _rule_id(rule_id):
    return f"xccdf_{NAMESPACE}_rule_{rule_id}"


# OVAL identifiers are numbers: each rule's number is fixed by its rule ID (never by its place
# in the table), so a result stays comparable with the scans before a rule was added.
FAMILIES = ("ENC", "LAYOUT", "KEY", "PERF", "PERSIST", "MOUNT")


def rule_number(rule_id):
    """The OVAL number of a rule: HANA-KEY-008 -> 308 (family 3, rule 8)."""
    _, family, serial = rule_id.split("-")
    return (FAMILIES.index(family) + 1) * 100 + int(serial)


def _definition(number):
    return f"oval:{NAMESPACE}:def:{number}"


def _oval(rules, when, status):
    o, i = f"{{{OVAL_NS}}}", f"{{{OVAL_IND}}}"
    root = ET.Element(f"{o}oval_definitions")
    generator = ET.SubElement(root, f"{o}generator")
    _text(generator, f"{{{OVAL_COMMON}}}product_name", "hana-storage-formula")
    _text(generator, f"{{{OVAL_COMMON}}}schema_version", "5.11.2")
    _text(generator, f"{{{OVAL_COMMON}}}timestamp", when)
    definitions, tests, objects = (
        ET.SubElement(root, f"{o}{t}") for t in ("definitions", "tests", "objects")
    )
    states, variables = ET.SubElement(root, f"{o}states"), ET.SubElement(root, f"{o}variables")
    ident = f"oval:{NAMESPACE}"

    def text_object(number, path, pattern, comment):
        obj = ET.SubElement(
            objects,
            f"{i}textfilecontent54_object",
            {"id": f"{ident}:obj:{number}", "version": "1", "comment": comment},
        )
        _text(obj, f"{i}filepath", path)
        _text(obj, f"{i}pattern", pattern, operation="pattern match")
        _text(obj, f"{i}instance", "1", datatype="int", operation="greater than or equal")
        return obj

    def test(number, object_number, existence, comment, state=None):
        element = ET.SubElement(
            tests,
            f"{i}textfilecontent54_test",
            {
                "id": f"{ident}:tst:{number}",
                "version": "1",
                "check": "all",
                "check_existence": existence,
                "comment": comment,
            },
        )
        ET.SubElement(element, f"{i}object", {"object_ref": f"{ident}:obj:{object_number}"})
        if state:
            ET.SubElement(element, f"{i}state", {"state_ref": f"{ident}:ste:{state}"})

    # the status file: complete, of this boot, within its validity
    text_object(1, status, r"^complete$", "the formula's audit status, written whole")
    test(1, 1, "at_least_one_exists", "the audit status file is complete")
    text_object(2, "/proc/uptime", r"^(\d+)\.", "the host's uptime, in seconds")

    def compared_to(number, object_number, operation, datatype, comment):
        """State ``number``: a subexpression that stands in ``operation`` to what object
        ``object_number`` matches (through local variable ``number``)."""
        state = ET.SubElement(
            states, f"{i}textfilecontent54_state", {"id": f"{ident}:ste:{number}", "version": "1"}
        )
        compared = {"datatype": datatype} if datatype != "string" else {}  # string: OVAL's default
        ET.SubElement(
            state,
            f"{i}subexpression",
            {**compared, "operation": operation, "var_ref": f"{ident}:var:{number}"},
        )
        variable = ET.SubElement(
            variables,
            f"{o}local_variable",
            {"id": f"{ident}:var:{number}", "version": "1", "datatype": datatype, "comment": comment},
        )
        ET.SubElement(
            variable,
            f"{o}object_component",
            {"object_ref": f"{ident}:obj:{object_number}", "item_field": "subexpression"},
        )

    text_object(3, status, r"^valid_until_uptime (\d+)$", "the uptime until which the status holds")
    compared_to(1, 3, "less than or equal", "int", "valid until this uptime")
    test(2, 2, "only_one_exists", "the audit status is within its validity", state=1)
    text_object(4, status, r"^boot_id (\S+)$", "the boot the status was written in")
    text_object(5, "/proc/sys/kernel/random/boot_id", r"^(\S+)$", "this boot")
    compared_to(2, 5, "equals", "string", "this boot")
    test(3, 4, "only_one_exists", "the audit status was written in this boot", state=2)

    for rule_id, rule in rules:
        number = rule_number(rule_id)
        text_object(10000 + number, status, rf"^checked {rule_id}$", f"{rule_id} was audited")
        test(10000 + number, 10000 + number, "at_least_one_exists", f"{rule_id} was audited")
        text_object(
            20000 + number,
            status,
            rf"^finding {rule_id} (\S+) (\S+)$",
            f"the volumes and devices {rule_id} fails on",
        )
        test(20000 + number, 20000 + number, "none_exist", f"no finding of {rule_id}")
        definition = ET.SubElement(
            definitions, f"{o}definition", {"id": _definition(number), "version": "1", "class": "compliance"}
        )
        metadata = ET.SubElement(definition, f"{o}metadata")
        _text(metadata, f"{o}title", f"{rule_id}: {rule.title}")
        _text(metadata, f"{o}description", rule.rationale)
        criteria = ET.SubElement(definition, f"{o}criteria", {"operator": "AND"})
        for test_number, comment in (
            (1, "the audit status file is complete"),
            (2, "the audit status is within its validity"),
            (3, "the audit status was written in this boot"),
            (10000 + number, f"{rule_id} was audited"),
            (20000 + number, f"no finding of {rule_id}"),
        ):
            ET.SubElement(
                criteria, f"{o}criterion", {"test_ref": f"{ident}:tst:{test_number}", "comment": comment}
            )
    return root
