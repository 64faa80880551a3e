"""Re-encryption online (hana_storage_core.reencrypt): the volume key's date in a LUKS2 token of
the formula's own, written by real cryptsetup and read back by the native parser, and what a
re-encryption would give a volume."""

import datetime
import json
import subprocess

import pytest
from hana_storage_core import luks, reencrypt

from tests.unit.conftest import CHEAP_KDF, cryptsetup, reencrypt_offline, rewrite_luks2_json

TODAY = datetime.date(2026, 11, 28)


def parse(path):
    return luks.parse_header(luks.reader_for(path.read_bytes()))


def import_token(path, text):
    subprocess.run(["cryptsetup", "token", "import", str(path)], input=text, text=True, check=True)


@pytest.fixture
def dated(make_luks):
    """A LUKS2 header with 512-byte sectors whose volume key token says 2025-01-01."""
    path = make_luks(sector_size=512, kdf="pbkdf2")
    cryptsetup("--version")  # skips without cryptsetup
    import_token(path, reencrypt.key_date_token(datetime.date(2025, 1, 1), parse(path)["uuid"]))
    return path


def test_the_date_cryptsetup_stored_is_the_date_read(dated):
    header = parse(dated)
    assert reencrypt.volume_key_date(header) == datetime.date(2025, 1, 1)
    assert reencrypt.key_age_days(header, TODAY) == 696


def test_a_header_without_the_token_has_a_key_of_unknown_age(make_luks):
    header = parse(make_luks(kdf="pbkdf2"))
    assert reencrypt.volume_key_date(header) is None
    assert reencrypt.key_age_days(header, TODAY) is None


@pytest.mark.parametrize(
    "created",
    ["2025-13-01", "", None, 20250101, "2025-01-01T00:00:00", "२०२५-०१-०१", "2025-1-1"],
)
def test_a_token_of_ours_without_a_valid_date_says_no_age_and_the_header_still_parses(make_luks, created):
    path = make_luks(kdf="pbkdf2")
    import_token(path, json.dumps({"type": reencrypt.KEY_DATE_TOKEN, "keyslots": [], "created": created}))
    header = parse(path)
    (token,) = [t for t in header["tokens"] if t["type"] == reencrypt.KEY_DATE_TOKEN]
    assert "error" in token["key_date"]
    assert reencrypt.volume_key_date(header) is None


def test_of_two_date_tokens_the_newest_is_the_keys(dated):
    """Two tokens that both date the key in use: the newer says when it was made."""
    import_token(dated, reencrypt.key_date_token(TODAY, parse(dated)["uuid"]))
    header = parse(dated)
    assert reencrypt.volume_key_date(header) == TODAY


# ---- the key a token dates: its fingerprint, across a real re-encryption ---------------------


def test_a_keyslot_added_keeps_the_fingerprint_and_a_re_encryption_changes_it(make_luks, keyfile, tmp_path):
    path = make_luks(kdf="pbkdf2")
    (before,) = parse(path)["volume_keys"]
    other = tmp_path / "other.key"
    other.write_bytes(b"x" * 64)
    subprocess.run(["cryptsetup", "luksAddKey", "-q", *CHEAP_KDF["pbkdf2"], "--key-file", str(keyfile), str(path), str(other)],
                   check=True)  # fmt: skip
    assert parse(path)["volume_keys"] == [before]
    reencrypt_offline(path, keyfile, "--init-only")
    during = parse(path)["volume_keys"]
    assert len(during) == 2 and before in during
    reencrypt_offline(path, keyfile, "--resume-only")
    (after,) = parse(path)["volume_keys"]
    assert after != before and after in during


def test_the_re_encryptions_token_dates_the_new_key_and_the_old_keeps_its_own(dated, keyfile):
    """The route: the token imported before the init (naming the key in use), then the init:
    during it the volume's age is the old key's, after it the new key's; the format's token
    stays useless only once removed (tokens_to_replace keeps the one dating the old key)."""
    header = parse(dated)
    (old,) = header["volume_keys"]
    assert reencrypt.tokens_to_replace(header) == []  # the format's token dates the old key: kept
    import_token(dated, reencrypt.key_date_token(TODAY, parse(dated)["uuid"], replaces=[old]))
    header = parse(dated)
    assert reencrypt.volume_key_date(header) == datetime.date(2025, 1, 1)  # the old key, still the only one
    reencrypt_offline(dated, keyfile, "--init-only")
    header = parse(dated)
    assert reencrypt.volume_key_date(header) == datetime.date(2025, 1, 1)  # the old key encrypts the rest
    assert sorted(reencrypt.key_dates(header).values()) == [datetime.date(2025, 1, 1), TODAY]
    reencrypt_offline(dated, keyfile, "--resume-only")
    header = parse(dated)
    assert reencrypt.volume_key_date(header) == TODAY
    assert reencrypt.key_age_days(header, TODAY) == 0


def test_an_init_that_never_happened_leaves_a_token_that_dates_nothing(dated):
    header = parse(dated)
    (old,) = header["volume_keys"]
    import_token(dated, reencrypt.key_date_token(TODAY, parse(dated)["uuid"], replaces=[old]))
    header = parse(dated)
    assert reencrypt.key_dates(header) == {old: datetime.date(2025, 1, 1)}
    # the next attempt removes it (it dates nothing) and keeps the format's
    (stale,) = [t["id"] for t in header["tokens"] if t.get("key_date", {}).get("replaces") == [old]]
    assert reencrypt.tokens_to_replace(header) == [stale]


def test_tokens_stay_at_most_two_over_many_re_encryptions(make_luks, keyfile):
    path = make_luks(kdf="pbkdf2")
    import_token(path, reencrypt.key_date_token(datetime.date(2024, 1, 1), parse(path)["uuid"]))
    for n in range(3):
        header = parse(path)
        (key,) = header["volume_keys"]
        day = datetime.date(2025, 1, 1) + datetime.timedelta(days=n)
        import_token(path, reencrypt.key_date_token(day, parse(path)["uuid"], replaces=[key]))
        for tid in reencrypt.tokens_to_replace(header):
            subprocess.run(["cryptsetup", "token", "remove", "--token-id", str(tid), str(path)], check=True)
        reencrypt_offline(path, keyfile)
        header = parse(path)
        assert reencrypt.volume_key_date(header) == day
        assert len([t for t in header["tokens"] if t["type"] == reencrypt.KEY_DATE_TOKEN]) <= 2


def test_a_key_made_by_hand_later_is_dated_by_our_newest_token_older_than_it_is(dated, keyfile):
    reencrypt_offline(dated, keyfile)  # an admin's re-encryption: no token of ours
    assert reencrypt.volume_key_date(parse(dated)) == datetime.date(2025, 1, 1)


@pytest.mark.parametrize(
    "replaces",
    ["abc", [1], ["x" * 65], ["a b"], ["k"] * 33, [""], {"a": 1}],
)
def test_a_token_whose_replaces_is_not_a_list_of_fingerprints_dates_nothing(make_luks, replaces):
    path = make_luks(kdf="pbkdf2")
    token = {"type": reencrypt.KEY_DATE_TOKEN, "keyslots": [], "created": "2025-01-01", "replaces": replaces,
             "volume": parse(path)["uuid"]}  # fmt: skip
    import_token(path, json.dumps(token))
    header = parse(path)
    (ours,) = [t for t in header["tokens"] if t["type"] == reencrypt.KEY_DATE_TOKEN]
    assert "error" in ours["key_date"]
    assert reencrypt.volume_key_date(header) is None


def test_a_date_after_today_dates_nothing(dated):
    """Attack review 18: a token dated after today (a clock that ran ahead, a forged import)
    made an old key 0 days old and silenced the cryptoperiod: it now dates nothing."""
    assert reencrypt.key_age_days(parse(dated), datetime.date(2024, 6, 1)) is None


def test_wants_a_new_sector_and_a_new_key(dated):
    want = reencrypt.wants(parse(dated), 4096, 4096, 365, TODAY)
    assert want["sector"] == (512, 4096)
    assert want["new_key"] == "its volume key is 696 days old, the cryptoperiod 365 days"
    assert want["refused"] is None


def test_wants_nothing_of_a_young_key_at_the_policys_sector(make_luks):
    path = make_luks(sector_size=4096, kdf="pbkdf2")
    import_token(path, reencrypt.key_date_token(TODAY - datetime.timedelta(days=30), parse(path)["uuid"]))
    assert reencrypt.wants(parse(path), 4096, 4096, 365, TODAY) == {
        "sector": None,
        "new_key": None,
        "refused": None,
    }


def test_no_cryptoperiod_wants_no_new_key_even_of_unknown_age(make_luks):
    header = parse(make_luks(sector_size=4096, kdf="pbkdf2"))
    assert reencrypt.wants(header, 4096, 4096, None, TODAY)["new_key"] is None


def test_an_unknown_age_under_a_cryptoperiod_wants_a_new_key(make_luks):
    header = parse(make_luks(sector_size=4096, kdf="pbkdf2"))
    assert (
        reencrypt.wants(header, 4096, 4096, 365, TODAY)["new_key"] == "its volume key's date is not recorded"
    )


def test_an_xfs_with_512_byte_sectors_refuses_the_sector_change_named(dated):
    """cryptsetup 2.6.1 in the lab: "Requested --sector-size 4096 is incompatible with xfs
    superblock (block size: 512 bytes)". The refusal names the way that works."""
    want = reencrypt.wants(parse(dated), 4096, 512, 365, TODAY)
    assert want["sector"] is None
    assert "mkfs.xfs -s size=4096" in want["refused"]
    assert want["new_key"]  # a new key is still possible at 512-byte sectors


def test_luks1_is_refused(make_luks):
    header = parse(make_luks(type="luks1", kdf="pbkdf2"))
    assert "LUKS2" in reencrypt.wants(header, 4096, 4096, 365, TODAY)["refused"]


def test_the_init_names_the_key_by_its_file_only():
    argv = reencrypt.reencrypt_init("/dev/vg/lv", "/run/hana-storage/keys/k", 3, 4096, ["--pbkdf", "pbkdf2"])
    assert argv[:4] == ["cryptsetup", "reencrypt", "--batch-mode", "--init-only"]
    assert argv[argv.index("--key-slot") + 1] == "3"
    assert argv[argv.index("--resilience") + 1] == "checksum"
    assert argv[argv.index("--key-file") + 1] == "/run/hana-storage/keys/k"
    assert argv[-1] == "/dev/vg/lv"


def test_a_forged_token_type_with_a_huge_date_field_does_not_break_the_parser(make_luks, tmp_path):
    path = make_luks(kdf="pbkdf2")

    def edit(meta):
        meta["tokens"]["5"] = {"type": reencrypt.KEY_DATE_TOKEN, "keyslots": [], "created": "9" * 5000}

    rewrite_luks2_json(path, edit)
    header = parse(path)
    assert reencrypt.volume_key_date(header) is None


def header_of(sector=512, created=None, underway=None, version=2, clevis=False):
    tokens = [{"id": 1, "type": "clevis", "keyslots": [1]}] if clevis else []
    if created:
        key_date = reencrypt.token_date(
            {"created": created, "volume": "u-1"}
        )  # as luks.parse_header records it
        tokens.append({"id": 0, "type": reencrypt.KEY_DATE_TOKEN, "keyslots": [], "key_date": key_date})
    keys = ["0123456789abcdef"] + (["fedcba9876543210"] if underway else [])
    return {
        "version": version,
        "uuid": "u-1",
        "sector_size": sector,
        "tokens": tokens,
        "reencryption": underway,
        "volume_keys": keys,
    }


def facts_of(header, **over):
    facts = {"header": header, "mapped": True, "running": False, "leftovers": [], "suspended": [],
             "fs_sector": 4096, "keyslot": 0}  # fmt: skip
    facts.update(over)
    return facts


def stage(facts, max_age_days=365):
    return reencrypt.stage(facts, 4096, max_age_days, TODAY)


def test_a_512_byte_volume_is_wanted_at_4096():
    assert stage(facts_of(header_of(512, "2026-11-01"))) == ("wanted", "its 512-byte sectors want 4096", 4096)


def test_an_old_key_at_the_right_sector_is_wanted_at_its_sector():
    got = stage(facts_of(header_of(4096, "2024-01-01")))
    assert got[0] == "wanted" and "days old" in got[1] and got[2] == 4096


def test_a_young_key_at_the_right_sector_is_current():
    assert stage(facts_of(header_of(4096, "2026-11-01")))[0] == "current"


def test_a_512_byte_xfs_refuses_the_sector_but_renews_an_old_key_at_512():
    got = stage(facts_of(header_of(512, "2020-01-01"), fs_sector=512))
    assert got[0] == "wanted" and got[2] == 512 and "sector size stays" in got[1]
    only_sector = stage(facts_of(header_of(512, "2026-11-01"), fs_sector=512))
    assert only_sector[0] == "refused" and "mkfs.xfs -s size=4096" in only_sector[1]


def test_below_lvm_a_pv_renews_its_key_at_its_own_sector_size_and_never_changes_it():
    """A PV under a mounted LV keeps its sector size: a new key only, at the sector it has."""
    old_key = reencrypt.stage(facts_of(header_of(512, "2020-01-01")), 4096, 365, TODAY, below_lvm=True)
    assert old_key[0] == "wanted" and old_key[2] == 512 and "sector size stays" in old_key[1], old_key
    young = reencrypt.stage(facts_of(header_of(512, "2026-11-01")), 4096, 365, TODAY, below_lvm=True)
    assert young[0] == "refused" and "below LVM" in young[1] and "mkfs.xfs -s size=4096" in young[1], young
    at_policy = reencrypt.stage(facts_of(header_of(4096, "2020-01-01")), 4096, 365, TODAY, below_lvm=True)
    assert at_policy[0] == "wanted" and at_policy[2] == 4096, at_policy
    assert reencrypt.stage(facts_of(header_of(4096, "2026-11-01")), 4096, 365, TODAY, below_lvm=True)[0] == (
        "current"
    )


@pytest.mark.parametrize(
    "over,words",
    [
        ({"mapped": False}, "not open"),
        ({"keyslot": None}, "opens none of its keyslots"),
        ({"header": header_of(512, "2020-01-01", clevis=True)}, "drop a clevis token"),
        ({"fs_sector": None}, "not known"),
    ],
)
def test_what_blocks_a_wanted_re_encryption_is_named(over, words):
    got = stage(dict(facts_of(header_of(512, "2026-11-01")), **over))
    assert got[0] == "refused" and words in got[1]


UNDERWAY = {"in_progress": True, "mode": "reencrypt", "target": {"sector_size": 4096}}


@pytest.mark.parametrize(
    "over,expected",
    [
        ({"running": True}, "running"),
        ({"mapped": False}, "closed"),
        ({"leftovers": ["hana_data-hotzone-forward"], "suspended": ["hana_data-hotzone-forward"]}, "frozen"),
        ({"leftovers": ["hana_data-hotzone-forward"]}, "crashed"),
        ({}, "paused"),
    ],
)
def test_a_re_encryption_under_way_has_the_in_place_stages(over, expected):
    got = stage(facts_of(header_of(512, underway=UNDERWAY), **over))
    assert got[0] == expected and got[2] == 4096


@pytest.mark.parametrize("mode", ["encrypt", "decrypt", None])
def test_another_mode_under_way_is_foreign(mode):
    assert stage(facts_of(header_of(512, underway=dict(UNDERWAY, mode=mode))))[0] == "foreign"


def test_no_header_is_absent_and_no_cryptoperiod_wants_no_key():
    assert stage(facts_of(None))[0] == "absent"
    assert stage(facts_of(header_of(4096)), max_age_days=None)[0] == "current"


def backup_problem(path, backup):
    import importlib.util

    from hana_storage_core import rules

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location(
        "host_reencrypt_backup", REPO / "_modules" / "hana_storage_host.py"
    )
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    return rules.header_backup_problem(host.header_backup(str(backup)), parse(path))


@pytest.fixture
def backed_up(make_luks, tmp_path):
    path, backup = make_luks(sector_size=512, kdf="pbkdf2"), tmp_path / "hana_data.luks-header"
    cryptsetup("luksHeaderBackup", str(path), "--header-backup-file", str(backup))
    assert backup_problem(path, backup) is None
    return path, backup


def test_a_header_backup_from_before_a_re_encryption_is_stale_never_one_to_restore(backed_up, keyfile):
    """A re-encryption gives the key's keyslot a new id and drops the old one: the backup made
    before it "lost" keyslot 0, which read as HANA-KEY-007 (manual: restore from the backup) and
    kept the backup forever. Restoring it would put the old volume key over data encrypted with
    the new one: every byte unreadable. The formula's re-encryption names the key it replaces in
    its date token: such a backup is stale (HANA-KEY-006: made anew)."""
    path, backup = backed_up
    (old,) = parse(path)["volume_keys"]
    import_token(path, reencrypt.key_date_token(TODAY, parse(path)["uuid"], replaces=[old]))
    reencrypt_offline(path, keyfile, "--sector-size", "4096")
    problem = backup_problem(path, backup)
    assert (problem["rule"], problem["code"]) == ("HANA-KEY-006", "rekeyed"), problem
    assert "restoring it would" in problem["text"]


def test_a_backup_of_a_key_no_token_retired_is_kept_and_not_offered_as_the_fix(backed_up, keyfile):
    """A re-encryption by hand, or a luksFormat that kept the UUID (and the key file): the
    backup's volume key is not the device's, and nothing says which happened. The backup is
    kept (HANA-KEY-007, manual) and the finding says what restoring it would cost."""
    path, backup = backed_up
    reencrypt_offline(path, keyfile, "--sector-size", "4096")
    problem = backup_problem(path, backup)
    assert (problem["rule"], problem["code"]) == ("HANA-KEY-007", "other_volume_key"), problem
    assert "unreadable" in problem["text"]


def test_a_luks_format_that_kept_the_uuid_keeps_the_backup(backed_up, keyfile):
    path, backup = backed_up
    uuid = parse(path)["uuid"]
    cryptsetup(
        "luksFormat",
        "-q",
        "--type",
        "luks2",
        "--uuid",
        uuid,
        *CHEAP_KDF["pbkdf2"],
        "--key-file",
        str(keyfile),
        str(path),
    )
    problem = backup_problem(path, backup)
    assert (problem["rule"], problem["code"]) == ("HANA-KEY-007", "other_volume_key"), problem


@pytest.mark.parametrize("cap,mib", [(None, 64), (0, 64), (1, 1), (4, 2), (50, 25), (1000, 64)])
def test_a_hotzone_holds_io_about_a_second_at_most_under_a_cap(cap, mib):
    assert reencrypt.hotzone_mib(cap) == mib
