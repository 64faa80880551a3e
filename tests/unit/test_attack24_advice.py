# ruff: noqa: F811 - pytest fixtures imported from other test modules are parameters here
"""Attack 24: what 0ead962's refusals and its tag drop tell the admin: the room saved to a file
under ROOM_SAVE_DIR, the comment of a refusal next to the drop's changes, the advice's commands
as a shell reads them, and the 512-byte verdict at its ends and its cost. Real images and dd
where bytes matter; the state with the host's facts given for pure logic."""

import os
import re
import shlex
import time

import pytest
from hana_storage_core import inplace

from tests.unit.test_attack22_advice import advised, apply_with, follow, room_saves  # noqa: F401 - a fixture
from tests.unit.test_attack22_mount_back import PLAIN, SHIFT, Lab, make_image
from tests.unit.test_inplace import (  # noqa: F401 - fixtures
    HOST_FACTS,
    LUKS,
    configure_loader_modules,
    host,
    opts,
    scratch,
    states,
)
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

MIB = 1 << 20
LV = "/dev/vg_hana_data/lv_hana_data"


def test_the_room_saved_in_plaintext_under_root_outlives_the_encryption_unmentioned(
    module, monkeypatch, tmp_path
):
    """HOLE (fixed; plaintext of the volume left on the unencrypted root disk for good, against the
    formula's very purpose: the refusal of an earlier version's cut init has the admin save the
    room - the volume's first 16 MiB as they were, XFS metadata and HANA's data - to
    /root/<vg>-<lv>.room (dd, mode 0644 under the usual umask) and then apply again. That apply
    encrypts the volume; neither it nor any later run, nor the refusal itself, names the file
    again or says to remove it once the encryption is under way. The audit measures the LV's
    encryption, not /root: a compliance check reports the volume encrypted while 16 MiB of its
    plaintext sit on /, in backups of /root and in root-disk snapshots). Fix: say in the
    refusal when the file may go (shred -u it once the encryption runs), and name it in the
    comment of the run that starts the encryption (or in the drop of the copy's tags)."""
    lab = Lab(module, monkeypatch, tmp_path, make_image(tmp_path), [inplace.plain_tag(PLAIN)])
    lab.mounted = False
    lab.write(os.path.getsize(lab.image) - SHIFT, lab.head()[: 5 * MIB])  # an earlier version's cut copy
    refusal, facts = lab.apply()
    assert inplace.stage(facts)[0] == "unclear" and facts["tail"] == "partial", facts
    follow(refusal["comment"], lab)  # saves the room, has the copy made again
    (saved,) = [p for p in os.listdir(tmp_path) if p.endswith(".room")]
    saved = str(tmp_path / saved)
    with open(saved, "rb") as handle:
        assert handle.read(5 * MIB) == lab.head()[: 5 * MIB]  # the volume's plaintext
    started, _ = lab.apply()
    assert started["result"] is True and "encrypting" in started["changes"], started["comment"]
    told = [text for text in (refusal["comment"], started["comment"]) if saved in text]
    removal = any(
        word in text.split(saved)[1][:200] or word in text.split(saved)[0][-200:]
        for text in told
        for word in ("shred", "rm ", "remove", "delete")
    )
    assert removal or not os.path.exists(saved), (
        f"{saved} ({os.path.getsize(saved)} bytes of plaintext) stays, never named again: "
        f"{started['comment'][:300]}"
    )


def test_a_refusal_that_says_nothing_was_changed_comes_back_with_the_tags_dropped(host, opts):
    """HOLE (fixed; the state's word contradicts what it did: on an LV whose LUKS2 header is under a
    re-encryption the formula did not start (stage foreign), or a frozen stack, the refusal ends
    "... Nothing was changed." - and 0ead962's wrapper then runs lvchange --deltag on the LV and
    reports copy_tags_dropped in changes. An admin told "nothing was changed" on an LV with
    someone else's cryptsetup on it reads no further; a reviewer diffing the LV's metadata
    finds a change the comment denies). Fix: drop the tags only in runs that act (or whose
    result is True), or append what was dropped and take "Nothing was changed" out."""
    host["hana_storage_host.in_place_facts"].return_value = dict(
        HOST_FACTS,
        signature="crypto_LUKS",
        reencryption={"in_progress": True, "mode": "decrypt"},
        mounted_from=None,
        lv_tags=[inplace.HEAD_COPIED_TAG],
    )
    ret = states.encrypted_in_place("hana_data", LV, "/hana/data", "/k", LUKS, 2, 64, ["noatime"])
    lvchanges = [c.args[0] for c in host["cmd.run_all"].call_args_list if c.args[0][0] == "lvchange"]
    said_nothing = "Nothing was changed" in ret["comment"]
    assert not (said_nothing and (ret["changes"] or lvchanges)), (ret["comment"], ret["changes"])


@pytest.mark.parametrize("stage_facts", ["torn", "unclear-partial", "unclear-other", "torn-mounted"])
def test_every_command_the_advice_names_is_one_a_shell_reads_as_the_state_means_it(
    monkeypatch, tmp_path, stage_facts
):
    """CLOSED. LVM names take only [A-Za-z0-9+_.-] and never start with '-': on an LV named
    with every one of them, each command in parentheses splits the same in a shell as on
    spaces (no quoting, globbing or expansion), and the saved room's file name stays in
    ROOM_SAVE_DIR."""
    device = "/dev/vg.hana+1_x-y/lv_hana-data.2+b"
    tags = {
        "torn": [inplace.HEAD_COPY_BEGUN_TAG, inplace.HEAD_COPIED_TAG],
        "torn-mounted": [inplace.HEAD_COPY_BEGUN_TAG, inplace.HEAD_COPIED_TAG],
    }.get(stage_facts, [])
    facts = dict(
        HOST_FACTS,
        mounted_from="device" if stage_facts.endswith("mounted") else None,
        device_bytes=544 * MIB,
        lv_tags=[inplace.plain_tag(512 * MIB), *tags],
        head_copy=inplace.head_copy(tags),
        tail="partial" if stage_facts == "unclear-partial" else "other",
    )
    ret, _ = apply_with(monkeypatch, tmp_path, facts, device)
    commands = re.findall(r"\(((?:dd|lvchange|xfs_repair) [^)]*)\)", ret["comment"])
    assert commands, ret["comment"]
    for text in commands:
        assert shlex.split(text) == text.split(), text
        assert not set(text) & set("$`\\\"'*?[]{};&|<>~!#"), text
    for argv in advised(ret["comment"]):
        for word in argv:
            if word.startswith("of=") and word != f"of={device}":
                assert os.path.dirname(word[3:]) == str(tmp_path), word


def test_the_sector_verdict_holds_at_both_ends_of_the_room():
    """CLOSED. A copy cut one sector short (all but the last sector copied) is "partial"; a
    head that differs from a complete copy only in its very last sector, over data, is
    "other"; in its very first sector, over data, "other" too."""
    head = os.urandom(SHIFT)
    assert inplace.tail_state(head, head[:-512] + bytes(512)) == "partial"
    changed = head[:-512] + bytes(a ^ 1 for a in head[-512:])
    assert inplace.tail_state(changed, head) == "other"
    changed = bytes(a ^ 1 for a in head[:512]) + head[512:]
    assert inplace.tail_state(changed, head) == "other"


def test_the_sector_verdict_on_16_mib_costs_less_than_a_fifth_of_a_second_natively():
    """CLOSED. The worst case (a 16 MiB copy cut at its last sector: every sector compared) takes
    under 0.2 s on this host (under emulation some ten times more, once per apply)."""
    head = os.urandom(SHIFT)
    tail = head[:-512] + bytes(512)
    began = time.perf_counter()
    assert inplace.tail_state(head, tail) == "partial"
    assert time.perf_counter() - began < 0.2
