"""SCAP the way SUSE Manager runs it: the data stream put in place by the formula's state, the
audit recorded by the formula, and Salt's openscap module (``openscap.xccdf``, what SUSE Manager's
Audit > OpenSCAP calls; on Salt 3008 from saltext-openscap) evaluating it on a real minion with
the real ``oscap``. Its results reach the master (``cp.push_dir``) and are read there.

The pillar names volumes whose devices do not exist here, so the audit finds them unmounted
(HANA-MOUNT-001) and touches nothing; the scan must fail exactly the rules the audit failed.
"""

import base64
import contextlib
import os
import pathlib
import xml.etree.ElementTree as ET

import pytest

pytestmark = pytest.mark.integration

STATUS = pathlib.Path("/var/lib/hana-storage/audit.status")  # the path the data stream reads
PROFILE = "xccdf_org.hana-storage-formula_profile_hana_storage"
XCCDF = "{http://checklists.nist.gov/xccdf/1.2}"
STORAGE = {
    "packages": {"install": False},
    "key": {"source": "pillar", "material": base64.b64encode(b"\x03" * 64).decode()},
    "volumes": {"data": {"mountpoint": "/hana/scap-itest", "devices": ["/dev/hana-scap-itest-missing"]}},
}


@pytest.fixture
def kept_status():
    """The host's own audit status, if it has one, is put back afterwards."""
    before = STATUS.read_bytes() if STATUS.exists() else None
    yield
    if before is None:
        with contextlib.suppress(FileNotFoundError):
            STATUS.unlink()
    else:
        STATUS.write_bytes(before)


def test_openscap_xccdf_on_a_real_minion_fails_exactly_the_audits_rules(
    minion, master, set_pillar, tmp_path, kept_status
):
    set_pillar(STORAGE)
    call = minion.salt_call_cli(timeout=300)
    stream = tmp_path / "hana-storage-ds.xml"
    ret = call.run("state.single", "hana_storage.scap_datastream", name=str(stream))
    (state,) = ret.data.values()
    assert state["result"] is True and state["changes"]["datastream"]["installed"] == str(stream), state
    (state,) = call.run("state.single", "hana_storage.scap_datastream", name=str(stream)).data.values()
    assert state["result"] is True and state["changes"] == {}, state  # in place: left alone

    audit = call.run("hana_storage.audit").data
    failing = {f["rule"] for f in audit["findings"]}
    assert "HANA-MOUNT-001" in failing
    # The status file is the host's: `make test` runs the integration tier of each Salt line side
    # by side, and their minions' beacons record their own audits there, as often as every few
    # seconds under load. So the scan reads a private copy of what this minion recorded, through
    # the installed data stream with its status path (and nothing else) changed.
    # (The minions of every line are "hana-minion": a record read right after this one's is taken
    # as this one's when it names the same findings.)
    for _attempt in range(20):
        recorded = call.run("hana_storage.scap_record").data
        assert recorded["written"] == str(STATUS) and recorded["error"] is None, recorded
        ours = STATUS.read_bytes()
        assert b"material" not in ours and STORAGE["key"]["material"].encode() not in ours
        lines = ours.decode().splitlines()
        if {line.split()[1] for line in lines if line.startswith("finding ")} == failing:
            break
    else:
        pytest.fail("another minion on this host recorded its audit each time this one had")
    private = tmp_path / "audit.status"
    private.write_bytes(ours)
    installed = stream.read_text()
    assert installed.count(f">{STATUS}<") >= 1
    scanned = tmp_path / "scanned-ds.xml"
    scanned.write_text(installed.replace(f">{STATUS}<", f">{private}<"))
    ret = call.run("openscap.xccdf", f"eval --profile {PROFILE} {scanned}")
    assert ret.returncode == 0, ret
    assert ret.data["success"] is True and ret.data["returncode"] == 2, ret.data  # 2: a rule failed
    # cp.push_dir keeps the minion's path under the master's cachedir
    pushed = pathlib.Path(master.config["cachedir"], "minions", minion.id, "files")
    results = pushed / ret.data["upload_dir"].lstrip("/") / "results.xml"
    outcome = {
        r.get("idref").rsplit("_rule_", 1)[1]: r.find(f"{XCCDF}result").text
        for r in ET.parse(results).getroot().iter(f"{XCCDF}rule-result")
    }
    assert {rule for rule, result in outcome.items() if result == "fail"} == failing
    assert {result for rule, result in outcome.items() if rule not in failing} == {"pass"}
    assert not os.path.exists("/hana/scap-itest")
