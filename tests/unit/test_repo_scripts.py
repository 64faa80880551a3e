"""The scripts CI and the Makefile run straight from the tree (``tools/vm-lanes`` ...): each is
executable in git, as a fresh clone gets it. A rewrite that dropped the mode of tools/vm-lanes
stopped `make test` at once with "Permission denied"."""

import subprocess

from tests.conftest import REPO


def test_every_script_with_a_shebang_is_executable_in_git():
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--stage", "--", ".ci", "tools", "lab"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    not_executable = []
    for line in listed:
        mode, _sha, _stage_path = line.split(" ", 2)
        path = line.split("\t", 1)[1]
        with open(REPO / path, "rb") as handle:
            if handle.read(2) == b"#!" and mode != "100755":
                not_executable.append(path)
    assert not_executable == []
