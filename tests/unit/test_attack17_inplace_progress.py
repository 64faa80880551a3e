# ruff: noqa: F811 - pytest fixtures imported from tests/unit/test_inplace.py are parameters here
"""Attack 17: progress lines, the audit's in-place facts and the exporter on odd input."""

import pytest
from hana_storage_core import events, inplace
from prometheus_client import CollectorRegistry, generate_latest

from tests.unit.test_events import load
from tests.unit.test_inplace import (  # noqa: F401 - fixtures
    ENCRYPT,
    HOST_FACTS,
    apply,
    audit_of,
    configure_loader_modules,
    host,
    opts,
)
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

HUGE = "9" * 5000  # a decimal string beyond Python's int() digit limit (4300)
LINE = f'{{"device_bytes":"1","device_size":"{HUGE}","speed":"0","eta_ms":"0"}}'


def test_a_progress_count_of_many_digits_is_a_progress_error_not_a_traceback():
    """HOLE (traceback). parse_progress turns a digit string into an int outside its try; one of
    more than 4300 digits raises a plain ValueError (Python 3.11's int limit), not InPlaceError, so
    last_progress does not skip the line and the error escapes into in_place_facts (the state:
    traceback instead of a result) and the audit's facts (_in_place_progress: the whole audit
    fails). Fix: catch ValueError around int(), or bound the digits (len(value) <= 20)."""
    with pytest.raises(inplace.InPlaceError):
        inplace.parse_progress(LINE)
    assert inplace.last_progress(f"{LINE}\n") is None


def test_the_audits_in_place_facts_survive_a_unit_output_they_cannot_read(module, monkeypatch, tmp_path):  # noqa: F811
    """HOLE (the audit fails). The same line in the unit's journal makes _in_place_progress, and
    with it hana_storage_host's facts for every volume, raise. Fix: as above."""
    lv = tmp_path / "lv"
    lv.write_bytes(b"")
    monkeypatch.setattr(module, "luks_header", lambda device: {"reencryption": ENCRYPT})
    monkeypatch.setattr(module, "_unit_active", lambda unit: True)
    monkeypatch.setattr(module, "_unit_output", lambda unit: f"{LINE}\n")
    plan = {"volumes": {"data": {"encrypt_in_place": True, "lv_path": str(lv), "crypt_name": "hana_data"}}}
    found = module._in_place_progress(plan)
    assert found["data"]["running"] is True and found["data"]["progress"] is None


@pytest.mark.parametrize(
    "line",
    [
        '{"device_bytes": 1.5, "device_size": "8", "speed": "0", "eta_ms": "0"}',
        '{"device_bytes": {"a": 1}, "device_size": "8", "speed": "0", "eta_ms": "0"}',
        '{"device_bytes": "1", "device_size": "8", "speed": "0", "eta_ms": "0", "x": "' + "a" * 100000 + '"}',
        '{"device_bytes": "١", "device_size": "8", "speed": "0", "eta_ms": "0"}',
        "{" * 100000,
        '{"device_bytes": ' + "9" * 5000 + ', "device_size": "8", "speed": "0", "eta_ms": "0"}',
    ],
)
def test_closed_floats_nesting_long_lines_and_huge_json_numbers(line):
    """CLOSED. A float, an object, a 100 kB line, a non-ASCII digit, a deep nesting and a JSON
    number of 5000 digits are each a progress error (or a well-formed line), never a traceback."""
    try:
        got = inplace.parse_progress(line)
    except inplace.InPlaceError:
        return
    assert 0 <= got["percent"] <= 100


def test_closed_a_huge_eta_is_said_in_hours_and_a_count_beyond_64_bits_is_an_error():
    got = inplace.parse_progress(
        '{"device_bytes": "1", "device_size": "8", "speed": "0", "eta_ms": "' + "9" * 18 + '"}'
    )
    assert inplace.describe("hana_data", got).startswith("encrypting hana_data: 12 %, about ")
    with pytest.raises(inplace.InPlaceError, match="not a count"):
        inplace.parse_progress(
            '{"device_bytes": "1", "device_size": "8", "speed": "0", "eta_ms": "' + "9" * 30 + '"}'
        )


def test_closed_the_exporter_takes_no_forged_in_place_shape():
    """CLOSED. Forged audit events (signed by a minion, still untrusted): in_place of every odd
    shape, volumes as a list, serve no gauge and raise nothing."""
    exporter = load("_engines/hana_storage_exporter.py", "exporter_attack17")
    registry = CollectorRegistry()
    metrics = exporter.Metrics(registry)
    for forged in ("50", [50], {"percent": float("nan")}, {"percent": 10**30}, {"percent": -0}, None, 3):
        event = audit_of(
            inplace.parse_progress('{"device_bytes":"1","device_size":"8","speed":"0","eta_ms":"0"}')
        )
        event["volumes"]["data"]["in_place"] = forged
        exporter.handle(metrics, "salt/beacon/db1/hana_storage/audit", event)
        text = generate_latest(registry).decode()
        if forged == {"percent": -0}:
            assert 'hana_storage_in_place_progress_ratio{minion="db1",volume="data"} 0.0' in text
        else:
            assert "hana_storage_in_place_progress_ratio{" not in text, forged
    assert events.in_place_percent({"percent": True}) is None


@pytest.mark.parametrize(
    "maps,dev,found",
    [
        ("7f0-7f1 r--p 00000000 fd:100 12 /hana/data/x.so\n", (253, 256), True),  # minor > 255
        ("7f0-7f1 r--p 00000000 103:1a2 12 /x\n", (259, 418), True),  # nvme major 259
        ("7f0-7f1 r--p 00000000 fd:03 0 [heap]\n", (253, 3), False),  # anonymous
        ("garbage\n7f0-7f1 r--p 0 zz:yy 1 /x\n\n7f0 r\n", (253, 3), False),
    ],
)
def test_closed_maps_lines_are_read_by_hex_major_minor(module, maps, dev, found):  # noqa: F811
    """CLOSED. /proc/<pid>/maps prints the device as hex major:minor of any width; malformed
    lines are skipped, not fatal."""
    assert module._maps_device(maps, *dev) is found


def test_closed_a_running_encryption_says_its_progress_and_touches_nothing(host):
    """CLOSED. While the unit runs, the state only reports."""
    host["hana_storage_host.in_place_facts"].return_value = dict(
        HOST_FACTS, signature="crypto_LUKS", reencryption=ENCRYPT, mapped=True, running=True, progress=None,
        leftovers=["hana_data-overlay", "hana_data-hotzone-backward"], suspended=["hana_data-overlay"],
    )  # fmt: skip
    ret = apply()
    assert ret["result"] is True and "started, no progress" in ret["comment"]
    host["cmd.run_all"].assert_not_called()


def test_the_facts_of_a_mounted_volume_say_what_it_is_mounted_from(module, monkeypatch, tmp_path):  # noqa: F811
    """in_place_facts compares the mount's device number with the LV's and the crypt mapping's:
    a helper it used was lost in a refactor and every in-place apply raised (the VM tier), which
    no unit test reached. The LV is a block node here; the mount table says it is mounted."""
    import os
    import stat

    lv = tmp_path / "lv"
    try:
        os.mknod(lv, stat.S_IFBLK | 0o600, os.makedev(7, 203))
    except PermissionError:
        pytest.skip("no CAP_MKNOD here")
    monkeypatch.setattr(module, "_blkid", lambda device: ([{"type": "ext4"}], None))
    monkeypatch.setattr(module, "_reencryption_run", lambda device, name, unit: {
        "mapped": False, "leftovers": [], "suspended": [], "unit": unit, "running": False})  # fmt: skip
    monkeypatch.setattr(module, "block_bytes", lambda device: 1 << 30)
    monkeypatch.setattr(module, "mounted_at", lambda mountpoint: "7:203")
    monkeypatch.setattr(module, "_processes_using", lambda dev: [{"pid": 1, "comm": "hdbindexserver"}])
    monkeypatch.setattr(module, "_run", lambda argv: ("  \n", None))  # lvs: no tags
    facts = module.in_place_facts(str(lv), "hana_data", "/hana/data")
    assert facts["mounted_from"] == "device" and facts["users"] == [{"pid": 1, "comm": "hdbindexserver"}]
