"""crypttab and fstab are rewritten whole or not at all: the entry logic is pure
(hana_storage_core.tab.set_entry), the write is one temporary file in the same directory, synced and
renamed over the file (hana_storage_core.files.replace_file). A kill at any moment leaves the old
file or the new one, never an empty or half-written one: a host without its crypttab does not
boot."""

import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from hana_storage_core import files as files
from hana_storage_core import tab as tab

from tests.conftest import REPO

CRYPTTAB = (
    "# <name> <device> <key file> <options>\n"
    "swap /dev/sda3 /dev/urandom swap,cipher=aes-xts-plain64\n"
    "hana_data UUID=1111 /run/hana-storage/keys/hana.key luks,noauto\n"
    "\n"
    "other UUID=2222 none luks\n"
)


def test_an_entry_is_added_changed_or_left_and_every_other_line_kept():
    line = tab.render_crypttab(
        "hana_data", "UUID=1111", "/run/hana-storage/keys/hana.key", ["luks", "noauto"]
    )
    assert tab.set_entry(CRYPTTAB, "crypttab", "hana_data", line) == (CRYPTTAB, "present")
    changed = tab.render_crypttab("hana_data", "UUID=3333", "/run/hana-storage/keys/hana.key", ["luks"])
    text, status = tab.set_entry(CRYPTTAB, "crypttab", "hana_data", changed)
    assert status == "change" and text == CRYPTTAB.replace(
        "hana_data UUID=1111 /run/hana-storage/keys/hana.key luks,noauto", changed
    )
    added = tab.render_crypttab("hana_log", "UUID=4444", "none", ["luks", "_netdev"])
    text, status = tab.set_entry(CRYPTTAB, "crypttab", "hana_log", added)
    assert status == "new" and text == CRYPTTAB + added + "\n"
    # a file that does not end in a newline gets one before the new line
    assert tab.set_entry("a /dev/x none luks", "crypttab", "b", "b /dev/y none luks") == (
        "a /dev/x none luks\nb /dev/y none luks\n",
        "new",
    )


def test_spacing_alone_is_no_change_and_a_repeated_entry_is_folded_into_one():
    spaced = "hana_data   UUID=1111\t/run/hana-storage/keys/hana.key   luks,noauto\n"
    line = tab.render_crypttab(
        "hana_data", "UUID=1111", "/run/hana-storage/keys/hana.key", ["luks", "noauto"]
    )
    assert tab.set_entry(spaced, "crypttab", "hana_data", line) == (spaced, "present")
    twice = "hana_data UUID=1 none luks\nx UUID=2 none luks\nhana_data UUID=1 none luks\n"
    text, status = tab.set_entry(twice, "crypttab", "hana_data", "hana_data UUID=9 none luks")
    assert (text, status) == ("hana_data UUID=9 none luks\nx UUID=2 none luks\n", "change")


def test_fstab_entries_are_matched_by_mountpoint():
    fstab = "UUID=aa / ext4 defaults 0 1\nUUID=bb /hana/data xfs noatime 0 0\n"
    line = tab.render_fstab("UUID=cc", "/hana/data", "xfs", ["noatime", "nodiratime"])
    text, status = tab.set_entry(fstab, "fstab", "/hana/data", line)
    assert status == "change" and text == "UUID=aa / ext4 defaults 0 1\n" + line + "\n"
    assert tab.set_entry(text, "fstab", "/hana/data", line) == (text, "present")


def test_an_unreadable_line_is_kept_as_it_is_and_never_taken_for_the_entry():
    odd = "this line has far too many fields to be a crypttab entry at all\nhana_data UUID=1 none luks\n"
    text, status = tab.set_entry(odd, "crypttab", "hana_data", "hana_data UUID=2 none luks")
    assert status == "change" and text.splitlines()[0] == odd.splitlines()[0]


def test_replace_file_keeps_mode_and_owner_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "crypttab"
    path.write_text("old\n")
    path.chmod(0o600)
    files.replace_file(str(path), b"new\n")
    assert path.read_text() == "new\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crypttab"]
    fresh = tmp_path / "fstab"
    files.replace_file(str(fresh), b"x\n", mode=0o644)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o644


def test_replace_file_replaces_a_symlink_and_never_writes_through_it(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    link = tmp_path / "crypttab"
    link.symlink_to(target)
    files.replace_file(str(link), b"new\n")
    assert target.read_text() == "keep\n" and not link.is_symlink() and link.read_text() == "new\n"
    (tmp_path / "dir").mkdir()
    with pytest.raises(OSError):
        files.replace_file(str(tmp_path / "dir"), b"x")


WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {utils!r})
    path, how = sys.argv[1], sys.argv[2]
    import salt.modules.cryptdev as cryptdev
    from hana_storage_core import files as hana_storage_files, tab as hana_storage_tab
    print("writing", flush=True)  # imports done: a kill from now on lands in the writes
    n = 0
    while True:
        n += 1
        if how == "salt":  # Salt's cryptdev.set_crypttab: truncates the file, then writes it
            cryptdev.set_crypttab("vol0", f"UUID=changed{{n}}", config=path, test=False)
        else:
            with open(path) as handle:
                text = handle.read()
            text, _ = hana_storage_tab.set_entry(text, "crypttab", "vol0", f"vol0 UUID=changed{{n}} none luks")
            hana_storage_files.replace_file(path, text.encode())
    """
)


def kill_loop(tmp_path, how, rounds):
    """Kill a writer that rewrites one entry of a 20,000-line crypttab over and over at random
    moments; the other 19,999 lines must survive every kill. Returns the kills that lost them."""
    path = tmp_path / "crypttab"
    path.write_text("".join(f"vol{i} UUID={i:08d} none luks\n" for i in range(20000)))
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format(utils=str(REPO / "_utils")))
    lost = []
    for round_ in range(rounds):
        writer = subprocess.Popen([sys.executable, str(script), str(path), how], stdout=subprocess.PIPE)
        writer.stdout.readline()  # its imports take seconds on a loaded machine: not the window
        time.sleep(random.random() * 0.4)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        try:
            kept = len(tab.parse_crypttab(path.read_text()))
        except tab.TabError:  # a line cut in two
            kept = None
        if kept != 20000:
            lost.append((round_, kept))
            path.write_text("".join(f"vol{i} UUID={i:08d} none luks\n" for i in range(20000)))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("crypttab", "writer.py")]
    return lost, leftovers


def test_salts_in_place_write_loses_the_crypttab_when_killed(tmp_path):
    """What the formula wrote crypttab with before (Salt's cryptdev.set_crypttab: open with "w+",
    then write): a kill in between leaves the file empty or cut short."""
    lost, _ = kill_loop(tmp_path, "salt", 20)
    assert lost, "no kill hit the window: the test proves nothing"


def test_a_killed_replace_leaves_the_old_file_or_the_new_one(tmp_path):
    lost, leftovers = kill_loop(tmp_path, "formula", 20)
    assert lost == []
    # a kill between the temporary file and the rename leaves the temporary, which the next
    # write removes: at most one, and never mistaken for the file
    assert len(leftovers) <= 1 and all(name.startswith(".crypttab.") for name in leftovers), leftovers


def test_create_file_makes_a_new_file_and_never_replaces_one(tmp_path):
    report = tmp_path / "evidence.html"
    files.create_file(str(report), b"<html>", mode=0o640)
    assert report.read_bytes() == b"<html>" and stat.S_IMODE(report.stat().st_mode) == 0o640
    with pytest.raises(FileExistsError):
        files.create_file(str(report), b"other", mode=0o640)
    assert report.read_bytes() == b"<html>"
    target = tmp_path / "shadow"
    target.write_text("keep\n")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(FileExistsError):
        files.create_file(str(tmp_path / "link"), b"x", mode=0o640)
    assert target.read_text() == "keep\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evidence.html", "link", "shadow"]


def test_a_memory_copy_is_named_by_the_pid_proc_knows_in_a_pid_namespace(tmp_path):
    """A process in a PID namespace of its own that shares its parent's /proc (the lab's
    systemd namespace; a container started with --pid but the host's /proc) has a pid there
    that os.getpid() does not return: the path handed to cryptsetup named another process's
    descriptor ("Device /proc/68/fd/7 does not exist"). The path now follows /proc/self."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "--pid", "--fork", "true"], check=False).returncode:
        pytest.skip("needs root and unshare --pid")
    source = tmp_path / "header"
    source.write_bytes(b"LUKS header bytes")
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(REPO / "_utils")!r})
        from hana_storage_core import files
        with files.memory_copy({str(source)!r}, 17) as path:
            with open(path, "rb") as handle:
                print(os.getpid(), handle.read().decode())
        """
    )
    out = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    pid, content = out.stdout.split(maxsplit=1)
    assert pid == "1" and content.strip() == "LUKS header bytes"
