"""The data-loss guard's decisions and the command lines the states run."""

import base64

import pytest
from hana_storage_core import commands as commands
from hana_storage_core import pillar as hp
from hana_storage_core import safety as safety

from tests.unit.test_audit import DEFAULTS

KEY = base64.b64encode(b"k" * 64).decode()


def volume(encryption="above_lvm", devices=("/dev/vda", "/dev/vdb"), allow=(), safe_mode=True):
    config = hp.merge(
        DEFAULTS,
        {
            "safe_mode": safe_mode,
            "key": {"source": "pillar", "material": KEY},
            "volumes": {
                "data": {
                    "mountpoint": "/hana/data",
                    "devices": list(devices),
                    "encryption": encryption,
                    "allow_format": list(allow),
                }
            },
        },
    )
    return hp.normalize(config)["volumes"]["data"]


def probe(device="/dev/vda", **facts):
    base = {
        "device": device,
        "exists": True,
        "block": True,
        "signatures": [],
        "pttype": None,
        "pv_vg": None,
        "luks": None,
        "key_opens": None,
        "holders": [],
        "mountpoints": [],
        "data_at": None,
        "key_error": None,
        "xfs": None,
        "lvm_sees_paths": [],
    }
    return {**base, **facts}


def sig(*types):
    return [{"type": t, "usage": ""} for t in types]


CASES = [
    # (id, encryption, probe facts, verdict, words)
    ("blank", "above_lvm", {}, "use", "blank"),
    ("orphan-pv", "above_lvm", {"signatures": sig("LVM2_member"), "pv_vg": ""}, "use", "already a PV"),
    (
        "our-pv",
        "above_lvm",
        {"signatures": sig("LVM2_member"), "pv_vg": "vg_hana_data", "holders": ["vg_hana_data-lv_hana_data"]},
        "use",
        "vg_hana_data",
    ),
    (
        "foreign-pv",
        "above_lvm",
        {"signatures": sig("LVM2_member"), "pv_vg": "vg_other"},
        "refuse",
        "vg_other",
    ),
    ("ext4", "above_lvm", {"signatures": sig("ext4"), "data_at": 4096}, "refuse", "ext4 signature"),
    ("xfs-on-disk", "below_lvm", {"signatures": sig("xfs")}, "refuse", "xfs signature"),
    ("gpt", "above_lvm", {"pttype": "gpt"}, "refuse", "gpt partition table"),
    ("raid", "above_lvm", {"signatures": sig("linux_raid_member")}, "refuse", "linux_raid_member"),
    (
        "ambivalent",
        "above_lvm",
        {"signatures": sig("ambivalent (several signatures)")},
        "refuse",
        "ambivalent",
    ),
    ("unknown-data", "above_lvm", {"data_at": 4096}, "refuse", "without a known signature"),
    ("mounted", "above_lvm", {"mountpoints": ["/srv"]}, "refuse", "mounted at /srv"),
    ("held", "above_lvm", {"holders": ["md0"]}, "refuse", "in use by md0"),
    ("missing", "above_lvm", {"exists": False}, "refuse", "does not exist"),
    ("not-block", "above_lvm", {"block": False}, "refuse", "not a block device"),
    (
        "our-luks-closed",
        "below_lvm",
        {"signatures": sig("crypto_LUKS"), "key_opens": True},
        "use",
        "opened by the volume's key",
    ),
    (
        "our-luks-open",
        "below_lvm",
        {"signatures": sig("crypto_LUKS"), "holders": ["hana_data_0"]},
        "use",
        "open as hana_data_0",
    ),
    (
        # re-encrypted online: cryptsetup's hotzone and overlay devices hold the disk (the VM tier
        # saw the guard refuse the volume at each apply while they ran)
        "our-luks-reencrypting",
        "below_lvm",
        {
            "signatures": sig("crypto_LUKS"),
            "luks": {"version": 2, "keyslots": 2, "reencryption": True},
            "holders": ["hana_data_0-hotzone-forward", "hana_data_0-overlay"],
        },  # fmt: skip
        "use",
        "open as hana_data_0",
    ),
    (
        "other-luks-reencrypting",
        "below_lvm",
        {"signatures": sig("crypto_LUKS"), "holders": ["other-hotzone-forward"]},
        "refuse",
        "in use by other-hotzone-forward",
    ),
    (
        "foreign-luks",
        "below_lvm",
        {"signatures": sig("crypto_LUKS"), "key_opens": False},
        "refuse",
        "key cannot open",
    ),
    (
        "unfinished-luks",
        "below_lvm",
        {
            "signatures": sig("crypto_LUKS"),
            "key_opens": False,
            "luks": {"version": 2, "keyslots": 0, "format_began": True},
        },
        "use",
        "interrupted luksFormat",
    ),
    (
        # issue 29, item 1: luksErase (or a damaged header) leaves no keyslot either, but the
        # formula did not begin that luksFormat: the data is behind it, its backup can restore it
        "erased-luks",
        "below_lvm",
        {"signatures": sig("crypto_LUKS"), "key_opens": False, "luks": {"version": 2, "keyslots": 0}},
        "refuse",
        "not one this formula began",
    ),
    (
        "foreign-luks-with-keyslot",
        "below_lvm",
        {"signatures": sig("crypto_LUKS"), "key_opens": False, "luks": {"version": 2, "keyslots": 1}},
        "refuse",
        "key cannot open",
    ),
    (
        "foreign-luks-open",
        "below_lvm",
        {"signatures": sig("crypto_LUKS"), "holders": ["other"]},
        "refuse",
        "in use by other",
    ),
    (
        "luks-on-above-disk",
        "above_lvm",
        {"signatures": sig("crypto_LUKS"), "key_opens": True},
        "refuse",
        "crypto_LUKS",
    ),
    (
        # issue 29, item 15: LVM sees the map's paths too: pvcreate ran on every map, then vgcreate
        # failed on duplicates and every later apply failed alike
        "map-whose-paths-lvm-scans",
        "above_lvm",
        {"lvm_sees_paths": ["sda", "sdi"]},
        "refuse",
        "paths (sda, sdi) LVM scans too",
    ),
    ("map-lvm-scan-unknown", "above_lvm", {"lvm_sees_paths": None}, "refuse", "could not tell"),
    ("map-below-lvm-paths-scanned", "below_lvm", {"lvm_sees_paths": ["sda"]}, "use", "blank"),
    (
        "pv-on-below-disk",
        "below_lvm",
        {"signatures": sig("LVM2_member"), "pv_vg": ""},
        "refuse",
        "LVM2_member",
    ),
]


@pytest.mark.parametrize("encryption,facts,verdict,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_disk_verdicts(encryption, facts, verdict, words):
    got = safety.disk_verdict(volume(encryption), probe(**facts))
    assert got["verdict"] == verdict and words in got["reason"], got


def test_allow_format_turns_refusal_into_wipe_but_never_for_live_devices():
    allowed = volume(allow=["/dev/vda"])
    assert safety.disk_verdict(allowed, probe(signatures=sig("ext4")))["verdict"] == "wipe"
    assert (
        safety.disk_verdict(allowed, probe(device="/dev/vdb", signatures=sig("ext4")))["verdict"] == "refuse"
    )
    assert safety.disk_verdict(allowed, probe(mountpoints=["/srv"]))["verdict"] == "refuse"
    assert safety.disk_verdict(allowed, probe(holders=["md0"]))["verdict"] == "refuse"
    assert safety.disk_verdict(allowed, probe(lvm_sees_paths=["sda"]))["verdict"] == "refuse"


def test_a_pv_whose_volume_group_lvm_did_not_report_is_never_wiped():
    """blkid sees an LVM label, but `pvs` did not list the device (suspended while it read, pvs
    failed, LVM's filter hides it): it may be a live PV of this very volume's VG. Unknown is not
    foreign, whatever allow_format or safe_mode say."""
    unknown = probe(signatures=sig("LVM2_member"), pv_vg=None)
    for config in (volume(allow=["/dev/vda"]), volume(safe_mode=False), volume()):
        verdict = safety.disk_verdict(config, unknown)
        assert (verdict["verdict"], verdict["code"]) == ("refuse", "pv_vg_unknown"), verdict
        assert "did not list it" in verdict["reason"] and "nothing is written" in verdict["reason"]
    foreign = safety.disk_verdict(
        volume(allow=["/dev/vda"]), probe(signatures=sig("LVM2_member"), pv_vg="vg_x")
    )
    assert (foreign["verdict"], foreign["code"]) == ("wipe", "foreign_pv")  # known, and allowed


def test_safe_mode_off_allows_every_pillar_device():
    loose = volume(safe_mode=False)
    assert loose["may_format"] == ["/dev/vda", "/dev/vdb"]
    assert safety.disk_verdict(loose, probe(device="/dev/vdb", pttype="dos"))["verdict"] == "wipe"


@pytest.mark.parametrize(
    "layer,facts,may_wipe,verdict,words",
    [
        ("luks", {}, False, "create", "blank"),
        (
            "luks",
            {"signatures": sig("crypto_LUKS"), "holders": ["hana_data"]},
            False,
            "use",
            "open as hana_data",
        ),
        ("luks", {"signatures": sig("crypto_LUKS"), "key_opens": True}, False, "use", "opened by"),
        ("luks", {"signatures": sig("crypto_LUKS"), "key_opens": False}, False, "refuse", "cannot open"),
        ("luks", {"signatures": sig("crypto_LUKS"), "key_opens": False}, True, "wipe", "allowed"),
        (
            "luks",
            {
                "signatures": sig("crypto_LUKS"),
                "key_opens": False,
                "luks": {"keyslots": 0, "format_began": True},
            },
            False,
            "create",
            "no keyslot",
        ),
        (
            "luks",
            {"signatures": sig("crypto_LUKS"), "key_opens": False, "luks": {"keyslots": 0}},
            False,
            "refuse",
            "not one this formula began",
        ),
        (
            "luks",
            {"signatures": sig("crypto_LUKS"), "key_opens": False, "luks": {"keyslots": 0}},
            True,
            "wipe",
            "allowed",
        ),
        ("luks", {"signatures": sig("xfs")}, False, "refuse", "xfs signature"),
        ("luks", {"holders": ["intruder"]}, True, "refuse", "in use by intruder"),
        ("xfs", {"signatures": sig("xfs"), "xfs": {"inprogress": False}}, False, "use", "already XFS"),
        ("xfs", {"signatures": sig("xfs"), "xfs": {"inprogress": True}}, False, "create", "interrupted mkfs"),
        ("xfs", {"signatures": sig("ext4")}, False, "refuse", "ext4"),
        ("xfs", {"signatures": sig("LVM2_member")}, True, "wipe", "LVM2_member"),
        ("xfs", {}, False, "create", "blank"),
    ],
)
def test_layer_verdicts(layer, facts, may_wipe, verdict, words):
    got = safety.layer_verdict(layer, probe(**facts), may_wipe, own_holders=["hana_data"])
    assert got["verdict"] == verdict and words in got["reason"], got


def test_refusal_summary_names_every_refused_device():
    verdicts = [
        safety.disk_verdict(volume(), probe(signatures=sig("ext4"))),
        safety.disk_verdict(volume(), probe(device="/dev/vdb")),
    ]
    assert safety.refusal_summary(verdicts) == "/dev/vda carries a ext4 signature"


# ---- command lines -------------------------------------------------------------------------------

LUKS = {
    "type": "luks2",
    "cipher": "aes-xts-plain64",
    "key_size": 512,
    "sector_size": 4096,
    "pbkdf": {"type": "argon2id", "memory_kib": 32768, "force_iterations": 4, "parallel": 1},
}


def test_luks_format_names_the_key_by_file_only():
    argv = commands.luks_format("/dev/vg/lv", "/run/hana-storage/keys/hana.key", LUKS, label="hana_data")
    assert argv == [
        "cryptsetup",
        "luksFormat",
        "--batch-mode",
        "--type",
        "luks2",
        "--cipher",
        "aes-xts-plain64",
        "--key-size",
        "512",
        "--sector-size",
        "4096",
        "--luks2-metadata-size",
        "128k",
        "--pbkdf",
        "argon2id",
        "--pbkdf-memory",
        "32768",
        "--pbkdf-parallel",
        "1",
        "--pbkdf-force-iterations",
        "4",
        "--key-file",
        "/run/hana-storage/keys/hana.key",
        "--label",
        "hana_data",
        "/dev/vg/lv",
    ]


def test_open_and_refresh_set_exactly_the_policy_flags():
    flags = ["--perf-no_write_workqueue", "--perf-no_read_workqueue"]
    assert commands.luks_open("hana_data", "/dev/vg/lv", "/k", flags, persistent=True) == [
        "cryptsetup",
        "open",
        "--type",
        "luks2",
        "--key-file",
        "/k",
        "--perf-no_read_workqueue",
        "--perf-no_write_workqueue",
        "--persistent",
        "/dev/vg/lv",
        "hana_data",
    ]
    assert commands.luks_refresh("hana_data", "/k", ["--allow-discards"], persistent=False) == [
        "cryptsetup",
        "refresh",
        "--key-file",
        "/k",
        "--allow-discards",
        "hana_data",
    ]


@pytest.mark.parametrize(
    "stripe,stripes,offset", [(256, 4, None), (64, 2, None), (256, 3, 33792), (128, 5, 33280), (256, 1, None)]
)
def test_luks_payload_starts_on_a_full_stripe(stripe, stripes, offset):
    got = commands.luks_data_offset(stripe, stripes)
    assert got == offset
    width = stripe * 1024 * stripes
    assert ((got or 32768) * 512) % width == 0 and (got or 32768) * 512 >= 16 << 20


def test_mkfs_is_aligned_and_never_forced_unless_asked():
    assert commands.mkfs_xfs("/dev/mapper/hana_data", 256, 4, ["-m crc=1"]) == [
        "mkfs.xfs",
        "-q",
        "-d",
        "su=256k,sw=4",
        "-m",
        "crc=1",
        "/dev/mapper/hana_data",
    ]
    assert commands.mkfs_xfs("/dev/x", 256, 1, []) == ["mkfs.xfs", "-q", "/dev/x"]
    assert "-f" in commands.mkfs_xfs("/dev/x", 256, 1, [], force=True)


# ---- issue 13: only a wrong key may lead to a wipe; blank means provably blank ----------------

OOM = "cryptsetup exited 3 (out of memory): Not enough available memory to open a keyslot."


@pytest.mark.parametrize("safe_mode,allow", [(True, ["/dev/vda"]), (False, [])])
def test_a_failed_key_test_refuses_even_where_formatting_is_allowed(safe_mode, allow):
    """The right key, an argon2id keyslot, too little memory: exit 3 is not "a foreign LUKS"."""
    allowed = volume("below_lvm", allow=allow, safe_mode=safe_mode)
    got = safety.disk_verdict(allowed, probe(signatures=sig("crypto_LUKS"), key_opens=None, key_error=OOM))
    assert (got["verdict"], got["code"]) == ("refuse", "key_test_failed"), got
    assert "out of memory" in got["reason"]
    wrong = safety.disk_verdict(allowed, probe(signatures=sig("crypto_LUKS"), key_opens=False))
    assert (wrong["verdict"], wrong["code"]) == ("wipe", "foreign_luks")


def test_an_untested_key_is_not_a_wrong_key():
    got = safety.disk_verdict(volume("below_lvm", allow=["/dev/vda"]), probe(signatures=sig("crypto_LUKS")))
    assert (got["verdict"], got["code"]) == ("refuse", "key_not_tested"), got


def test_layer_luks_key_test_failure_is_never_wiped():
    got = safety.layer_verdict("luks", probe(signatures=sig("crypto_LUKS"), key_error=OOM), may_wipe=True)
    assert (got["verdict"], got["code"]) == ("refuse", "key_test_failed"), got


def test_data_far_from_the_start_makes_a_disk_foreign():
    got = safety.disk_verdict(volume(), probe(data_at=512 << 20))
    assert (got["verdict"], got["code"]) == ("refuse", "unknown_data"), got
    assert str(512 << 20) in got["reason"]


@pytest.mark.parametrize(
    "facts,created_now,may_wipe,verdict,code",
    [
        ({}, False, False, "create", "blank"),  # sampled areas all zero
        ({}, True, False, "create", "created_now"),
        ({"data_at": 1 << 20}, True, False, "create", "created_now"),  # created now: garbage of no one
        # plain dm-crypt, a detached-header LUKS, a damaged LUKS1 header: no signature, data
        ({"data_at": 0}, False, False, "refuse", "unknown_data"),
        ({"data_at": 0}, False, True, "wipe", "unknown_data"),
    ],
)
def test_an_existing_lv_without_a_signature_is_formatted_only_when_provably_blank(
    facts, created_now, may_wipe, verdict, code
):
    got = safety.layer_verdict(
        "luks", probe(**facts), may_wipe, own_holders=["hana_data"], created_now=created_now
    )
    assert (got["verdict"], got["code"]) == (verdict, code), got


@pytest.mark.parametrize(
    "facts,verdict,code,words",
    [
        ({}, "create", "blank", "blank"),
        ({"signatures": sig("LVM2_member"), "pv_vg": ""}, "use", "own_pv", "no VG yet"),
        ({"signatures": sig("LVM2_member"), "pv_vg": "vg_hana_log"}, "use", "own_pv", "vg_hana_log"),
        ({"signatures": sig("LVM2_member"), "pv_vg": "vg_other"}, "refuse", "foreign_signature", "vg_other"),
        ({"signatures": sig("xfs")}, "refuse", "foreign_signature", "xfs signature"),
        ({"signatures": sig("linux_raid_member")}, "refuse", "foreign_signature", "linux_raid_member"),
        ({"pttype": "gpt"}, "refuse", "foreign_signature", "gpt partition table"),
        ({"holders": ["intruder"]}, "refuse", "held", "intruder"),
    ],
)
def test_what_an_opened_luks_device_holds_is_checked_before_pvcreate(facts, verdict, code, words):
    # may_wipe is not even asked: allow_format names disks, not what a key opens inside them
    got = safety.layer_verdict("pv", probe("/dev/mapper/hana_log_0", **facts), True, own_vg="vg_hana_log")
    assert (got["verdict"], got["code"]) == (verdict, code) and words in got["reason"], got


@pytest.mark.parametrize(
    "facts,verdict,code",
    [
        ({"signatures": sig("xfs"), "mountpoints": ["/hana/data"]}, "use", "own_xfs"),
        ({"signatures": sig("ext4"), "mountpoints": ["/srv/old"]}, "refuse", "mounted"),
        (
            {"signatures": sig("xfs"), "xfs": {"inprogress": True}, "mountpoints": ["/mnt"]},
            "refuse",
            "mounted",
        ),
        ({"signatures": sig("ext4"), "holders": ["other_dm"]}, "refuse", "held"),
        ({"mountpoints": ["/mnt"]}, "refuse", "mounted"),
    ],
    ids=["own-xfs-mounted", "foreign-mounted", "unfinished-xfs-mounted", "foreign-held", "blank-mounted"],
)
def test_a_live_filesystem_device_is_never_formatted_even_when_every_device_may_be(facts, verdict, code):
    got = safety.layer_verdict("xfs", probe("/dev/mapper/hana_data", **facts), True)
    assert (got["verdict"], got["code"]) == (verdict, code), got


def test_every_verdict_carries_a_code():
    for case in CASES:
        assert safety.disk_verdict(volume(case[1]), probe(**case[2]))["code"]
