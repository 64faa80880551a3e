"""TPM2 beside Tang (issue 33 §1): the pillar's TPM2 policy, alone or with Tang in one sss; the
bindings the real clevis makes against a real TPM (swtpm on loopback) and a real Tang server,
read back and compared with the pillar; the PCR record that names a changed PCR; the state that
binds again after a planned PCR change. The boot path itself is proven in the VM tier
(tests/vm/test_lab_tpm.py)."""

# ruff: noqa: F811 - the fixtures imported from test_states are parameters of the tests

import copy
import json
import subprocess

import pytest
from hana_storage_core import commands as commands
from hana_storage_core import luks as luks
from hana_storage_core import readiness as readiness
from hana_storage_core import rules as rules
from hana_storage_core import tpm as tpm

from tests.unit.test_audit import DEFAULTS, KEY_FILE, PILLAR, SCHEMA, compliant, found, plan_of
from tests.unit.test_audit import hp as hp
from tests.unit.test_states import (  # noqa: F401 - fixtures
    LV,
    configure_loader_modules,
    dry_run,
    marks,
    opts,
    pillar_data,
    salt_functions,
    scratch,
    states,
)

RECOVERY = {"source": "keyfile", "path": KEY_FILE}
TPM2 = {"pcr_bank": "sha256", "pcr_ids": [7]}
SERVER = {"url": "http://tang.example:7500", "thumbprint": "T" * 43}


def with_key(key, volume="data"):
    pillar = copy.deepcopy(PILLAR)
    pillar["volumes"][volume]["key"] = key
    return pillar


def errors(pillar):
    return hp.validate(hp.merge(DEFAULTS, pillar), SCHEMA)


# ---- the pillar ---------------------------------------------------------------------------------


def test_a_tpm2_key_plans_its_policy_and_opens_at_boot_without_waiting_for_the_network():
    plan = plan_of(with_key({"source": "tpm2", "tpm2": {"pcr_ids": [7, 0]}, "recovery": RECOVERY}))
    data = plan["volumes"]["data"]
    assert data["key"]["clevis"] == {"tang": None, "tpm2": {"pcr_bank": "sha256", "pcr_ids": [0, 7]}}
    assert data["key"]["crypttab"] == "none" and data["key"]["file"] == KEY_FILE
    assert "_netdev" not in data["crypttab_options"] and "noauto" not in data["crypttab_options"]


def test_tang_with_a_tpm2_policy_plans_both_and_waits_for_the_network():
    key = {"source": "tang", "servers": [SERVER], "tpm2": TPM2, "recovery": RECOVERY}
    data = plan_of(with_key(key))["volumes"]["data"]
    assert data["key"]["clevis"] == {"tang": {"servers": [SERVER], "threshold": 1}, "tpm2": TPM2}
    assert "_netdev" in data["crypttab_options"]


@pytest.mark.parametrize(
    "key,expected",
    [
        ({"source": "tpm2", "tpm2": TPM2}, "hana:storage:volumes:data:key:recovery: required key is missing"),
        ({"source": "tpm2", "recovery": RECOVERY}, "hana:storage:volumes:data:key:tpm2: required key is missing"),
        ({"source": "tpm2", "tpm2": TPM2, "servers": [SERVER], "recovery": RECOVERY},
         "hana:storage:volumes:data:key:servers: only used with source tang"),
        ({"source": "keyfile", "path": "/etc/k", "tpm2": TPM2},
         "hana:storage:volumes:data:key:tpm2: only used with source tang or tpm2"),
        ({"source": "tpm2", "tpm2": {"pcr_ids": [24]}, "recovery": RECOVERY}, "must be at most 23; got 24"),
        ({"source": "tpm2", "tpm2": {"pcr_bank": "md5"}, "recovery": RECOVERY}, "got 'md5'"),
        ({"source": "tpm2", "tpm2": {"pcr_ids": [7, 7]}, "recovery": RECOVERY}, "items must be unique"),
    ],
)  # fmt: skip
def test_a_tpm2_key_without_a_recovery_key_or_with_a_wrong_policy_is_refused(key, expected):
    """A vTPM can be lost (PowerVM removes it to change its encryption level): TPM2 alone
    without a recovery keyslot is refused, as is a policy no TPM has."""
    found_errors = errors(with_key(key))
    assert any(expected in e for e in found_errors), found_errors


def test_clevis_configs_for_tpm2_alone_tang_and_tpm2_and_several_tang_servers_with_tpm2():
    assert commands.clevis_config({"tang": None, "tpm2": TPM2}) == (
        "tpm2",
        json.dumps({"pcr_bank": "sha256", "pcr_ids": "7"}),
    )
    assert commands.clevis_config({"tang": None, "tpm2": {"pcr_bank": None, "pcr_ids": []}}) == ("tpm2", "{}")
    one = {"servers": [SERVER], "threshold": 1}
    pin, config = commands.clevis_config({"tang": one, "tpm2": TPM2})
    assert pin == "sss" and json.loads(config) == {
        "t": 2,
        "pins": {
            "tang": {"url": SERVER["url"], "thp": "T" * 43},
            "tpm2": {"pcr_bank": "sha256", "pcr_ids": "7"},
        },
    }
    two = {"servers": [SERVER, {"url": "http://b:7500", "thumbprint": "B" * 43}], "threshold": 1}
    pin, config = commands.clevis_config({"tang": two, "tpm2": TPM2})
    assert json.loads(config)["pins"]["sss"] == {
        "t": 1,
        "pins": {
            "tang": [{"url": SERVER["url"], "thp": "T" * 43}, {"url": "http://b:7500", "thp": "B" * 43}]
        },
    }


# ---- PCR records and tpm2_pcrread ----------------------------------------------------------------

PCRREAD = """  sha256:
    0 : 0x0000000000000000000000000000000000000000000000000000000000000001
    7 : 0xABCDEF0000000000000000000000000000000000000000000000000000000000
"""


def test_tpm2_pcrread_is_parsed_and_anything_else_refused_with_its_own_error():
    assert tpm.parse_pcrread(PCRREAD) == {"sha256": {0: "0" * 63 + "1", 7: "abcdef" + "0" * 58}}
    for bad in ("sha256:\n  7 : zz\n", "  7 : 0x00\n", "ERROR: Esys_PCR_Read(0x98E) - tpm:error(2.0)\n"):
        with pytest.raises(tpm.PcrReadError):
            tpm.parse_pcrread(bad)


@pytest.mark.parametrize(
    "token",
    [
        {"pcr_bank": "sha256"},
        {"pcr_bank": "sha256", "values": {"x": "00" * 32}},
        {"pcr_bank": "sha256", "values": {"7": "not hex"}},
        {"pcr_bank": "sha256", "values": {"99": "00" * 32}},
        {"pcr_bank": 5, "values": {}},
        {"pcr_bank": "sha256", "values": ["00" * 32]},
    ],
)
def test_a_pcr_record_that_is_not_one_is_an_error_not_a_traceback(token):
    assert "error" in tpm.pcr_record(token)


def header_with(bindings, records):
    tokens = [
        {"id": i, "type": "clevis", "keyslots": [slot], "clevis": b} for i, (slot, b) in enumerate(bindings)
    ]
    for slot, values in records:
        raw = json.loads(tpm.pcr_token(slot, "sha256", values))
        tokens.append(
            {
                "id": len(tokens),
                "type": tpm.PCR_TOKEN,
                "keyslots": raw["keyslots"],
                "pcrs": tpm.pcr_record(raw),
            }
        )
    return {"tokens": tokens}


TPM2_BINDING = {"pin": "tpm2", "threshold": 0, "servers": [], "tpm2": TPM2}


def test_pcr_drift_names_the_pcrs_that_changed_since_binding_and_skips_bindings_without_a_record():
    then = {7: "11" * 32}
    header = header_with([("1", TPM2_BINDING), ("2", TPM2_BINDING)], [("1", then)])
    assert tpm.pcr_drift(header, {"sha256": then}) == {"1": []}
    assert tpm.pcr_drift(header, {"sha256": {0: "00" * 32, 7: "22" * 32}}) == {"1": [7]}
    # a record of other PCRs than its binding's, or two records for one keyslot: no record
    other = header_with([("1", TPM2_BINDING)], [("1", {0: "00" * 32, 7: "11" * 32})])
    twice = header_with([("1", TPM2_BINDING)], [("1", then), ("1", then)])
    assert tpm.pcr_drift(other, {"sha256": then}) == {} and tpm.pcr_drift(twice, {"sha256": then}) == {}
    assert tpm.pcr_drift(header, {}) == {}  # the bank was not read: nothing compared


# ---- readiness ---------------------------------------------------------------------------------


def tpm2_line(options=("luks",)):
    return {"name": "hana_data", "device": "UUID=u", "keyfile": "none", "options": list(options)}


def clevis_facts(unlocks, drift, network=False, units=("enabled", "disabled")):
    return {
        "source": "/dev/vdb",
        "units": dict(zip(readiness.ASKPASS_UNITS, units, strict=True)),
        "clevis": {"tokens": 1, "network": network, "unlocks": unlocks, "error": None if unlocks else "keyslot 1: failed", "pcr_drift": drift},
    }  # fmt: skip


def test_a_tpm2_line_needs_the_askpass_agent_but_not_the_network():
    assert readiness.line_verdict(tpm2_line(), clevis_facts(True, {"1": []}))["ready"] is True
    tang = readiness.line_verdict(tpm2_line(["luks", "_netdev"]), clevis_facts(True, {}, network=True))
    assert [p["code"] for p in tang["problems"]] == ["askpass_disabled"]  # remote-cryptsetup.target


def test_readiness_names_the_pcr_that_changed_since_the_binding():
    verdict = readiness.line_verdict(tpm2_line(), clevis_facts(False, {"1": [7]}))
    assert verdict["ready"] is False
    assert [p["code"] for p in verdict["problems"]] == ["pcr_changed", "clevis_fails"]
    assert "keyslot 1" in verdict["problems"][0]["cause"] and "PCR 7" in verdict["problems"][0]["cause"]
    unreadable = readiness.line_verdict(tpm2_line(), clevis_facts(False, {"error": "this host has no TPM"}))
    assert [p["code"] for p in unreadable["problems"]] == ["tpm_unreadable", "clevis_fails"]


# ---- real bindings: clevis, a software TPM, a Tang server ------------------------------------------


@pytest.fixture(scope="module")
def tpm_and_tang(tmp_path_factory):
    from swtpm_server import SwtpmMissing, SwtpmServer
    from tang_server import TangServer

    root = tmp_path_factory.mktemp("tpm2")
    try:
        software_tpm = SwtpmServer(root)
    except SwtpmMissing as missing:
        pytest.fail(str(missing))
    with software_tpm as tpm_server, TangServer(root / "a") as first, TangServer(root / "b") as second:
        yield tpm_server, first, second


def bound(tmp_path, tpm_server, policy, name="hdr.img"):
    """A LUKS2 header file bound by the real `clevis luks bind` to ``policy``, the recovery key in
    keyslot 0. Returns (path, key path)."""
    image, key = tmp_path / name, tmp_path / f"{name}.key"
    key.write_bytes(b"r" * 64)
    subprocess.run(["truncate", "-s", "20M", str(image)], check=True)
    cheap = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    subprocess.run(
        ["cryptsetup", "luksFormat", "-q", "--type", "luks2", *cheap, "--key-file", str(key), str(image)],
        check=True,
    )
    done = tpm_server.run(*commands.clevis_bind(str(image), str(key), policy))
    assert done.returncode == 0, done.stderr
    return image, key


def parsed(image):
    return luks.parse_header(luks.reader_for(image.read_bytes()))


def tpm2_facts(header, network=False):
    facts = compliant()
    facts["headers"]["dm-0"] = dict(facts["headers"]["dm-0"], tokens=header["tokens"])
    entry = next(e for e in facts["crypttab"] if e["name"] == "hana_data")
    entry.update(keyfile="none", options=[*entry["options"], *(["_netdev"] if network else [])])
    if network:
        facts["fstab"][0]["options"] = [*facts["fstab"][0]["options"], "_netdev"]
    return facts


def test_a_real_tpm2_binding_is_read_back_as_the_pillar_made_it_and_is_compliant(tpm_and_tang, tmp_path):
    tpm_server, _first, _second = tpm_and_tang
    pillar = with_key({"source": "tpm2", "tpm2": TPM2, "recovery": RECOVERY})
    policy = plan_of(pillar)["volumes"]["data"]["key"]["clevis"]
    image, _key = bound(tmp_path, tpm_server, policy)
    header = parsed(image)
    (token,) = [t for t in header["tokens"] if t["type"] == "clevis"]
    assert token["clevis"] == {"pin": "tpm2", "threshold": 0, "servers": [], "tpm2": TPM2}
    assert rules.binding_verdict(token["clevis"], policy) == "matches"
    assert found(tpm2_facts(header), pillar) == []
    assert "jwk_priv" not in json.dumps(header) and "jwe" not in json.dumps(header)
    # the pillar asks other PCRs: a binding it does not name (HANA-KEY-003), never "stale"
    other = with_key({"source": "tpm2", "tpm2": {"pcr_ids": [7, 8]}, "recovery": RECOVERY})
    assert found(tpm2_facts(header), other) == [("HANA-KEY-003", "data", "/dev/mapper/hana_data")]
    # tpm2_reseal kept in the pillar: every apply would seal to whatever booted (HANA-KEY-009)
    kept = with_key({"source": "tpm2", "tpm2": TPM2, "recovery": RECOVERY})
    kept["tpm2_reseal"] = True
    assert found(tpm2_facts(header), kept) == [("HANA-KEY-009", "data", "/dev/mapper/hana_data")]
    # a TPM2 binding where the pillar names Tang alone is not the pillar's either
    tang_only = with_key({"source": "tang", "servers": [SERVER], "recovery": RECOVERY})
    assert ("HANA-KEY-003", "data", "/dev/mapper/hana_data") in found(tpm2_facts(header, True), tang_only)


@pytest.mark.parametrize("servers", [1, 2])
def test_a_real_tpm2_and_tang_binding_needs_both_and_matches_the_pillar(tpm_and_tang, tmp_path, servers):
    tpm_server, tang_server, second = tpm_and_tang
    listed = [{"url": s.url, "thumbprint": s.thumbprint} for s in (tang_server, second)[:servers]]
    key = {"source": "tang", "servers": listed, "threshold": 1, "tpm2": TPM2, "recovery": RECOVERY}
    pillar = with_key(key)
    policy = plan_of(pillar)["volumes"]["data"]["key"]["clevis"]
    image, _key = bound(tmp_path, tpm_server, policy)
    (token,) = [t for t in parsed(image)["tokens"] if t["type"] == "clevis"]
    assert token["clevis"]["pin"] == "sss" and token["clevis"]["tpm2"] == TPM2
    assert [s["url"] for s in token["clevis"]["servers"]] == [s["url"] for s in listed]
    assert rules.binding_verdict(token["clevis"], policy) == "matches"
    assert found(tpm2_facts(parsed(image), network=True), pillar) == []
    # unlocks while the TPM and Tang both answer; not once Tang is gone
    assert tpm_server.run("clevis", "luks", "pass", "-d", str(image), "-s", "1").returncode == 0
    for server in (tang_server, second)[:servers]:  # threshold 1: all of them gone
        server.stop()
    try:
        assert tpm_server.run("clevis", "luks", "pass", "-d", str(image), "-s", "1").returncode != 0
    finally:
        for server in (tang_server, second)[:servers]:
            server.start()


def test_a_changed_pcr_stops_the_real_unlock_and_the_record_names_it(tpm_and_tang, tmp_path):
    tpm_server, _first, _second = tpm_and_tang
    policy = {"tang": None, "tpm2": {"pcr_bank": "sha256", "pcr_ids": [7, 8]}}
    image, _key = bound(tmp_path, tpm_server, policy, "drift.img")
    then = tpm.parse_pcrread(tpm_server.pcrs("sha256", [7, 8]))["sha256"]
    record = tpm_server.run(
        *commands.luks_token_import(str(image)), stdin=tpm.pcr_token(1, "sha256", then).encode()
    )
    assert record.returncode == 0, record.stderr
    header = parsed(image)
    assert tpm.pcr_drift(header, {"sha256": then}) == {"1": []}
    assert tpm_server.run("clevis", "luks", "pass", "-d", str(image), "-s", "1").returncode == 0
    tpm_server.extend(8)
    now = tpm.parse_pcrread(tpm_server.pcrs("sha256", [7, 8]))
    assert tpm.pcr_drift(header, now) == {"1": [8]}
    failed = tpm_server.run("clevis", "luks", "pass", "-d", str(image), "-s", "1")
    assert failed.returncode != 0
    # the audit reads the record beside the binding; the keyslot stays accounted for
    pillar = with_key({"source": "tpm2", "tpm2": policy["tpm2"], "recovery": RECOVERY})
    assert found(tpm2_facts(header), pillar) == []


# ---- the state: bind, record, and bind again after a planned PCR change --------------------------

POLICY = {"tang": None, "tpm2": TPM2}
NOW = {7: "22" * 32}


def tpm2_token(slot, token_id=0):
    return {"id": token_id, "type": "clevis", "keyslots": [str(slot)], "clevis": dict(TPM2_BINDING)}


def record_token(slot, token_id, values):
    raw = json.loads(tpm.pcr_token(slot, "sha256", values))
    return {"id": token_id, "type": tpm.PCR_TOKEN, "keyslots": raw["keyslots"], "pcrs": tpm.pcr_record(raw)}


@pytest.fixture
def recovery(tmp_path):
    """The recovery key's file, in place (what key_present makes sure of before)."""
    path = tmp_path / "recovery.key"
    path.write_bytes(b"r" * 64)
    return path


def argvs_run(salt_functions):
    return [call.args[0] for call in salt_functions["cmd.run_all"].call_args_list]


def headers(salt_functions, *sequence):
    """The device's header reads as each of ``sequence`` in turn, then as the last one."""
    reads = iter(sequence)
    last = {}

    def read(*_args):
        last["tokens"] = next(reads, last.get("tokens"))
        return {"uuid": "u-1", "flags": [], "tokens": list(last["tokens"])}

    salt_functions["hana_storage_host.luks_header"].side_effect = read


def test_clevis_bound_binds_to_the_tpm2_and_records_the_pcrs_it_sealed_to(salt_functions):
    headers(salt_functions, [], [tpm2_token(1)], [tpm2_token(1)], [tpm2_token(1), record_token(1, 1, NOW)])
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)
    ret = states.clevis_bound(LV, "/k", POLICY)
    assert ret["result"] is True, ret
    assert [argv[:3] for argv in argvs_run(salt_functions)] == [
        ["clevis", "luks", "bind"],
        ["cryptsetup", "token", "import"],
    ]
    imported = salt_functions["cmd.run_all"].call_args_list[1].kwargs["stdin"]
    assert json.loads(imported) == {
        "type": tpm.PCR_TOKEN,
        "keyslots": ["1"],
        "pcr_bank": "sha256",
        "values": {"7": "22" * 32},
    }
    assert ret["changes"] == {"bound": {"tpm2": TPM2}}


def test_clevis_bound_binds_again_after_a_pcr_changed_then_removes_the_old_binding_and_its_record(
    salt_functions, recovery
):
    then = {7: "11" * 32}
    before = [tpm2_token(1), record_token(1, 1, then)]
    headers(
        salt_functions,
        before,
        [*before, tpm2_token(2, 2)],
        [record_token(1, 1, then), tpm2_token(2, 2), record_token(2, 3, NOW)],
    )
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"1": [7]}
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)
    ret = states.clevis_bound(LV, str(recovery), POLICY, reseal=True)  # the change was planned: tpm2_reseal
    assert ret["result"] is True, ret
    assert [argv for argv in argvs_run(salt_functions) if argv[0] != "cryptsetup" or argv[1] != "token"][
        1:
    ] == [
        ["clevis", "luks", "unbind", "-d", LV, "-s", "1", "-f"],
    ]
    assert ["cryptsetup", "token", "remove", "--token-id", "1", LV] in argvs_run(salt_functions)
    assert "PCR 7" in ret["comment"]
    assert ret["changes"]["unbound"] == {"keyslots": [1]} and ret["changes"]["pcr_records_removed"] == [1]


def test_clevis_bound_keeps_a_tpm2_binding_whose_pcrs_are_as_bound(salt_functions):
    headers(salt_functions, [tpm2_token(1), record_token(1, 1, NOW)])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"1": []}
    ret = states.clevis_bound(LV, "/k", POLICY)
    assert ret["result"] is True and ret["changes"] == {} and argvs_run(salt_functions) == []


def test_clevis_bound_in_test_mode_says_it_would_bind_again_and_changes_nothing(
    salt_functions, dry_run, recovery
):
    headers(salt_functions, [tpm2_token(1), record_token(1, 1, {7: "11" * 32})])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"1": [7]}
    ret = states.clevis_bound(LV, str(recovery), POLICY, reseal=True)
    assert ret["result"] is None and argvs_run(salt_functions) == []
    assert "would bind" in ret["comment"] and "PCR 7" in ret["comment"]


@pytest.mark.parametrize("test", [False, True], ids=["apply", "test"])
def test_a_pcr_change_nobody_planned_fails_the_state_and_changes_nothing(salt_functions, opts, test):
    """Sealing to whatever booted would bless a boot chain someone changed: without the pillar's
    tpm2_reseal the state names the PCR, says how to proceed, and runs nothing."""
    opts["test"] = test
    headers(salt_functions, [tpm2_token(1), record_token(1, 1, {7: "11" * 32})])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"1": [7]}
    ret = states.clevis_bound(LV, "/k", POLICY)
    assert ret["result"] is False and ret["changes"] == {} and argvs_run(salt_functions) == []
    assert "PCR 7" in ret["comment"] and "tpm2_reseal" in ret["comment"]


def test_a_binding_without_a_record_that_opens_gets_one_and_one_that_does_not_needs_reseal(salt_functions):
    headers(salt_functions, [tpm2_token(1)], [tpm2_token(1)], [tpm2_token(1), record_token(1, 1, NOW)])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {}
    salt_functions["hana_storage_host.pcr_values"] = lambda bank, ids: dict(NOW)
    ret = states.clevis_bound(LV, "/k", POLICY)
    assert ret["result"] is True and ret["changes"] == {"pcrs_recorded": [1]}, ret
    assert [argv[:3] for argv in argvs_run(salt_functions)] == [["cryptsetup", "token", "import"]]
    salt_functions["cmd.run_all"].reset_mock()
    headers(salt_functions, [tpm2_token(1)])
    salt_functions["hana_storage_host.tpm2_unseals"].return_value = {
        "unseals": False,
        "error": "policy check failed",
    }
    ret = states.clevis_bound(LV, "/k", POLICY)
    assert (
        ret["result"] is False and "no longer unseals" in ret["comment"] and "tpm2_reseal" in ret["comment"]
    )
    assert argvs_run(salt_functions) == []


def test_clevis_bound_never_removes_a_keyslot_the_recovery_key_opens(salt_functions, tmp_path):
    """A token on the recovery key's keyslot (written with cryptsetup token import, no key
    needed) that reads as a drifted TPM2 binding: the state refuses instead of unbinding it."""
    recovery = tmp_path / "recovery.key"
    recovery.write_bytes(b"r" * 64)
    headers(salt_functions, [tpm2_token(0), record_token(0, 1, {7: "11" * 32})])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"0": [7]}
    salt_functions["hana_storage_host.key_slots"] = lambda device, key, keyslots=None: {
        "keyslots": [0],
        "error": None,
    }
    ret = states.clevis_bound(LV, str(recovery), POLICY, reseal=True)
    assert ret["result"] is False and "opened by the recovery" in ret["comment"], ret
    assert argvs_run(salt_functions) == []


def test_clevis_bound_refuses_when_the_tpm_cannot_be_read(salt_functions):
    headers(salt_functions, [tpm2_token(1), record_token(1, 1, NOW)])
    salt_functions["hana_storage_host.pcr_drift"] = lambda device: {"error": "this host has no TPM"}
    ret = states.clevis_bound(LV, "/k", POLICY)
    assert ret["result"] is False and "no TPM" in ret["comment"] and argvs_run(salt_functions) == []
