# ruff: noqa: F811 - the host module fixture imported from tests/unit/test_module_facts.py is a parameter here
"""Attack 23: the copy's tags (HEAD_COPY_BEGUN_TAG, HEAD_COPIED_TAG) on the paths that leave them
behind: the untag after the init failing (tolerated), a power cut between the init and the untag,
an init that wrote the header and failed after, and a failed init on an LV that was unmounted
when the run began (no mount back, so nothing drops COPIED). Real images, real dd, real
cryptsetup where its header matters, the host module's own reads."""

import os
import re
import shutil
import subprocess

import pytest
from hana_storage_core import inplace

from tests.unit.test_attack22_advice import CHEAP
from tests.unit.test_attack22_mount_back import SHIFT, Lab, make_image
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

MIB = 1 << 20
ROOM = inplace.header_room(2, 64 * 1024, 4 * MIB)


class PowerCut(BaseException):
    """The host loses power: nothing after this runs."""


@pytest.fixture
def lab(module, monkeypatch, tmp_path):
    return Lab(module, monkeypatch, tmp_path, make_image(tmp_path))


def is_untag(argv):
    """The state's lvchange that drops both copy tags once the init ended."""
    return argv[0] == "lvchange" and "--addtag" not in argv and argv.count("--deltag") == 2


def real_init(lab, tmp_path, answer):
    """cryptsetup's init writes the header for real (the LV is LUKS2 after it) and exits with
    ``answer``; cryptsetup's other commands (the open of a later run) succeed, scripted."""
    key, work = tmp_path / "k.key", tmp_path / "work"
    work.mkdir(exist_ok=True)
    key.write_bytes(os.urandom(64))

    def cryptsetup(argv):
        if "--init-only" not in argv:
            return None
        real = inplace.reencrypt_init(str(lab.image), "hana_data", str(key), CHEAP, ROOM, 4096)[:-1]
        done = subprocess.run(real, cwd=work, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return answer

    lab.hooks["cryptsetup"] = cryptsetup


OK = {"retcode": 0, "stdout": "", "stderr": ""}


def untag_fails(lab, tmp_path):
    real_init(lab, tmp_path, OK)
    lab.hooks["lvchange"] = lambda argv: (
        {"retcode": 5, "stdout": "", "stderr": "Cannot update volume group: lvmlockd lock timed out"}
        if is_untag(argv)
        else None
    )


def power_cut_at_the_untag(lab, tmp_path):
    real_init(lab, tmp_path, OK)

    def cut(argv):
        if is_untag(argv):
            raise PowerCut
        return None

    lab.hooks["lvchange"] = cut


def init_writes_the_header_and_fails(lab, tmp_path):
    """cryptsetup writes the header, then cannot activate (a udev timeout, dm-crypt refusing the
    cipher under FIPS): exit 1, the LV LUKS2."""
    real_init(lab, tmp_path, {"retcode": 1, "stdout": "", "stderr": "Cannot activate device hana_data"})


@pytest.mark.parametrize("leave", [untag_fails, power_cut_at_the_untag, init_writes_the_header_and_fails])
def test_copy_tags_left_on_the_encrypted_lv_make_a_rebuilt_volume_torn_and_the_advice_destroys_it(
    lab, tmp_path, leave
):
    """HOLE (fixed; data loss by advice from a stale tag, the attack-22 "rebuilt volume" hole by three
    other doors: the tags are dropped by one lvchange right after the init, and only there.
    (1) That lvchange failing is tolerated ("its copy's LVM tags stay"); (2) a power cut or a kill
    of the job between the init and that lvchange skips it; (3) an init that wrote the header and
    then failed (activation) never reaches it. No later run drops them: the stages closed, paused,
    running and done never touch the tags. Years later the volume is rebuilt on the same LV
    (mkfs.xfs, HANA restored) and encrypted in place again: COPIED and a room that is not the new
    head say "torn", and the copy back named writes the OLD volume's first 16 MiB over the
    restored one). Fix: drop the copy tags in every later run that finds a LUKS2 header on the LV
    (closed, paused, running, done: in_place_facts reads the tags, the state untags), and bind
    COPIED to the head it vouches for (the XFS UUID, or a hash of the head, in the tag), so a tag
    whose copy is not this head's decides nothing."""
    if not shutil.which("cryptsetup"):
        pytest.skip("cryptsetup not installed")
    leave(lab, tmp_path)
    try:
        lab.apply()
    except PowerCut:
        pass
    assert inplace.HEAD_COPIED_TAG in lab.tags, lab.tags  # left behind on the encrypted LV
    lab.hooks.pop("lvchange", None)  # the VG takes tags again
    lab.mounted = False
    later, facts = lab.apply()  # the next apply: the LV LUKS2 under way, opened and resumed
    assert facts["signature"] == "crypto_LUKS" and later["result"] is True, later["comment"]
    lab.hooks.clear()
    # later: the volume rebuilt on the same LV and restored; unmounted for the new encryption
    subprocess.run(["wipefs", "-a", "-q", str(lab.image)], check=True)
    subprocess.run(["mkfs.xfs", "-f", "-q", "-s", "size=4096", str(lab.image)], check=True)
    lab.write(4 * MIB, os.urandom(12 * MIB))
    rebuilt = lab.head()
    lab.mounted = False
    again, facts = lab.apply()
    if inplace.stage(facts)[0] == "torn":
        back = re.search(r"copy them back \((dd [^)]*)\)", again["comment"]).group(1).split()
        subprocess.run(back, check=True, capture_output=True)
    assert lab.head() == rebuilt, f"the restored volume's head was overwritten ({again['comment'][:200]})"


def test_a_failed_init_on_an_lv_unmounted_at_the_start_leaves_copied_and_the_next_mount_makes_it_torn(
    lab,
):
    """HOLE (fixed; a refusal that leads with a data-losing copy back: the XFS was not mounted when the
    run began (HANA stopped and /hana/data unmounted by the admin, or a boot that did not mount
    it), so the run has no umount and no mount back; the init fails with the head untouched (an
    Argon2 memory limit, a key file cryptsetup rejects) and the COPIED tag stays - the mount back
    is the only place that drops it. The admin mounts the volume again to bring HANA back while
    the cause is fixed; HANA writes. The next apply: COPIED and a room that no longer matches:
    "torn: cryptsetup was cut off while writing the header ... copy them back", which rolls
    HANA's first 16 MiB back to before it ran; the caveat about a mount since speaks of a boot
    through /etc/fstab, not of this). Fix: after any failed init (and copy/verify/copied) whose
    head still matches the copy, drop COPIED whether or not this run unmounted (the same check
    _mount_back makes); the BEGUN tag alone then makes the next apply copy again."""
    lab.mounted = False
    lab.hooks["cryptsetup"] = lambda argv: {"retcode": 1, "stdout": "", "stderr": "Argon2 out of memory"}
    ret, facts = lab.apply()
    assert ret["result"] is False and inplace.stage(facts)[0] == "plain", ret["comment"]
    lab.hooks.clear()
    lab.mounted = True  # the admin brings HANA back while the cause is looked into
    lab.write(6 * MIB, os.urandom(64 * 1024))
    again, facts = lab.apply()
    assert inplace.stage(facts)[0] != "torn", (lab.tags, again["comment"][:300])


def test_a_leftover_begun_tag_with_the_route_abandoned_and_the_lv_written_for_months_only_copies_again(
    lab,
):
    """CLOSED. A BEGUN tag left by a mount back (the init failed), the pillar flag removed, HANA
    writing for months, the flag set again: the room is a stale copy ("other"), the stage plain,
    the head copied again after the unmount and never written before cryptsetup runs."""
    lab.hooks["cryptsetup"] = lambda argv: {"retcode": 1, "stdout": "", "stderr": "Argon2 out of memory"}
    lab.apply()
    assert lab.mounted and lab.tags.count(inplace.HEAD_COPY_BEGUN_TAG) == 1, lab.tags
    lab.hooks.clear()
    lab.write(5 * MIB, os.urandom(MIB))  # months of HANA
    seen = {}

    def init(argv):
        seen["head"], seen["tail"] = lab.head(), lab.tail()
        return {"retcode": 0, "stdout": "", "stderr": ""}

    lab.hooks["cryptsetup"] = init
    live = lab.head()
    ret, facts = lab.apply()
    assert facts["tail"] == "other" and inplace.stage(facts)[0] == "plain", facts
    assert ret["result"] is True and seen == {"head": live, "tail": live}, ret["comment"]
    assert not set(inplace.HEAD_COPY_TAGS) & set(lab.tags)


def test_test_mode_with_leftover_tags_moves_no_tag_and_writes_nothing(lab, monkeypatch):
    """CLOSED. test=True on an LV with both copy tags and a stale room: the plan says so, nothing
    runs."""
    lab.tags += [inplace.HEAD_COPY_BEGUN_TAG]
    lab.write(os.path.getsize(lab.image) - SHIFT, os.urandom(SHIFT))
    before, tags = lab.head(), list(lab.tags)
    ret, _ = lab.apply(test=True)
    assert ret["result"] is None and lab.ran == [], (ret["comment"], lab.ran)
    assert lab.tags == tags and lab.head() == before and lab.mounted
