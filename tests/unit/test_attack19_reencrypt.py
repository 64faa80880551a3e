"""Attack 19 on the re-encryption online (reencrypted_online, reencrypt.py, the date token,
header backups across a re-encryption, the pillar gate).

The state runs here on an image file with real cryptsetup 2.6.1: the host's facts are
hana_storage_host.reencrypt_facts read from the image (only /sys, systemd and the XFS are
stubbed), every command runs for real (the init with --force-offline-reencrypt: an image is no
block device), and the unit's `cryptsetup reencrypt --resume-only` is run offline by the test.
Tests whose docstring starts with "HOLE" failed on the code they were written against (cecfefb)
and are its regression tests now."""

import datetime
import hashlib
import json
import os
import subprocess

import pytest
from hana_storage_core import luks, reencrypt, rules

from tests.support.real_commands import real_run_all
from tests.unit.conftest import cryptsetup, rewrite_luks2_json
from tests.unit.test_events import load

states = load("_states/hana_storage.py", "hana_storage_state_attack19")
host = load("_modules/hana_storage_host.py", "hana_storage_host_attack19")

TODAY = datetime.date.today()
OLD = datetime.date(2020, 1, 1)  # the day the volume key was really made
NAME = "hana_data"
CHEAP = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
LUKS = {"cipher": "aes-xts-plain64", "key_size": 512, "sector_size": 4096,
        "pbkdf": {"type": "pbkdf2", "force_iterations": 1000}}  # fmt: skip
OK = {"retcode": 0, "stdout": "", "stderr": ""}


class Killed(BaseException):
    """The apply killed (SIGKILL) as it was about to run a command."""


def parse(path):
    return luks.parse_header(luks.reader_for(path.read_bytes()))


def ours(header):
    return [t for t in header["tokens"] if t["type"] == reencrypt.KEY_DATE_TOKEN]


def import_token(path, text):
    subprocess.run(["cryptsetup", "token", "import", str(path)], input=text, text=True, check=True)


def resume(path, keyfile):
    """What the unit does: the re-encryption to its end (offline on an image)."""
    run = ["cryptsetup", "reencrypt", "-q", "--resume-only", "--force-offline-reencrypt",
           "--key-file", str(keyfile), str(path)]  # fmt: skip
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def volume(make_luks):
    """A 512-byte-sector LUKS2 image whose volume key was made on OLD (the format's token)."""
    path = make_luks(sector_size=512, kdf="pbkdf2")
    cryptsetup("--version")
    import_token(path, reencrypt.key_date_token(OLD, parse(path)["uuid"]))
    return path


@pytest.fixture
def apply(monkeypatch, tmp_path, keyfile):
    """apply(image, test=False, kill=None) -> (ret, [(argv, stdin)]): one run of the state.
    ``kill(argv)`` true: the apply dies just before that command."""
    monkeypatch.setattr(states, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(states, "_ramfs", lambda directory: os.makedirs(directory, exist_ok=True))
    monkeypatch.setattr(host, "_sysfs", lambda: {"dm-9": {"dm": {"name": NAME, "suspended": False}}})
    monkeypatch.setattr(host, "_unit_active", lambda unit: False)
    monkeypatch.setattr(host, "_reencrypt_running", lambda crypt_name, device: False)
    monkeypatch.setattr(host, "xfs_superblock", lambda device: {"sectsize": 4096})
    monkeypatch.setattr(host, "__salt__", {"cmd.run_all": real_run_all}, raising=False)

    def run(image, test=False, kill=None):
        ran = []

        def run_all(argv, **kwargs):
            argv = list(argv)
            if kill and kill(argv):
                raise Killed(argv)
            ran.append((argv, kwargs.get("stdin")))
            if argv[0] in ("systemctl", "systemd-run"):
                return OK
            if argv[:2] == ["cryptsetup", "reencrypt"]:
                argv = [*argv[:-1], "--force-offline-reencrypt", argv[-1]]
            return real_run_all(argv, **kwargs)

        salt = {
            "hana_storage_host.reencrypt_facts": host.reencrypt_facts,
            "hana_storage_host.luks_header": host.luks_header,
            "cmd.run_all": run_all,
        }
        monkeypatch.setattr(states, "__salt__", salt, raising=False)
        monkeypatch.setattr(states, "__opts__", {"test": test}, raising=False)
        monkeypatch.setattr(states, "__context__", {}, raising=False)
        try:
            ret = states.reencrypted_online(NAME, str(image), str(keyfile), LUKS, "/dev/mapper/x", 365)
        except Killed:
            ret = None
        return ret, ran

    return run


# ---- holes -----------------------------------------------------------------------------------


def test_a_systemd_tpm2_binding_and_an_escrow_keyslot_are_dropped_by_the_re_encryption(
    volume, apply, keyfile, tmp_path
):
    """HOLE (fixed): [data loss: a way in is dropped] stage() refuses only a *Clevis* token. A TPM2
    binding made by systemd-cryptenroll (token "systemd-tpm2", its own keyslot) or an escrow
    passphrase keyslot (someone's way in the pillar does not know) is not looked at: the init
    runs with --key-slot <the key's>, and when the re-encryption ends every other keyslot is
    gone (the passphrase opens nothing; the host no longer unlocks by TPM2 at boot), and the
    old header backup that held them is replaced automatically (`rekeyed`).
    Fix: reencrypt_facts/stage refuse ("refused", naming them) while the header holds a keyslot
    other than facts["keyslot"] or a token other than ours (systemd-*, clevis, any other)."""
    escrow = tmp_path / "escrow"
    escrow.write_bytes(b"escrow passphrase kept in the vault")
    cryptsetup("luksAddKey", "-q", *CHEAP, "--key-file", str(keyfile), str(volume), str(escrow))
    tpm2 = {"type": "systemd-tpm2", "keyslots": ["1"], "tpm2-blob": "AA==", "tpm2-pcrs": [7],
            "tpm2-pcr-bank": "sha256", "tpm2-primary-alg": "ecc", "tpm2-policy-hash": "00", "tpm2-pin": False}  # fmt: skip
    rewrite_luks2_json(volume, lambda meta: meta.setdefault("tokens", {}).__setitem__("5", tpm2))
    ret, _ = apply(volume)
    if parse(volume)["reencryption"]:  # the init ran: let the unit finish, then try the escrow
        resume(volume, keyfile)
        opened = cryptsetup("open", "--test-passphrase", "--key-file", str(escrow), str(volume), check=False)
        assert opened.returncode == 0, (
            f"the escrow keyslot and the TPM2 binding were dropped: {ret['comment']}"
        )
    assert ret["result"] is False and not parse(volume)["reencryption"], ret


def test_a_future_token_is_kept_and_dates_the_new_key_younger_than_it_is(volume, apply, keyfile):
    """HOLE (fixed): [wrong audit: a key younger than it is] tokens_to_replace calls key_dates(header)
    without today, so a token dated after today (a luksFormat token written while the host's
    clock ran 30 days ahead, or a forged one) is taken as the key's date: it is KEPT, and the
    real dating token is removed. After the formula's own re-encryption ends, the new key
    (made today) is dated by that token once its day comes: 31 days later the audit reads it
    1 day old. Had it been removed (it dates nothing today), the key would read 31.
    Fix: tokens_to_replace(header, today) uses key_dates(header, today): a token after today
    is among those removed (the state passes datetime.date.today())."""
    uuid = parse(volume)["uuid"]
    import_token(volume, reencrypt.key_date_token(TODAY + datetime.timedelta(days=30), uuid))
    assert reencrypt.volume_key_date(parse(volume), TODAY) == OLD  # judged right today
    ret, _ = apply(volume)
    assert ret["result"] is True, ret
    resume(volume, keyfile)
    header = parse(volume)
    assert reencrypt.key_age_days(header, TODAY) == 0
    later = TODAY + datetime.timedelta(days=31)
    assert reencrypt.key_age_days(header, later) >= 31, [t["key_date"] for t in ours(header)]


def test_a_backup_made_during_the_re_encryption_is_kept_and_offered_for_restore_after_it(
    volume, apply, keyfile, tmp_path
):
    """HOLE (fixed): [data loss by advice] during the re-encryption the audit calls the backup from
    before `stale` (HANA-KEY-006: "back it up again ... cryptsetup luksHeaderBackup"); an admin
    who does so gets a backup holding both volume keys and the re-encryption's state (offset).
    Once it ends, that backup shares the new key with the header, so `rekeyed` does not fire:
    it is HANA-KEY-007 keyslots_lost, kept forever, with "If the volume's key no longer opens
    it, restore it now: cryptsetup luksHeaderRestore". Restored, it says the data is still
    under the old key from the saved offset on: every byte re-encrypted since reads wrong, and
    a resume then encrypts that garbage again.
    Fix: in header_backup_problem, fire `rekeyed` when (theirs - ours) & replaced_keys(header)
    (a key of the backup that a token of ours retired), not only when none is shared; and/or
    call a backup whose header is under re-encryption while the live one is not `rekeyed`."""
    before = tmp_path / "before.luks-header"
    cryptsetup("luksHeaderBackup", str(volume), "--header-backup-file", str(before))
    ret, _ = apply(volume)
    assert ret["result"] is True and parse(volume)["reencryption"], ret
    during = rules.header_backup_problem(host.header_backup(str(before)), parse(volume))
    assert during and during["rule"] == "HANA-KEY-006", during  # what leads to the backup below
    midway = tmp_path / "midway.luks-header"
    cryptsetup("luksHeaderBackup", str(volume), "--header-backup-file", str(midway))
    resume(volume, keyfile)
    problem = rules.header_backup_problem(host.header_backup(str(midway)), parse(volume))
    assert problem and problem["rule"] == "HANA-KEY-006", problem


def test_the_scratch_directory_names_its_owner_by_the_pid_proc_knows(monkeypatch, tmp_path):
    """HOLE (fixed): [minor: a killed run's header copy may stay, or a live run's directory be removed]
    commit 3c3be38 names descriptors by readlink("/proc/self"), because os.getpid() is another
    process in a PID namespace sharing its parent's /proc. _run_scratch (now also the
    re-encryption's init) still names its directory clevis-<_process_id(os.getpid())>-: there it
    is "clevis-None-..." (a concurrent run removes it while cryptsetup works in it) or names
    another live process (never removed).
    Fix: _process_id(os.readlink("/proc/self")) in _run_scratch (one helper with files.fd_path)."""
    monkeypatch.setattr(states, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(states, "_ramfs", lambda directory: os.makedirs(directory, exist_ok=True))
    monkeypatch.setattr(states, "__context__", {}, raising=False)
    seen = {}

    def run_all(argv, env=None, **_):
        seen["owned"] = states._scratch_owner_runs(os.path.basename(env["TMPDIR"]))
        return OK

    monkeypatch.setattr(states, "__salt__", {"cmd.run_all": run_all}, raising=False)
    monkeypatch.setattr(os, "getpid", lambda: (1 << 22) + 7)  # a namespace pid /proc does not know
    states._run_scratch(["true"], workdir=True)
    assert seen["owned"] is True


# ---- what holds ------------------------------------------------------------------------------


def test_a_kill_after_the_token_import_leaves_the_old_date_and_the_next_run_goes_on(volume, apply, keyfile):
    """Killed before the init (token imported), then between the next run's import and its
    removal of the first run's token: each next run keeps the key's real date, our tokens stay
    few, and the last run inits."""
    for kill in (lambda a: a[:2] == ["cryptsetup", "reencrypt"],
                 lambda a: a[:3] == ["cryptsetup", "token", "remove"]):  # fmt: skip
        ret, _ = apply(volume, kill=kill)
        header = parse(volume)
        assert ret is None and not header["reencryption"]
        assert reencrypt.volume_key_date(header, TODAY) == OLD and len(ours(header)) <= 3
    ret, ran = apply(volume)
    header = parse(volume)
    assert ret["result"] is True and header["reencryption"] and len(ours(header)) <= 2
    assert reencrypt.volume_key_date(header, TODAY) == OLD  # the old key still encrypts most
    resume(volume, keyfile)
    assert reencrypt.volume_key_date(parse(volume), TODAY) == TODAY


def test_the_newer_backup_is_kept_when_an_older_header_is_restored_over_a_re_encryption(
    volume, apply, keyfile, tmp_path
):
    """`rekeyed` cannot fire for the one way back: a header from before the re-encryption (its
    token names the old key) restored by mistake over the re-encrypted data; the backup of the
    new key is then the way back, and it is HANA-KEY-007 (kept), not replaced."""
    apply(volume, kill=lambda a: a[:2] == ["cryptsetup", "reencrypt"])  # the token names the old key
    old_header, new_backup = tmp_path / "old", tmp_path / "new"
    cryptsetup("luksHeaderBackup", str(volume), "--header-backup-file", str(old_header))
    assert apply(volume)[0]["result"] is True
    resume(volume, keyfile)
    cryptsetup("luksHeaderBackup", str(volume), "--header-backup-file", str(new_backup))
    cryptsetup("luksHeaderRestore", "-q", str(volume), "--header-backup-file", str(old_header))
    problem = rules.header_backup_problem(host.header_backup(str(new_backup)), parse(volume))
    assert (problem["rule"], problem["code"]) == ("HANA-KEY-007", "other_volume_key"), problem


def test_a_kill_between_the_init_and_the_unit_start_only_starts_the_unit_next(volume, apply):
    ret, _ = apply(volume, kill=lambda a: a[0] == "systemd-run")
    assert ret is None and parse(volume)["reencryption"]
    image = volume.read_bytes()
    ret, ran = apply(volume)
    assert ret["result"] is True and ret["changes"]["reencrypting"]["from"] == "paused", ret
    assert [a[0] for a, _ in ran] == ["systemctl", "systemd-run"] and volume.read_bytes() == image


def test_test_mode_changes_nothing_at_any_stage(volume, apply):
    for _ in range(2):  # wanted, then paused (after a real run's init)
        image = volume.read_bytes()
        ret, ran = apply(volume, test=True)
        assert ret["result"] is None and ret["changes"] == {} and ran == [] and volume.read_bytes() == image
        apply(volume, kill=lambda a: a[0] == "systemd-run")


def test_no_key_material_in_any_argv_stdin_or_return(volume, apply, keyfile):
    meta = json.loads(cryptsetup("luksDump", "--dump-json-metadata", str(volume)).stdout)
    secrets = {keyfile.read_bytes().hex(), hashlib.sha256(keyfile.read_bytes()).hexdigest()}
    secrets |= {d["salt"] for d in meta["digests"].values()} | {d["digest"] for d in meta["digests"].values()}
    ret, ran = apply(volume)
    text = json.dumps([ret, ran], default=str)
    assert ret["result"] is True and not [s for s in secrets if s in text]
    assert keyfile.read_bytes().decode("latin-1") not in text
    assert all(str(keyfile) == a[a.index("--key-file") + 1] for a, _ in ran if "--key-file" in a)


def test_a_volume_under_encryption_in_place_or_with_clevis_is_left_alone(volume, apply, monkeypatch):
    """mode encrypt (the in-place route's) is foreign; a Clevis token refuses; nothing runs."""
    facts = host.reencrypt_facts
    image = volume.read_bytes()
    clevis = {"id": 9, "type": "clevis", "keyslots": [2]}
    for over in (
        {"header": dict(parse(volume), reencryption={"mode": "encrypt"})},
        {"header": dict(parse(volume), tokens=[*parse(volume)["tokens"], clevis])},
    ):
        monkeypatch.setattr(host, "reencrypt_facts", lambda *a, over=over: {**facts(*a), **over})
        ret, ran = apply(volume)
        assert ret["result"] is False and "Nothing was changed" in ret["comment"] and ran == []
    assert volume.read_bytes() == image


@pytest.mark.parametrize("bytes_", [b"", b"LUKS\xba\xbe" + b"\0" * 100, b"\0" * 70000, b"x" * 5000])
def test_a_malformed_backup_file_is_an_error_never_a_traceback(tmp_path, bytes_):
    path = tmp_path / "b.luks-header"
    path.write_bytes(bytes_)
    fact = host.header_backup(str(path))
    assert fact["exists"] is True and "error" in fact
    assert rules.header_backup_problem(fact, {"uuid": "u", "volume_keys": ["a"], "keyslots": []})


def test_the_pillar_gate_refuses_clevis_rotation_in_place_and_defaults_not_below_lvm():
    import copy

    from tests.unit.test_pillar import GOOD, KEY, errors_of

    def errors(edit):
        pillar = copy.deepcopy(GOOD)
        pillar["volumes"]["data"]["reencrypt_online"] = True
        edit(pillar)
        return " ".join(errors_of(pillar))

    assert errors(lambda p: None) == ""
    assert "being rotated" in errors(
        lambda p: p["key"].__setitem__("previous", {"source": "pillar", "material": KEY})
    )
    assert "encrypted in place" in errors(
        lambda p: p["volumes"]["data"].__setitem__("encrypt_in_place", True)
    )
    tang = {"source": "tang", "servers": [{"url": "http://t:7500", "thumbprint": "x" * 43}],
            "recovery": {"source": "pillar", "material": KEY}}  # fmt: skip
    assert "binds through Clevis" in errors(lambda p: p["volumes"]["data"].__setitem__("key", tang))
    assert "unknown key" in errors(lambda p: p.__setitem__("volume_defaults", {"reencrypt_online": True}))
    # below LVM each PV gets a new key, its sector size stays (reencrypt.wants)
    assert errors(lambda p: p["volumes"]["data"].__setitem__("encryption", "below_lvm")) == ""
