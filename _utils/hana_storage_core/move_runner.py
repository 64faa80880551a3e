"""The encryption in place below LVM, run: reads the facts ``moves.next_step`` decides on, and
runs each step until the volume is done or a step is refused. It runs as ``python -m
hana_storage_core.move_runner <volume>`` in the transient unit the state starts, with the
minion's Python, so that it outlives the Salt job and the minion; a kill at any moment leaves
LVM's pvmove checkpoints, the ledger and /etc/crypttab as they were, and the next start goes
on from there. Each step is printed as a JSON line (the unit's journal).

The plan is the state's (moves.plan), the ledger the runner's: both root-only files under
moves.MOVES_DIR, each replaced whole.
"""

import datetime
import json
import os
import stat
import subprocess
import sys

from . import commands, files, luks, lvm, moves, reencrypt, stack, tab

CRYPTTAB = "/etc/crypttab"
REPEATS = 3  # the same step this often in a row: it does not take effect
# LVM refuses PVs of different logical block sizes in one VG by default; the state chose a LUKS
# sector size no larger than the XFS's on the LV, which therefore takes either
MIXED_BLOCK_SIZES = "devices { allow_mixed_block_sizes = 1 }"


class StepFailed(RuntimeError):
    """A command of a step failed; its message says which and why."""


def _run(argv, check=True, stdin=None):
    """Run ``argv`` (never key material on it; ``stdin``: a token's JSON): its CompletedProcess;
    ``check``: a non-zero exit is StepFailed, with the end of what it said."""
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=False,
        **({"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}),
    )
    if check and done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise StepFailed(
            f"{argv[0]} {argv[1] if len(argv) > 1 else ''} exited {done.returncode}: {' / '.join(tail)}"
        )
    return done


def read_json(path, default=None):
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as error:
        raise moves.MovesError(f"{path}: {error}") from error


def write_json(path, data):
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    files.replace_file(path, json.dumps(data, indent=1, sort_keys=True).encode(), mode=0o600)


def read_plan(volume_name):
    plan = read_json(moves.plan_path(volume_name))
    return None if plan is None else moves.check_plan(plan)


def read_ledger(volume_name):
    ledger = read_json(moves.ledger_path(volume_name))
    return None if ledger is None else moves.check_ledger(ledger)


def _real(path):
    return os.path.realpath(path)


def _sysfs_text(path):
    """A sysfs attribute's text, "" when the kernel has none; one that cannot be read stops the
    step (an identity read as "no ID" would vouch for any disk of the same size)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip()
    except FileNotFoundError:
        return ""
    except OSError as error:
        raise StepFailed(f"{path} cannot be read: {error.strerror or error}") from None


def identity(path):
    """What names the disk at ``path`` whichever path a boot gives it (sysfs_identity); None when
    no block device is at ``path``."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISBLK(found.st_mode):
        return None
    entry = f"/sys/dev/block/{os.major(found.st_rdev)}:{os.minor(found.st_rdev)}"
    return sysfs_identity(os.path.realpath(entry)) if os.path.isdir(entry) else None


def sysfs_identity(entry):
    """``<id>/<sectors>`` for the /sys/class/block entry ``entry``: its WWID or serial (a
    multipath map: its first path's, so that the LUN is one whether named by the map or by a
    path; another dm device: its dm UUID; an md array: its UUID; a partition: its disk's, and
    its number) and its size in 512-byte sectors. A disk without an ID of its own (some virtual
    disks) is named by its size only."""
    disk, part = entry, ""
    if os.path.exists(f"{entry}/partition"):
        disk, part = os.path.dirname(entry), f"-part{_sysfs_text(f'{entry}/partition')}"
    dm_uuid = _sysfs_text(f"{disk}/dm/uuid")
    multipath = stack.is_multipath_uuid(dm_uuid) and os.path.isdir(f"{disk}/slaves")
    paths = sorted(os.listdir(f"{disk}/slaves")) if multipath else []
    if paths:
        disk, dm_uuid = os.path.realpath(f"{disk}/slaves/{paths[0]}"), ""
    found = dm_uuid or next(
        (text for text in (_sysfs_text(f"{disk}/{f}") for f in ("md/uuid", *stack.WWID_FILES)) if text), ""
    )
    return f"{found}{part}/{_sysfs_text(f'{entry}/size') or '?'}"


def pv_rows():
    done = _run(
        lvm._report_command(
            "pvs", "pv_name,pv_uuid,vg_name,pv_pe_count,pv_pe_alloc_count,vg_extent_size,pe_start"
        )
    )
    try:
        rows = json.loads(done.stdout)["report"][0]["pv"]
        return {
            _real(row["pv_name"]): {
                "vg": row["vg_name"],
                "uuid": row.get("pv_uuid") or None,
                "pe_count": int(row["pv_pe_count"] or 0),
                "alloc": int(row["pv_pe_alloc_count"] or 0),
                "extent": int(row["vg_extent_size"] or 0),
                "pe_start": int(row.get("pe_start") or 0),
            }
            for row in rows
        }
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
        raise moves.MovesError(f"pvs printed a report that does not parse: {error}") from error


def _lv_rows(vg):
    done = _run(lvm._report_command("lvs", "lv_name,lv_attr,copy_percent", "-a", vg))
    try:
        return json.loads(done.stdout)["report"][0]["lv"]
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise moves.MovesError(f"lvs printed a report that does not parse: {error}") from error


def _blkid(device):
    done = _run(["blkid", "-p", "-o", "export", device], check=False)
    if done.returncode == 2:  # nothing found
        return {}
    if done.returncode:
        raise StepFailed(f"blkid {device} exited {done.returncode}: {done.stderr.strip()}")
    return tab.parse_blkid_export(done.stdout)


def _key_opens(device, key_file):
    argv = ["cryptsetup", "open", "--test-passphrase", "--key-file", key_file, device]
    return _run(argv, check=False).returncode == 0


def _header(device):
    """The LUKS2 header of ``device`` (luks.parse_header), or None when it cannot be read: torn,
    not LUKS2, or the device not readable."""
    try:
        fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return luks.parse_header(lambda offset, size: os.pread(fd, size, offset))
    except (ValueError, OSError):
        return None
    finally:
        os.close(fd)


def _keyslots(header):
    """How many keyslots ``header`` has, or None when it could not be read."""
    slots = (header or {}).get("keyslots")
    return len(slots) if isinstance(slots, (list, dict)) else None


def _key_dated(header):
    """``header`` dates its volume key (reencrypt.KEY_DATE_TOKEN); an unread one does not."""
    return header is not None and reencrypt.volume_key_date(header) is not None


def _crypttab_names():
    try:
        with open(CRYPTTAB, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return []
    names = []
    for line in text.splitlines():
        try:
            names += [entry["name"] for entry in tab.parse_crypttab(line)]
        except tab.TabError:
            continue  # not an entry: nobody's
    return names


def _crypt_device(name):
    """The device under the crypt mapping ``name`` (its real path), or None."""
    for line in _run(["cryptsetup", "status", name], check=False).stdout.splitlines():
        key, _, value = line.strip().partition(":")
        if key == "device":
            return _real(value.strip())
    return None


def read_facts(plan, test_keys=True):
    """The facts moves.next_step decides on (its docstring), read from the host. The key is
    tried (an argon2 derivation each) only on a LUKS target that is not open, the one case a
    step depends on it; ``test_keys`` False tries none (``opens`` None: progress only)."""
    rows = pv_rows()
    paths = {plan["spare"]["device"]}
    for move in plan["moves"]:
        paths |= {move["source"], move["target"]["device"], moves.mapper(move["target"]["name"])}
    pvs = {path: rows[_real(path)] for path in paths if os.path.exists(path) and _real(path) in rows}
    opened = {}
    for move in plan["moves"]:
        name = move["target"]["name"]
        if os.path.exists(moves.mapper(name)):
            opened[name] = _crypt_device(name) == _real(move["target"]["device"])
    luks, signatures, blkid_uuid = {}, {}, {}
    identities = {path: identity(path) for path in paths}
    for move in plan["moves"]:
        device, name = move["target"]["device"], move["target"]["name"]
        found = _blkid(device)
        # a partition table is something on the device too (blkid -p: PTTYPE, no TYPE)
        signatures[device] = [found["TYPE"]] if "TYPE" in found else []
        if "PTTYPE" in found:
            signatures[device].append(f"{found['PTTYPE']} partition table")
        blkid_uuid[device] = found.get("UUID")
        if found.get("TYPE") == "crypto_LUKS":
            header = _header(device)
            luks[device] = {
                "uuid": found.get("UUID"),
                "opens": _key_opens(device, plan["key_file"]) if test_keys and name not in opened else None,
                "dated": _key_dated(header),
                "keyslots": _keyslots(header),
            }
    lvs = _lv_rows(plan["vg"])
    moving = next((lv for lv in lvs if str(lv.get("lv_attr", "")).startswith("p")), None)
    try:
        percent = None if moving is None else float(moving.get("copy_percent") or 0)
    except (TypeError, ValueError) as error:
        raise moves.MovesError(f"lvs printed a copy percent that does not parse: {error}") from error
    return {
        "pvs": pvs,
        "luks": luks,
        "open": [name for name, over in opened.items() if over],
        "open_elsewhere": [name for name, over in opened.items() if not over],
        "moving": None if moving is None else {"percent": percent},
        "crypttab": _crypttab_names(),
        "signatures": signatures,
        "blkid_uuid": blkid_uuid,
        "identity": identities,
    }


def _set_crypttab(name, line=None):
    """The entry of ``name`` made ``line``, or dropped (None); the file replaced whole."""
    try:
        with open(CRYPTTAB, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        text = ""
    text = tab.set_entry(text, "crypttab", name, line)[0] if line else tab.drop_entry(text, "crypttab", name)
    files.replace_file(CRYPTTAB, text.encode("utf-8"))


def _fill(plan, name):
    """Write zeros over the free extents of ``name``'s PV, through dm-crypt (an LV of its own
    over them, then removed): what a raw PV left there is overwritten by ciphertext."""
    vg, pv_path = plan["vg"], moves.mapper(name)
    lv = f"{vg}/{moves.FILL_LV}"
    if any(row.get("lv_name") == moves.FILL_LV for row in _lv_rows(vg)):
        _run(["lvremove", "-y", lv])
    row = pv_rows().get(_real(pv_path))
    if row is None or row["vg"] != vg:
        raise moves.MovesError(f"{pv_path} is not a PV of {vg}: its free extents cannot be written over")
    free = row["pe_count"] - row["alloc"]
    if free > 0:
        _run(["lvcreate", "-y", "-Wn", "-Zn", "-n", moves.FILL_LV, "-l", str(free), vg, pv_path])
        path = f"/dev/{lv}"
        _zero(path, 0, _size(path))
        _run(["lvremove", "-y", lv])


def _size(path):
    """The size of the block device at ``path`` in bytes."""
    return int(_run(["blockdev", "--getsize64", path]).stdout)


def _zero(path, offset, length):
    """Zeros over ``length`` bytes of ``path`` from ``offset``, synced."""
    chunk = bytes(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        end = offset + length
        while offset < end:
            offset += os.pwrite(fd, chunk[: min(len(chunk), end - offset)], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _scrub(path, extent):
    """Before ``path`` (a new LUKS device, nothing on it yet) becomes a PV: zeros over what no
    extent of the PV will cover - its head (the PV label and metadata area) and its tail past the
    last whole extent, where the raw PV's old plaintext sits, shifted by the LUKS2 header."""
    if _blkid(path):
        return  # something is on it already (a pvcreate that was cut short after its label)
    size = _size(path)
    head = min(size, moves.LUKS2_DATA_OFFSET)
    _zero(path, 0, head)
    tail = max(head, size - (extent or 0) - moves.LUKS2_DATA_OFFSET)
    _zero(path, tail, size - tail)


def _formatted(plan, ledger, device):
    """``device`` carries these moves' LUKS: the ledger says so, and its wiping mark goes."""
    if device in ledger["formatted"] and ledger["wiping"] != device:
        return
    if device not in ledger["formatted"]:
        ledger["formatted"].append(device)
    if ledger["wiping"] == device:
        ledger["wiping"] = None
    write_json(moves.ledger_path(plan["volume"]), ledger)


def _fit_head(path):
    """``path``, a PV pvcreate made and no VG holds yet: when LVM put its first extent past what
    _scrub zeroed (pe_start aligned to a large optimal I/O size, or lvm.conf's data alignment),
    it is made again over zeros up to that first extent."""
    row = pv_rows().get(_real(path))
    if row is None or row["vg"] or row["pe_start"] <= moves.LUKS2_DATA_OFFSET:
        return
    _run(["pvremove", "-y", path])
    _zero(path, 0, row["pe_start"])
    _run(["pvcreate", path])


def perform(plan, ledger, step):
    """Run ``step``; the ledger is written where the step says (before the command it vouches for)."""
    action, vg, volume = step["action"], plan["vg"], plan["volume"]
    target = step.get("target") or {}
    key_file = plan["key_file"]
    if action == "format":
        if target["device"] != plan["spare"]["device"]:
            if ledger["wiping"] != target["device"]:
                ledger["wiping"] = target["device"]
                if step.get("identity") and target["device"] not in ledger["identity"]:
                    # _may_format has just found the PV label this route freed on it: the disk
                    ledger["identity"][target["device"]] = step["identity"]
                write_json(moves.ledger_path(volume), ledger)
            _run(["wipefs", "-a", target["device"]])  # the LVM label of the PV this route freed
        luks = {**plan["luks"], "type": "luks2"}
        _run(
            commands.luks_format(target["device"], key_file, luks, label=target["name"], uuid=target["uuid"])
        )
        _formatted(plan, ledger, target["device"])
    elif action == "open":  # only ever of our LUKS: a cut after luksFormat is recorded here
        _formatted(plan, ledger, target["device"])
        _run(commands.luks_open(target["name"], target["device"], key_file, plan["flag_options"], False))
    elif action == "date":  # what the audit measures the cryptoperiod from, as luks_formatted does
        token = reencrypt.key_date_token(datetime.date.today(), target["uuid"])
        _run(commands.luks_token_import(target["device"]), stdin=token)
    elif action == "crypttab":
        _set_crypttab(target["name"], target["crypttab"])
    elif action == "pvcreate":
        _scrub(step["path"], step.get("extent"))
        _run(["pvcreate", step["path"]])
    elif action == "vgextend":  # 4 KiB LUKS sectors beside 512-byte LUNs until the last move
        _fit_head(step["path"])
        _run(["vgextend", "--config", MIXED_BLOCK_SIZES, vg, step["path"]])
    elif action == "move":
        _run(["pvmove", "-i", "10", step["source"], step["path"]])
    elif action == "resume":  # after a kill or a boot: on from LVM's last checkpoint, in an active VG
        _run(["vgchange", "-ay", vg])
        # pvmove of a source whose move was interrupted polls that move on (and no other
        # volume's, as a bare pvmove would)
        _run(["pvmove", "-i", "10", step["source"], step["path"]])
    elif action == "release":
        if step["source"] not in ledger["freed"]:
            ledger["freed"].append(step["source"])
            if step.get("pv_uuid"):
                ledger["freed_pv"][step["source"]] = step["pv_uuid"]
            if step.get("identity"):
                ledger["identity"][step["source"]] = step["identity"]
            write_json(moves.ledger_path(volume), ledger)
        _run(["vgreduce", vg, step["source"]])
    elif action == "fill":
        _fill(plan, step["name"])
        ledger["filled"].append(step["name"])
        write_json(moves.ledger_path(volume), ledger)
    elif action == "pvremove":
        _run(["pvremove", step["path"]])
    elif action == "close":
        _run(["cryptsetup", "close", step["name"]])
    elif action == "uncrypttab":
        _set_crypttab(step["name"])
    elif action == "erase":
        _run(["cryptsetup", "erase", "--batch-mode", step["device"]])
        _run(["wipefs", "-a", step["device"]])
    elif action == "finish":
        ledger.update(done=True, error=None)
        write_json(moves.ledger_path(volume), ledger)
    else:
        raise moves.MovesError(f"no such step: {action}")


def _say(step, facts, plan):
    done, total, percent = moves.progress(plan, facts)
    line = {"step": step["action"], "move": step["move"], "moves": total, "done": done, "percent": percent}
    print(json.dumps({**line, "text": step["text"]}), flush=True)


def run(volume_name):
    """Every step, until done (0) or refused or failed (1, the ledger's error says why)."""
    plan = read_plan(volume_name)
    ledger = read_ledger(volume_name)
    if plan is None or ledger is None:
        print(f"no plan or ledger for {volume_name} in {moves.MOVES_DIR}", file=sys.stderr)
        return 1
    last, repeats = None, 0
    while True:
        try:
            facts = read_facts(plan)
            step = moves.next_step(plan, facts, ledger)
            _say(step, facts, plan)
            if step["action"] == "done":
                return 0
            key = (step["action"], step["move"], step.get("name"))
            repeats = repeats + 1 if key == last else 1
            last = key
            if step["action"] == "refuse":
                raise StepFailed(step["text"])
            if repeats > REPEATS:
                raise StepFailed(f"{step['text']}: the step did not take effect after {REPEATS} tries")
            perform(plan, ledger, step)
        except Exception as error:  # noqa: BLE001 - whatever stops the run is in the ledger, no traceback only
            ledger["error"] = (
                str(error)
                if isinstance(error, (StepFailed, moves.MovesError))
                else (f"{type(error).__name__}: {error}")
            )
            write_json(moves.ledger_path(volume_name), ledger)
            print(json.dumps({"step": "failed", "text": str(error)}), flush=True)
            return 1


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]) if len(sys.argv) == 2 else 2)
