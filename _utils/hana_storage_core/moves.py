"""Encryption in place below LVM: each PV's extents move (``pvmove``, online) onto a LUKS PV,
through one spare LUN. Pure code: what the moves are, and which step comes next on the facts
``move_runner`` reads; ``move_runner`` runs the steps, in a systemd unit of its own.

The route, for a volume on devices D0 .. Dn-1 (raw PVs of its VG) and a blank spare S:

1. S is formatted LUKS2 and opened as ``<crypt>_spare``; D0's extents move onto it;
2. each freed Dk-1 is formatted and opened as ``<crypt>_<k-1>``; Dk's extents move onto it;
3. the last one, Dn-1, is formatted as ``<crypt>_<n-1>`` and the spare's extents move onto it;
4. the free extents of each new PV are written over (zeros through dm-crypt), as its head and
   tail were before its pvcreate, since a raw PV's unallocated extents, metadata area and tail
   may hold old plaintext the moves never overwrite;
5. the spare leaves the VG, is closed, and its LUKS2 header is erased: it held ciphertext only,
   whose key is then gone (what stays reads as data to the guard: it is zeroed, or named in
   allow_format, to serve again).

n + 1 moves, one more than the least, so that every device ends with the crypt name of its
position in the pillar (``<crypt>_<k>`` on Dk, as on a host the formula built) and no pillar
change is needed afterwards. Each target is an empty PV that receives one source's extents, so
no PV ever holds two stripes of the LV. Each new crypt device is in /etc/crypttab before it
becomes a PV: a boot in the middle opens it and LVM finds its VG whole, with the interrupted
pvmove in it, which the next ``pvmove`` resumes from LVM's last checkpoint.

A device is formatted only when it is the spare the state found blank before the first step
(the ledger names it) and still without a signature, or a device this route freed: the ledger
names it with its PV UUID before ``vgreduce`` takes it out of the VG, which LVM allows only when
no extent is left on it, and it must still carry exactly that PV label, in no VG. A device the
ledger says these moves formatted is never formatted again unless it carries their LUKS header
without a keyslot (a luksFormat cut short): a path of it without that header names another disk.
Anything else is refused.

A step is a dict: ``action`` (the code the runner and the state decide on), ``move`` (its
index, or None), ``text`` (for people), and what the action needs.
"""

MOVES_DIR = "/var/lib/hana-storage/moves"  # root-only: each volume's plan and ledger
FILL_LV = "hana_storage_fill"  # the LV that writes over a new PV's free extents
PE_START = 1 << 20  # pvcreate's default first extent
LUKS2_DATA_OFFSET = 16 << 20  # cryptsetup's default, for the estimate before anything is formatted


class MovesError(ValueError):
    """A plan, a ledger or a fact that cannot be what the state wrote or the host says."""


def plan_path(volume_name):
    return f"{MOVES_DIR}/{volume_name}.json"


def ledger_path(volume_name):
    return f"{MOVES_DIR}/{volume_name}.ledger.json"


def mapper(name):
    return f"/dev/mapper/{name}"


def chain(volume):
    """The moves of ``volume`` (its plan from pillar.normalize), in order: [{"source": the PV's
    path, "target": {"device", "name"}}]."""
    crypt, spare = volume["crypt"], volume["spare"]
    targets = [spare, *crypt]
    sources = [c["device"] for c in crypt] + [mapper(spare["name"])]
    return [
        {"source": source, "target": {"device": t["device"], "name": t["name"]}}
        for source, t in zip(sources, targets, strict=True)
    ]


def unit_argv(volume_name, unit, python, path):
    """``systemd-run`` of the runner for ``volume_name``: ``python`` (the minion's) with the
    package on ``path``. Stopped like any unit: a pvmove's copy goes on in the kernel without it,
    and the next start resumes it."""
    code = "import sys; from hana_storage_core import move_runner; sys.exit(move_runner.run(sys.argv[1]))"
    return [
        "systemd-run",
        f"--unit={unit}",
        f"--description=hana-storage: encrypt {volume_name} below LVM, PV by PV",
        f"--setenv=PYTHONPATH={path}",
        python,
        "-c",
        code,
        volume_name,
    ]


def plan(volume, key_file, luks, flag_options, crypttab_lines, uuids):
    """What the runner reads: the moves, each target with the LUKS UUID it is formatted with
    (made before it, so that its crypttab line is known) and that line."""
    moves = chain(volume)
    for move in moves:
        name = move["target"]["name"]
        move["target"].update(uuid=uuids[name], crypttab=crypttab_lines[name])
    return {
        "volume": volume["name"],
        "vg": volume["vg"],
        "key_file": key_file,
        "luks": luks,
        "flag_options": sorted(flag_options),
        "moves": moves,
        "spare": dict(volume["spare"]),
        "final": [c["name"] for c in volume["crypt"]],
    }


def check_plan(plan_data):
    """``plan_data`` as the runner reads it back: the fields it acts on, each of its type."""
    try:
        ok = (
            isinstance(plan_data["vg"], str)
            and isinstance(plan_data["key_file"], str)
            and isinstance(plan_data["luks"], dict)
            and all(isinstance(o, str) and o.startswith("--") for o in plan_data["flag_options"])
            and all(
                isinstance(m["source"], str)
                and all(isinstance(m["target"][k], str) for k in ("device", "name", "uuid", "crypttab"))
                for m in plan_data["moves"]
            )
            and len(plan_data["moves"]) >= 2
            and all(isinstance(plan_data["spare"][k], str) for k in ("device", "name"))
            and all(isinstance(n, str) for n in plan_data["final"])
            and isinstance(plan_data["volume"], str)
            and all(k in plan_data["luks"] for k in ("cipher", "key_size", "sector_size"))
            and _is_chain(plan_data)
        )
    except (KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise MovesError("the moves' plan is not what the state writes")
    return plan_data


def _is_chain(plan_data):
    """The moves are moves.chain's: the spare first, each freed source the next target, the
    spare's PV the last source, each device's final name its target's."""
    chain_ = plan_data["moves"]
    spare = plan_data["spare"]
    return (
        chain_[0]["target"]["device"] == spare["device"]
        and chain_[0]["target"]["name"] == spare["name"]
        and chain_[-1]["source"] == mapper(spare["name"])
        and all(chain_[k]["target"]["device"] == chain_[k - 1]["source"] for k in range(1, len(chain_)))
        and [m["target"]["name"] for m in chain_[1:]] == plan_data["final"]
        and len({m["source"] for m in chain_}) == len(chain_)
    )


def new_ledger():
    """``spare_device``: the spare the state found blank; ``freed_pv``: {source: the PV UUID it
    had when it left the VG}; ``wiping``: the freed device whose old PV label the runner is
    wiping before its luksFormat (a cut between the two leaves it without a signature), cleared
    once it carries these moves' LUKS; ``formatted``: the devices whose luksFormat these moves
    saw done - a path of them without that LUKS names another disk (a boot renumbered it);
    ``identity``: {device: move_runner.identity} of the spare when it was found blank and of
    each source when it was freed - a path showing another is another disk."""
    return {
        "spare_blank": False,
        "spare_device": None,
        "freed": [],
        "freed_pv": {},
        "wiping": None,
        "formatted": [],
        "identity": {},
        "filled": [],
        "done": False,
        "error": None,
    }


def check_ledger(ledger):
    base = new_ledger()
    if not isinstance(ledger, dict) or set(ledger) - set(base):
        raise MovesError("the moves' ledger is not what the runner writes")
    merged = {**base, **ledger}
    if not (
        isinstance(merged["spare_blank"], bool)
        and isinstance(merged["done"], bool)
        and all(
            isinstance(merged[k], list) and all(isinstance(d, str) for d in merged[k])
            for k in ("freed", "filled", "formatted")
        )
        and all(
            isinstance(merged[k], dict)
            and all(isinstance(d, str) and isinstance(v, str) for d, v in merged[k].items())
            for k in ("freed_pv", "identity")
        )
        and all(merged[k] is None or isinstance(merged[k], str) for k in ("error", "spare_device", "wiping"))
    ):
        raise MovesError("the moves' ledger is not what the runner writes")
    return merged


def _step(action, move=None, text="", **extra):
    return {"action": action, "move": move, "text": text, **extra}


def _pv(facts, path):
    return facts["pvs"].get(path)


def _in_vg(facts, path, vg):
    pv = _pv(facts, path)
    return bool(pv) and pv["vg"] == vg


def _under_way(plan_data, facts, ledger=None):
    """The first move whose source is still a PV of the VG, or (with the ledger) whose source
    these moves have not released: a source LVM does not list (its LUKS PV closed, its path
    another disk after a boot) is not moved (None: all moved)."""
    for index, move in enumerate(plan_data["moves"]):
        if _in_vg(facts, move["source"], plan_data["vg"]):
            return index
        if ledger is not None and move["source"] not in ledger["freed"]:
            return index
    return None


def progress(plan_data, facts):
    """(moves done, of how many, percent of the current move or None)."""
    index = _under_way(plan_data, facts)
    total = len(plan_data["moves"])
    if index is None:
        return total, total, None
    return index, total, (facts.get("moving") or {}).get("percent")


def percent(plan_data, facts):
    """How far the volume is, 0-100: the moves done and the current pvmove's copy."""
    done, total, current = progress(plan_data, facts)
    return min(100, int(100 * (done + (current or 0) / 100) / total))


def describe(plan_data, facts):
    """``encrypting hana_data by moves: move 2 of 4 (/dev/vdb onto hana_data_0) 37 %``."""
    done, total, percent = progress(plan_data, facts)
    if done == total:
        return f"{plan_data['volume']}: every PV moved onto LUKS"
    move = plan_data["moves"][done]
    shown = f" {percent:.0f} %" if percent is not None else ""
    return (
        f"{plan_data['volume']}: move {done + 1} of {total} ({move['source']} onto "
        f"{move['target']['name']}){shown}"
    )


def _may_format(plan_data, facts, ledger, target):
    """None when the runner may format ``target`` (a device of the plan), else why not."""
    device = target["device"]
    pv = _pv(facts, device)
    if pv is not None and pv["vg"]:
        return f"{device} is a PV of volume group {pv['vg']!r}"
    found = facts["signatures"].get(device, [])
    if device in ledger["formatted"]:
        return (
            f"these moves formatted {device}, which now carries {', '.join(found) or 'no signature'} and "
            "not their LUKS: another disk behind the path (renumbered by a boot?)"
        )
    recorded, seen = ledger["identity"].get(device), facts["identity"].get(device)
    if recorded and not same_disk(recorded, seen):
        return (
            f"{device} is {seen or 'nothing'} and was {recorded} when these moves "
            f"{'found it blank' if device == plan_data['spare']['device'] else 'freed it'}: another disk "
            "behind the path (renumbered by a boot?)"
        )
    if device == plan_data["spare"]["device"]:
        if not ledger["spare_blank"]:
            return f"the spare {device} was not found blank before the first move"
        if ledger["spare_device"] != device:
            return (
                f"the spare found blank before the first move was {ledger['spare_device']}, the plan "
                f"names {device}"
            )
        if found:
            return f"the spare {device} now carries {', '.join(found)}"
        return None
    if device not in ledger["freed"]:
        return f"{device} was not freed by these moves"
    if ledger["wiping"] == device and not found:
        return None  # our wipefs of its PV label, cut short before its luksFormat
    pv_uuid = ledger["freed_pv"].get(device)
    seen = (facts.get("blkid_uuid") or {}).get(device)
    if found != ["LVM2_member"] or pv_uuid is None or seen != pv_uuid:
        return (
            f"{device}, freed by these moves as PV {pv_uuid}, now carries "
            f"{', '.join(found) or 'no signature'}{f' (UUID {seen})' if seen else ''}: not the device these "
            "moves freed, or reused since"
        )
    return None


def same_disk(recorded, seen):
    """Do two move_runner.identity strings (``<id>/<sectors>``) name one disk? By its ID when it
    has one (a LUN grown since keeps its ID), by its size only when it has none."""
    if not seen:
        return False
    recorded_id, _, recorded_size = recorded.rpartition("/")
    seen_id, _, seen_size = seen.rpartition("/")
    if recorded_id:
        return seen_id == recorded_id
    return not seen_id and seen_size == recorded_size


def room(device_bytes, extent_bytes):
    """The extents a LUKS PV on a device of ``device_bytes`` holds, by cryptsetup's and
    pvcreate's defaults (the runner checks the real count before each move)."""
    return max(0, (device_bytes - LUKS2_DATA_OFFSET - PE_START) // extent_bytes)


def room_errors(plan_data, facts, sizes):
    """Every move whose target would be too small for its source's extents, before anything is
    touched: [message]. ``sizes``: {device: bytes}."""
    errors = []
    first = _pv(facts, plan_data["moves"][0]["source"]) or {}
    for move in plan_data["moves"]:
        # the spare's extents will be the first PV's; its own PV does not exist yet
        source = _pv(facts, move["source"]) or first
        target = move["target"]["device"]
        extent = source.get("extent") or first.get("extent") or 1
        needed, have = source.get("alloc", 0), room(sizes[target] or 0, extent)
        if needed > have:
            errors.append(
                f"{target} would hold {have} extents as a LUKS PV and {move['source']} has {needed}: "
                f"the LUKS2 header takes {LUKS2_DATA_OFFSET >> 20} MiB of each device; grow each LUN by "
                f"{-(-(needed - have) * extent >> 20)} MiB or more, or free as many extents on each PV"
            )
    return errors


def next_step(plan_data, facts, ledger):
    """The step that comes next. ``facts`` (move_runner.read_facts): {"pvs": {path: {"vg",
    "uuid", "pe_count", "alloc", "extent", "pe_start"}} (a path LVM does not list is absent),
    "luks": {device: {"uuid", "opens", "dated", "keyslots"}} (the targets with a LUKS header;
    ``opens``: the key opens it, None when not tried; ``dated``: its header dates its volume
    key), "open": [crypt names open over their target], "open_elsewhere": [crypt names open over
    another device], "moving": {"percent"} or None (a pvmove in the VG), "crypttab": [names],
    "signatures": {device: [types]} and "blkid_uuid": {device: UUID or None} (the targets'),
    "identity": {path: move_runner.identity or None} (the spare's, the sources', the targets')}. A
    fill LV left by a kill is the fill step's to remove (move_runner._fill)."""
    if ledger["done"]:
        return _step("done", text=describe(plan_data, facts))
    closed = _closed_target(plan_data, facts, ledger)
    if closed:
        return closed
    if facts["moving"] is not None:  # the pvmove of the first source still in the VG
        index = _under_way(plan_data, facts)
        if index is None:
            return _step(
                "refuse",
                text=f"a pvmove runs in {plan_data['vg']} and no source of these moves is left in it: "
                "not theirs; let it end (or pvmove --abort it) first",
            )
        move = plan_data["moves"][index]
        # the target too: LVM ignores it when it resumes ("Detected pvmove in progress"), and
        # confines a pvmove it starts anew (the one it resumed ended meanwhile, or it was not
        # ours) to this move's target
        return _step(
            "resume",
            index,
            describe(plan_data, facts),
            source=move["source"],
            path=mapper(move["target"]["name"]),
        )
    index = _under_way(plan_data, facts, ledger)
    if index is not None:
        return _move_step(plan_data, facts, ledger, index)
    for name in plan_data["final"]:
        if name not in ledger["filled"]:
            return _step("fill", text=f"writing over the free extents of {name}", name=name)
    return _retire_step(plan_data, facts, ledger)


def _closed_target(plan_data, facts, ledger):
    """The open step of a LUKS PV these moves made that is not open (after a boot that could not
    open it: a pillar key's file is on a ramfs), or None. Its VG is whole only with it, and
    an interrupted pvmove resumes only in a whole VG. Not the spare once it is released."""
    for move in plan_data["moves"]:
        target = move["target"]
        found = facts["luks"].get(target["device"])
        if (
            found
            and found["uuid"] == target["uuid"]
            and found["opens"]
            and target["name"] not in facts["open"] + facts["open_elsewhere"]
            and mapper(target["name"]) not in ledger["freed"]
        ):
            return _step("open", text=f"opening {target['device']} as {target['name']}", target=target)
    return None


def _target_step(plan_data, facts, ledger, at, target):
    """Open ``target`` (formatting it first when it may be), or None when it is open."""
    device, name = target["device"], target["name"]
    if name in facts["open_elsewhere"]:
        return _step("refuse", text=f"{at}: {name} is open over another device than {device}")
    if name in facts["open"]:
        return None
    found = facts["luks"].get(device)
    if found and found["uuid"] != target["uuid"]:
        return _step(
            "refuse", text=f"{at}: {device} carries LUKS (UUID {found['uuid']}) these moves did not make"
        )
    if found and found["opens"]:
        return _step("open", text=f"{at}: opening {device} as {name}", target=target)
    if found and found.get("keyslots") != 0:
        # our UUID and a keyslot the key does not open: a key test that failed (memory, a key
        # file missing or changed), never a luksFormat cut short; it may hold extents already
        return _step(
            "refuse",
            text=f"{at}: the key does not open {device} (these moves' LUKS, "
            f"{found.get('keyslots')} keyslot(s)); nothing is formatted",
        )
    if not found:
        why = _may_format(plan_data, facts, ledger, target)
        if why:
            return _step("refuse", text=f"{at}: refusing to format {device}: {why}")
    # else our UUID without a keyslot: our luksFormat was cut short before it, done again.
    # A freed device's identity goes with its wiping mark, for a ledger whose release kept none
    return _step(
        "format",
        text=f"{at}: formatting {device} as {name}",
        target=target,
        identity=facts["identity"].get(device),
    )


def _move_step(plan_data, facts, ledger, index):
    vg = plan_data["vg"]
    move = plan_data["moves"][index]
    source, target = move["source"], move["target"]
    name, pv_path = target["name"], mapper(target["name"])
    source_pv = _pv(facts, source)
    at = f"move {index + 1} of {len(plan_data['moves'])}"
    if source_pv is None or source_pv["vg"] != vg:
        return _step(
            "refuse",
            index,
            f"{at}: {source}, which these moves have not released, is not a PV of {vg} that LVM sees "
            "(its LUKS PV closed, or its path names another disk since a boot)",
        )
    opening = _target_step(plan_data, facts, ledger, at, target)
    if opening:
        return {**opening, "move": index}
    if name not in facts["crypttab"]:
        return _step("crypttab", index, f"{at}: {name} into /etc/crypttab", target=target)
    if not facts["luks"][target["device"]]["dated"]:
        return _step("date", index, f"{at}: dating the volume key of {name}", target=target)
    target_pv = _pv(facts, pv_path)
    if target_pv is None:
        return _step(
            "pvcreate", index, f"{at}: {pv_path} becomes a PV", path=pv_path, extent=source_pv["extent"]
        )
    if target_pv["vg"] != vg:
        if target_pv["vg"]:
            return _step("refuse", index, f"{at}: {pv_path} is a PV of volume group {target_pv['vg']!r}")
        return _step("vgextend", index, f"{at}: {pv_path} joins {vg}", path=pv_path)
    if source_pv["alloc"] == 0:  # moved (or empty from the start): its target is a PV of the VG
        return _step(
            "release",
            index,
            f"{at}: {source} is empty; it leaves {vg}",
            source=source,
            pv_uuid=source_pv.get("uuid"),
            identity=facts["identity"].get(source),
        )
    if target_pv["alloc"]:
        return _step(
            "refuse",
            index,
            f"{at}: {pv_path} already holds {target_pv['alloc']} extents: a second source on it could put "
            "two stripes of an LV on one PV",
        )
    if target_pv["pe_count"] < source_pv["alloc"]:
        return _step(
            "refuse",
            index,
            f"{at}: {pv_path} holds {target_pv['pe_count']} extents and {source} has {source_pv['alloc']}: "
            "grow the LUN or free extents on the PV",
        )
    return _step("move", index, f"{at}: moving {source} onto {name}", source=source, path=pv_path)


def _retire_step(plan_data, facts, ledger):
    spare = plan_data["spare"]
    path = mapper(spare["name"])
    if path not in ledger["freed"]:
        return _step("refuse", text=f"the spare's PV {path} was not released by these moves")
    if _pv(facts, path) is not None:
        return _step("pvremove", text=f"{path} is no PV any more", path=path)
    if spare["name"] in facts["open"] or spare["name"] in facts["open_elsewhere"]:
        return _step("close", text=f"closing {spare['name']}", name=spare["name"])
    if spare["name"] in facts["crypttab"]:
        return _step("uncrypttab", text=f"{spare['name']} out of /etc/crypttab", name=spare["name"])
    found = facts["luks"].get(spare["device"])
    if found:
        if found["uuid"] != plan_data["moves"][0]["target"]["uuid"]:
            return _step("refuse", text=f"the spare {spare['device']} carries LUKS these moves did not make")
        return _step(
            "erase", text=f"erasing the LUKS2 header of the spare {spare['device']}", device=spare["device"]
        )
    return _step("finish", text=describe(plan_data, facts))
