"""Pillar validation: the example and lab pillars pass, every malformed pillar names its key path."""

import base64
import copy
import json
import re

import jinja2
import pytest
import yaml
from hana_storage_core import pillar as hp
from hana_storage_core import rules as rules

from tests.conftest import REPO

SCHEMA = json.loads((REPO / "salt/hana/storage/schema.json").read_text())
DEFAULTS = yaml.safe_load((REPO / "salt/hana/storage/parameters/defaults.yaml").read_text())
KEY = base64.b64encode(b"k" * 64).decode()
GOOD = {
    "key": {"source": "pillar", "material": KEY},
    "volumes": {
        "data": {"mountpoint": "/hana/data", "devices": ["/dev/vda", "/dev/vdb", "/dev/vdc", "/dev/vdd"]},
        "log": {
            "mountpoint": "/hana/log",
            "devices": ["/dev/vde", "/dev/vdf"],
            "encryption": "below_lvm",
            "stripe_size": 64,
        },
        "shared": {"mountpoint": "/hana/shared", "devices": ["/dev/vdg"]},
    },
}


def errors_of(pillar, facts=None):
    return hp.validate(hp.merge(DEFAULTS, pillar), SCHEMA, facts, rules.auto_rules())


def test_defaults_and_schema_are_consistent():
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    # defaults alone only miss volumes
    assert errors_of({}) == ["hana:storage:volumes: needs at least 1 entry"]


def test_header_backups_are_named_by_crypt_device():
    pillar = dict(GOOD, header_backup={"directory": "/var/lib/hana-storage/luks-headers/"})
    assert errors_of(pillar) == []
    plan = hp.normalize(hp.merge(DEFAULTS, pillar))
    assert [c["header_backup"] for v in plan["volumes"].values() for c in v["crypt"]] == [
        "/var/lib/hana-storage/luks-headers/hana_data.luks-header",
        "/var/lib/hana-storage/luks-headers/hana_log_0.luks-header",
        "/var/lib/hana-storage/luks-headers/hana_log_1.luks-header",
        "/var/lib/hana-storage/luks-headers/hana_shared.luks-header",
    ]
    assert errors_of(dict(GOOD, header_backup={"directory": "relative"})) != []
    assert errors_of(dict(GOOD, header_backup={})) != []


def test_good_pillar_is_valid_and_normalises():
    assert errors_of(GOOD) == []
    plan = hp.normalize(hp.merge(DEFAULTS, GOOD))
    data, log = plan["volumes"]["data"], plan["volumes"]["log"]
    assert data["stripes"] == 4 and data["stripe_size_kib"] == 256
    assert data["crypt"] == [
        {"name": "hana_data", "device": "/dev/vg_hana_data/lv_hana_data", "header_backup": None}
    ]
    assert data["fs_device"] == "/dev/mapper/hana_data"
    assert [c["name"] for c in log["crypt"]] == ["hana_log_0", "hana_log_1"]
    assert log["pvs"] == ["/dev/mapper/hana_log_0", "/dev/mapper/hana_log_1"]
    assert log["fs_device"] == "/dev/vg_hana_log/lv_hana_log"
    assert data["key"] == {
        "id": "default",
        "source": "pillar",
        "file": "/run/hana-storage/keys/hana.key",
        "store": "pillar",
        "pillar": "hana:storage:key:material",
        "crypttab": "/run/hana-storage/keys/hana.key",
        "previous": None,
        "clevis": None,
    }
    assert KEY not in json.dumps(plan)


PREVIOUS = base64.b64encode(b"p" * 32).decode()


def test_a_key_being_rotated_names_its_previous_key_in_the_plan_without_material():
    pillar = dict(
        GOOD,
        key={"source": "pillar", "material": KEY, "previous": {"source": "pillar", "material": PREVIOUS}},
    )
    pillar["volumes"] = dict(
        GOOD["volumes"],
        shared=dict(
            GOOD["volumes"]["shared"],
            key={
                "source": "keyfile",
                "path": "/etc/keys/shared-2.key",
                "previous": {"source": "keyfile", "path": "/etc/keys/shared-1.key"},
            },
        ),
    )
    assert errors_of(pillar) == []
    plan = hp.normalize(hp.merge(DEFAULTS, pillar))
    assert plan["volumes"]["data"]["key"]["previous"] == {
        "file": "/run/hana-storage/keys/hana.previous.key",
        "store": "pillar",
        "pillar": "hana:storage:key:previous:material",
    }
    assert plan["volumes"]["shared"]["key"]["previous"] == {
        "file": "/etc/keys/shared-1.key",
        "store": "keyfile",
        "pillar": "hana:storage:volumes:shared:key:previous:material",
    }
    assert plan["volumes"]["shared"]["key"]["crypttab"] == "/etc/keys/shared-2.key"
    assert PREVIOUS not in json.dumps(plan) and KEY not in json.dumps(plan)


def test_a_tang_volume_rotates_its_recovery_key():
    tang = {
        "source": "tang",
        "servers": [{"url": "http://tang.example:7500", "thumbprint": "a" * 43}],
        "recovery": {
            "source": "keyfile",
            "path": "/etc/keys/recovery-2.key",
            "previous": {"source": "keyfile", "path": "/etc/keys/recovery-1.key"},
        },
    }

    def with_data_key(key):
        return dict(GOOD, volumes=dict(GOOD["volumes"], data=dict(GOOD["volumes"]["data"], key=key)))

    assert errors_of(with_data_key(tang)) == []
    plan = hp.normalize(hp.merge(DEFAULTS, with_data_key(tang)))
    assert plan["volumes"]["data"]["key"]["file"] == "/etc/keys/recovery-2.key"
    assert plan["volumes"]["data"]["key"]["previous"]["file"] == "/etc/keys/recovery-1.key"
    wrong = dict(tang, previous={"source": "keyfile", "path": "/etc/keys/old.key"})
    assert errors_of(with_data_key(wrong)) == [
        "hana:storage:volumes:data:key:previous: not used with source tang (the recovery key has its own)"
    ]


@pytest.mark.parametrize(
    "key, error",
    [
        (
            {"source": "keyfile", "path": "/etc/k", "previous": {"source": "keyfile", "path": "/etc/k"}},
            "hana:storage:key:previous: is the key itself; name the key being rotated away here and the new "
            "key in its place (the values are not shown)",
        ),
        (
            {"source": "pillar", "material": KEY, "previous": {"source": "pillar", "material": KEY}},
            "hana:storage:key:previous: is the key itself; name the key being rotated away here and the new "
            "key in its place (the values are not shown)",
        ),
        (
            {
                "source": "pillar",
                "material": KEY,
                "previous": {"source": "pillar", "material": "not base64!"},
            },
            "hana:storage:key:previous:material: must be base64 (the value is not shown)",
        ),
        (
            {
                "source": "keyfile",
                "path": "/etc/k",
                "previous": {"source": "keyfile", "path": "/hana/data/old.key"},
            },
            "hana:storage:key:previous:path: /hana/data/old.key lies inside the HANA mountpoint /hana/data "
            "(volume 'data'); a key must never sit on the device it unlocks",
        ),
    ],
)
def test_a_previous_key_must_be_another_key_kept_off_the_volumes(key, error):
    assert error in errors_of(dict(GOOD, key=key))


def test_pillar_example_is_valid():
    pillar = yaml.safe_load((REPO / "pillar.example").read_text())["hana"]["storage"]
    assert errors_of(pillar) == []


def test_lab_pillar_is_valid():
    text = jinja2.Template((REPO / "lab/pillar.sls.j2").read_text()).render(key_b64=KEY)
    assert errors_of(yaml.safe_load(text)["hana"]["storage"]) == []


def mutate(path, value):
    """A copy of GOOD with the value at path ('a:b:0') set, or deleted when value is DELETE."""
    pillar = copy.deepcopy(GOOD)
    node = pillar
    parts = path.split(":")
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    last = int(parts[-1]) if isinstance(node, list) else parts[-1]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return pillar


DELETE = object()
SHORT_KEY = base64.b64encode(b"short").decode()

# (id, key path set, value, key path expected in an error, words expected in that error)
BAD = [
    ("unknown-top-key", "colour", "blue", "hana:storage:colour", "unknown key"),
    (
        "unknown-volume-key",
        "volumes:data:stripe_count",
        4,
        "hana:storage:volumes:data:stripe_count",
        "unknown key",
    ),
    ("stripes-zero", "volumes:data:stripes", 0, "hana:storage:volumes:data:stripes", "at least 1"),
    ("stripes-not-int", "volumes:data:stripes", "4", "hana:storage:volumes:data:stripes", "integer"),
    (
        "stripes-uneven",
        "volumes:data:stripes",
        3,
        "hana:storage:volumes:data:devices",
        "multiple of 3 devices (3, 6)",
    ),
    ("unknown-luks-key", "luks:mode", "fast", "hana:storage:luks:mode", "unknown key"),
    ("volumes-not-mapping", "volumes", ["data"], "hana:storage:volumes", "must be object"),
    ("no-volumes", "volumes", {}, "hana:storage:volumes", "at least 1"),
    (
        "missing-mountpoint",
        "volumes:data:mountpoint",
        DELETE,
        "hana:storage:volumes:data:mountpoint",
        "missing",
    ),
    ("missing-devices", "volumes:data:devices", DELETE, "hana:storage:volumes:data:devices", "missing"),
    ("empty-devices", "volumes:data:devices", [], "hana:storage:volumes:data:devices", "at least 1"),
    (
        "device-not-string",
        "volumes:data:devices:0",
        7,
        "hana:storage:volumes:data:devices:0",
        "must be string",
    ),
    ("relative-device", "volumes:data:devices:0", "vda", "hana:storage:volumes:data:devices:0", "/dev/"),
    (
        "device-outside-dev",
        "volumes:data:devices:0",
        "/tmp/disk.img",
        "hana:storage:volumes:data:devices:0",
        "/dev/",
    ),
    (
        "device-dotdot",
        "volumes:data:devices:0",
        "/dev/../etc/passwd",
        "hana:storage:volumes:data:devices:0",
        "normalised",
    ),
    (
        "duplicate-device-in-volume",
        "volumes:data:devices:1",
        "/dev/vda",
        "hana:storage:volumes:data:devices",
        "unique",
    ),
    (
        "device-in-two-volumes",
        "volumes:shared:devices:0",
        "/dev/vde",
        "hana:storage:volumes:shared:devices:0",
        "already used by volume 'log'",
    ),
    (
        "relative-mountpoint",
        "volumes:data:mountpoint",
        "hana/data",
        "hana:storage:volumes:data:mountpoint",
        "absolute path",
    ),
    ("root-mountpoint", "volumes:data:mountpoint", "/", "hana:storage:volumes:data:mountpoint", "system"),
    ("usr-mountpoint", "volumes:data:mountpoint", "/usr", "hana:storage:volumes:data:mountpoint", "system"),
    (
        "duplicate-mountpoint",
        "volumes:log:mountpoint",
        "/hana/data",
        "hana:storage:volumes:log:mountpoint",
        "also the mountpoint",
    ),
    (
        "nested-mountpoint",
        "volumes:log:mountpoint",
        "/hana/data/log",
        "hana:storage:volumes:log:mountpoint",
        "nested",
    ),
    (
        "trailing-slash-mountpoint",
        "volumes:data:mountpoint",
        "/hana/data/",
        "hana:storage:volumes:data:mountpoint",
        "normalised",
    ),
    (
        "stripe-not-power-of-two",
        "volumes:log:stripe_size",
        100,
        "hana:storage:volumes:log:stripe_size",
        "power of two",
    ),
    (
        "stripe-too-small",
        "volumes:log:stripe_size",
        2,
        "hana:storage:volumes:log:stripe_size",
        "power of two",
    ),
    ("stripe-too-large", "volumes:log:stripe_size", "8m", "hana:storage:volumes:log:stripe_size", "4096 KiB"),
    ("stripe-garbage", "volumes:log:stripe_size", "64 kb", "hana:storage:volumes:log:stripe_size", "KiB"),
    ("stripe-float", "volumes:log:stripe_size", 64.5, "hana:storage:volumes:log:stripe_size", "KiB"),
    (
        "default-stripe-bad",
        "volume_defaults:stripe_size",
        300,
        "hana:storage:volume_defaults:stripe_size",
        "power of two",
    ),
    (
        "nobarrier",
        "volumes:data:mount_options",
        ["noatime", "nobarrier"],
        "hana:storage:volumes:data:mount_options:1",
        "4.19",
    ),
    (
        "barrier-default",
        "volume_defaults:mount_options",
        ["barrier"],
        "hana:storage:volume_defaults:mount_options:0",
        "4.19",
    ),
    (
        "mount-option-injection",
        "volumes:data:mount_options",
        ["noatime,exec"],
        "hana:storage:volumes:data:mount_options:0",
        "mount option",
    ),
    (
        "mkfs-force",
        "volumes:data:mkfs_options",
        ["-f"],
        "hana:storage:volumes:data:mkfs_options:0",
        "overwrite",
    ),
    (
        "mkfs-su",
        "volumes:data:mkfs_options",
        ["-d su=64k,sw=2"],
        "hana:storage:volumes:data:mkfs_options:0",
        "derived",
    ),
    ("ext4", "volumes:data:filesystem", "ext4", "hana:storage:volumes:data:filesystem", "xfs"),
    (
        "bad-encryption",
        "volumes:data:encryption",
        "none",
        "hana:storage:volumes:data:encryption",
        "above_lvm",
    ),
    ("cipher-null", "luks:cipher", "cipher_null-ecb", "hana:storage:luks:cipher", "aes-xts-plain64"),
    ("cbc-cipher", "luks:cipher", "aes-cbc-essiv:sha256", "hana:storage:luks:cipher", "one of"),
    ("key-size-128", "luks:key_size", 128, "hana:storage:luks:key_size", "256, 512"),
    ("luks1", "luks:type", "luks1", "hana:storage:luks:type", "luks2"),
    ("sector-size-odd", "luks:sector_size", 1000, "hana:storage:luks:sector_size", "4096"),
    (
        "perf-flag-string",
        "luks:perf:no_read_workqueue",
        "yes",
        "hana:storage:luks:perf:no_read_workqueue",
        "boolean",
    ),
    (
        "unknown-perf-flag",
        "luks:perf:same_cpu_crypt",
        True,
        "hana:storage:luks:perf:same_cpu_crypt",
        "unknown",
    ),
    ("weak-pbkdf", "luks:pbkdf:type", "md5", "hana:storage:luks:pbkdf:type", "argon2id"),
    ("pbkdf-memory-huge", "luks:pbkdf:memory_kib", 10**9, "hana:storage:luks:pbkdf:memory_kib", "at most"),
    ("key-source-unknown", "key:source", "vault", "hana:storage:key:source", "keyfile, pillar"),
    (
        "keyfile-without-path",
        "volumes:log:key",
        {"source": "keyfile"},
        "hana:storage:volumes:log:key:path",
        "missing",
    ),
    ("pillar-key-without-material", "key", {"source": "pillar"}, "hana:storage:key:material", "missing"),
    ("key-not-base64", "key:material", "not base64!!", "hana:storage:key:material", "base64"),
    ("key-too-short", "key:material", SHORT_KEY, "hana:storage:key:material", "at least 32 bytes"),
    (
        "key-relative-path",
        "key",
        {"source": "keyfile", "path": "keys/hana.key"},
        "hana:storage:key:path",
        "absolute",
    ),
    (
        "key-inside-hana-mount",
        "key",
        {"source": "keyfile", "path": "/hana/data/.key"},
        "hana:storage:key:path",
        "inside the HANA mountpoint",
    ),
    (
        "volume-key-inside-mount",
        "volumes:log:key",
        {"source": "keyfile", "path": "/hana/shared/log.key"},
        "hana:storage:volumes:log:key:path",
        "inside the HANA mountpoint",
    ),
    (
        "keyfile-with-material",
        "key",
        {"source": "keyfile", "path": "/etc/k", "material": KEY},
        "hana:storage:key:material",
        "not used with source keyfile",
    ),
    (
        "volume-name-upper",
        "volumes:Data",
        {"mountpoint": "/hana/x", "devices": ["/dev/vdh"]},
        "hana:storage:volumes",
        "volume name",
    ),
    ("bad-vg-name", "volumes:data:vg", "-vg", "hana:storage:volumes:data:vg", "LVM name"),
    ("vg-shared", "volumes:log:vg", "vg_hana_data", "hana:storage:volumes:log:vg", "also used by volume"),
    (
        "crypt-name-shared",
        "volumes:shared:crypt_name",
        "hana_data",
        "hana:storage:volumes:shared:crypt_name",
        "also used",
    ),
    (
        "allow-format-foreign",
        "volumes:data:allow_format",
        ["/dev/vdg"],
        "hana:storage:volumes:data:allow_format:0",
        "not one of this volume's devices",
    ),
    ("safe-mode-string", "safe_mode", "off", "hana:storage:safe_mode", "boolean"),
    ("bad-size", "volumes:data:size", "lots", "hana:storage:volumes:data:size", "LV size"),
    (
        "remediate-manual-rule",
        "compliance:remediation:rules",
        ["HANA-ENC-001"],
        "hana:storage:compliance:remediation:rules:0",
        "HANA-PERF-002",
    ),
    (
        "ignore-bad-rule",
        "compliance:ignore_rules",
        ["PERF-2"],
        "hana:storage:compliance:ignore_rules:0",
        "rule ID",
    ),
    (
        "beacon-interval-zero",
        "compliance:beacon:interval",
        0,
        "hana:storage:compliance:beacon:interval",
        "at least 1",
    ),
    (
        "too-many-devices",
        "volumes:data:devices",
        [f"/dev/sd{i}" for i in range(65)],
        "hana:storage:volumes:data:devices",
        "at most 64",
    ),
]


@pytest.mark.parametrize("path,value,where,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_pillar_is_rejected_with_its_key_path(path, value, where, words):
    errors = errors_of(mutate(path, value))
    matching = [e for e in errors if e.startswith(where + ":") and words in e]
    assert matching, f"expected an error at {where} mentioning {words!r}, got {errors}"


def test_there_are_at_least_forty_bad_pillars():
    assert len(BAD) >= 40


def test_key_material_never_echoed():
    for material in ("not base64!!", SHORT_KEY, 12345, ["a"]):
        errors = errors_of(mutate("key:material", material))
        assert errors and not any(str(material) in e for e in errors), errors


def test_not_a_mapping():
    assert hp.schema_errors("x", SCHEMA) == ["hana:storage: must be object, got string"]


HOST = {
    "devices": {
        d: {"exists": True, "block": True, "realpath": d}
        for d in ["/dev/vda", "/dev/vdb", "/dev/vdc", "/dev/vdd", "/dev/vde", "/dev/vdf", "/dev/vdg"]
    },
    "system_devices": ["/dev/sda", "/dev/sda1"],
}


def test_host_checks_pass_on_matching_host():
    assert errors_of(GOOD, HOST) == []


@pytest.mark.parametrize(
    "device,fact,words",
    [
        ("/dev/vdg", {"exists": False}, "does not exist"),
        ("/dev/vdg", {"exists": True, "block": False, "realpath": "/dev/vdg"}, "not a block device"),
        ("/dev/vdg", {"exists": True, "block": True, "realpath": "/dev/sda1"}, "via symlink to /dev/sda1"),
        ("/dev/vdg", {"exists": True, "block": True, "realpath": "/dev/vda"}, "same disk as /dev/vda"),
    ],
)
def test_host_checks(device, fact, words):
    facts = copy.deepcopy(HOST)
    facts["devices"][device] = fact
    errors = errors_of(GOOD, facts)
    assert any(e.startswith("hana:storage:volumes:shared:devices:0:") and words in e for e in errors), errors


@pytest.mark.parametrize(
    "systemd,options",
    [
        ("239", ["luks"]),  # RHEL 8
        ("246", ["luks"]),  # SLES 15 SP3
        ("248", ["luks", "no-read-workqueue", "no-write-workqueue"]),
        ("252", ["luks", "no-read-workqueue", "no-write-workqueue"]),  # RHEL 9, Debian 12
        (None, ["luks", "no-read-workqueue", "no-write-workqueue"]),
    ],
)
def test_crypttab_options_are_what_the_hosts_systemd_understands(systemd, options):
    config = hp.merge(
        DEFAULTS,
        {
            "key": {"source": "keyfile", "path": "/k"},
            "volumes": {"data": {"mountpoint": "/hana/data", "devices": ["/dev/vda"]}},
        },
    )
    assert hp.normalize(config, systemd)["volumes"]["data"]["crypttab_options"] == options


def test_each_dm_crypt_flag_is_spelled_in_one_table_the_parsers_understand():
    """The plan carries every flag the formula decides on with each layer's spelling: the dm
    table's and the LUKS2 header's parsers know those spellings, and the pillar names them."""
    from hana_storage_core import dm as dm
    from hana_storage_core import luks as luks

    plan = hp.normalize(hp.merge(DEFAULTS, GOOD), systemd_version="247")
    flags = {f["dm"]: f for f in plan["luks"]["flags"]}
    assert set(flags) == {f.dm for f in hp.CRYPT_FLAGS}
    assert {f["dm"] for f in flags.values()} <= set(dm.CRYPT_FLAGS)
    assert {f["header"] for f in flags.values()} <= set(luks.LUKS2_FLAGS)
    luks_schema = SCHEMA["$defs"]["luks"]["properties"]
    assert set(luks_schema["perf"]["properties"]) == {f["dm"] for f in flags.values() if f["perf"]}
    assert {f["dm"] for f in flags.values() if not f["perf"]} <= set(luks_schema)
    assert plan["luks"]["dm_flags"] == sorted(f["dm"] for f in flags.values() if f["wanted"])
    # systemd 247 knows discard, not the workqueue options
    wanted_crypttab = {
        f["crypttab"] for f in flags.values() if f["wanted"] and f["crypttab_since_systemd"] <= 247
    }
    assert set(plan["volumes"]["data"]["crypttab_options"]) - {"luks", "noauto"} == wanted_crypttab


def test_default_names_are_the_same_for_validation_and_the_plan():
    taken = copy.deepcopy(GOOD)
    taken["volumes"]["log"]["vg"] = "vg_hana_data"  # the data volume's default VG name
    assert any("vg name 'vg_hana_data' is also used by volume" in e for e in errors_of(taken))
    plan = hp.normalize(hp.merge(DEFAULTS, GOOD))
    for name, volume in plan["volumes"].items():
        assert {k: volume[k] for k in ("vg", "lv", "crypt_name")} == hp.default_names(name)


# ---- issue 29: strings that split a line, keys that collide, backups in the wrong place ---------


@pytest.mark.parametrize(
    "path,value,where",
    [
        ("volumes:data:mountpoint", "/hana/data\n", "hana:storage:volumes:data:mountpoint"),
        ("volumes:data:crypt_name", "hana_data\n", "hana:storage:volumes:data:crypt_name"),
        ("volumes:data:vg", "vg_data\n", "hana:storage:volumes:data:vg"),
        ("volumes:data:mount_options", ["noatime\n"], "hana:storage:volumes:data:mount_options:0"),
        ("volumes:data:devices:0", "/dev/vda\n", "hana:storage:volumes:data:devices:0"),
        ("volumes:data:mountpoint", "/hana/da\tta", "hana:storage:volumes:data:mountpoint"),
        ("key:material", KEY + "\n", "hana:storage:key:material"),
    ],
)
def test_a_control_character_in_any_pillar_string_is_refused(path, value, where):
    """Python's ``$`` matches before a final newline: every ``^...$`` pattern of the schema lets
    ``"hana_data\\n"`` through, and crypttab or fstab then gets a line split in two."""
    errors = errors_of(mutate(path, value))
    assert any(e.startswith(where + ":") and "control character" in e for e in errors), errors
    assert all(KEY not in e for e in errors)


def test_a_control_character_in_a_volume_name_is_refused():
    pillar = copy.deepcopy(GOOD)
    pillar["volumes"]["data\n"] = pillar["volumes"].pop("data")
    errors = errors_of(pillar)
    assert any("control character" in e for e in errors), errors


def test_no_volume_name_makes_two_keys_share_a_file():
    """A volume named ``hana`` with its own pillar key and the default pillar key both mapped to
    /run/hana-storage/keys/hana.key; a volume named ``default`` took the default key's id."""
    own = {"source": "pillar", "material": base64.b64encode(b"h" * 32).decode()}
    pillar = copy.deepcopy(GOOD)
    pillar["volumes"]["hana"] = {"mountpoint": "/hana/x", "devices": ["/dev/vdh"], "key": own}
    pillar["volumes"]["default"] = {"mountpoint": "/hana/y", "devices": ["/dev/vdi"], "key": dict(own)}
    assert errors_of(pillar) == []
    plan = hp.normalize(hp.merge(DEFAULTS, pillar))
    keys = {name: volume["key"] for name, volume in plan["volumes"].items()}
    by_id = {}
    for key in keys.values():
        by_id.setdefault(key["id"], set()).add(key["file"])
    assert all(len(files) == 1 for files in by_id.values()), by_id  # one id, one file
    files = {key["id"]: key["file"] for key in keys.values()}
    assert len(set(files.values())) == len(files), files  # one file, one id
    assert keys["data"]["file"] == "/run/hana-storage/keys/hana.key"  # the default key's is unchanged


def test_a_key_file_under_the_pillar_keys_ramfs_is_refused():
    pillar = dict(GOOD, key={"source": "keyfile", "path": "/run/hana-storage/keys/hana.key"})
    errors = errors_of(pillar)
    assert any(e.startswith("hana:storage:key:path:") and "/run/hana-storage/keys" in e for e in errors), (
        errors
    )


@pytest.mark.parametrize(
    "directory,words",
    [
        ("/hana/shared/luks-headers", "inside the HANA mountpoint /hana/shared"),
        ("/hana/data", "inside the HANA mountpoint /hana/data"),
        ("/run/hana-storage/keys/headers", "gone at the next boot"),
        ("/tmp/headers", "gone at the next boot"),
        ("/dev/shm/headers", "gone at the next boot"),
    ],
)
def test_header_backups_are_refused_where_they_cannot_help(directory, words):
    errors = errors_of(dict(GOOD, header_backup={"directory": directory}))
    assert any(e.startswith("hana:storage:header_backup:directory:") and words in e for e in errors), errors


@pytest.mark.parametrize(
    "fact,words",
    [
        ({"realpath": "/hana/shared/x", "fstype": "xfs"}, "inside the HANA mountpoint /hana/shared"),
        ({"realpath": "/var/lib/hana-storage/luks-headers", "fstype": "tmpfs"}, "gone at the next boot"),
        ({"realpath": "/var/lib/hana-storage/luks-headers", "fstype": "ramfs"}, "gone at the next boot"),
    ],
)
def test_a_header_backup_directory_that_leads_onto_a_volume_or_a_ram_disk_is_refused(fact, words):
    facts = copy.deepcopy(HOST)
    facts["paths"] = {"/var/lib/hana-storage/luks-headers": fact}
    pillar = dict(GOOD, header_backup={"directory": "/var/lib/hana-storage/luks-headers"})
    errors = errors_of(pillar, facts)
    assert any(e.startswith("hana:storage:header_backup:directory:") and words in e for e in errors), errors


def test_a_key_of_another_source_takes_nothing_from_the_default_key():
    """defaults.yaml's key (a key file's path) must not be merged under a pillar's Tang key."""
    tang = {
        "source": "tang",
        "servers": [
            {
                "url": "http://tang1.example.com:7500",
                "thumbprint": "mRKTopaNeBJf2hKS6_dNjFZL5e6FDpmLP9Aee-A8Fpo",
            }
        ],
        "threshold": 1,
        "recovery": {"source": "pillar", "material": KEY},
    }
    assert errors_of(dict(GOOD, key=tang)) == []
    assert errors_of(dict(GOOD, key={"source": "pillar", "material": KEY})) == []
    # the same source still merges: a path alone is the default key file's source
    assert errors_of(dict(GOOD, key={"path": "/etc/keys/other.key"})) == []


def _example_lines():
    return (REPO / "pillar.example").read_text().splitlines()


PLACEHOLDER = re.compile(r"<[^>]+>")


def _documented_forms():
    """Every commented-out setting of pillar.example, each as (line number, the example's lines
    with that setting uncommented): a ``# name: value`` line, or a ``# name:`` line with the
    deeper commented lines below it, at the indentation of a mapping it belongs to. Placeholders
    (``<base64 ...>``) become real values."""
    lines = _example_lines()
    forms = []
    start = lines.index("hana:")
    for index, line in enumerate(lines):
        match = None if index < start else re.match(r"^(\s*)# ([a-z_]+):( .*)?$", line)
        if not match:
            continue
        indent = match.group(1)
        block = [index]
        if not (match.group(3) or "").strip() or (match.group(3) or "").strip().startswith("#"):
            for follow in range(index + 1, len(lines)):
                if re.match(rf"^{indent}#   ", lines[follow]) or re.match(rf"^{indent}#\s*- ", lines[follow]):
                    block.append(follow)
                else:
                    break
        edited = list(lines)
        for number in block:
            text = (
                lines[number].replace(f"{indent}# ", indent, 1)
                if number == index
                else lines[number].replace(f"{indent}#   ", f"{indent}  ", 1)
            )
            edited[number] = PLACEHOLDER.sub(KEY, text)
        forms.append((index + 1, edited))
    return forms


def _replace_mapping(lines, number):
    """The example with the uncommented setting at line ``number`` (1-based) replacing a sibling of
    the same name that is set already (``key:`` over the active ``key:``)."""
    line = lines[number - 1]
    indent = len(line) - len(line.lstrip())
    name = line.strip().split(":", 1)[0]
    start = number - 1
    # find the block's parent start: walk up to a line with a smaller indentation
    parent = start
    while parent > 0 and (
        not lines[parent - 1].strip()
        or lines[parent - 1].lstrip().startswith("#")
        or len(lines[parent - 1]) - len(lines[parent - 1].lstrip()) >= indent
    ):
        parent -= 1
    for other in range(parent, len(lines)):
        text = lines[other]
        if other == start or not text.strip() or text.lstrip().startswith("#"):
            continue
        depth = len(text) - len(text.lstrip())
        if other > start and depth < indent:
            break
        if depth == indent and text.strip().split(":", 1)[0] == name:
            end = other + 1
            while end < len(lines) and (
                not lines[end].strip()
                or lines[end].lstrip().startswith("#")
                or len(lines[end]) - len(lines[end].lstrip()) > indent
            ):
                end += 1
            return lines[:other] + ["#"] * (end - other) + lines[end:]
    return lines


def test_every_form_pillar_example_documents_validates_as_written():
    forms = _documented_forms()
    assert len(forms) >= 10, forms  # the key sources, the rotation, the PBKDF knobs, names ...
    failures = {}
    for number, lines in forms:
        lines = _replace_mapping(lines, number)
        try:
            pillar = yaml.safe_load("\n".join(lines))["hana"]["storage"]
        except yaml.YAMLError as error:
            failures[number] = f"not YAML once uncommented: {error}"
            continue
        errors = errors_of(pillar)
        if errors:
            failures[number] = errors
    assert failures == {}, failures


def _schema_keys(schema, prefix=()):
    """Every property path of the schema (volumes' entries as ``volumes:<name>``)."""
    found = set()
    node = schema
    while "$ref" in node:
        node = SCHEMA
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    for name, sub in node.get("properties", {}).items():
        found.add((*prefix, name))
        found |= _schema_keys(sub, (*prefix, name))
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and "$ref" in extra:
        found |= _schema_keys(extra, (*prefix, "*"))
    return found


def test_pillar_example_names_every_key_of_the_schema():
    text = (REPO / "pillar.example").read_text()
    words = set(re.findall(r"\b([a-z][a-z0-9_]*):", text))
    missing = sorted({":".join(path) for path in _schema_keys(SCHEMA) if path[-1] not in words})
    assert missing == [], f"pillar.example does not mention: {missing}"


# ---- outside review (attack branch): each test below fails until its hole is fixed ----------------


TANG_SERVER = {"url": "http://tang.example:7500", "thumbprint": "T" * 43}


@pytest.mark.parametrize(
    "key,why",
    [
        ({"source": "keyfile", "path": "/etc/hana-storage/keys/hana_data.luks-header"},
         "the header backup of hana_data is renamed over it"),
        ({"source": "keyfile", "path": "/etc/hana-storage/keys/hana_data.luks-header.new"},
         "each backup run unlinks it first"),
        ({"source": "tang", "servers": [TANG_SERVER],
          "recovery": {"source": "keyfile", "path": "/run/hana-storage/scratch/keys/recovery.key"}},
         "a ramfs is mounted over it; each Clevis run rmtree's every directory there"),
    ],
)  # fmt: skip
def test_a_key_file_where_the_formula_writes_its_own_files_is_refused(key, why):
    """Key loss (pillar). The checks keep key files out of PILLAR_KEY_DIR and HANA mountpoints,
    not out of the other paths the formula writes: ``<header_backup.directory>/<crypt>.luks-header``
    (core.files.install renames the proven backup over it: tests/unit/test_states.py
    test_a_header_backup_never_replaces_a_key_file), its ``.new`` (unlinked before each backup),
    and /run/hana-storage/scratch (_run_scratch mounts a ramfs there and removes every directory
    in it). Such a pillar validates; the first apply destroys the key the volume opens with."""
    pillar = {
        "key": key,
        "header_backup": {"directory": "/etc/hana-storage/keys"},
        "volumes": {"data": {"mountpoint": "/hana/data", "devices": ["/dev/vda"]}},
    }
    assert errors_of(pillar) != [], why
