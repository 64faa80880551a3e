"""Issue 33: the boot readiness verdict per crypttab line (core.readiness), over facts as
hana_storage_host.boot_path reads them; the VM proof is tests/vm/test_lab_boot.py."""

import json
import subprocess

import pytest
from hana_storage_core import readiness, tab

KEY = "/etc/hana-storage/keys/hana.key"
ENABLED = {unit: "enabled" for unit in readiness.ASKPASS_UNITS}


def line(text):
    (parsed,) = tab.parse_crypttab(text)
    return parsed


def codes(text, **facts):
    judged = readiness.line_verdict(line(text), {"source": "/dev/dm-3", "units": ENABLED, **facts})
    assert judged["ready"] is (not judged["problems"])
    assert all(p["cause"] and p["fix"] for p in judged["problems"])
    return [p["code"] for p in judged["problems"]]


KEY_LINE = f"hana_data UUID=0c1d {KEY} luks,no-read-workqueue"
TANG_LINE = "hana_log_0 /dev/vde none luks,_netdev"


@pytest.mark.parametrize(
    "key,found",
    [
        ({"path": KEY, "exists": True, "opens": True, "error": None}, []),
        ({"path": KEY, "exists": False}, ["key_file_missing"]),
        ({"path": KEY, "exists": True, "opens": False, "error": None}, ["key_does_not_open"]),
        (
            {"path": KEY, "exists": True, "opens": None, "error": "cryptsetup exited 1 (wrong parameters)"},
            ["key_untested"],
        ),
    ],
)
def test_a_key_file_line_is_ready_when_its_key_file_opens_the_device(key, found):
    assert codes(KEY_LINE, key=key) == found


def test_a_missing_device_is_named_and_nothing_else_is_tried():
    judged = readiness.line_verdict(line(KEY_LINE), {"source": None, "units": ENABLED})
    assert [p["code"] for p in judged["problems"]] == ["device_missing"]
    assert "UUID=0c1d" in judged["problems"][0]["cause"]


def test_a_tang_line_needs_the_agent_the_network_and_clevis_unlocking_now():
    unlocks = {"tokens": 1, "network": True, "unlocks": True, "error": None}
    assert codes(TANG_LINE, clevis=unlocks) == []
    refused = {
        "tokens": 1,
        "network": True,
        "unlocks": False,
        "error": "keyslot 1: Error communicating with server",
    }
    assert codes(TANG_LINE, clevis=refused) == ["clevis_fails"]
    units = {"clevis-luks-askpass.path": "disabled", "remote-cryptsetup.target": "enabled-runtime"}
    found = codes("hana_log_0 /dev/vde none luks", clevis=unlocks, units=units)
    assert found == ["askpass_disabled", "askpass_disabled", "no_netdev"]
    judged = readiness.line_verdict(
        line(TANG_LINE), {"source": "/dev/vde", "units": ENABLED, "clevis": refused}
    )
    assert "Error communicating with server" in judged["problems"][0]["cause"]


def test_no_key_file_and_no_clevis_is_a_passphrase_at_the_console():
    assert codes("hana_log_0 /dev/vde none luks", clevis={"tokens": 0}) == ["no_unattended_unlock"]
    assert codes("hana_log_0 /dev/vde - luks") == ["no_unattended_unlock"]


def test_noauto_lines_are_salts_and_throwaway_lines_need_their_device_only():
    judged = readiness.line_verdict(line(f"hana_x /dev/vdx {KEY} luks,noauto"), {"source": None})
    assert judged == {
        "name": "hana_x",
        "device": "/dev/vdx",
        "at_boot": False,
        "blocks_boot": False,
        "problems": [],
        "ready": True,
    }
    assert codes("swap /dev/sda3 /dev/urandom swap,cipher=aes-xts-plain64") == []


def test_the_host_is_ready_only_when_every_line_is():
    lines = tab.parse_crypttab(f"{KEY_LINE}\n{TANG_LINE}\n")
    good = {"source": "/dev/dm-3", "units": ENABLED, "key": {"path": KEY, "exists": True, "opens": True}}
    tang = {"source": "/dev/vde", "units": ENABLED, "clevis": {"tokens": 1, "unlocks": True}}
    assert readiness.verdict(lines, [good, tang])["ready"] is True
    tang_down = dict(tang, clevis={"tokens": 1, "unlocks": False, "error": "timeout"})
    result = readiness.verdict(lines, [good, tang_down])
    assert result["ready"] is False and [r["ready"] for r in result["lines"]] == [True, False]


def test_a_tpm2_only_binding_needs_no_network_but_a_key_in_systemds_directory_is_a_key_file():
    tpm = {"tokens": 1, "network": False, "unlocks": True, "error": None}
    assert codes("hana_log_0 /dev/vde none luks", clevis=tpm) == []
    in_directory = {"path": "/etc/cryptsetup-keys.d/hana_log_0.key", "exists": True, "opens": False}
    assert codes("hana_log_0 /dev/vde none luks", key=in_directory) == ["key_does_not_open"]


def test_an_unreadable_header_is_named_not_taken_for_a_missing_binding():
    broken = {
        "tokens": 0,
        "network": False,
        "unlocks": False,
        "error": "no readable LUKS header: bad checksum",
    }
    assert codes("hana_log_0 /dev/vde none luks,_netdev", clevis=broken) == ["header_unreadable"]


@pytest.mark.parametrize(
    "text",
    [
        f"hana_data /dev/vdb {KEY} luks,header=/etc/hdr.img",
        f"hana_data /dev/vdb {KEY} luks,keyfile-offset=512",
        f"hana_data /dev/vdb {KEY} luks,key-slot=3",
        "hana_data /dev/vdb none luks,fido2-device=auto",
        "hana_data /dev/vdb /keys/k:UUID=1234 luks",
    ],
)
def test_a_line_this_check_cannot_follow_is_unchecked_never_ready(text):
    assert readiness.judged_by_key(line(text)) is False
    assert codes(text) == ["unchecked"]


def test_a_nofail_line_does_not_block_the_boot_but_is_not_ready_either():
    judged = readiness.line_verdict(
        line(f"hana_data UUID=0c1d {KEY} luks,nofail"), {"source": None, "units": ENABLED}
    )
    assert (judged["blocks_boot"], judged["ready"]) == (False, False)


# ---- the Clevis call (hana_storage_host._clevis_pass), with a stand-in clevis ----------------


@pytest.fixture
def host(monkeypatch, tmp_path):
    import importlib.util

    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location(
        "host_readiness", REPO / "_modules" / "hana_storage_host.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setattr(module, "CLEVIS_ENV", {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/bin", "LC_ALL": "C"})
    module.bin_dir = bin_dir
    return module


# bytes of a test image made by luks_image: its whole header (metadata 16 KiB, keyslots 1 MiB)
IMAGE_BYTES = 4 << 20


def luks_image(folder, keyslots=(1,)):
    """A real LUKS2 image in ``folder`` (cheap PBKDF2 keyslots, no token): keyslot 0 opens with
    "first", each of ``keyslots`` with "second"."""
    image, first, second = folder / "luks.img", folder / "first.key", folder / "second.key"
    image.write_bytes(bytes(IMAGE_BYTES))
    first.write_bytes(b"first")
    second.write_bytes(b"second")
    fast = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    steps = [
        ["luksFormat", "-q", "--type", "luks2", *fast, "--luks2-metadata-size", "16k"]
        + ["--luks2-keyslots-size", "1m", "--key-file", str(first), str(image)]
    ] + [
        [
            "luksAddKey",
            "-q",
            *fast,
            "--key-slot",
            str(slot),
            "--key-file",
            str(first),
            str(image),
            str(second),
        ]
        for slot in keyslots
    ]
    for argv in steps:
        subprocess.run(["cryptsetup", *argv], check=True, capture_output=True)  # noqa: S603, S607
    return image


def null_jwe(secret):
    """A Clevis token's ``jwe`` (the JSON form) of ``secret`` under the null pin: it decrypts
    with no Tang server and no TPM."""
    compact = subprocess.run(
        ["clevis", "encrypt", "null", "{}"],  # noqa: S607
        input=secret,
        capture_output=True,
        check=True,
    ).stdout
    return json.loads(
        subprocess.run(["jose", "jwe", "fmt", "-i-"], input=compact, capture_output=True, check=True).stdout  # noqa: S607
    )


def import_clevis_token(image, keyslots, secret, token_id=None):
    """A Clevis token on ``keyslots`` (strings) of ``image`` whose null-pin JWE decrypts to ``secret``."""
    subprocess.run(  # noqa: S603
        ["cryptsetup", "token", "import", *(["--token-id", token_id] if token_id else []), str(image)],  # noqa: S607
        input=json.dumps({"type": "clevis", "keyslots": keyslots, "jwe": null_jwe(secret)}).encode(),
        check=True,
        capture_output=True,
    )


def stand_in(host, script, program="clevis"):
    path = host.bin_dir / program
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


# what the stand-in cryptsetup got on its stdin for the keyslot it was asked about
TESTED = 'test "$1 $2 $3 $4 $5 $6" = "open --test-passphrase --key-slot 1 --key-file -" || exit 9\n'


def test_clevis_reads_the_copy_as_its_own_descriptor_and_its_answer_goes_nowhere(host, capfd, tmp_path):
    """The copy is handed down as the children's descriptor (/dev/fd/N): no process of clevis can
    reach another file by that number; the passphrase goes through a pipe into cryptsetup, which
    tests it on that keyslot alone, and nowhere else."""
    got = tmp_path / "got"
    stand_in(
        host, 'test "$1 $2 $3" = "luks pass -d" || exit 9\nhead -c 4 "$4" >&2\nprintf SECRET-PASSPHRASE\n'
    )
    stand_in(host, TESTED + f'test "$7" = "$7" && cat >{got}\n', program="cryptsetup")
    with host.core.files.memory_copy(__file__, 64) as copy:
        code, said = host._clevis_pass(copy, "1", 10)
    with open(__file__, encoding="utf-8") as handle:
        assert (code, said[:4]) == (0, handle.read(4))  # this very file's first bytes, through /dev/fd
    assert got.read_text() == "SECRET-PASSPHRASE"  # exactly, no newline added
    assert "SECRET" not in capfd.readouterr().out + said


def test_a_passphrase_that_does_not_open_the_keyslot_is_not_an_unlock(host):
    """clevis luks pass checks its passphrase against any keyslot; the keyslot asked about is
    cryptsetup's to answer for (regression, review: a token moved onto another binding's keyslot)."""
    stand_in(host, "printf SECRET\n")
    stand_in(
        host,
        TESTED + "cat >/dev/null\necho 'No key available with this passphrase.' >&2\nexit 2\n",
        "cryptsetup",
    )
    with host.core.files.memory_copy(__file__, 64) as copy:
        assert host._clevis_pass(copy, "1", 10) == (2, "No key available with this passphrase.")


def test_a_clevis_that_never_answers_is_killed_with_everything_it_started(host, tmp_path):
    """Regression (review): on a timeout only clevis itself was killed, and its curl lived on."""
    marker = tmp_path / "grandchild.pid"
    stand_in(host, f"sleep 300 &\necho $! >{marker}\nwait\n")
    stand_in(host, "cat >/dev/null\n", "cryptsetup")
    with host.core.files.memory_copy(__file__, 64) as copy:
        code, said = host._clevis_pass(copy, "1", 1)
    assert code is None and "no answer within 1 s" in said
    pid = int(marker.read_text())
    import os
    import time

    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"clevis's child {pid} outlived the timeout")


@pytest.mark.parametrize("bad", ["thirty", "", None, True, 0, 0.5, -30, 3601, float("nan"), "1e400"])
def test_a_clevis_timeout_that_is_no_number_of_seconds_is_refused_before_anything_is_read(host, bad):
    host._parsed_file = lambda *_: pytest.fail("crypttab read before the argument was checked")
    with pytest.raises(host.CommandExecutionError, match="clevis_timeout is seconds"):
        host.boot_path(clevis_timeout=bad)


def test_the_clevis_timeout_given_is_each_keyslot_s_and_four_of_them_the_whole_check_s(host, monkeypatch):
    """A slow TPM or Tang server (a lab guest under emulation, a busy vTPM) gets the time the
    caller gives it: each keyslot that long, all the lines together CLEVIS_WAITS times that."""
    lines = [tab.parse_crypttab(f"hana_{n} /dev/vd{n} none luks,_netdev\n")[0] for n in "bc"]
    given = []
    monkeypatch.setattr(host, "_parsed_file", lambda *_: lines)
    monkeypatch.setattr(host, "unit_enabled", lambda unit: "enabled")
    monkeypatch.setattr(host, "_crypttab_source_path", lambda device: device)
    monkeypatch.setattr(host, "_header_or_error", lambda path: {})
    monkeypatch.setattr(host.time, "monotonic", lambda: 1000.0)

    def unlocks(path, header, timeout, deadline):
        given.append((path, timeout, deadline))
        return {"tokens": 1, "network": True, "unlocks": True, "error": None}

    monkeypatch.setattr(host, "_clevis_unlocks", unlocks)
    assert len(host.boot_path(clevis_timeout="90")["facts"]) == 2
    assert given == [("/dev/vdb", 90.0, 1360.0), ("/dev/vdc", 90.0, 1360.0)]
