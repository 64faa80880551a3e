"""Attack 22: the copy tags outlive the copy they vouch for.

HEAD_COPIED_TAG says "the tail is the head as it was". Nothing drops it once cryptsetup's init
wrote the header: it stays on the LV through the encryption and after it, next to the PLAIN tag.
An XFS made on that LV later (the volume rebuilt and restored from a backup, the encryption
undone and done again) meets a tag that speaks of a head that no longer exists, and stage()
calls the new volume "torn", with a copy back of an old head over the new one."""

import os
import re
import subprocess

import pytest
from hana_storage_core import inplace

from tests.unit.test_attack22_mount_back import Lab, make_image
from tests.unit.test_module_facts import module  # noqa: F401 - the host module, loaded afresh

MIB = 1 << 20


@pytest.fixture
def lab(module, monkeypatch, tmp_path):  # noqa: F811
    return Lab(module, monkeypatch, tmp_path, make_image(tmp_path))


def test_the_copy_tag_from_a_finished_init_makes_a_rebuilt_volume_torn_and_its_advice_destroys_it(lab):
    """HOLE (fixed; data loss by advice from a stale tag: a successful init leaves HEAD_COPIED_TAG on the
    LV forever; when the volume is later rebuilt on the same LV (mkfs.xfs, HANA restored from
    backup) and encrypted in place again, the new XFS's head differs from the old copy in the
    room, the tag says "complete copy", stage() says "torn: cryptsetup was cut off while writing
    the header", and the copy back the refusal names writes the OLD volume's first 16 MiB over
    the restored one). Fix: drop the copy tags (lvchange --deltag) as soon as cryptsetup's init
    succeeded (the header is written, the datashift recovery owns the tail from then on), and
    bind the tag to the copy it vouches for (e.g. a hash of the head, or the XFS UUID, in the
    tag): a tag whose copy is not this head's is no evidence of a torn header."""
    ret, _ = lab.apply()  # cryptsetup and systemd succeed (scripted): the encryption is under way
    assert ret["result"] is True, ret["comment"]
    assert not set(inplace.HEAD_COPY_TAGS) & set(lab.tags), lab.tags  # fixed: dropped after the init
    # later: the volume rebuilt on the same LV and restored, the XFS mounted, then unmounted
    # for the new encryption in place (the pillar's encrypt_in_place still set)
    subprocess.run(["mkfs.xfs", "-f", "-q", "-s", "size=4096", str(lab.image)], check=True)
    lab.write(4 * MIB, os.urandom(12 * MIB))  # the restored data
    rebuilt = lab.head()
    lab.mounted = False
    again, facts = lab.apply()
    if inplace.stage(facts)[0] == "torn":
        back = re.search(r"copy them back \((dd [^)]*)\)", again["comment"]).group(1).split()
        subprocess.run(back, check=True, capture_output=True)
    assert lab.head() == rebuilt, f"the restored volume's head was overwritten ({again['comment'][:200]})"


def test_a_leftover_begun_tag_with_an_intact_head_only_makes_the_copy_again(lab):
    """CLOSED. A BEGUN tag from a run cut in its copy: the next apply copies the head again and
    goes on; the head is never written."""
    lab.tags.append(inplace.HEAD_COPY_BEGUN_TAG)
    lab.write(lab.image.stat().st_size - 16 * MIB, os.urandom(3 * MIB))  # a torn earlier copy
    before = lab.head()
    ret, facts = lab.apply()
    assert inplace.stage(facts)[0] == "plain" and ret["result"] is True, ret["comment"]
    assert lab.head() == before and lab.tail() == before
