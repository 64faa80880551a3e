"""Attack 20 on _reencrypt_running (a hand `cryptsetup reencrypt` matched by the block device its
argv names) and on the bounded hotzone (reencrypt.hotzone_mib, --hotzone-size on the unit).
Tests whose docstring starts with "HOLE" fail on the code they were written against (effe833)."""

import os
import pathlib
import stat
import subprocess
import tempfile
import time

import pytest
from hana_storage_core import inplace, luks, reencrypt

from tests.conftest import REPO
from tests.unit.conftest import cryptsetup
from tests.unit.test_events import load

host = load("_modules/hana_storage_host.py", "hana_storage_host_attack20_running")
NAME = "hana_log_0"


def block_node(path, minor=201):
    try:
        os.mknod(path, stat.S_IFBLK | 0o600, os.makedev(7, minor))
    except PermissionError:
        pytest.skip("no CAP_MKNOD here")
    return path


SHELL_NAMED_CRYPTSETUP = pathlib.Path(tempfile.mkdtemp(prefix="attack20-")) / "cryptsetup"
SHELL_NAMED_CRYPTSETUP.symlink_to("/bin/sh")  # its comm is the name it was started by


def stand_in(args, cwd=None):
    """A process whose argv and comm are ``cryptsetup <args>`` (a shell sleeping under that name)."""
    args = [os.fsencode(a) for a in args]
    proc = subprocess.Popen(
        [b"cryptsetup", b"-c", b"sleep 30; true", *args], executable=str(SHELL_NAMED_CRYPTSETUP), cwd=cwd
    )
    for _ in range(1000):  # until its argv is the one given (up to 10 s on a busy machine)
        with open(f"/proc/{proc.pid}/cmdline", "rb") as handle:
            if args[-1] in handle.read():
                break
        time.sleep(0.01)
    return proc


def stop(proc):
    proc.kill()
    proc.wait()


def test_a_hand_run_naming_the_device_by_a_relative_path_reads_as_not_running(tmp_path, monkeypatch):
    """HOLE (fixed) [two writers on one header / a unit started beside a hand run]: _reencrypt_running
    compares only absolute argv paths (`arg.startswith(b"/")`) by block number. An admin in
    /dev/disk/by-id who runs `cryptsetup reencrypt ... wwn-0x...` (cryptsetup resolves it against
    its cwd) is not seen: the state reads "paused" and starts its unit beside the hand run (the
    reencryption lock then fails one of them; every apply "starts" it again, and the comment
    says "open, and nothing runs it"). Fix: resolve a relative arg against /proc/<pid>/cwd
    (os.path.join(f"/proc/{pid}/cwd", arg)) before taking its block number."""
    device = block_node(tmp_path / "lv")
    (tmp_path / "key").write_bytes(b"k")
    monkeypatch.setattr(host, "DEVICE_ROOT", str(tmp_path))  # as /dev/disk/by-id would be
    proc = stand_in(["reencrypt", "--key-file", "key", "lv"], cwd=tmp_path)
    try:
        assert host._reencrypt_running(NAME, str(device)) is True
    finally:
        stop(proc)


def test_the_argv_of_a_hand_run_is_stat_ed_wherever_it_points(tmp_path, monkeypatch):
    """HOLE (fixed, low) [hang of the apply]: every absolute argv word of any `cryptsetup reencrypt` on the
    host is os.stat()-ed by the minion (_block_number), key files and header files included: a
    hand run with `--key-file /net/vault/key` on an autofs/NFS mount whose server is gone makes
    the stat (so reencrypt_facts, every apply, the beacon) block. Only the device words can name
    the device. Fix: skip the values of options that take files (--key-file, --header,
    --header-backup-file, --volume-key-file, --master-key-file), or stat only under /dev."""
    device = block_node(tmp_path / "lv")
    seen = []
    real = host._block_number
    monkeypatch.setattr(host, "_block_number", lambda path: seen.append(path) or real(path))
    proc = stand_in(["reencrypt", "--key-file", "/net/vault/hana.key", str(tmp_path / "other")])
    try:
        assert host._reencrypt_running(NAME, str(device)) is False
    finally:
        stop(proc)
    assert "/net/vault/hana.key" not in seen, seen


def test_odd_argv_words_are_neither_an_exception_nor_a_match(tmp_path):
    """Non-UTF-8 bytes, a word longer than PATH_MAX, a dangling link, a FIFO, /proc/self paths and
    a regular file (st_rdev 0): no traceback, no match; the device through a link still matches."""
    device = block_node(tmp_path / "lv")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "link").symlink_to(device)
    words = ["reencrypt", b"\xff\xfe/x", b"/\xff\xfe", "/" + "a" * 3000, str(tmp_path / "fifo"),
             str(tmp_path / "dangling"), "/proc/self/fd/0", "/dev/null", str(REPO / "README.md")]  # fmt: skip
    proc = stand_in(words)
    try:
        assert host._reencrypt_running(NAME, str(device)) is False
    finally:
        stop(proc)
    proc = stand_in([*words, str(tmp_path / "link")])
    try:
        assert host._reencrypt_running(NAME, str(device)) is True
    finally:
        stop(proc)


def test_a_device_word_past_the_first_4096_bytes_of_argv_is_not_seen(tmp_path):
    """HOLE (fixed, low) [a unit started beside a hand run]: _reencrypt_running reads only the first 4096
    bytes of /proc/<pid>/cmdline (`handle.read(4096)`), and cryptsetup's device word comes last:
    a hand run whose options take more room (long paths, a --key-description, many --token-id)
    reads as not running. Fix: read the whole cmdline (it is bounded by ARG_MAX; read until EOF)."""
    device = block_node(tmp_path / "lv")
    proc = stand_in(["reencrypt", "--key-file", "/etc/hana-storage/keys/" + "k" * 4100, str(device)])
    try:
        assert host._reencrypt_running(NAME, str(device)) is True
    finally:
        stop(proc)


# ---- the hotzone -----------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [None, 1, 2, 3, 127, 128, 129, 100000, 1.0, 99.0])
def test_every_cap_the_schema_allows_gives_a_hotzone_of_whole_mib_from_1_to_64(cap):
    """schema.json: in_place.max_mib_s is an integer 1..100000 (jsonschema takes 1.0 as one)."""
    mib = reencrypt.hotzone_mib(cap)
    assert isinstance(mib, int) and 1 <= mib <= reencrypt.HOTZONE_MAX_MIB
    argv = inplace.reencrypt_unit(NAME, "/k", "/dev/sdb", cap, hotzone_mib=mib)
    assert argv[argv.index("--hotzone-size") + 1] == f"{mib}M"


@pytest.mark.parametrize("cap", [1, 100000])
def test_cryptsetup_takes_the_hotzone_on_a_resume_and_finishes(make_luks, keyfile, cap):
    """The unit's --resume-only with --hotzone-size (1 MiB and 64 MiB, the bounds): cryptsetup
    2.6.1 resumes, works in hotzones of that size, and finishes; the key still opens it."""
    path = make_luks(sector_size=512, kdf="pbkdf2")
    cryptsetup("reencrypt", "-q", "--init-only", "--force-offline-reencrypt", "--resilience", "checksum",
               "--key-slot", "0", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000",
               "--key-file", str(keyfile), str(path))  # fmt: skip
    mib = reencrypt.hotzone_mib(cap)
    done = cryptsetup("reencrypt", "-q", "--resume-only", "--force-offline-reencrypt", "--key-file", str(keyfile),
                      "--hotzone-size", f"{mib}M", "--debug", str(path), check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    if mib < 8:  # the 24 MiB image's 8 MiB of data: several hotzones of that size
        assert f"size :{mib << 20}." in done.stdout
    header = luks.parse_header(luks.reader_for(path.read_bytes()))
    assert not header["reencryption"]
    assert (
        cryptsetup("open", "--test-passphrase", "--key-file", str(keyfile), str(path), check=False).returncode
        == 0
    )
