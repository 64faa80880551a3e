"""Below LVM, any LV over PVs whose payload marks survive is taken as blank (8625b32).

The payload marks of the formula's LUKS devices now outlive pvcreate, and last until the
volume's own LV shows a signature: across every apply that stops between pvcreate and mkfs
(killed, or failing at lv_present, say a size the VG cannot hold). ``probe`` then calls any LV
that lies only on those devices ``payload_unused``, and ``layer_verdict("xfs")`` creates XFS on
it, whoever made that LV and whatever was written to it: the marks say nothing about LVs.
"""

import importlib.util
import json
import os

from hana_storage_core import safety

from tests.conftest import REPO
from tests.support.fake_block import os_with_block_device

LV = "/dev/vg_hana_data/lv_hana_data"
UUIDS = ["0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0", "1f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"]


def crypt_dm_uuid(uuid, name):
    return f"CRYPT-LUKS2-{uuid.replace('-', '')}-{name}"


def host_with(tmp_path, monkeypatch):
    """The host module over a fake sysfs: LV (dm-9) striped over two opened LUKS devices
    (dm-1, dm-2) the formula formatted, both with their payload marks; the LV has no signature
    and holds data (non-zero bytes at 1 MiB). Every command fails (no LVM tags, no lvs)."""
    spec = importlib.util.spec_from_file_location("host_attack4", REPO / "_modules" / "hana_storage_host.py")
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    host.__opts__ = {"cachedir": str(tmp_path / "cache")}
    host.__salt__ = {"cmd.run_all": lambda *a, **k: {"retcode": 1, "stdout": "", "stderr": "no"}}
    sysfs = tmp_path / "sys"
    for name, uuid in (("dm-9", "LVM-" + "a" * 64), ("dm-1", crypt_dm_uuid(UUIDS[0], "hana_data_0")),
                       ("dm-2", crypt_dm_uuid(UUIDS[1], "hana_data_1"))):  # fmt: skip
        (sysfs / name / "dm").mkdir(parents=True)
        (sysfs / name / "dm" / "uuid").write_text(uuid + "\n")
        (sysfs / name / "holders").mkdir()
        (sysfs / name / "slaves").mkdir()
        (sysfs / name / "size").write_text("4194304\n")
    (sysfs / "dm-9" / "slaves" / "dm-1").touch()
    (sysfs / "dm-9" / "slaves" / "dm-2").touch()
    monkeypatch.setattr(host, "SYSFS_BLOCK", str(sysfs))
    for uuid in UUIDS:
        mark = host.format_marker(uuid, "payload")
        os.makedirs(os.path.dirname(mark), exist_ok=True)
        open(mark, "w").close()

    monkeypatch.setattr(host, "os", os_with_block_device(LV, 253, 9))
    monkeypatch.setattr(host, "_kernel_name", lambda path: "dm-9")
    monkeypatch.setattr(host, "_mounts", lambda: [])
    monkeypatch.setattr(host, "_blkid", lambda path: ([], None))
    monkeypatch.setattr(host, "_first_data", lambda name, size: 1 << 20)
    return host


def test_an_lv_the_formula_did_not_create_is_not_blank_for_its_marks(tmp_path, monkeypatch):
    """Attack: below LVM, an apply stops after vgcreate (killed, or lv_present fails on every
    apply: a size the VG cannot hold); the payload marks stay, as they now do past pvcreate. The
    admin makes the LV the pillar names by hand (or points the pillar's ``lv`` at an LV of theirs
    in the formula's VG) and writes data with no signature to it: plain dm-crypt, LUKS with a
    detached header, a raw restore. The next apply: lv_present finds the LV, ``formatted`` probes
    it - not created by this run, no signature, non-zero data - and the probe calls it
    ``payload_unused`` because it lies on the marked LUKS devices.

    Impact: mkfs.xfs over someone's data on a device allow_format does not name. Before 8625b32
    the same LV was refused (unknown_data).

    Expected: marks of the LUKS devices below say what was written to those devices, not who made
    an LV on them: an LV nothing ties to the formula's own lvcreate (no mark or tag of it) that
    holds data is refused, not formatted.
    """
    host = host_with(tmp_path, monkeypatch)
    probe = host.probe([LV])[LV]
    assert probe["data_at"] == 1 << 20 and sorted(probe["luks_below"]) == UUIDS
    verdict = safety.layer_verdict("xfs", probe, may_wipe=False, created_now=False)
    assert verdict["verdict"] == "refuse", verdict


def lv_tags(host, tags):
    """LVM answers the LV's tags (an lvs report), as for an LV the formula's lvcreate made."""
    rows = [{"lv_tags": ",".join(tags)}]
    host.__salt__ = {
        "cmd.run_all": lambda argv, **k: {
            "retcode": 0 if argv[0] == "lvs" and "/dev/mapper/vg_hana_data-lv_hana_data" in argv else 1,
            "stdout": json.dumps({"report": [{"lv": rows}]}),
            "stderr": "",
        }
    }


def test_the_lv_the_formula_created_on_its_marked_devices_is_blank(tmp_path, monkeypatch):
    """Fixed by creating the LV with lvcreate --addtag (written with the LV's metadata): the
    formula's own LV, killed before mkfs, is still taken for blank; the same LV without the tag
    (made by hand, or by an older formula) is refused."""
    host = host_with(tmp_path, monkeypatch)
    (tmp_path / "sys" / "dm-9" / "dm" / "name").write_text("vg_hana_data-lv_hana_data\n")
    lv_tags(host, ["hana_storage_formula"])
    probe = host.probe([LV])[LV]
    assert probe["payload_unused"] is True
    assert safety.layer_verdict("xfs", probe, may_wipe=False, created_now=False)["verdict"] != "refuse"
    lv_tags(host, ["backup_team"])
    assert host.probe([LV])[LV]["payload_unused"] is False
