"""Attack on 1612e8c: below LVM, the guard reads the LV's tags with `lvs` to tell the formula's
own LV (tag hana_storage_formula) from one made by hand.

``lv_tags_command`` leaves the list separator of the `lvs` report to lvm.conf. With
``report { list_item_separator = ";" }`` there (a site setting; the --config the formula passes
does not pin it), LVM 2.03.16 answers an LV with two tags as
``{"lv_tags":"backup_team;hana_storage_formula"}`` (checked on loop devices), and
``parse_lv_tags`` splits on "," only: the tag is not found. The formula's own LV, killed before
mkfs and tagged by someone else too (a backup tool, an admin's inventory tag), is then refused
(unknown_data) at every apply although it holds only the noise of the formula's fresh LUKS
devices. Fail-closed (no data lost), but a false refusal that names no cause: the README tells
the admin the LV is "not one the formula created" and to lvremove it or use allow_format.
"""

import json

from hana_storage_core import safety

from tests.unit.test_attack4_lv_marks import LV, host_with


def lvm_with_separator(host, separator, tags):
    """`lvs` as LVM answers it: lv_tags joined with lvm.conf's list_item_separator, unless the
    command's own --config sets report/list_item_separator."""

    def run_all(argv, **kwargs):
        config = " ".join(a for i, a in enumerate(argv) if i and argv[i - 1] == "--config")
        used = separator
        if "list_item_separator" in config:
            used = config.split("list_item_separator", 1)[1].split('"')[1]
        ok = argv[0] == "lvs" and "/dev/mapper/vg_hana_data-lv_hana_data" in argv
        rows = [{"lv_tags": used.join(tags)}]
        return {"retcode": 0 if ok else 5, "stdout": json.dumps({"report": [{"lv": rows}]}), "stderr": ""}

    host.__salt__ = {"cmd.run_all": run_all}


def test_the_formulas_lv_with_a_second_tag_is_blank_whatever_lvm_conf_separates_lists_with(
    tmp_path, monkeypatch
):
    host = host_with(tmp_path, monkeypatch)
    (tmp_path / "sys" / "dm-9" / "dm" / "name").write_text("vg_hana_data-lv_hana_data\n")
    lvm_with_separator(host, ",", ["backup_team", "hana_storage_formula"])
    assert host.probe([LV])[LV]["payload_unused"] is True  # the default separator: holds
    lvm_with_separator(host, ";", ["backup_team", "hana_storage_formula"])
    probe = host.probe([LV])[LV]
    assert probe["payload_unused"] is True, "the formula's own LV is refused under list_item_separator=';'"
    assert safety.layer_verdict("xfs", probe, may_wipe=False, created_now=False)["verdict"] != "refuse"
