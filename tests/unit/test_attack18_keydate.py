"""Attack on the volume key's date (reencrypt.KEY_DATE_TOKEN, HANA-KEY-010): forged and odd
tokens, kills between the steps, hand re-encryptions, LV tags, malformed headers.

The safety direction: the audit must never report a volume key YOUNGER than it is (that hides
an expired cryptoperiod); older or unknown is acceptable. Tests whose docstring starts with
"HOLE:" demonstrate a hole and fail on the code they were written against; the others show
what holds. Every hole found is fixed: those tests are the regression tests now."""

import datetime
import importlib.util
import json
import os
import subprocess
from unittest.mock import MagicMock

import pytest
from hana_storage_core import inplace, luks, reencrypt

from tests.conftest import REPO
from tests.unit.conftest import cryptsetup, reencrypt_offline, rewrite_luks2_json

REAL_TODAY = datetime.date.today()
FORMAT_DAY = datetime.date(2020, 1, 1)  # the day the volume key was really made


def parse(path):
    return luks.parse_header(luks.reader_for(path.read_bytes()))


def import_token(path, text, check=True):
    return subprocess.run(
        ["cryptsetup", "token", "import", str(path)], input=text, text=True, capture_output=True, check=check
    )


def remove_token(path, tid):
    subprocess.run(["cryptsetup", "token", "remove", "--token-id", str(tid), str(path)], check=True)


def ours(header):
    return [t for t in header["tokens"] if t["type"] == reencrypt.KEY_DATE_TOKEN]


@pytest.fixture
def old_volume(make_luks):
    """A volume whose key was made on FORMAT_DAY, dated so by luksFormat's token."""
    path = make_luks(kdf="pbkdf2")
    cryptsetup("--version")
    import_token(path, reencrypt.key_date_token(FORMAT_DAY, parse(path)["uuid"]))
    return path


# ---- holes -----------------------------------------------------------------------------------


def test_a_future_dated_token_hides_an_expired_cryptoperiod(old_volume):
    """HOLE (fixed: it dates nothing): a date token with a day after today (a forged or carelessly imported one, or the
    formula's own written while the host's clock ran ahead, e.g. an NTP/RTC glitch during a
    re-encryption) makes the key's age 0 (key_age_days clamps "a clock set back"): the audit
    stays silent and reencrypted_online says "current" for years, although the key is from
    2020. Younger than it is: the cryptoperiod is hidden.
    Fix: a token date after ``today`` dates nothing, or makes the age unknown (key_age_days
    returns None; HANA-KEY-010 reports it, e.g. "its date ... is in the future"); a clock set
    back then shows as unknown, which is the acceptable direction."""
    import_token(old_volume, json.dumps(
        {"type": reencrypt.KEY_DATE_TOKEN, "keyslots": [], "created": "2099-01-01", "replaces": []}
    ))  # fmt: skip
    header = parse(old_volume)
    age = reencrypt.key_age_days(header, REAL_TODAY)
    assert age is None or age >= (REAL_TODAY - FORMAT_DAY).days, age
    assert reencrypt.wants(header, 4096, 4096, 365, REAL_TODAY)["new_key"] is not None


def test_the_audit_is_silent_on_a_future_dated_key(old_volume):
    """HOLE (fixed): the same forged/clock-skewed token through the audit: no HANA-KEY-010 under a
    365-day cryptoperiod for a key made in 2020 (its age reported as 0).
    Fix: as above; _volume_key_age_rule reports a date after facts["today"]."""
    from hana_storage_core import rules

    from tests.unit.test_audit import PILLAR, compliant, plan_of

    def key_010():
        summary = parse(old_volume)
        facts = compliant()
        facts["today"] = REAL_TODAY.isoformat()
        facts["headers"]["dm-0"] = dict(
            facts["headers"]["dm-0"],
            tokens=summary["tokens"],
            volume_keys=summary["volume_keys"],
            uuid=summary["uuid"],
        )
        report = rules.audit(plan_of(dict(PILLAR, luks={"volume_key_max_age_days": 365})), facts)
        return [
            f["actual"] for f in report["findings"] if f["rule"] == "HANA-KEY-010" and f["volume"] == "data"
        ]

    assert key_010() == [(REAL_TODAY - FORMAT_DAY).days]  # the 2020 key, reported
    import_token(old_volume, reencrypt.key_date_token(datetime.date(2099, 1, 1), parse(old_volume)["uuid"]))
    assert key_010(), "a 2020 key, silent under a 365-day cryptoperiod"


def test_a_token_copied_from_another_volume_dates_this_volumes_old_key(old_volume, make_luks):
    """HOLE (design, fixed: a token names its volume by its LUKS UUID): a token names the keys it does NOT date, so any token of ours with an
    empty (or unrelated) "replaces" dates every key of the header it lands in. An admin who
    copies the date token of a fresh volume onto an old one (cryptsetup token export/import,
    a header "template", a script that imports the same token everywhere) makes a 2020 key
    read as made today: the audit reports it younger than it is.
    Fix: once the key exists, name it positively: luksFormat's and the in-place route's
    tokens can carry {"key": fingerprint} at once, and the re-encryption's negative token can
    be exchanged for a positive one by the first run after the end (stage "current"); a key
    is then dated only by a token that names it (a negative token only during a
    re-encryption, for the new key). A deliberate forger who computes the fingerprint is not
    stopped (no secret binds the token), which the docstring should then say."""
    fresh = make_luks(kdf="pbkdf2")
    import_token(fresh, reencrypt.key_date_token(REAL_TODAY, parse(fresh)["uuid"]))
    exported = subprocess.run(
        ["cryptsetup", "token", "export", "--token-id", "0", str(fresh)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    import_token(old_volume, exported)
    assert reencrypt.volume_key_date(parse(old_volume)) == FORMAT_DAY


def test_a_future_lv_tag_is_recorded_by_the_in_place_state(monkeypatch, tmp_path):
    """HOLE (fixed: min(tag day, today)): encrypted_in_place/_date_in_place_key imports whatever day the LV's
    hana_storage_key_made_ tag says, after today too (a forged tag, a tag written while the
    clock ran ahead: lvchange --addtag needs no key). tagged_key_day keeps the oldest tag, but
    a single future tag (or all tags in the future) is recorded as the key's date, and then
    dates it 0 days old until that day.
    Fix: _date_in_place_key (or in_place_facts) refuses a tag day after today (records
    nothing, says so: the key stays of unknown age), or records min(tag day, today)."""
    spec = importlib.util.spec_from_file_location(
        "hana_storage_state_attack18", REPO / "_states" / "hana_storage.py"
    )
    states = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(states)
    run_all = MagicMock(return_value={"retcode": 0, "stdout": "", "stderr": ""})
    facts = {
        "signature": "crypto_LUKS", "reencryption": None, "mapped": True, "leftovers": [], "suspended": [],
        "unit": inplace.unit_name("hana_data"), "running": False, "progress": None, "mounted_from": "crypt",
        "users": [], "device_bytes": 512 << 20, "fs_bytes": None, "fs_sector": None, "lv_tags": [],
        "key_day": inplace.tagged_key_day(["hana_storage_key_made_2099-01-01"]),
    }  # fmt: skip
    salt = {
        "hana_storage_host.in_place_facts": MagicMock(return_value=facts),
        "hana_storage_host.lv_room": MagicMock(
            return_value={"segments": [], "pvs": [{"pv": "/dev/vda", "free": 9, "extent_bytes": 4 << 20}]}
        ),
        "hana_storage_host.luks_header": MagicMock(return_value={"uuid": "u-1"}),
        "cmd.run_all": run_all,
    }
    monkeypatch.setattr(states, "__salt__", salt, raising=False)
    monkeypatch.setattr(states, "__opts__", {"test": False}, raising=False)
    monkeypatch.setattr(states, "__context__", {}, raising=False)
    states.encrypted_in_place(
        "hana_data", "/dev/vg/lv", "/hana/data", "/k.key", {"sector_size": 4096}, 2, 64, ["noatime"]
    )
    recorded = [
        json.loads(c.kwargs["stdin"])["created"]
        for c in run_all.call_args_list
        if c.args[0][:3] == ["cryptsetup", "token", "import"]
    ]
    assert all(datetime.date.fromisoformat(day) <= REAL_TODAY for day in recorded), recorded


def test_a_digest_whose_segments_is_not_a_list_is_a_luks_error(make_luks):
    """HOLE (fixed on main; parser, predates this branch: luks._summarise's digests_for_segment, reached now
    next to the new _keys_in_use): a digest with "segments": 5 (or true) makes parse_header
    raise TypeError ("argument of type 'int' is not iterable"), not LuksError. luks_header
    catches ValueError only, so the audit's fact collection dies on one forged header and
    every other finding of every volume is lost.
    Fix: in _summarise use _list(d.get("segments")) (and _list for "keyslots"), or have
    _volume_keys reject a digest whose "segments" is not a list of strings with LuksError."""
    path = make_luks(kdf="pbkdf2")
    for bad in (5, True):
        rewrite_luks2_json(path, lambda meta, bad=bad: meta["digests"]["0"].__setitem__("segments", bad))
        try:
            parse(path)
        except luks.LuksError:
            pass


def test_a_luks1_volume_under_a_cryptoperiod_has_no_key_010(make_luks):
    """HOLE (minor, fixed: LUKS1 is reported of unknown age): _volume_key_age_rule returns for LUKS1, so a LUKS1 volume under a
    cryptoperiod gets no HANA-KEY-010 although its key's age is unknown (no token there).
    HANA-ENC-002 is reported, but it maps to AT_REST/SC-13, not PCI-3.7.4: an evidence view
    by control shows the cryptoperiod control as met for that volume.
    Fix: for a header of version != 2 report HANA-KEY-010 "unknown" (LUKS1 cannot record the
    date; convert it and re-encrypt)."""
    from hana_storage_core import rules

    from tests.unit.test_audit import PILLAR, compliant, plan_of

    facts = compliant()
    facts["today"] = REAL_TODAY.isoformat()
    facts["headers"]["dm-0"] = parse(make_luks(type="luks1", kdf="pbkdf2"))
    report = rules.audit(plan_of(dict(PILLAR, luks={"volume_key_max_age_days": 365})), facts)
    data = {f["rule"] for f in report["findings"] if f["volume"] == "data"}
    assert "HANA-ENC-002" in data
    assert "HANA-KEY-010" in data, sorted(data)


# ---- what holds ------------------------------------------------------------------------------


def test_cryptsetup_refuses_a_token_import_once_the_init_ran(old_volume, keyfile):
    """The docstring's premise: from --init-only to the end no token can be imported (so
    nobody dates the old key anew during a re-encryption with the CLI)."""
    reencrypt_offline(old_volume, keyfile, "--init-only")
    done = import_token(
        old_volume, reencrypt.key_date_token(REAL_TODAY, parse(old_volume)["uuid"]), check=False
    )
    assert done.returncode != 0 and "reencryption" in done.stderr
    assert reencrypt.volume_key_date(parse(old_volume)) == FORMAT_DAY


def test_a_killed_init_then_a_hand_re_encryption_dates_the_new_key_older_not_younger(old_volume, keyfile):
    """The formula's token imported, its removals done, the init killed (never ran); an admin
    re-encrypts by hand later: the new key is dated by the stale token's day (<= the day it
    was really made), the old one never younger than FORMAT_DAY."""
    (key,) = parse(old_volume)["volume_keys"]
    before = parse(old_volume)
    stale_day = REAL_TODAY - datetime.timedelta(days=30)
    import_token(old_volume, reencrypt.key_date_token(stale_day, parse(old_volume)["uuid"], replaces=[key]))
    for tid in reencrypt.tokens_to_replace(before):
        remove_token(old_volume, tid)
    assert reencrypt.volume_key_date(parse(old_volume)) == FORMAT_DAY  # the stale token dates nothing
    reencrypt_offline(old_volume, keyfile, "--init-only")
    during = parse(old_volume)
    assert reencrypt.volume_key_date(during) == FORMAT_DAY  # the old key still encrypts most
    assert sorted(reencrypt.key_dates(during).values()) == [FORMAT_DAY, stale_day]
    reencrypt_offline(old_volume, keyfile, "--resume-only")
    assert reencrypt.volume_key_date(parse(old_volume)) == stale_day <= REAL_TODAY


def test_many_failed_inits_keep_our_tokens_bounded_and_never_touch_another_tool(old_volume):
    """40 runs whose init fails after the date and the removals: our tokens stay at most two
    (three for an instant), a token of another tool is never removed, and the key keeps its
    real date: the formula cannot crowd Clevis out of the 32 token slots."""
    import_token(old_volume, json.dumps({"type": "other-tool", "keyslots": [], "x": 1}))
    (key,) = parse(old_volume)["volume_keys"]
    for n in range(40):
        header = parse(old_volume)
        import_token(
            old_volume,
            reencrypt.key_date_token(
                FORMAT_DAY + datetime.timedelta(days=n + 1), parse(old_volume)["uuid"], [key]
            ),
        )
        assert len(parse(old_volume)["tokens"]) <= 4
        for tid in reencrypt.tokens_to_replace(header):
            remove_token(old_volume, tid)
        header = parse(old_volume)
        assert len(ours(header)) <= 2 and [t for t in header["tokens"] if t["type"] == "other-tool"]
        assert reencrypt.volume_key_date(header) == FORMAT_DAY


def test_a_header_restored_from_a_backup_before_the_date_keeps_the_old_date(old_volume, tmp_path):
    backup = tmp_path / "hdr.bak"
    cryptsetup("luksHeaderBackup", str(old_volume), "--header-backup-file", str(backup))
    (key,) = parse(old_volume)["volume_keys"]
    import_token(old_volume, reencrypt.key_date_token(REAL_TODAY, parse(old_volume)["uuid"], [key]))
    cryptsetup("luksHeaderRestore", "-q", str(old_volume), "--header-backup-file", str(backup))
    assert reencrypt.volume_key_date(parse(old_volume)) == FORMAT_DAY


@pytest.mark.parametrize(
    "token",
    [
        {"created": {"y": 2025}},
        {"created": "2025-01-01", "replaces": [{"a": 1}]},
        {"created": "2025-01-01", "replaces": ["ａｂ"]},
        {"created": "2025-01-01", "replaces": ["0123456789abcdef"] * 33},
        {"created": "2025-01-01", "replaces": None},
        {"created": "2025-01-01", "replaces": "0123456789abcdef"},
        {"created": "2025-01-01\u0000"},
        {"created": "0000-01-01"},
    ],
)
def test_forged_token_shapes_are_errors_never_tracebacks_nor_younger_dates(old_volume, token):
    """Every odd token is parsed without a traceback and dates nothing: the key keeps
    FORMAT_DAY (an ignored token can only make a key older: the date is a max)."""
    rewrite_luks2_json(
        old_volume,
        lambda meta: meta["tokens"].__setitem__(
            "7", {"type": reencrypt.KEY_DATE_TOKEN, "keyslots": [], **token}
        ),
    )
    header = parse(old_volume)
    (forged,) = [t for t in ours(header) if t["id"] == 7]
    assert "error" in forged["key_date"]
    assert reencrypt.volume_key_date(header) == FORMAT_DAY
    assert 7 in reencrypt.tokens_to_replace(header)


@pytest.mark.parametrize("edit", ["drop_salt", "salt_int", "digest_list"])
def test_a_digest_without_salt_is_a_luks_error(make_luks, edit):
    path = make_luks(kdf="pbkdf2")

    def change(meta):
        digest = meta["digests"]["0"]
        if edit == "drop_salt":
            del digest["salt"]
        elif edit == "salt_int":
            digest["salt"] = 5
        else:
            digest["digest"] = ["x"]

    rewrite_luks2_json(path, change)
    with pytest.raises(luks.LuksError):
        parse(path)


def test_no_key_material_in_the_token_nor_the_summary(old_volume, keyfile):
    """The token and the parsed summary hold no salt, digest or key bytes."""
    meta = json.loads(cryptsetup("luksDump", "--dump-json-metadata", str(old_volume)).stdout)
    secrets = {meta["digests"]["0"]["salt"], meta["digests"]["0"]["digest"], keyfile.read_bytes().hex()}
    secrets |= {s["kdf"]["salt"] for s in meta["keyslots"].values()}
    (key,) = parse(old_volume)["volume_keys"]
    text = json.dumps(parse(old_volume), default=str) + reencrypt.key_date_token(
        REAL_TODAY, parse(old_volume)["uuid"], [key]
    )
    assert not [s for s in secrets if s in text]


def test_test_mode_of_the_re_encryption_writes_nothing(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "hana_storage_state_attack18b", REPO / "_states" / "hana_storage.py"
    )
    states = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(states)
    header = {
        "version": 2,
        "sector_size": 512,
        "tokens": [],
        "reencryption": None,
        "volume_keys": ["0123456789abcdef"],
    }
    facts = {"header": header, "mapped": True, "leftovers": [], "suspended": [], "unit": "u", "running": False,
             "progress": None, "fs_sector": 4096, "keyslot": 0}  # fmt: skip
    run_all = MagicMock(return_value={"retcode": 0, "stdout": "", "stderr": ""})
    monkeypatch.setattr(states, "__salt__", {"hana_storage_host.reencrypt_facts": MagicMock(return_value=facts),
                                             "cmd.run_all": run_all}, raising=False)  # fmt: skip
    monkeypatch.setattr(states, "__opts__", {"test": True}, raising=False)
    monkeypatch.setattr(states, "__context__", {}, raising=False)
    monkeypatch.setattr(os, "makedirs", MagicMock(side_effect=AssertionError("a write in test mode")))
    ret = states.reencrypted_online(
        "hana_data", "/dev/vg/lv", "/k.key", {"sector_size": 4096}, "/dev/mapper/x", 365
    )
    assert ret["result"] is None and "record today" in ret["comment"]
    run_all.assert_not_called()
