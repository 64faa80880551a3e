"""Attack 25: the encryption in place below LVM (moves.py, move_runner.py, moved_onto_luks, the
SLS gating). Each test asserts the safe behaviour; those whose name says HOLE failed on the
first version of the route (a LUKS PV holding extents formatted again when its key test failed,
a finished volume left unmanaged behind a requisite cycle, 4 KiB sectors under a 512-byte XFS,
a partitioned or renumbered freed device formatted, an empty PV never encrypted, a traceback
past the ledger, a changed spare formatted unprobed, a corrupt ledger failing every volume's
render, a spare erased while it held extents, old plaintext outside the new extents, a boot in
the middle stuck in emergency mode)."""

import copy
import json
import subprocess

import pytest
import salt.exceptions
from hana_storage_core import move_runner, moves
from hana_storage_core import pillar as hp

from tests.unit.test_events import load
from tests.unit.test_moves import (
    DEFAULTS,
    DEVICES,
    SPARE,
    Host,
    blank_ledger,
    run,
    storage,
    the_plan,
    volume_plan,
)
from tests.unit.test_sls import rendered_all

states = load("_states/hana_storage.py", "hana_storage_state_attack_moves")
host_module = load("_modules/hana_storage_host.py", "hana_storage_host_attack_moves")
MIB = 1 << 20
SPARE_PV = "/dev/mapper/hana_data_spare"


def step_of(host, ledger):
    return moves.next_step(host.plan, host.facts(), ledger)


# ---- 1. a LUKS PV holding data is formatted again when the key test fails -----------------------


def test_HOLE_a_target_holding_extents_is_formatted_again_when_the_key_test_fails():
    """HOLE: _target_step reads 'our UUID, the key does not open it' as a luksFormat cut short
    and formats, with no _may_format check and no look at the header's keyslots. Here the spare
    holds 80 of /dev/vdb's extents (pvmove --abort keeps moved segments; or an LV grown on the
    source during the move) and its key test fails (argon2 out of memory on a loaded HANA host,
    the pillar key's ramfs file missing for a moment, the key changed in the pillar)."""
    plan = the_plan()
    host, ledger = Host(plan), blank_ledger()
    run(host, ledger, stop_after=6)  # format, open, crypttab, date, pvcreate, vgextend of the spare
    host.pvs["/dev/vdb"]["alloc"], host.pvs[SPARE_PV]["alloc"] = 120, 80
    assert step_of(host, ledger)["action"] == "refuse"  # with the key: refused, as it should be
    host.open = {}  # a boot, or the mapping closed
    del host.pvs[SPARE_PV]
    host.luks[SPARE]["opens"] = False
    step = step_of(host, ledger)
    assert step["action"] != "format", f"would luksFormat {SPARE}, which holds 80 extents of the LV"


def test_HOLE_a_luks_pv_of_the_vg_is_formatted_again_when_the_key_test_fails():
    """HOLE: the same with the target a PV of the VG without extents yet (killed before the
    pvmove): its luksFormat takes a PV out from under the VG (a missing PV; LVM then refuses
    every change until vgreduce --removemissing)."""
    plan = the_plan()
    host, ledger = Host(plan), blank_ledger()
    run(host, ledger, stop_after=6)
    host.open = {}
    del host.pvs[SPARE_PV]
    host.luks[SPARE]["opens"] = False
    assert step_of(host, ledger)["action"] != "format"


# ---- 2. after the moves, the volume's own states form a requisite cycle --------------------------


def _graph(states_):
    graph = {}
    for sid, body in states_.items():
        (args,) = body.values()
        graph[sid] = [
            v
            for a in args
            if isinstance(a, dict) and "require" in a
            for r in a["require"]
            for v in r.values()
        ]
    return graph


def _cycle(graph, start):
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in graph.get(node, []):
            if nxt == start:
                return [*path, nxt]
            if nxt not in seen and nxt in graph:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_HOLE_once_the_moves_are_done_the_volume_gets_the_above_lvm_in_place_state_and_a_cycle(tmp_path):
    """HOLE: with the ledger done (moves_pending False) and the pillar unchanged, as the README
    says it may stay, luks.sls renders hana_storage.encrypted_in_place (the ABOVE-LVM route) on
    the LV of a below-LVM volume, and luks-N requires it: luks-0 -> in-place -> lv-extended ->
    lv-active -> lv -> vg-extended -> vg -> pv-0 -> inside-0 -> open-0 -> luks-0. Salt fails
    every state of the cycle ("Recursive requisite found"): no crypttab, flags, header backups
    or mount for that volume, ever, until encrypt_in_place and in_place_spare leave the pillar.
    The same on a fresh host whose devices are not PVs yet."""
    found = rendered_all(tmp_path, storage())
    assert "hana-storage-data-in-place" not in found, "above-LVM in-place rendered for a below-LVM volume"
    assert _cycle(_graph(found), "hana-storage-data-luks-0") is None


# ---- 3. the LUKS sector size falls back to 4096 when the XFS cannot be read ----------------------


def _luks_policy():
    return hp.normalize(hp.merge(DEFAULTS, storage()))["luks"]


def test_HOLE_an_unreadable_xfs_superblock_gives_4096_byte_luks_sectors(monkeypatch):
    """HOLE: _moves_plan takes min(pillar, XFS sectsz) and, when xfs_superblock fails (the LV
    inactive after a boot with a pillar key: its VG misses the closed LUKS PVs; not XFS), the
    pillar's 4096 - recomputed on every apply. An XFS made with 512-byte sectors on PVs that
    become 4 KiB LUKS PVs (vgextend is run with allow_mixed_block_sizes=1) no longer mounts
    ("device supports 4096 byte sectors (not 512)"), and the mounted one gets I/O errors on
    512-byte log writes once the LV's table is reloaded onto them."""
    calls = {"n": 0}

    def superblock(device):
        calls["n"] += 1
        if calls["n"] == 1:
            return {"sectsize": 512}
        raise salt.exceptions.CommandExecutionError(f"cannot open {device}: No such file or directory")

    monkeypatch.setattr(
        states,
        "__salt__",
        {"hana_storage_host.dm_uuid": lambda device: "", "hana_storage_host.xfs_superblock": superblock},
        raising=False,
    )
    first = states._moves_plan(volume_plan(), _luks_policy(), None)
    assert first["luks"]["sector_size"] == 512
    try:
        later = states._moves_plan(volume_plan(), _luks_policy(), first)  # the next apply, LV unreadable
    except (moves.MovesError, salt.exceptions.CommandExecutionError):
        return
    assert later["luks"]["sector_size"] == 512, "the next target would be formatted with 4096-byte sectors"


# ---- 4. blkid's PTTYPE is not a signature to the runner ------------------------------------------


def _fake_host(monkeypatch, blkid, pvs, existing, status):
    monkeypatch.setattr(move_runner, "_real", lambda path: path)
    monkeypatch.setattr(move_runner.os.path, "exists", lambda path: path in existing)
    monkeypatch.setattr(move_runner, "pv_rows", lambda: copy.deepcopy(pvs))
    monkeypatch.setattr(move_runner, "_lv_rows", lambda vg: [])
    monkeypatch.setattr(move_runner, "_crypttab_names", lambda: ["hana_data_spare"])
    monkeypatch.setattr(move_runner, "_key_opens", lambda device, key: True)
    monkeypatch.setattr(move_runner, "_key_dated", lambda header: True)
    monkeypatch.setattr(move_runner, "_crypt_device", lambda name: status.get(name))

    def fake_run(argv, check=True, stdin=None):
        assert argv[0] == "blkid", argv
        out = blkid.get(argv[-1], "")
        return subprocess.CompletedProcess(argv, 0 if out else 2, out, "")

    monkeypatch.setattr(move_runner, "_run", fake_run)


def test_HOLE_a_freed_device_an_admin_partitioned_meanwhile_is_formatted(monkeypatch):
    """HOLE: read_facts keeps blkid's TYPE only. /dev/vdb, freed by the first move, was given a
    GPT by an admin (its header at LBA 1 overwrites the LVM label) with a filesystem in a
    partition: blkid -p prints PTTYPE=gpt and no TYPE, so the device 'carries nothing', and
    the runner runs wipefs -a and luksFormat on it. The same for a spare partitioned after the
    state found it blank."""
    plan = the_plan()
    vg, ext = plan["vg"], 4 << 20
    pvs = {
        "/dev/vdc": {"vg": vg, "pe_count": 250, "alloc": 200, "extent": ext},
        "/dev/vdd": {"vg": vg, "pe_count": 250, "alloc": 200, "extent": ext},
        SPARE_PV: {"vg": vg, "pe_count": 246, "alloc": 200, "extent": ext},
    }
    existing = {*DEVICES, SPARE, SPARE_PV}
    blkid = {
        SPARE: "UUID=u-hana_data_spare\nTYPE=crypto_LUKS\nUSAGE=crypto\n",
        "/dev/vdb": "PTUUID=0f7b7a3e-8d1c-4b5a-9e57-3c8b4c1a9d2e\nPTTYPE=gpt\n",
        "/dev/vdc": "UUID=pv-c\nTYPE=LVM2_member\n",
        "/dev/vdd": "UUID=pv-d\nTYPE=LVM2_member\n",
    }
    _fake_host(monkeypatch, blkid, pvs, existing, {"hana_data_spare": SPARE})
    facts = move_runner.read_facts(plan)
    ledger = {**blank_ledger(), "freed": ["/dev/vdb"]}
    step = moves.next_step(plan, facts, ledger)
    assert step["action"] != "format", "wipefs -a and luksFormat on a partitioned disk"


# ---- 5. a first PV without extents: the route skips the spare and ends 'done' short ---------------


@pytest.mark.parametrize("alloc", [(0, 200, 200), (200, 0, 200)])
def test_HOLE_a_pv_without_extents_ends_done_with_a_device_never_encrypted(alloc):
    """HOLE: a PV with no extent (devices a multiple of 'stripes', the LV not over all of them)
    is released before its move's target is made: with D0 empty the spare is never formatted,
    the last move (spare -> D2) has no source PV and _under_way says 'all moved'; with D1 empty
    D0 is never formatted. The pure route fills PVs that do not exist and says done with a
    device left an orphan raw PV outside the VG; the real runner dies on pv_rows()[...]
    (KeyError, below)."""
    host, ledger = Host(the_plan(), alloc=alloc), blank_ledger()
    actions, _ = run(host, ledger)
    missing = [d for d in DEVICES if d not in host.formatted]
    assert not missing, f"{actions[-1]} without encrypting {missing}: {actions}"


def test_HOLE_an_unexpected_exception_in_a_step_escapes_the_runner_and_the_state_says_ok(
    monkeypatch, tmp_path
):
    """HOLE: run() catches StepFailed, MovesError, TabError and OSError only. _fill's KeyError
    (a PV that is not there), a ValueError from float(copy_percent) or int(blockdev), a KeyError
    of a plan field check_plan does not check ('volume', the luks policy's keys) escape as a
    traceback: the ledger's error stays None, so the next apply says 'started again' with
    result True, every time."""
    monkeypatch.setattr(moves, "MOVES_DIR", str(tmp_path))
    plan = the_plan()
    move_runner.write_json(moves.plan_path("data"), plan)
    move_runner.write_json(moves.ledger_path("data"), {**blank_ledger(), "freed": [*DEVICES, SPARE_PV]})
    facts = {"pvs": {}, "luks": {}, "open": [], "open_elsewhere": [], "moving": None, "crypttab": [],
             "signatures": {}}  # fmt: skip
    monkeypatch.setattr(move_runner, "read_facts", lambda p: facts)
    monkeypatch.setattr(move_runner, "pv_rows", lambda: {})
    monkeypatch.setattr(move_runner, "_lv_rows", lambda vg: [])
    try:
        code = move_runner.run("data")
    except Exception as error:  # noqa: BLE001
        pytest.fail(f"{type(error).__name__} escapes run(): the ledger records no error")
    assert code == 1
    assert json.loads((tmp_path / "data.ledger.json").read_text())["error"]


# ---- 6. the spare: checked once, by path, and never again -----------------------------------------


def test_HOLE_a_spare_changed_in_the_pillar_after_the_first_start_is_formatted_unprobed(
    monkeypatch, tmp_path
):
    """HOLE: ledger['spare_blank'] says nothing of WHICH device was found blank. The first run
    failed before formatting the spare (ledger written, error set); the admin names another
    LUN in in_place_spare. The state skips _moves_refused (ledger is not None), rewrites the
    plan with the new spare, and the runner formats it on blkid's word alone: no data
    sampling, no partition table, no holders (what the guard's probe checks)."""
    monkeypatch.setattr(moves, "MOVES_DIR", str(tmp_path))
    probed = []
    monkeypatch.setattr(states, "_probe", lambda device, key_file=None: probed.append(device) or {})
    first = the_plan()
    ledger = {**blank_ledger(), "error": "luksFormat exited 1: ..."}
    volume = volume_plan(in_place_spare="/dev/vdf")
    host_facts = Host(first).facts()

    def facts_of(plan):
        return {"ledger": ledger, "facts": host_facts, "unit": "u", "running": False,
                "step": moves.next_step(plan, host_facts, ledger)}  # fmt: skip

    monkeypatch.setattr(
        states,
        "__salt__",
        {
            "hana_storage_host.moves_stored_plan": lambda name: first,
            "hana_storage_host.moves_facts": facts_of,
            "hana_storage_host.dm_uuid": lambda device: "",
            "hana_storage_host.xfs_superblock": lambda device: {"sectsize": 4096},
            "cmd.run_all": lambda *a, **k: {"retcode": 0, "stdout": "", "stderr": ""},
        },
        raising=False,
    )
    monkeypatch.setattr(states, "__opts__", {"test": False}, raising=False)
    ret = states.moved_onto_luks("data", volume, _luks_policy())
    if not (tmp_path / "data.json").exists():  # refused before writing anything: safe
        assert ret["result"] is False and "/dev/vdf" in ret["comment"], ret
        return
    written = json.loads((tmp_path / "data.json").read_text())
    assert written["spare"]["device"] == "/dev/vdf"
    step = moves.next_step(written, host_facts, ledger)
    assert "/dev/vdf" in probed or step["action"] != "format", (ret["comment"], step)


def test_HOLE_a_freed_path_that_now_names_a_disk_without_a_signature_is_formatted():
    """HOLE: ledger['freed'] holds path strings. After a boot that renumbered /dev/sdX (the
    schema accepts any /dev path), or an admin who wiped the freed LUN and reused it raw, the
    path names a disk with no signature, and _may_format allows it (unknown is not blank).
    Recording the PV UUID before vgreduce and requiring blkid to show that UUID (or the runner's
    own 'wiping' mark) would tell."""
    host, ledger = Host(the_plan()), blank_ledger()
    run(host, ledger, stop_after=8)  # first move done, /dev/vdb released
    assert ledger["freed"] == ["/dev/vdb"]
    del host.pvs["/dev/vdb"]
    host.signatures["/dev/vdb"] = []  # another disk behind the path, holding data, no signature
    assert step_of(host, ledger)["action"] != "format"


# ---- 7. a bad ledger breaks the render of every volume --------------------------------------------


def test_HOLE_a_corrupt_ledger_fails_the_render_of_every_volume(tmp_path, monkeypatch):
    """HOLE: map.jinja calls moves_pending for every volume; a ledger that does not parse (or a
    failing pvs) raises MovesError/StepFailed inside Jinja: the whole SLS fails to render, so
    every volume on the host (here 'log', which has nothing to do with the moves) goes
    unmanaged, with a render traceback instead of a clear error on the one volume."""
    monkeypatch.setattr(moves, "MOVES_DIR", str(tmp_path))
    (tmp_path / "data.ledger.json").write_text('{"done": tru')
    volume = volume_plan()
    try:
        host_module.moves_pending(volume)
    except Exception as error:  # noqa: BLE001
        pytest.fail(f"moves_pending raises {type(error).__name__} inside map.jinja: {error}")
    pillar = storage()
    pillar["volumes"]["log"] = {"mountpoint": "/hana/log", "devices": ["/dev/vdz"]}
    from tests.support.sls import render

    plan = hp.normalize(hp.merge(DEFAULTS, pillar))

    def pending(v):
        return host_module.moves_pending(v)

    functions = {
        "hana_storage.settings": lambda host_checks=True: {"valid": True, "config": plan},
        "hana_storage_host.moves_pending": pending,
    }
    try:
        text = render(tmp_path, "mount.sls", "Suse", functions=functions)
    except Exception as error:  # noqa: BLE001
        pytest.fail(f"the render of every volume fails: {type(error).__name__}: {str(error)[:120]}")
    assert "hana-storage-log-mount" in text


# ---- 8. the spare's retirement does not check that the spare was released -------------------------


def test_HOLE_a_closed_spare_still_holding_extents_is_taken_out_of_crypttab_and_erased():
    """HOLE (defence in depth): _under_way skips a move whose source PV LVM does not list, and
    _retire_step takes the spare's crypttab line and LUKS keyslots away without asking the
    ledger whether the spare was released (its mapper path in ledger['freed']). With the spare
    closed (its key test failed, or its LUN renumbered after a boot with a pillar key) while it
    holds a stripe, the decisions are fill..., uncrypttab, erase. Today only LVM refusing the
    fill's lvcreate on a VG with a missing PV stops it."""
    host, ledger = Host(the_plan()), blank_ledger()
    run(host, ledger, stop_after=24)  # three moves done: the spare still holds /dev/vdb's 200 extents
    assert host.pvs[SPARE_PV]["alloc"] == 200 and ledger["freed"] == DEVICES
    host.open.pop("hana_data_spare")
    del host.pvs[SPARE_PV]
    host.luks[SPARE]["opens"] = False
    ledger["filled"] = list(host.plan["final"])  # the fills passed (no free extent to write over)
    decided = []
    for _ in range(6):
        step = step_of(host, ledger)
        decided.append(step["action"])
        if step["action"] in ("refuse", "done", "erase", "format"):
            break
        host.perform(step, ledger)
    assert "erase" not in decided and "uncrypttab" not in decided, decided


# ---- 9. old plaintext the fill never reaches ---------------------------------------------------


def _new_extents_end(mapper_bytes, extent):
    return moves.PE_START + (mapper_bytes - moves.PE_START) // extent * extent


@pytest.mark.parametrize("extent_mib", [4, 32, 64])
def test_HOLE_old_plaintext_outside_the_new_pvs_extents_is_never_overwritten(
    extent_mib, tmp_path, monkeypatch
):
    """HOLE: the fill writes over the new PV's free EXTENTS only. The new PV's extents start 16
    MiB (the LUKS2 header) + pe_start further in: its metadata area ([16, 17) MiB of the LUN,
    which pvcreate writes only a few KiB of) and, with extents over 16 MiB (vgcreate -s 32M/64M,
    common on multi-TB HANA VGs), up to extent - 16 MiB of the old PV's last extent past the
    new PV's last extent, keep the old PV's plaintext on the LUN. The mapper (dm-crypt's
    plaintext view) is a file here, filled with the old bytes as the LUN shows them through
    dm-crypt's eyes (garbage, non-zero); what the runner writes before pvcreate must zero all of
    it outside the new PV's extents."""
    extent = extent_mib * MIB
    lun = moves.PE_START + 10 * extent  # its raw PV had exactly 10 extents
    mapper = tmp_path / "mapper"
    mapper.write_bytes(b"\xaa" * (lun - moves.LUKS2_DATA_OFFSET))
    scrub = getattr(move_runner, "_scrub", None)
    if scrub is not None:
        size = mapper.stat().st_size
        real_run = move_runner._run

        def fake_run(argv, check=True, stdin=None):
            if argv[0] == "blockdev":
                return subprocess.CompletedProcess(argv, 0, f"{size}\n", "")
            return real_run(argv, check, stdin)

        monkeypatch.setattr(move_runner, "_run", fake_run)
        scrub(str(mapper), extent)  # what the pvcreate step runs first, on the patched code
    data = mapper.read_bytes()
    head, end = data[: moves.PE_START], _new_extents_end(len(data), extent)
    left = (len(head) - head.count(0)) + (len(data) - end - data[end:].count(0))
    assert left == 0, f"{left // MIB} MiB of old bytes outside the new PV's extents stay as they were"


# ---- 10. the spare is not blank again, as the README says -------------------------------------


def test_the_erased_spare_carries_no_signature_and_is_still_not_blank_to_the_guard(tmp_path, keyfile):
    """What the README says of the spare once the moves end: cryptsetup erase wipes the keyslots,
    wipefs -a the magic; the header's binary and JSON areas and the ciphertext stay, so the
    guard's probe (_first_data) calls it data without a known signature: to use it again it is
    named in allow_format or zeroed whole."""
    image = tmp_path / "spare.img"
    subprocess.run(["truncate", "-s", "24M", str(image)], check=True)
    subprocess.run(
        ["cryptsetup", "luksFormat", "-q", "--type", "luks2", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations",
         "1000", "--key-file", str(keyfile), str(image)],
        check=True,
    )  # fmt: skip
    subprocess.run(["cryptsetup", "erase", "--batch-mode", str(image)], check=True)
    subprocess.run(["wipefs", "-a", str(image)], check=True, capture_output=True)
    assert subprocess.run(["blkid", "-p", str(image)], capture_output=True).returncode == 2  # no signature
    head = image.read_bytes()[: 8 * MIB]
    assert head.count(0) != len(head)


# ---- 11. a boot in the middle with a pillar key --------------------------------------------------


def test_HOLE_with_a_pillar_key_a_boot_in_the_middle_stops_in_emergency_mode(tmp_path, monkeypatch):
    """HOLE: a pillar key's crypttab lines are 'noauto' (its file is on a ramfs): a boot in the
    middle opens none of the new LUKS PVs, the VG is partial, the LV stays inactive, and the
    host's own /etc/fstab line for the volume (an unencrypted volume's, without nofail: mount.sls
    is gated off while the moves run, so nothing adds it) sends the boot to emergency mode -
    where no minion runs to write the key and let the unit 'open the new PVs first' (README).
    _moves_refused checks the spare, the PVs and the room, not this."""
    import base64

    pillar = storage()
    pillar["key"] = {"source": "pillar", "material": base64.b64encode(bytes(range(32))).decode()}
    volume = hp.normalize(hp.merge(DEFAULTS, pillar))["volumes"]["data"]
    assert "noauto" in volume["crypttab_options"]
    fstab = tmp_path / "fstab"
    fstab.write_text("UUID=0c6f-lv /hana/data xfs noatime 0 0\n")
    monkeypatch.setattr(states, "FSTAB", str(fstab))
    blank = {"device": SPARE, "exists": True, "block": True, "signatures": [], "pttype": None, "holders": [],
             "mountpoints": [], "data_at": None, "lvm_sees_paths": []}  # fmt: skip
    monkeypatch.setattr(states, "_probe", lambda device, key_file=None: dict(blank))
    monkeypatch.setattr(
        states, "__salt__", {"hana_storage_host.block_bytes": lambda d: 1 << 40}, raising=False
    )
    plan = the_plan()
    refused = states._moves_refused(volume, plan, Host(plan).facts())
    assert refused and "fstab" in refused, refused


# ---- regression: every kill point, with and without an empty PV, ends the same ------------------


@pytest.mark.parametrize("alloc", [(200, 200, 200), (0, 200, 200), (200, 0, 200), (200, 200, 0)])
def test_a_kill_after_every_step_ends_with_every_device_a_luks_pv_holding_what_it_held(alloc):
    """Not a hole on its own: the patched route, killed after each step in turn (the ledger as
    written), ends done with each device formatted once and the extents where they belong."""
    total = len(run(Host(the_plan(), alloc=alloc), blank_ledger())[0])
    for kill in range(total):
        host, ledger = Host(the_plan(), alloc=alloc), blank_ledger()
        run(host, ledger, stop_after=kill)
        actions, step = run(host, copy.deepcopy(ledger) if not ledger["done"] else ledger)
        assert actions[-1] == "done", (kill, step)
        assert sorted(host.formatted) == sorted([SPARE, *DEVICES]), (kill, host.formatted)
        held = {n: host.pvs[f"/dev/mapper/{n}"]["alloc"] for n in host.plan["final"]}
        assert sorted(held.values()) == sorted(alloc), (kill, held)
