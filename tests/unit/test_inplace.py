"""Encryption in place: the pure plan (hana_storage_core.inplace), the pillar's gate, and the
state's steps through Salt's loader dunders with the host's facts given. The real thing (a
kernel, cryptsetup, systemd, kills and a power cut) is tests/vm/test_in_place.py."""

import datetime
import importlib.util
import json
import os
import subprocess
from unittest.mock import MagicMock

import pytest
from hana_storage_core import events, inplace, luks, reencrypt
from prometheus_client import CollectorRegistry, generate_latest

from tests.conftest import REPO
from tests.support.real_commands import real_run_all as _real_run_all
from tests.unit.test_events import load
from tests.unit.test_pillar import errors_of, mutate

spec = importlib.util.spec_from_file_location(
    "hana_storage_state_inplace", REPO / "_states" / "hana_storage.py"
)
states = importlib.util.module_from_spec(spec)
spec.loader.exec_module(states)

MIB = 1 << 20
LV = "/dev/vg_hana_data/lv_hana_data"
LUKS = {"cipher": "aes-xts-plain64", "key_size": 512, "sector_size": 4096, "pbkdf": {"type": "argon2id"}}
KEY = "/etc/hana-storage/keys/hana.key"


# ---- the pure plan ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stripes,stripe_kib,extent,room",
    [
        (2, 64, 4 * MIB, 32 * MIB),  # two stripes of 4 MiB extents: 8 MiB steps
        (3, 64, 4 * MIB, 36 * MIB),  # three: 12 MiB steps, the data offset 18 MiB (96 stripe widths)
        (1, 0, 4 * MIB, 32 * MIB),
        (4, 256, 4 * MIB, 32 * MIB),
        (8, 1024, 4 * MIB, 32 * MIB),
        (5, 256, 32 * MIB, 160 * MIB),
    ],
)
def test_the_header_room_is_whole_stripes_and_starts_the_payload_on_a_full_stripe(
    stripes, stripe_kib, extent, room
):
    got = inplace.header_room(stripes, stripe_kib * 1024, extent)
    assert got == room
    assert got % (stripes * extent) == 0  # the LV grows in its own geometry
    assert (got // 2) % max(stripes * stripe_kib * 1024, 1) == 0  # data offset on a full stripe


def test_a_room_beyond_what_cryptsetup_takes_is_refused():
    with pytest.raises(inplace.InPlaceError, match="more than cryptsetup takes"):
        inplace.header_room(64, 64 * 1024, 1 << 30)


@pytest.mark.parametrize(
    "device,fs,tags,expect",
    [
        (512 * MIB, 480 * MIB, [], (512 * MIB, 32 * MIB)),  # every byte of the LV is kept, not only the XFS's
        (
            544 * MIB,
            480 * MIB,
            ["hana_storage_plain_bytes_536870912"],
            (512 * MIB, 0),
        ),  # killed after lvextend
        (536 * MIB, 480 * MIB, ["x", "hana_storage_plain_bytes_536870912"], (512 * MIB, 8 * MIB)),
    ],
)
def test_the_room_plan_grows_the_lv_once_beyond_its_size_before(device, fs, tags, expect):
    assert inplace.room_plan(device, fs, tags, 32 * MIB) == expect


@pytest.mark.parametrize(
    "device,fs,tags,words",
    [
        (512 * MIB, 600 * MIB, [], "larger than the volume"),
        (512 * MIB, 100, ["hana_storage_plain_bytes_1", "hana_storage_plain_bytes_2"], "do not say one size"),
        (512 * MIB, 100, ["hana_storage_plain_bytes_-1"], "do not say one size"),
        (512 * MIB, 100, ["hana_storage_plain_bytes_٣"], "do not say one size"),
        (512 * MIB, 100, [f"hana_storage_plain_bytes_{1 << 40}"], "less than"),
    ],
)
def test_a_room_plan_that_would_cut_data_is_refused(device, fs, tags, words):
    with pytest.raises(inplace.InPlaceError, match=words):
        inplace.room_plan(device, fs, tags, 32 * MIB)


def test_the_sector_size_is_never_larger_than_the_filesystems():
    assert inplace.sector_size(4096, 4096) == 4096
    assert inplace.sector_size(4096, 512) == 512
    assert inplace.sector_size(4096, None) == 4096


def facts(**overrides):
    base = {
        "signature": "xfs",
        "reencryption": None,
        "mapped": False,
        "running": False,
        "leftovers": [],
        "suspended": [],
    }
    return {**base, **overrides}


ENCRYPT = {"in_progress": True, "mode": "encrypt"}


@pytest.mark.parametrize(
    "given,stage",
    [
        (facts(), "plain"),
        (facts(signature="crypto_LUKS"), "done"),
        (facts(signature="ext4"), "foreign"),
        (facts(signature=""), "blank"),
        (facts(mapped=True), "foreign"),
        (facts(tail="other"), "unclear"),
        (facts(tail="copy"), "plain"),
        (facts(tail="zero"), "plain"),
        # the state's own copy of the head was cut off: cryptsetup never ran, the head is intact
        (facts(tail="other", head_copy="begun"), "plain"),
        (facts(tail="zero", head_copy="begun"), "plain"),
        # the copy was complete: a head that differs was changed by the header write
        (facts(tail="other", head_copy="copied"), "torn"),
        (facts(tail="zero", head_copy="copied"), "torn"),
        (facts(tail="other", head_copy="copied", signature=""), "torn"),
        (facts(tail="copy", head_copy="copied"), "plain"),
        # a boot that mounted the XFS from the LV since changes the head too: the admin tells
        (facts(tail="other", head_copy="copied", mounted_from="device"), "torn"),
        (facts(tail="other", signature=""), "unclear"),
        (facts(tail="zero", signature=""), "foreign"),
        (facts(tail="copy", head_copy="begun", signature=""), "foreign"),
        (facts(signature="crypto_LUKS", reencryption={"in_progress": True, "mode": "reencrypt"}), "foreign"),
        (facts(signature="crypto_LUKS", reencryption=ENCRYPT, running=True, mapped=True), "running"),
        (facts(signature="crypto_LUKS", reencryption=ENCRYPT), "closed"),
        (facts(signature="crypto_LUKS", reencryption=ENCRYPT, mapped=True), "paused"),
        (
            facts(
                signature="crypto_LUKS", reencryption=ENCRYPT, mapped=True, leftovers=["hana_data-overlay"]
            ),
            "crashed",
        ),
        (
            facts(
                signature="crypto_LUKS",
                reencryption=ENCRYPT,
                mapped=True,
                leftovers=["hana_data-hotzone-backward"],
                suspended=["hana_data-hotzone-backward"],
            ),
            "frozen",
        ),
    ],
)
def test_the_stage_follows_from_the_facts(given, stage):
    assert inplace.stage(given)[0] == stage


def test_only_cryptsetups_own_devices_of_the_mapping_are_leftovers():
    names = [
        "hana_data",
        "hana_data-overlay",
        "hana_data-hotzone-backward",
        "hana_data-hotzone-x",
        "hana_log-overlay",
    ]
    assert inplace.leftovers("hana_data", names) == ["hana_data-hotzone-backward", "hana_data-overlay"]


LINE = '{"device":"/dev/dm-3","device_bytes":"16777216","device_size":"536870912","speed":"233398","eta_ms":"7860000","time_ms":"71882"}'


def test_a_progress_line_reads_as_percent_and_time_left():
    progress = inplace.parse_progress(LINE)
    assert progress == {
        "done": 16 * MIB,
        "size": 512 * MIB,
        "percent": 3,
        "eta_s": 7860,
        "bytes_per_s": 233398,
    }
    assert inplace.describe("hana_data", progress) == "encrypting hana_data: 3 %, about 2 h 11 min left"
    assert inplace.describe("hana_data", None) == "encrypting hana_data: started, no progress reported yet"


@pytest.mark.parametrize(
    "line",
    [
        "Reencryption interrupted.",
        "[1, 2]",
        '{"device_bytes": "1", "device_size": "0", "speed": "0", "eta_ms": "0"}',
        '{"device_bytes": "9", "device_size": "8", "speed": "0", "eta_ms": "0"}',
        '{"device_bytes": true, "device_size": "8", "speed": "0", "eta_ms": "0"}',
        '{"device_bytes": "-1", "device_size": "8", "speed": "0", "eta_ms": "0"}',
        '{"device_size": "8", "speed": "0", "eta_ms": "0"}',
        '{"device_bytes": "1e3", "device_size": "8", "speed": "0", "eta_ms": "0"}',
    ],
)
def test_a_malformed_progress_line_is_its_own_error(line):
    with pytest.raises(inplace.InPlaceError):
        inplace.parse_progress(line)


def test_the_last_well_formed_line_of_a_units_output_is_its_progress():
    text = f"Started unit.\n{LINE}\n{{broken\nReencryption interrupted.\n"
    assert inplace.last_progress(text)["percent"] == 3
    assert inplace.last_progress("") is None


def test_no_command_line_carries_key_material_and_the_unit_stops_on_sigint_only():
    init = inplace.reencrypt_init(LV, "hana_data", KEY, LUKS, 32 * MIB, 4096)
    assert init[:5] == ["cryptsetup", "reencrypt", "--batch-mode", "--encrypt", "--init-only"]
    assert init[init.index("--reduce-device-size") + 1] == "32M"
    assert init[init.index("--key-file") + 1] == KEY and init[-2:] == [LV, "hana_data"]
    unit = inplace.reencrypt_unit("hana_data", KEY, LV, max_mib_s=50)
    assert "--property=KillSignal=SIGINT" in unit and "--property=SendSIGKILL=no" in unit
    assert f"--property=IOWriteBandwidthMax={LV} 50M" in unit
    assert unit[unit.index("--active-name") + 1] == "hana_data" and "--resume-only" in unit
    assert not [a for a in inplace.reencrypt_unit("hana_data", KEY, LV) if "Bandwidth" in a]


# ---- the pillar's gate -----------------------------------------------------------------------


def test_encrypt_in_place_below_lvm_without_a_spare_names_the_route_and_what_it_needs():
    errors = errors_of(mutate("volumes:log:encrypt_in_place", True))
    assert any(
        "through a spare LUN" in e
        and "volumes:log:in_place_spare" in e
        and "volumes:log:encrypt_in_place" in e
        for e in errors
    ), errors


def test_encrypt_in_place_with_a_clevis_key_source_is_refused():
    pillar = mutate("volumes:data:encrypt_in_place", True)
    pillar["volumes"]["data"]["key"] = {
        "source": "tang",
        "servers": [{"url": "http://tang.example:7500", "thumbprint": "x" * 43}],
        "recovery": {"source": "pillar", "material": pillar["key"]["material"]},
    }
    errors = errors_of(pillar)
    assert any("binds through Clevis" in e for e in errors), errors


def test_encrypt_in_place_above_lvm_and_its_rate_are_valid_and_bad_rates_are_not():
    pillar = mutate("volumes:data:encrypt_in_place", True)
    pillar["in_place"] = {"max_mib_s": 200}
    assert errors_of(pillar) == []
    for bad in (0, "fast", True, 1.5):
        pillar["in_place"] = {"max_mib_s": bad}
        assert any("in_place:max_mib_s" in e for e in errors_of(pillar)), bad


# ---- the state -------------------------------------------------------------------------------


HOST_FACTS = {
    "signature": "xfs",
    "reencryption": None,
    "mapped": False,
    "leftovers": [],
    "suspended": [],
    "unit": inplace.unit_name("hana_data"),
    "running": False,
    "progress": None,
    "mounted_from": "device",
    "users": [],
    "device_bytes": 512 * MIB,
    "fs_bytes": 480 * MIB,
    "fs_sector": 4096,
    "lv_tags": [],
    "key_day": None,
}
SEGMENTS = [
    {"vg": "vg_hana_data", "lv": "lv_hana_data", "stripes": 2, "stripe_size": 65536, "size": 512 * MIB}
]
PVS = [{"pv": d, "free": 100, "extent_bytes": 4 * MIB, "allocatable": True} for d in ("/dev/vda", "/dev/vdb")]


@pytest.fixture
def host():
    return {
        "hana_storage_host.in_place_facts": MagicMock(return_value=dict(HOST_FACTS)),
        "hana_storage_host.lv_room": MagicMock(return_value={"segments": SEGMENTS, "pvs": PVS}),
        "hana_storage_host.signatures": MagicMock(
            return_value=([{"type": "xfs", "usage": "filesystem"}], None)
        ),
        "hana_storage_host.luks_header": MagicMock(return_value={"uuid": "u-1"}),
        "hana_storage_host.block_bytes": MagicMock(return_value=544 * MIB),
        "hana_storage_host.tail_state": MagicMock(return_value="copy"),
        "cmd.run_all": MagicMock(return_value={"retcode": 0, "stdout": "", "stderr": ""}),
    }


@pytest.fixture
def opts():
    return {"test": False}


@pytest.fixture(autouse=True)
def scratch(monkeypatch, tmp_path):
    """The init's private directory: under a temporary directory, not a ramfs on /run."""
    monkeypatch.setattr(states, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(states, "_ramfs", lambda directory: os.makedirs(directory, exist_ok=True))


@pytest.fixture
def configure_loader_modules(host, opts):
    return {states: {"__salt__": host, "__opts__": opts, "__context__": {}}}


def underway_facts(**overrides):
    """The host's facts of a volume whose encryption in place is under way, its mapping open."""
    return dict(HOST_FACTS, signature="crypto_LUKS", reencryption=ENCRYPT, mapped=True, **overrides)


def apply():
    return states.encrypted_in_place(
        "hana_data", LV, "/hana/data", KEY, LUKS, 2, 64, ["noatime"], max_mib_s=None
    )


def commands(host):
    return [c.args[0] for c in host["cmd.run_all"].call_args_list]


def test_test_mode_says_every_step_and_runs_nothing(host, opts):
    opts["test"] = True
    ret = apply()
    assert ret["result"] is None and ret["changes"] == {}
    for words in (
        "would extend /dev/vg_hana_data/lv_hana_data by 33554432 bytes",
        "zero its room beyond 536870912 bytes",
        "record /dev/vg_hana_data/lv_hana_data's size (536870912 bytes)",
        "tag the copy of its first bytes begun; unmount /hana/data; copy its first 16 MiB to the end "
        "of its room; read the copy back; tag the copy complete; write the LUKS2 header (4096-byte sectors)",
        "drop the copy's tags",
        "mount /dev/mapper/hana_data at /hana/data",
        "start hana-storage-encrypt-hana_data.service",
    ):
        assert words in ret["comment"], ret["comment"]
    host["cmd.run_all"].assert_not_called()


def test_the_apply_runs_the_steps_in_order_and_says_the_downtime(host):
    ret = apply()
    assert ret["result"] is True, ret
    ran = [argv[:2] for argv in commands(host)]
    assert ran == [
        ["lvextend", "--extents"],
        ["dd", "if=/dev/zero"],
        ["lvchange", "--addtag"],
        ["lvchange", "--config"],  # the copy begun
        ["umount", "/hana/data"],
        ["dd", "if=/dev/vg_hana_data/lv_hana_data"],
        ["lvchange", "--config"],  # the copy complete
        ["cryptsetup", "reencrypt"],
        ["lvchange", "--config"],  # the copy's tags dropped
        ["mount", "-t"],
        ["systemctl", "reset-failed"],
        ["systemd-run", "--unit=hana-storage-encrypt-hana_data.service"],
    ]
    assert ret["changes"]["encrypting"]["from"] == "plain" and "downtime_s" in ret["changes"]
    # the day the key is made goes with the size into the LV's tags (the header takes no token
    # until the encryption ends)
    tag = next(argv for argv in commands(host) if argv[0] == "lvchange")
    assert inplace.key_day_tag(datetime.date.today()) in tag and inplace.tagged_key_day(tag) == (
        datetime.date.today().isoformat()
    )
    # the new header is written in a private directory on a ramfs, never in the job's cwd
    init = next(c for c in host["cmd.run_all"].call_args_list if c.args[0][:2] == ["cryptsetup", "reencrypt"])
    assert init.kwargs["cwd"].startswith(states.SCRATCH)


def done_facts(key_day):
    return dict(HOST_FACTS, signature="crypto_LUKS", mapped=True, mounted_from="crypt", key_day=key_day)


def test_once_the_encryption_ended_the_tagged_day_dates_the_key(host):
    host["hana_storage_host.in_place_facts"].return_value = done_facts("2026-11-20")
    ret = apply()
    assert ret["result"] is True and "recorded 2026-11-20" in ret["comment"], ret
    (imported,) = host["cmd.run_all"].call_args_list
    assert imported.args[0] == ["cryptsetup", "token", "import", LV]
    token = json.loads(imported.kwargs["stdin"])
    assert (token["created"], token["volume"], token["replaces"]) == ("2026-11-20", "u-1", [])
    assert ret["changes"] == {"key_date": {"device": LV, "created": "2026-11-20"}}


def test_test_mode_says_the_date_it_would_record_and_runs_nothing(host, opts):
    opts["test"] = True
    host["hana_storage_host.in_place_facts"].return_value = done_facts("2026-11-20")
    ret = apply()
    assert ret["result"] is None and "would record 2026-11-20" in ret["comment"]
    host["cmd.run_all"].assert_not_called()


def test_a_dated_or_untagged_encrypted_volume_is_left_alone(host):
    """key_day None: the header has a date token, or the LV has no day tag (a volume encrypted in
    place before the tag, or by luksFormat): its age stays what the header says, or unknown."""
    host["hana_storage_host.in_place_facts"].return_value = done_facts(None)
    ret = apply()
    assert ret["result"] is True and ret["changes"] == {}
    host["cmd.run_all"].assert_not_called()


@pytest.mark.parametrize(
    "tags,day",
    [
        (["hana_storage_key_made_2026-11-20"], "2026-11-20"),
        (["hana_storage_key_made_2026-11-20", "hana_storage_key_made_2026-10-01"], "2026-10-01"),
        (["hana_storage_key_made_2026-13-01", "hana_storage_key_made_"], None),
        (["hana_storage_plain_bytes_1048576"], None),
        (["hana_storage_key_made_2026-11-20x"], None),
    ],
)
def test_the_tagged_day_is_the_oldest_valid_one(tags, day):
    assert inplace.tagged_key_day(tags) == day


def test_a_process_with_a_file_open_stops_it_before_anything_runs(host):
    host["hana_storage_host.in_place_facts"].return_value = dict(
        HOST_FACTS, users=[{"pid": 4242, "comm": "hdbindexserver"}]
    )
    ret = apply()
    assert ret["result"] is False and "hdbindexserver (pid 4242)" in ret["comment"]
    host["cmd.run_all"].assert_not_called()


def test_a_step_that_fails_stops_the_rest(host):
    host["cmd.run_all"].side_effect = lambda argv, **kw: {
        "retcode": 1 if argv[0] == "lvextend" else 0,
        "stdout": "",
        "stderr": "Insufficient free space",
    }
    ret = apply()
    assert ret["result"] is False and "Insufficient free space" in ret["comment"]
    assert [argv[0] for argv in commands(host)] == ["lvextend"]  # the filesystem never went down


def test_a_frozen_stack_is_never_touched_and_a_reboot_is_named(host):
    host["hana_storage_host.in_place_facts"].return_value = underway_facts(
        mounted_from="crypt",
        leftovers=["hana_data-hotzone-backward", "hana_data-overlay"],
        suspended=["hana_data-hotzone-backward"],
    )
    ret = apply()
    assert (
        ret["result"] is False and "Reboot the host" in ret["comment"] and "dmsetup resume" in ret["comment"]
    )
    host["cmd.run_all"].assert_not_called()


def test_a_crash_is_recovered_offline(host):
    host["hana_storage_host.in_place_facts"].return_value = underway_facts(
        mounted_from="crypt",
        leftovers=["hana_data-overlay"],
    )
    ret = apply()
    assert ret["result"] is True, ret
    assert [argv[:2] for argv in commands(host)][:4] == [
        ["umount", "/hana/data"],
        ["cryptsetup", "close"],
        ["cryptsetup", "open"],
        ["mount", "-t"],
    ]


def test_a_running_encryption_is_reported_not_touched(host):
    host["hana_storage_host.in_place_facts"].return_value = underway_facts(
        running=True,
        progress=inplace.parse_progress(LINE),
    )
    ret = apply()
    assert ret["result"] is True and ret["comment"].startswith("encrypting hana_data: 3 %")
    host["cmd.run_all"].assert_not_called()


def test_a_volume_that_fills_its_vg_is_refused_with_the_need(host):
    host["hana_storage_host.lv_room"].return_value = {
        "segments": SEGMENTS,
        "pvs": [dict(p, free=0) for p in PVS],
    }
    ret = apply()
    assert ret["result"] is False and "must grow by 33554432 bytes" in ret["comment"], ret
    host["cmd.run_all"].assert_not_called()


# ---- what the fleet sees: the audit and its event, the exporter ------------------------------


def audit_of(underway, running=True):
    report = {
        "compliant": False,
        "findings": [],
        "volumes": {
            "data": {
                "compliant": False,
                "rules": ["HANA-ENC-001"],
                "mountpoint": "/hana/data",
                "in_place": underway and {"running": running, "progress": underway},
            },
            "log": {"compliant": True, "rules": [], "mountpoint": "/hana/log"},
        },
    }
    return events.audit_event(report, "full", 0.1, 1000.0, {})


def test_the_audit_event_carries_the_progress_and_the_exporter_a_gauge_while_it_lasts():
    module = load("_engines/hana_storage_exporter.py", "exporter_in_place")
    registry = CollectorRegistry()
    metrics = module.Metrics(registry)
    event = audit_of(inplace.parse_progress(LINE))
    assert event["volumes"]["data"]["in_place"] == {"running": True, "percent": 3, "eta_s": 7860}
    assert "in_place" not in event["volumes"]["log"]
    module.handle(metrics, "salt/beacon/db1/hana_storage/audit", event)
    assert (
        'hana_storage_in_place_progress_ratio{minion="db1",volume="data"} 0.03'
        in generate_latest(registry).decode()
    )
    module.handle(metrics, "salt/beacon/db1/hana_storage/audit", audit_of(None))
    assert "hana_storage_in_place_progress_ratio{" not in generate_latest(registry).decode()
    for forged in (101, -1, True, "50", 1.5, None):
        bad = audit_of(inplace.parse_progress(LINE))
        bad["volumes"]["data"]["in_place"]["percent"] = forged
        module.handle(metrics, "salt/beacon/db1/hana_storage/audit", bad)
        assert "hana_storage_in_place_progress_ratio{" not in generate_latest(registry).decode(), forged


# ---- the host's facts: the key's day, from the LV's tag, only while the header has no date ----


@pytest.fixture
def host_module(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "host_module_inplace", REPO / "_modules" / "hana_storage_host.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_sysfs", dict)
    monkeypatch.setattr(module, "block_bytes", lambda path: os.path.getsize(path))
    monkeypatch.setattr(module, "mounted_at", lambda mountpoint: None)
    monkeypatch.setattr(module, "_unit_active", lambda unit: False)
    module.__salt__ = {"cmd.run_all": _real_run_all}
    return module


def facts_with_tags(module, monkeypatch, image, tags):
    real_run = module._run
    monkeypatch.setattr(
        module,
        "_run",
        lambda argv: ("  " + ",".join(tags) + "\n", None) if argv[0] == "lvs" else real_run(argv),
    )
    return module.in_place_facts(str(image), "hana_data", "/hana/data")


TAGS = [inplace.plain_tag(8 * MIB), inplace.key_day_tag(datetime.date(2026, 11, 20))]


def test_an_encrypted_lv_with_the_day_tag_and_no_date_token_has_its_key_day(
    host_module, monkeypatch, make_luks
):
    facts = facts_with_tags(host_module, monkeypatch, make_luks(kdf="pbkdf2"), TAGS)
    assert facts["signature"] == "crypto_LUKS" and facts["key_day"] == "2026-11-20"
    assert inplace.stage(facts)[0] == "done"


def test_once_dated_or_without_the_day_tag_there_is_no_key_day(host_module, monkeypatch, make_luks):
    undated = make_luks(kdf="pbkdf2")
    assert facts_with_tags(host_module, monkeypatch, undated, TAGS[:1])["key_day"] is None
    dated = make_luks(kdf="pbkdf2")
    subprocess.run(
        ["cryptsetup", "token", "import", str(dated)],
        input=reencrypt.key_date_token(
            datetime.date(2026, 11, 20), luks.parse_header(luks.reader_for(dated.read_bytes()))["uuid"]
        ),
        text=True,
        check=True,
    )
    assert facts_with_tags(host_module, monkeypatch, dated, TAGS)["key_day"] is None
