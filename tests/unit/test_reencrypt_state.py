"""hana_storage.reencrypted_online through Salt's loader dunders, the host's facts given: the
steps of a re-encryption online, their order, test=True, and what each stage says."""

import datetime
import importlib.util
import json
import os
from unittest.mock import MagicMock

import pytest
from hana_storage_core import inplace, reencrypt

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location(
    "hana_storage_state_reencrypt", REPO / "_states" / "hana_storage.py"
)
states = importlib.util.module_from_spec(spec)
spec.loader.exec_module(states)

LV = "/dev/vg_hana_data/lv_hana_data"
CRYPT = "/dev/mapper/hana_data"
KEY = "/etc/hana-storage/keys/hana.key"
LUKS = {"cipher": "aes-xts-plain64", "key_size": 512, "sector_size": 4096, "pbkdf": {"type": "pbkdf2"}}
KEY_IN_USE = "0123456789abcdef"  # luks.key_fingerprint of the volume key


def date_token(tid, created, replaces=()):
    """A KEY_DATE_TOKEN as luks.parse_header records it."""
    key_date = reencrypt.token_date({"created": created, "volume": "u-1", "replaces": list(replaces)})
    return {"id": tid, "type": reencrypt.KEY_DATE_TOKEN, "keyslots": [], "key_date": key_date}


OLD_DATE = date_token(3, "2020-01-01")  # luksFormat's: it dates the key in use
STALE = date_token(5, "2021-06-01", replaces=[KEY_IN_USE])  # an init that never happened: dates nothing
HEADER = {"version": 2, "uuid": "u-1", "sector_size": 512, "tokens": [OLD_DATE, STALE], "reencryption": None,
          "volume_keys": [KEY_IN_USE]}  # fmt: skip
FACTS = {
    "header": HEADER,
    "mapped": True,
    "leftovers": [],
    "suspended": [],
    "unit": inplace.unit_name("hana_data"),
    "running": False,
    "progress": None,
    "fs_sector": 4096,
    "keyslot": 1,
}


@pytest.fixture
def host():
    return {
        "hana_storage_host.reencrypt_facts": MagicMock(return_value=dict(FACTS)),
        "cmd.run_all": MagicMock(return_value={"retcode": 0, "stdout": "", "stderr": ""}),
    }


@pytest.fixture
def opts():
    return {"test": False}


@pytest.fixture(autouse=True)
def scratch(monkeypatch, tmp_path):
    monkeypatch.setattr(states, "SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.setattr(states, "_ramfs", lambda directory: os.makedirs(directory, exist_ok=True))


@pytest.fixture
def configure_loader_modules(host, opts):
    return {states: {"__salt__": host, "__opts__": opts, "__context__": {}}}


def apply(max_age_days=365, **kwargs):
    return states.reencrypted_online("hana_data", LV, KEY, LUKS, CRYPT, max_age_days=max_age_days, **kwargs)


def calls(host):
    return host["cmd.run_all"].call_args_list


def test_a_512_byte_volume_with_an_old_key_is_prepared_dated_and_handed_to_its_unit(host):
    ret = apply()
    assert ret["result"] is True, ret
    ran = [c.args[0] for c in calls(host)]
    assert [argv[:3] for argv in ran] == [
        ["cryptsetup", "token", "import"],  # first: cryptsetup refuses it from the init to the end
        ["cryptsetup", "token", "remove"],
        ["cryptsetup", "reencrypt", "--batch-mode"],
        ["systemctl", "reset-failed", inplace.unit_name("hana_data")],
        [
            "systemd-run",
            f"--unit={inplace.unit_name('hana_data')}",
            "--description=hana-storage: re-encrypt hana_data online",
        ],
    ]
    init = ran[2]
    assert init[init.index("--key-slot") + 1] == "1" and init[init.index("--sector-size") + 1] == "4096"
    unit = ran[4]  # cryptsetup's own checksum hotzone would hold I/O to half a volume for minutes
    assert unit[unit.index("--hotzone-size") + 1] == f"{reencrypt.HOTZONE_MAX_MIB}M"
    assert "--init-only" in init and init[-1] == LV
    token = json.loads(calls(host)[0].kwargs["stdin"])
    assert token["type"] == "hana-storage-volume-key" and token["replaces"] == [KEY_IN_USE]
    assert ran[1][-3:] == ["--token-id", "5", LV]  # the stale one; the format's still dates the old key
    assert ret["changes"]["reencrypting"] == {
        "device": LV,
        "unit": inplace.unit_name("hana_data"),
        "from": "wanted",
        "sector_size": 4096,
    }
    # no key material on any command line: the key is named by its file only
    assert all(KEY in argv or "--key-file" not in argv for argv in ran)


def test_test_mode_says_each_step_and_runs_nothing(host, opts):
    opts["test"] = True
    ret = apply()
    assert ret["result"] is None and ret["changes"] == {}
    for words in (
        "its 512-byte sectors want 4096",
        f"prepare {LV} for a new volume key and 4096-byte sectors",
        "record today as the date of its new volume key",
        "remove the date token 5, made useless by it",
        f"start {inplace.unit_name('hana_data')}",
    ):
        assert words in ret["comment"], ret["comment"]
    host["cmd.run_all"].assert_not_called()


def test_a_refused_date_stops_before_the_init(host):
    host["cmd.run_all"].return_value = {"retcode": 1, "stdout": "", "stderr": "Token import failed"}
    ret = apply()
    assert ret["result"] is False and "Token import failed" in ret["comment"]
    assert [c.args[0][:3] for c in calls(host)] == [["cryptsetup", "token", "import"]]


def test_a_failed_init_starts_nothing_and_its_token_dates_nothing(host):
    """The token names the key in use as the one it replaces: with no new key made, it dates
    nothing, and the next attempt removes it (test_reencrypt.py)."""
    host["cmd.run_all"].side_effect = lambda argv, **_: (
        {"retcode": 1, "stdout": "", "stderr": "No key available"}
        if argv[:2] == ["cryptsetup", "reencrypt"]
        else {"retcode": 0, "stdout": "", "stderr": ""}
    )
    ret = apply()
    assert ret["result"] is False and "No key available" in ret["comment"]
    assert [c.args[0][1] for c in calls(host)] == ["token", "token", "reencrypt"]


@pytest.mark.parametrize(
    "over,words",
    [
        (
            {
                "header": dict(
                    HEADER, tokens=[*HEADER["tokens"], {"id": 9, "type": "clevis", "keyslots": [2]}]
                )
            },
            "drop a clevis token",
        ),  # fmt: skip
        ({"keyslot": None}, "opens none of its keyslots"),
        ({"fs_sector": 512, "header": dict(HEADER, tokens=[])}, "mkfs.xfs -s size=4096"),
    ],
)
def test_a_refused_volume_is_named_and_nothing_runs(host, over, words):
    host["hana_storage_host.reencrypt_facts"].return_value = dict(FACTS, **over)
    ret = apply(max_age_days=None)
    assert ret["result"] is False and words in ret["comment"] and "Nothing was changed" in ret["comment"]
    host["cmd.run_all"].assert_not_called()


def test_a_current_volume_is_left_alone(host):
    young = dict(
        HEADER,
        sector_size=4096,
        tokens=[date_token(3, (datetime.date.today() - datetime.timedelta(days=10)).isoformat())],
    )
    host["hana_storage_host.reencrypt_facts"].return_value = dict(FACTS, header=young)
    ret = apply()
    assert ret["result"] is True and ret["changes"] == {} and "needs no re-encryption" in ret["comment"]
    host["cmd.run_all"].assert_not_called()


UNDERWAY = {"in_progress": True, "mode": "reencrypt", "target": {"sector_size": 4096}}


def test_a_paused_re_encryption_is_started_again_without_a_new_init(host):
    host["hana_storage_host.reencrypt_facts"].return_value = dict(
        FACTS, header=dict(HEADER, reencryption=UNDERWAY)
    )
    ret = apply()
    assert ret["result"] is True and ret["changes"]["reencrypting"]["from"] == "paused"
    assert [c.args[0][0] for c in calls(host)] == ["systemctl", "systemd-run"]


@pytest.mark.parametrize("stage_facts", [{"leftovers": ["hana_data-hotzone-forward"]},
                                         {"leftovers": ["x"], "suspended": ["x"]}])  # fmt: skip
def test_a_killed_re_encryption_names_a_reboot_and_touches_nothing(host, stage_facts):
    host["hana_storage_host.reencrypt_facts"].return_value = dict(
        FACTS, header=dict(HEADER, reencryption=UNDERWAY), **stage_facts
    )
    ret = apply()
    assert ret["result"] is False and "Reboot the host" in ret["comment"]
    host["cmd.run_all"].assert_not_called()


def test_a_running_re_encryption_says_how_far(host):
    progress = {"percent": 37.0, "eta_s": 7800}
    host["hana_storage_host.reencrypt_facts"].return_value = dict(
        FACTS, header=dict(HEADER, reencryption=UNDERWAY), running=True, progress=progress
    )
    ret = apply()
    assert ret["result"] is True and "37" in ret["comment"]
    host["cmd.run_all"].assert_not_called()


def test_below_lvm_a_pv_gets_a_new_key_at_its_512_byte_sectors(host):
    """A PV under the mounted LV: the init keeps its sector size, and the state says why."""
    ret = apply(below_lvm=True)
    assert ret["result"] is True and "below LVM" in ret["comment"], ret
    init = [c.args[0] for c in calls(host) if c.args[0][:2] == ["cryptsetup", "reencrypt"]][0]
    assert init[init.index("--sector-size") + 1] == "512"
    assert ret["changes"]["reencrypting"]["sector_size"] == 512
