"""States Salt core lacks for encrypted HANA storage: the pillar gate, keys, the data-loss guard,
LUKS format and open (with dm-crypt flags, active and persistent), guarded mkfs, crypttab and
fstab by UUID, and mounting that never displaces a foreign mount, and the PVs, VG and striped
LV of a volume (why not Salt's lvm states: above ``vg_present``).

Key material never leaves the key state: every other state names the key by its file, and no
return, change, comment or command line carries it. Every state is idempotent and, with
``test=True``, says what it would do without touching anything.

The states read the host through ``hana_storage_host`` and the pillar through
``hana_storage.validate_pillar``, neither of which runs a state: ``hana_storage.remediate``,
which runs these states, is never called back.
"""

import base64
import binascii
import contextlib
import datetime
import hmac
import os
import shutil
import stat
import sys
import tempfile
import time
import uuid as uuid_module

import hana_storage_core as core  # the loader puts its utils directories on sys.path while loading this
import salt.utils.data
from salt.exceptions import CommandExecutionError

core = core.fresh()  # after a saltutil.sync, the files it brought, not those this process imported first

__virtualname__ = "hana_storage"


def __virtual__():
    if "hana_storage.settings" in __salt__:
        return __virtualname__
    return False, "hana_storage state: the hana_storage execution module is not loaded (saltutil.sync_all)"


def _ret(name):
    """A step's return. Every step starts here, and so keeps the LVM reports it reads for the
    steps after it (lvm.RUN_REPORTS), until a step runs a command."""
    context = globals().get("__context__")
    if context is not None:
        context.setdefault(core.lvm.RUN_REPORTS, {})
    return {"name": name, "changes": {}, "result": True, "comment": ""}


def _done(ret, comment, result=True, **changes):
    ret.update(result=result, comment=comment)
    ret["changes"].update(changes)
    return ret


def _would(ret, comment):
    return _done(ret, comment, result=None)


def _change(ret, argv, failed, done, **changes):
    """Run ``argv`` (under test=True only say so): ``failed`` with its error, or ``done`` with
    ``changes``."""
    if __opts__["test"]:
        return _would(ret, f"would run {' '.join(argv)}")
    ok, err = _run(argv)
    if not ok:
        return _done(ret, f"{failed}: {err}", result=False)
    return _done(ret, done, **changes)


def _forget_reads():
    """Whatever a command changed, the LVM reports are read again (lvm.RUN_REPORTS)."""
    context = globals().get("__context__")
    if context is not None:
        context[core.lvm.RUN_REPORTS] = {}


def _afresh(function, *args):
    """``hana_storage_host.<function>(*args)`` on LVM reports read now. The run's kept reports
    may only say that a step has nothing to do: one may be minutes old, and blind to a device
    that was suspended (a multipath map reloading) while it was read. What a step is about to
    change, or to fail on, it proves on reports read now."""
    _forget_reads()
    return __salt__[f"hana_storage_host.{function}"](*args)


def _run(argv, stdin=None):
    """Run a command; (ok, stderr). Command lines here never hold key material; ``stdin`` (a
    LUKS2 token's JSON) never holds it either. A program that cannot be started (not installed)
    is a failed command, not an exception. Whatever it changed, the LVM reports this run kept
    are read again."""
    _forget_reads()
    try:
        result = __salt__["cmd.run_all"](
            argv,
            python_shell=False,
            output_loglevel="quiet",
            ignore_retcode=True,
            **({"stdin": stdin} if stdin is not None else {}),
        )
    except CommandExecutionError as error:
        return False, _brief(f"cannot run {argv[0]}: {error}")
    return result["retcode"] == 0, _brief(result["stderr"] or result["stdout"])


def _brief(message, limit=600):
    """A command's message for a state's comment: whole, or its start (where most tools name the
    cause, mkfs.xfs before its usage text) and its end."""
    message = message.strip()
    if len(message) <= limit:
        return message
    return f"{message[: limit // 2]} [...] {message[-limit // 2 :]}"


SCRATCH = "/run/hana-storage/scratch"  # a ramfs: what Clevis copies of a header never reaches a disk


def _run_scratch(argv, workdir=False):
    """Run a Clevis command with a private TMPDIR (and, with ``workdir``, working directory) on
    a root-only ramfs, removed afterwards.

    ``clevis luks bind`` copies the whole LUKS header into a ``mktemp -d`` and leaves it there
    when killed: under /tmp that is a header on a disk (with a revoked key's keyslot, during a
    rotation). ``cryptsetup reencrypt --encrypt`` writes its new header to a file in its working
    directory first. A directory a killed run left on the ramfs is removed by the next run (one
    whose process still runs, a remediation's beside this apply, is its own); a reboot empties
    the ramfs."""
    _forget_reads()
    try:
        _ramfs(SCRATCH)
        for name in os.listdir(SCRATCH):
            if not _scratch_owner_runs(name):
                shutil.rmtree(os.path.join(SCRATCH, name), ignore_errors=True)
        private = tempfile.mkdtemp(prefix=f"clevis-{_process_id(core.files.proc_pid())}-", dir=SCRATCH)
    except (OSError, CommandExecutionError) as error:
        return False, f"no private scratch directory for Clevis on a ramfs at {SCRATCH}: {error}"
    try:
        result = __salt__["cmd.run_all"](
            argv,
            python_shell=False,
            output_loglevel="quiet",
            ignore_retcode=True,
            env={"TMPDIR": private},
            **({"cwd": private} if workdir else {}),
        )
        return result["retcode"] == 0, _brief(result["stderr"] or result["stdout"])
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _process_id(pid):
    """``<pid>.<start time>``: a process, told apart from a later one given the same PID; None
    when ``pid`` runs no more."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rpartition(")")[2].split()
    except OSError:
        return None
    return f"{pid}.{fields[19]}" if len(fields) > 19 else None


def _scratch_owner_runs(name):
    """Does the process that made scratch directory ``name`` (clevis-<pid>.<start>-XXXX) still
    run? A name of another shape is a killed run's from an older release."""
    owner = name.split("-")[1] if name.count("-") >= 2 else ""
    pid = owner.partition(".")[0]
    return pid.isdigit() and _process_id(pid) == owner


def _ramfs(directory):
    """A root-only ramfs is mounted on ``directory``: ramfs pages are never swapped out."""
    mount = _live_mount(directory)
    if mount is not None and mount["fstype"] == KEY_FSTYPE:
        return
    os.makedirs(directory, mode=0o700, exist_ok=True)
    result = __salt__["mount.mount"](directory, "hana-storage-scratch", fstype=KEY_FSTYPE, opts="mode=0700")
    if result is not True:
        raise CommandExecutionError(f"mounting a ramfs on {directory} failed: {result}")


def _probes(devices, key_file=None):
    """hana_storage_host.probe of ``devices``, forgetting on the way (a real run only) the
    luksFormat marks of stages that are over: the header mark once its header has a keyslot,
    the payload mark once a signature is seen inside the opened device - a PV only once one is
    seen on the LV above it too (below LVM, the LV the formula creates on the PVs reads the
    same noise until mkfs). A header of that UUID without keyslots, or data without a signature
    inside it, is someone's from then on, never the formula's unfinished work. (A job killed
    after luksFormat, lvcreate or mkfs leaves its marks, and the command, its child, finishes
    anyway.)"""
    probes = __salt__["hana_storage_host.probe"](devices, key_file=key_file)
    if not __opts__["test"]:
        for probe in probes.values():
            luks = probe.get("luks") or {}
            if isinstance(luks.get("uuid"), str) and luks.get("keyslots"):
                _forget_format_mark(luks["uuid"], "header")
            types = [s.get("type") for s in probe.get("signatures") or []]
            if probe.get("inside_luks") and (probe.get("pttype") or types and types != ["LVM2_member"]):
                _forget_format_mark(probe["inside_luks"], "payload")
            if probe.get("luks_below") and (probe.get("pttype") or types):
                for uuid in probe["luks_below"]:
                    _forget_format_mark(uuid, "payload")
    return probes


def _forget_format_mark(uuid, stage):
    with contextlib.suppress(FileNotFoundError, CommandExecutionError):
        os.unlink(__salt__["hana_storage_host.format_marker"](uuid, stage))


def _probe(device, key_file=None):
    return _probes([device], key_file=key_file)[device]


def _key_files(*paths):
    """The key files of ``paths`` that are in place: a volume's key and, while it is rotated,
    its previous key; either opening a LUKS device makes it the volume's own."""
    return [path for path in paths if path and os.path.isfile(path)]


def _wipe(ret, device, reason):
    ok, err = _run(core.commands.wipe(device))
    if not ok:
        _done(ret, f"wipefs {device} failed: {err}", result=False)
        return False
    ret["changes"].setdefault("wiped", {})[device] = reason
    return True


# ---- the pillar gate -------------------------------------------------------------------------


def pillar_valid(name):
    """
    Fail, naming every error and its key path, unless the ``hana:storage`` pillar is valid.

    .. code-block:: yaml

        hana-storage-pillar-valid:
          hana_storage.pillar_valid: []
    """
    ret = _ret(name)
    errors = __salt__["hana_storage.validate_pillar"]()
    ret["comment"] = core.pillar.validation_summary(errors)
    if errors:
        ret["result"] = False
        ret["comment"] += "\nnothing was touched"
    return ret


# ---- keys ------------------------------------------------------------------------------------


def key_present(name, source, pillar_path=None):
    """
    The key file ``name`` is in place, root-only.

    source
        ``keyfile``: the file must already be there (put by the key store); its mode and owner
        are corrected to 0400 root, through a descriptor (a symlink is never followed), and a
        key whose real path runs through a directory others can write is refused.
        ``pillar``: the base64 material at the pillar path ``pillar_path`` is written to ``name`` on
        a ramfs mounted (mode 0700) on its directory: ramfs pages never go to swap, and nothing
        reaches a persistent disk.
    """
    ret = _ret(name)
    if source == "keyfile":
        return _keyfile_mode(ret, name)
    key = _pillar_key(pillar_path) or b""
    if not key:
        return _done(
            ret, f"no usable key material at pillar {pillar_path} (the value is not shown)", result=False
        )
    directory = os.path.dirname(name)
    if os.path.islink(name) or os.path.islink(directory):
        return _done(
            ret, f"{name} or its directory is a symlink: refusing to write a key through it", result=False
        )
    try:
        mount = _live_mount(os.path.realpath(directory))
        on_ramfs = mount is not None and mount["fstype"] == KEY_FSTYPE
    except MountTableError as error:
        return _done(ret, f"{error}: not writing a key there", result=False)
    if on_ramfs and os.path.isfile(name) and _key_file_matches(name, key):
        return _done(ret, f"key file {name} is in place (ramfs, 0400 root)")
    if __opts__["test"]:
        where = "" if on_ramfs else f"mount a ramfs (mode 0700) on {directory} and "
        return _would(ret, f"would {where}write the key from pillar {pillar_path} to {name} (0400 root)")
    if not on_ramfs and not _mount_key_ramfs(ret, directory, name):
        return ret
    core.files.replace_file(name, key, mode=0o400)
    ret["changes"]["key_file"] = f"written ({len(key)} bytes, mode 0400, {KEY_FSTYPE})"
    return _done(ret, f"wrote the key from pillar {pillar_path} to {name}")


KEY_FSTYPE = "ramfs"  # tmpfs pages can be swapped out; ramfs pages never are


def _pillar_key(pillar):
    """The key bytes at the pillar path ``pillar``: None when nothing is there, b"" when what is
    there is not base64."""
    material = salt.utils.data.traverse_dict_and_list(__pillar__, pillar, None) if pillar else None
    if not material:
        return None
    try:
        return base64.b64decode(material, validate=True)
    except (binascii.Error, ValueError, TypeError):
        return b""


class MountTableError(CommandExecutionError):
    """A line of /proc/self/mountinfo that may be the mount a state must know is unreadable."""


def _mount_table(path):
    """The parsed mount table, unless a line that cannot be read may be the mount at ``path``:
    a state must not guess what is mounted where."""
    with open("/proc/self/mountinfo", "rb") as handle:
        raw = handle.read()
    malformed = []
    mounts = core.tab.parse_mountinfo(raw, malformed=malformed)
    doubt = core.tab.mountinfo_doubt(malformed, path)
    if doubt:
        raise MountTableError(f"cannot tell what is mounted at {path}: /proc/self/mountinfo {doubt['error']}")
    return mounts


def _mount_key_ramfs(ret, directory, name):
    """Mount a root-only ramfs on the key directory; a key file left on the filesystem below
    (tmpfs, from before) is removed first, so no copy stays where it could be swapped."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for stale in (name, f"{name}.new"):
        if os.path.lexists(stale):
            os.unlink(stale)
            ret["changes"].setdefault("removed", []).append(stale)
    result = __salt__["mount.mount"](directory, "hana-storage-keys", fstype=KEY_FSTYPE, opts="mode=0700")
    if result is not True:
        _done(ret, f"mounting a ramfs on {directory} failed: {result}", result=False)
        return False
    ret["changes"]["mounted"] = {"directory": directory, "fstype": KEY_FSTYPE, "mode": "0700"}
    return True


def _key_file_matches(path, key):
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        same = hmac.compare_digest(handle.read(), key)
    return same and stat.S_IMODE(info.st_mode) == 0o400 and info.st_uid == 0


def _unsafe_directory(path):
    """The first directory a user other than root could change (not root's, or group/other-
    writable without the sticky bit), or None: of ``path`` as named, of each symlink it is
    named through (whoever may replace a link chooses the key), and of its real path."""
    named = os.path.abspath(path)
    for _hop in range(40):  # the kernel's own limit of links followed
        unsafe = _first_unsafe_directory(os.path.dirname(named))
        if unsafe or not os.path.islink(named):
            break
        named = os.path.normpath(os.path.join(os.path.dirname(named), os.readlink(named)))
    else:
        return named  # a loop of links
    return unsafe or _first_unsafe_directory(os.path.dirname(os.path.realpath(path)))


def _first_unsafe_directory(directory):
    parts = directory.strip("/").split("/") if directory != "/" else []
    for depth in range(len(parts) + 1):
        prefix = "/" + "/".join(parts[:depth])
        info = os.stat(prefix)  # a symlinked directory counts as the directory it leads to
        writable = info.st_mode & 0o002 or (info.st_mode & 0o020 and info.st_gid != 0)
        if info.st_uid != 0 or (writable and not info.st_mode & stat.S_ISVTX):
            return prefix
    return None


def _keyfile_mode(ret, name):
    try:
        link = stat.S_ISLNK(os.lstat(name).st_mode)
        unsafe = _unsafe_directory(name)
    except OSError:
        link, unsafe = False, None
    if not os.path.isfile(name):
        return _done(
            ret,
            f"key file {name} does not exist: the key store must put it there "
            "(hana:storage:key:source is keyfile)",
            result=False,
        )
    if unsafe:
        via = f" (through the symlink {name})" if link else ""
        return _done(
            ret,
            f"refusing key file {name}: its directory {unsafe}{via} can be changed by users other than root, "
            "who could swap the key or redirect what is done to it. Nothing was changed.",
            result=False,
        )
    # through one descriptor of the real file: a symlink swapped in meanwhile is not followed
    fd = os.open(os.path.realpath(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode):
            return _done(ret, f"key file {name} is not a regular file: not touching it", result=False)
        if not mode & 0o077 and info.st_uid == 0:
            return _done(ret, f"key file {name} is root-only ({mode:04o})")
        if __opts__["test"]:
            return _would(
                ret, f"would make key file {name} mode 0400, owner root (now {mode:04o}, uid {info.st_uid})"
            )
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o400)
    finally:
        os.close(fd)
    return _done(
        ret,
        f"key file {name} made root-only",
        mode={"old": f"{mode:04o}", "new": "0400"},
        owner={"old": info.st_uid, "new": 0},
    )


# ---- the data-loss guard ---------------------------------------------------------------------


def devices_safe(name, volume):
    """
    Every device of a volume is blank or already part of it, or the pillar allows formatting it
    (then it is wiped here). Anything else stops the volume: nothing on any of its devices is
    touched, and the comment names each device and the signature found.

    name
        The volume's name.
    volume
        The volume's plan (``hana_storage.settings``).
    """
    ret = _ret(name)
    below = volume["encryption"] == "below_lvm"
    key_file = volume["key"]["file"]
    keys = _key_files(key_file, (volume["key"].get("previous") or {}).get("file"))
    probes = _probes(volume["devices"], key_file=keys if below and keys else None)
    verdicts = [core.safety.disk_verdict(volume, probes[device]) for device in volume["devices"]]
    refused = [v for v in verdicts if v["verdict"] == "refuse"]
    if refused and __opts__["test"] and all(v["code"] == "key_not_tested" for v in refused):
        return _would(
            ret,
            f"volume {name}: {', '.join(v['device'] for v in refused)} hold LUKS; whether the "
            f"key opens them is checked once the key file {key_file} is written",
        )
    if refused:
        return _done(
            ret,
            f"refusing to touch volume {name}: {core.safety.refusal_summary(verdicts)}. Nothing was "
            f"changed on any of its devices. To format a device that holds data, list it in "
            f"hana:storage:volumes:{name}:allow_format.",
            result=False,
        )
    wipes = [v for v in verdicts if v["verdict"] == "wipe"]
    summary = ", ".join(f"{v['device']} {v['reason']}" for v in verdicts)
    if wipes and __opts__["test"]:
        return _would(ret, f"would wipe {', '.join(v['device'] for v in wipes)} ({summary})")
    for verdict in wipes:
        if not _wipe(ret, verdict["device"], verdict["reason"]):
            return ret
    return _done(ret, f"volume {name}: {summary}")


# ---- LUKS ------------------------------------------------------------------------------------


def luks_formatted(
    name,
    key_file,
    luks,
    label,
    stripe_kib=0,
    stripes=1,
    may_wipe=False,
    created_by=None,
    previous_key_file=None,
):
    """
    ``name`` is LUKS2 as the policy says, opened by ``key_file`` (or, while the key is rotated,
    by ``previous_key_file``); a blank device is formatted, one with any other content is
    refused (or wiped first when ``may_wipe``). "Blank" is not "no signature": plain dm-crypt or
    a detached-header LUKS shows none. Only a device the state ``created_by`` created in this
    run, or one whose sampled areas read zero, is blank.

    label
        The LUKS2 label, also the crypt mapping's name: a device held by it is already ours.
    created_by
        The ID of the state that creates ``name`` (the volume's ``lvm.lv_present``).

    luks
        The LUKS policy (type, cipher, key_size, sector_size, pbkdf).
    stripe_kib, stripes
        Stripe geometry below (LUKS above LVM): the payload starts on a full stripe.
    """
    ret = _ret(name)
    what = (
        f"{luks['type'].upper()} {luks['cipher']}, {luks['key_size']}-bit key, {luks['sector_size']}-byte "
        f"sectors, {core.kdf.describe(luks['pbkdf'])}"
    )
    if not os.path.exists(name):
        if __opts__["test"]:
            return _would(ret, f"would luksFormat {name} once it exists ({what})")
        return _done(ret, f"{name} does not exist", result=False)
    probe = _probe(name, _key_files(key_file, previous_key_file) or None)
    if probe.get("luks") and _under_reencryption(ret, name):
        return ret
    verdict = core.safety.layer_verdict(
        "luks", probe, may_wipe, own_holders=[label], created_now=_created_in_this_run(created_by)
    )
    if verdict["verdict"] == "use":
        return _done(ret, f"{name}: {verdict['reason']}")
    if verdict["verdict"] == "refuse" and verdict["code"] == "key_not_tested" and __opts__["test"]:
        # key_present writes the key file first in a real run; then the key is tried
        return _would(ret, f"{name} is LUKS; whether the key opens it is checked once {key_file} is written")
    if verdict["verdict"] == "refuse":
        return _done(
            ret, f"refusing to luksFormat {name}: it {verdict['reason']}. Nothing was changed.", result=False
        )
    if __opts__["test"]:
        return _would(ret, f"would luksFormat {name} ({what}; {verdict['reason']})")
    if verdict["verdict"] == "wipe" and not _wipe(ret, name, verdict["reason"]):
        return ret
    offset = core.commands.luks_data_offset(stripe_kib, stripes)
    # the mark that says this header is the formula's own until its keyslot is there: a luksFormat
    # killed in between leaves a header no key opens, which the next run may format again
    # (the payload mark, that what is inside reads noise nobody wrote, lasts until a PV or XFS is there)
    uuid = str(uuid_module.uuid4())
    marker = __salt__["hana_storage_host.format_marker"](uuid)
    os.makedirs(os.path.dirname(marker), mode=0o700, exist_ok=True)
    core.files.replace_file(
        __salt__["hana_storage_host.format_marker"](uuid, "payload"), name.encode(), mode=0o600
    )
    core.files.replace_file(marker, name.encode(), mode=0o600)
    argv = core.commands.luks_format(name, key_file, luks, label=label, offset_sectors=offset, uuid=uuid)
    ok, err = _run(argv)
    if not ok:
        return _done(ret, f"cryptsetup luksFormat {name} failed: {err}", result=False)
    os.unlink(marker)
    dated, err = _record_key_date(name, uuid=uuid)
    said = "" if dated else f" (its volume key's date was not recorded: {err})"
    return _done(
        ret, f"formatted {name}: {what}{said}", formatted={"device": name, "luks_uuid": uuid, "format": what}
    )


def _record_key_date(device, day=None, replaces=(), uuid=None):
    """``day`` (today by default) as the date of ``device``'s volume key that is none of
    ``replaces`` (fingerprints), in a date token (reencrypt.KEY_DATE_TOKEN) that names the
    volume by its LUKS ``uuid`` (read from the header when not given): what the audit measures
    the cryptoperiod from. (ok, error)."""
    try:
        uuid = uuid or __salt__["hana_storage_host.luks_header"](device).get("uuid")
    except CommandExecutionError as error:
        return False, f"its LUKS header cannot be read: {error}"
    if not isinstance(uuid, str):
        return False, "its LUKS header has no UUID"
    token = core.reencrypt.key_date_token(day or datetime.date.today(), uuid, replaces)
    return _run(["cryptsetup", "token", "import", device], stdin=token)


def encrypted_in_place(
    name, device, mountpoint, key_file, luks, stripes, stripe_kib, mount_options, max_mib_s=None
):
    """
    The volume's LV ``device``, which holds an unencrypted XFS mounted at ``mountpoint``, is
    encrypted where it is as ``name`` (``hana_storage_core.inplace`` has the route and why):
    its LV grows by the header's room in its own stripes, ``cryptsetup reencrypt --encrypt
    --init-only`` writes the header and opens it, the XFS is mounted again from the crypt
    device, and the unit ``hana-storage-encrypt-<name>`` encrypts it online. The state
    returns with the encryption under way and says how far it is; each later run says so
    again, starts the unit after a clean stop or a reboot, and after a kill that left
    cryptsetup's hotzone in the stack recovers offline (unmount, close, open, mount) first.
    The mount goes down only while no process has a file open on it; else the state refuses
    and names them.

    luks
        The LUKS policy (cipher, key_size, sector_size, pbkdf).
    stripes, stripe_kib
        The LV's geometry: the header's room is whole stripes, the payload starts on one.
    mount_options
        The volume's mount options, for the mount from the crypt device.
    max_mib_s
        At most this many MiB/s read and written by the encryption (hana:storage:in_place).
    """
    ret = _encrypt_in_place(
        name, device, mountpoint, key_file, luks, stripes, stripe_kib, mount_options, max_mib_s
    )
    ret["comment"] += ret.pop("comment_note", "")
    # the copy's tags left on an LV that holds a LUKS2 header (a run cut off after the init) go
    # in any run: were the volume made anew on the LV, they would call its new head torn
    stale = ret.pop("copy_tags", None) if ret["result"] is not False else None
    if stale and __opts__["test"]:
        ret["comment"] += f" Would drop the LVM tags {', '.join(stale)} its copy left."
        ret["result"] = None if ret["result"] is True else ret["result"]
    elif stale:
        ok, err = _copy_untag(device, *stale)()
        if ok:
            ret["changes"]["copy_tags_dropped"] = stale
        else:
            ret["comment"] += f" The LVM tags {', '.join(stale)} its copy left stay: {err}."
    return ret


def _encrypt_in_place(
    name, device, mountpoint, key_file, luks, stripes, stripe_kib, mount_options, max_mib_s
):
    ret = _ret(name)
    try:
        found = __salt__["hana_storage_host.lv_room"](device)
        if "error" in found:
            raise CommandExecutionError(f"the LVM layout of {device} cannot be read: {found['error']}")
        extent = found["pvs"][0]["extent_bytes"] if found["pvs"] else 4 << 20
        room = core.inplace.header_room(stripes, stripe_kib * 1024, extent)
        facts = __salt__["hana_storage_host.in_place_facts"](
            device, name, mountpoint, core.inplace.data_shift(room)
        )
    except (core.inplace.InPlaceError, CommandExecutionError) as error:
        return _done(ret, f"cannot tell where the encryption of {device} stands: {error}", result=False)
    stage, why = core.inplace.stage(facts)
    # a header that opens (in this run, or earlier) makes the copy moot: the wrapper drops its tags
    # when the run succeeds
    if stage in ("closed", "crashed", "paused", "running", "done"):
        ret["copy_tags"] = [t for t in core.inplace.HEAD_COPY_TAGS if t in facts.get("lv_tags", ())]
    if stage == "done" and facts.get("key_day"):
        return _date_in_place_key(ret, device, why, facts["key_day"])
    if stage in ("done", "blank"):
        return _done(ret, f"{device} {why}")
    if stage == "foreign":
        return _done(
            ret, f"refusing to encrypt {device} in place: it {why}. Nothing was changed.", result=False
        )
    if stage in ("torn", "unclear"):
        return _done(ret, _cut_init_advice(device, mountpoint, stage, why, room, facts), result=False)
    if stage == "running":
        return _done(ret, core.inplace.describe(name, facts["progress"]))
    if stage == "frozen":
        return _done(
            ret,
            f"{name} {why}. Reboot the host: the boot's open recovers the interrupted hotzone (as after a "
            "power cut), and the next apply goes on. Do not resume those devices by hand (dmsetup "
            "resume): reads through the stack then return wrong data. Nothing was changed.",
            result=False,
        )
    mounted = facts["mounted_from"] is not None
    if facts["mounted_from"] == "other" or (stage == "plain" and facts["mounted_from"] == "crypt"):
        return _done(
            ret,
            f"{mountpoint} is mounted from another device than {device}: not touching either",
            result=False,
        )
    crypt = f"/dev/mapper/{name}"
    steps = []  # (step code, what, argv): what may run with the filesystem mounted comes first
    offline = mounted and stage in ("plain", "crashed")
    if stage == "plain":
        try:
            steps += _header_room(device, room, stripes, stripe_kib, found, facts)
        except core.inplace.InPlaceError as error:
            return _done(
                ret, f"not encrypting {device} in place: {error}. Nothing was changed.", result=False
            )
    copy = stage == "plain" and not (
        # a copy read while the XFS was unmounted and still matching is the head as it is
        not mounted and facts.get("head_copy") == "copied" and facts.get("tail") == "copy"
    )
    if copy:
        steps.append(_copy_begun(device))
    if offline:
        steps.append(("umount", f"unmount {mountpoint}", ["umount", mountpoint]))
    if copy:
        steps += _head_copy(device, core.inplace.data_shift(room))
    if stage == "plain":
        sector = core.inplace.sector_size(luks["sector_size"], facts["fs_sector"])
        steps.append(
            (
                "init",
                f"write the LUKS2 header ({sector}-byte sectors) and open {device} as {name}",
                core.inplace.reencrypt_init(device, name, key_file, luks, room, sector),
            )
        )
        steps.append(("untag", "drop the copy's tags", _copy_untag(device, *core.inplace.HEAD_COPY_TAGS)))
    if stage == "crashed":
        steps.append(("close", f"close {name} and cryptsetup's leftovers", ["cryptsetup", "close", name]))
    if stage in ("crashed", "closed"):
        steps.append(
            (
                "open",
                f"open {device} as {name} (libcryptsetup recovers the interrupted hotzone)",
                core.commands.luks_open(name, device, key_file, [], persistent=False),
            )
        )
    options = ",".join(mount_options) or "defaults"
    if offline:
        steps.append(
            (
                "mount",
                f"mount {crypt} at {mountpoint}",
                ["mount", "-t", "xfs", "-o", options, crypt, mountpoint],
            )
        )
    unit = facts["unit"]
    steps.append(("start", f"start {unit}", core.inplace.reencrypt_unit(name, key_file, device, max_mib_s)))
    if offline and facts["users"]:
        return _done(
            ret,
            f"not encrypting {device} in place ({name} {why}): {mountpoint} must be unmounted once, and "
            f"{core.inplace.holders_text(facts['users'])} have files open on it. Stop them (HANA: "
            "sapcontrol -function StopSystem) and apply again. Nothing was changed.",
            result=False,
        )
    plan = "; ".join(what for _, what, _ in steps)
    if __opts__["test"]:
        return _would(ret, f"{name} {why}: would {plan}")
    try:
        _ramfs(SCRATCH)  # where the init writes its new header: ready before the mount goes down
    except (OSError, CommandExecutionError) as error:
        return _done(ret, f"not encrypting {device} in place: {error}. Nothing was changed.", result=False)
    began, down = time.monotonic(), None
    for step, what, argv in steps:
        if step == "start":  # systemd keeps a failed transient unit's name taken until reset
            _run(["systemctl", "reset-failed", unit])
        if callable(argv):
            ok, err = argv()
        else:
            ok, err = _run_scratch(argv, workdir=True) if step == "init" else _run(argv)
        if not ok and step == "untag":  # the init ended: stale tags on a LUKS2 LV decide nothing
            ret["comment_note"] = f" (its copy's LVM tags stay: {err})"
            continue
        if not ok:
            back = _after_a_failed_step(
                device, mountpoint, options, core.inplace.data_shift(room), step, down
            )
            return _done(
                ret, f"{name}: {what} failed: {err}.{back} Apply again to go on from here.", result=False
            )
        if step == "umount":
            down = time.monotonic()
        if step == "mount":
            ret["changes"]["downtime_s"] = round(time.monotonic() - down, 1)
    ret["changes"]["encrypting"] = {"device": device, "unit": unit, "from": stage}
    saved = f" {_saved_room(device)} holds a plaintext copy of its room: shred -u it."
    note = saved if os.path.exists(_saved_room(device)) else ""
    return _done(ret, f"{name} {why}: {plan} ({round(time.monotonic() - began, 1)} s){note}")


def moved_onto_luks(name, volume, luks):
    """
    The volume ``name``, installed unencrypted below LVM (its devices raw PVs of its VG), is
    encrypted in place online: each PV's extents move onto a LUKS PV, through the pillar's spare
    LUN (``hana_storage_core.moves`` has the route and why). The state checks what it can before
    the first step (the spare blank, every target large enough), writes the plan and starts the
    unit ``hana-storage-encrypt-<crypt name>``, which runs every move and outlives the Salt job.
    Each later run says how far it is, and starts the unit again after a kill, a failed step or
    a boot; nothing is unmounted.

    volume
        The volume's plan (``hana_storage.settings``).
    luks
        The LUKS policy (cipher, key_size, sector_size, pbkdf, flags).
    """
    ret = _ret(name)
    try:
        plan = _moves_plan(volume, luks, __salt__["hana_storage_host.moves_stored_plan"](name))
        found = __salt__["hana_storage_host.moves_facts"](plan)
    except (core.moves.MovesError, core.move_runner.StepFailed, core.tab.TabError, OSError) as error:
        return _done(ret, f"{name}: cannot tell where its encryption in place stands: {error}", result=False)
    step, ledger, unit = found["step"], found["ledger"], found["unit"]
    where = core.moves.describe(plan, found["facts"])
    if step["action"] == "done":
        return _done(ret, where)
    if found["running"]:
        return _done(ret, f"{where}; the unit {unit} runs it")
    spare_device = volume["spare"]["device"]
    if ledger is not None and ledger["spare_device"] != spare_device:
        return _done(
            ret,
            f"{name}: in_place_spare is {spare_device}, the moves began with {ledger['spare_device']}: "
            "the spare cannot change while they run. Nothing was changed.",
            result=False,
        )
    if ledger is None:
        refused = _moves_refused(volume, plan, found["facts"])
        if refused:
            return _done(
                ret, f"not encrypting {name} in place: {refused}. Nothing was changed.", result=False
            )
    moves = "; ".join(
        f"{m['source']} onto {m['target']['name']} ({m['target']['device']})" for m in plan["moves"]
    )
    failed = f" Its last run failed: {ledger['error']}." if ledger and ledger["error"] else ""
    if __opts__["test"]:
        if ledger is None:
            return _would(
                ret,
                f"{name}: would format the spare {volume['spare']['device']} LUKS2 and start {unit}, which "
                f"moves {moves}, writes over each new PV's free extents and erases the spare",
            )
        return _would(ret, f"{where}.{failed} Would start {unit} again: {step['text']}")
    spare_id = found["facts"]["identity"].get(spare_device)
    try:
        core.move_runner.write_json(core.moves.plan_path(name), plan)
        if ledger is None:
            core.move_runner.write_json(
                core.moves.ledger_path(name),
                {
                    **core.moves.new_ledger(),
                    "spare_blank": True,
                    "spare_device": spare_device,
                    # the disk found blank, by what names it whichever path a boot gives it
                    "identity": {spare_device: spare_id} if spare_id else {},
                },
            )
    except OSError as error:
        return _done(ret, f"{name}: cannot write its plan: {error}. Nothing was changed.", result=False)
    _run(["systemctl", "reset-failed", unit])  # systemd keeps a failed transient unit's name taken
    ok, err = _run(core.moves.unit_argv(name, unit, sys.executable, os.path.dirname(core.HERE)))
    # a bus connection dropped after systemd took the job fails systemd-run, the unit runs anyway
    if not ok and not __salt__["hana_storage_host.unit_active"](unit):
        return _done(ret, f"{name}: cannot start {unit}: {err}", result=False)
    verb = "started" if ledger is None else "started again"
    return _done(
        ret,
        f"{where}.{failed} {unit} {verb}: {step['text']}",
        result=not failed,
        encrypting={"volume": name, "unit": unit, "moves": [m["source"] for m in plan["moves"]]},
    )


def _moves_plan(volume, luks, stored):
    """moves.plan for ``volume``, with the LUKS UUIDs of the ``stored`` plan (the unit formats with
    them and crypttab names them: they never change once written), new ones for the rest."""
    uuids = {m["target"]["name"]: m["target"]["uuid"] for m in (stored or {}).get("moves", [])}
    lines = {}
    for target in [volume["spare"], *volume["crypt"]]:
        uuids.setdefault(target["name"], str(uuid_module.uuid4()))
        source = core.stack.crypttab_source(
            uuids[target["name"]], __salt__["hana_storage_host.dm_uuid"](target["device"])
        )
        lines[target["name"]] = core.tab.render_crypttab(
            target["name"], source, volume["key"]["crypttab"], volume["crypttab_options"]
        )
    flags = [f["cryptsetup"] for f in luks["flags"] if f["wanted"]]
    if stored:  # the policy the first targets were formatted with: every target gets the same
        policy = stored["luks"]
    else:  # the LV keeps its XFS: no LUKS sector larger than the XFS's (inplace.sector_size)
        try:
            fs_sector = __salt__["hana_storage_host.xfs_superblock"](volume["lv_path"])["sectsize"]
        except (CommandExecutionError, KeyError) as error:
            raise core.moves.MovesError(
                f"the XFS on {volume['lv_path']} cannot be read ({error}): its sector size bounds the "
                "LUKS sector size"
            ) from None
        policy = {**luks, "sector_size": core.inplace.sector_size(luks["sector_size"], fs_sector)}
    return core.moves.plan(volume, volume["key"]["file"], policy, flags, lines, uuids)


def _moves_refused(volume, plan, facts):
    """Why the moves may not begin (None: they may): the spare not blank, a device not a PV of
    the volume's VG, a target too small."""
    spare = volume["spare"]["device"]
    probe = _probe(spare)
    verdict = core.safety.disk_verdict({**volume, "may_format": []}, probe)
    if verdict["code"] != "blank":
        return f"the spare {spare} {verdict['reason']}; it must be blank"
    strangers = [d for d in volume["devices"] if (facts["pvs"].get(d) or {}).get("vg") != volume["vg"]]
    if strangers:
        return f"{', '.join(strangers)} {'is' if len(strangers) == 1 else 'are'} not a PV of {volume['vg']}"
    stuck = _boot_waits_for(volume)
    if stuck:
        return stuck
    room = __salt__["hana_storage_host.vg_pvs"](volume["vg"])
    if "error" in room:
        return f"the PVs of {volume['vg']} cannot be read: {room['error']}"
    named = {os.path.realpath(d) for d in volume["devices"]}
    others = [p for p in room["pvs"] if os.path.realpath(p) not in named]
    if others:
        return (
            f"{volume['vg']} also has {', '.join(others)}, which the pillar's devices do not name: no move "
            "would take it, and it would stay a raw PV; name it in devices, or pvmove it off and vgreduce it"
        )
    sizes = {d: __salt__["hana_storage_host.block_bytes"](d) for d in [spare, *volume["devices"]]}
    errors = core.moves.room_errors(plan, facts, sizes)
    return "; ".join(errors) or None


def _boot_waits_for(volume):
    """Why a boot in the middle of the moves would not come up (None: it would). A key the boot
    cannot open with (a pillar key's crypttab line is noauto) leaves the new LUKS PVs closed,
    the VG partial and the LV inactive: an /etc/fstab line of the mount point without noauto or
    nofail then sends the boot to emergency mode, where no Salt runs to open them."""
    if "noauto" not in volume["crypttab_options"]:
        return None
    try:
        with open(FSTAB, encoding="utf-8") as handle:
            entries = core.tab.parse_fstab(handle.read())
    except FileNotFoundError:
        return None
    except (OSError, core.tab.TabError) as error:
        return f"{FSTAB} cannot be read ({error})"
    mine = [e for e in entries if core.tab.mount_key(e["file"]) == core.tab.mount_key(volume["mountpoint"])]
    waits = [e for e in mine if not {"noauto", "nofail"} & set(e["options"])]
    if waits:
        return (
            f"{FSTAB} line {waits[0]['line']} mounts {volume['mountpoint']} at boot, and with this key the "
            "boot opens none of the new LUKS PVs: a boot in the middle would stop in emergency mode. Add "
            "nofail (or noauto) to that line first"
        )
    return None


def _date_in_place_key(ret, device, why, day):
    """The encryption in place of ``device`` ended: the day it made the volume key (its LV's tag)
    goes into the header's date token, which cryptsetup refused while it ran. A tag after today
    (anyone may tag an LV) is taken as today: a key is never recorded younger than it is."""
    day = min(day, datetime.date.today().isoformat())  # ISO dates sort as strings
    if __opts__["test"]:
        return _would(
            ret, f"{device} {why}: would record {day}, the day its volume key was made, in its header"
        )
    ok, err = _record_key_date(device, datetime.date.fromisoformat(day))
    if not ok:
        return _done(ret, f"{device} {why}, but its volume key's date was not recorded: {err}", result=False)
    ret["changes"]["key_date"] = {"device": device, "created": day}
    return _done(ret, f"{device} {why}: recorded {day}, the day its volume key was made, in its header")


def reencrypted_online(
    name, device, key_file, luks, fs_device, max_age_days=None, max_mib_s=None, below_lvm=False
):
    """
    The LUKS2 ``device``, open as ``name``, is re-encrypted online when the policy asks for it
    (``hana_storage_core.reencrypt`` has the route): to the policy's sector size (512 -> 4096)
    and to a new volume key once the one it has is older than ``max_age_days`` or of unknown age.
    The header records today as the new volume key's date (a token that names the key in use as
    the one it replaces, imported first: cryptsetup refuses it from the init to the end),
    ``cryptsetup reencrypt --init-only`` (checksum resilience, the key's keyslot) prepares it,
    and the unit
    ``hana-storage-encrypt-<name>`` re-encrypts it while HANA runs. Nothing is unmounted. Later
    runs say how far it is and start the unit after a stop or a reboot.

    luks
        The LUKS policy (sector_size, pbkdf).
    fs_device
        Where the volume's XFS is (the crypt device above LVM, the LV below it): a sector size
        larger than the XFS's would leave it unmountable.
    max_age_days
        The volume keys' cryptoperiod (hana:storage:luks:volume_key_max_age_days).
    max_mib_s
        At most this many MiB/s read and written by the unit (hana:storage:in_place).
    below_lvm
        ``device`` is one of the volume's PVs: it gets a new volume key, its sector size stays
        (each PV's re-encryption runs in a unit of its own, side by side, each with its share
        of the volume's ``max_mib_s``). The LV is not read: a sibling PV a killed run left
        suspended would hold the read.
    """
    ret = _ret(name)
    try:  # below LVM the sector size stays: the LV, on the sibling PVs too, is not read
        facts = __salt__["hana_storage_host.reencrypt_facts"](
            device, name, key_file, None if below_lvm else fs_device
        )
    except CommandExecutionError as error:
        return _done(ret, f"cannot tell where the re-encryption of {device} stands: {error}", result=False)
    today = datetime.date.today()  # one day for the decision, the new token and those it drops
    stage, why, sector = core.reencrypt.stage(facts, luks["sector_size"], max_age_days, today, below_lvm)
    if stage in ("absent", "current"):
        return _done(ret, f"{device} {why}")
    if stage in ("refused", "foreign"):
        return _done(ret, f"not re-encrypting {device}: it {why}. Nothing was changed.", result=False)
    if stage == "running":
        return _done(ret, core.inplace.describe(name, facts["progress"]))
    if stage in ("frozen", "crashed"):
        return _done(
            ret,
            f"{name} {why}. Reboot the host: the boot's open recovers the interrupted hotzone, and the "
            "next apply goes on. Do not resume those devices by hand (dmsetup resume): reads through the "
            "stack then return wrong data. Nothing was changed.",
            result=False,
        )
    unit = facts["unit"]
    steps = []
    if stage == "wanted":  # the date first: cryptsetup refuses a token from the init to the end
        pbkdf = core.commands.pbkdf_args(luks.get("pbkdf", {}))
        steps.append(("date", "record today as the date of its new volume key", None))
        steps += [
            ("undate", f"remove the date token {tid}, made useless by it", _token_remove(device, tid))
            for tid in core.reencrypt.tokens_to_replace(facts["header"], today)
        ]
        steps.append(
            (
                "init",
                f"prepare {device} for a new volume key and {sector}-byte sectors",
                core.reencrypt.reencrypt_init(device, key_file, facts["keyslot"], sector, pbkdf),
            )
        )
    if stage == "closed":
        steps.append(
            (
                "open",
                f"open {device} as {name} (libcryptsetup recovers the interrupted hotzone)",
                core.commands.luks_open(name, device, key_file, [], persistent=False),
            )
        )
    steps.append(
        (
            "start",
            f"start {unit}",
            core.inplace.reencrypt_unit(
                name,
                key_file,
                device,
                max_mib_s,
                what="re-encrypt {} online",
                hotzone_mib=core.reencrypt.hotzone_mib(max_mib_s),
            ),
        )
    )
    plan = "; ".join(what for _, what, _ in steps)
    if __opts__["test"]:
        return _would(ret, f"{name} {why}: would {plan}")
    for step, what, argv in steps:
        if step == "start":  # systemd keeps a failed transient unit's name taken until reset
            _run(["systemctl", "reset-failed", unit])
        if step == "date":
            ok, err = _record_key_date(
                device,
                today,
                replaces=facts["header"].get("volume_keys", []),
                uuid=facts["header"].get("uuid"),
            )
        elif step == "init":
            ok, err = _run_scratch(argv, workdir=True)
        else:
            ok, err = _run(argv)
        if not ok:
            return _done(ret, f"{name}: {what} failed: {err}. Apply again to go on from here.", result=False)
    ret["changes"]["reencrypting"] = {"device": device, "unit": unit, "from": stage, "sector_size": sector}
    return _done(ret, f"{name} {why}: {plan}")


def _token_remove(device, token_id):
    return ["cryptsetup", "token", "remove", "--token-id", str(token_id), device]


# where the refusal of an earlier version's cut init has the admin save the LV's room, before
# anything is written (root's own directory: the room holds the volume's plaintext)
ROOM_SAVE_DIR = "/root"

# the steps that leave the LV's first bytes as they were when they fail (the head is not
# written before cryptsetup's init; the init's own failure is told by the copy, read again)
_BEFORE_THE_HEADER = ("copy", "verify", "copied")


def _after_a_failed_step(device, mountpoint, options, shift, step, down):
    """What a failed ``step`` of the plain route leaves, for the comment: before the init, the
    LV mounted back at once (the begun tag stays: the next run copies again); after a failed
    init whose head still matches the copy, the complete tag dropped first (mounted, the XFS
    changes its head, and the tag would then call it torn) and the LV mounted back if this run
    unmounted it; else, the LV left as it is for the next run to judge."""
    if step in _BEFORE_THE_HEADER:
        return _mount(device, mountpoint, options) if down is not None else ""
    if step != "init":
        return ""
    try:
        held = __salt__["hana_storage_host.tail_state"](device, shift)
    except CommandExecutionError as error:
        held = f"unreadable ({error})"
    if held != "copy":
        left = f"{mountpoint} stays unmounted" if down is not None else "nothing more was done"
        return (
            f" Its first bytes no longer match their copy in its room ({held}): {left} (apply again: "
            "the next run says what to do)."
        )
    ok, err = _copy_untag(device, core.inplace.HEAD_COPIED_TAG)()
    if not ok:
        left = f"{mountpoint} stays unmounted" if down is not None else "do not mount it from the LV"
        return f" Its copy's LVM tag could not be removed ({err}): {left}."
    return _mount(device, mountpoint, options) if down is not None else ""


def _mount(device, mountpoint, options):
    ok, err = _run(["mount", "-t", "xfs", "-o", options, device, mountpoint])
    return f" {device} mounted back at {mountpoint}." if ok else f" Mounting {device} back failed: {err}."


def _lv_name(device):
    """vg/lv of the LV path /dev/vg/lv."""
    return "/".join(device.split("/")[2:4])


def _copy_begun(device):
    """The step, before the unmount, that says cryptsetup runs on the LV only after a complete
    copy of its head (inplace.HEAD_COPY_BEGUN_TAG); an older copy's complete tag goes with it."""
    return (
        "copy-begun",
        "tag the copy of its first bytes begun",
        _lvchange_tags(
            device, "--deltag", core.inplace.HEAD_COPIED_TAG, "--addtag", core.inplace.HEAD_COPY_BEGUN_TAG
        ),
    )


def _copy_untag(device, *tags):
    def untag():
        return _run(_lvchange_tags(device, *(a for t in tags for a in ("--deltag", t))))

    return untag


def _lvchange_tags(device, *changes):
    """lvchange of the LV's tags, past suspended devices (a killed re-encryption's stack above
    the LV: LVM would wait on them for good)."""
    return ["lvchange", *core.lvm.NO_SUSPENDED, *changes, _lv_name(device)]


def _head_copy(device, shift):
    """The steps that copy the LV's first ``shift`` bytes into the end of its room, with the
    filesystem unmounted and before cryptsetup runs, read it back, and tag it complete."""

    def copy():
        size = __salt__["hana_storage_host.block_bytes"](device)
        if not size or size < 2 * shift:
            return False, f"{device} is {size} bytes, too small for two copies of {shift} bytes"
        return _run(
            [
                "dd",
                f"if={device}",
                f"of={device}",
                "bs=1M",
                f"count={shift}",
                f"seek={size - shift}",
                "iflag=direct,count_bytes",
                "oflag=direct,seek_bytes",
                "conv=notrunc,fsync",
                "status=none",
            ]
        )

    def verify():
        try:
            held = __salt__["hana_storage_host.tail_state"](device, shift)
        except CommandExecutionError as error:
            return False, str(error)
        return (True, "") if held == "copy" else (False, f"the copy reads back as {held!r}")

    return [
        ("copy", f"copy its first {shift // core.inplace.MIB} MiB to the end of its room", copy),
        ("verify", "read the copy back", verify),
        ("copied", "tag the copy complete", _lvchange_tags(device, "--addtag", core.inplace.HEAD_COPIED_TAG)),
    ]


def _saved_room(device):
    """Where the refusal of an earlier version's cut init has the LV's room saved."""
    return os.path.join(ROOM_SAVE_DIR, f"{_lv_name(device).replace('/', '-')}.room")


def _cut_init_advice(device, mountpoint, stage, why, room, facts):
    """The refusal of an LV whose init was cut off (inplace stages "torn" and "unclear"): what
    brings its first bytes back, by the copy's tags and what its room holds (inplace.tail_state),
    in exact bytes. While the XFS is mounted from the LV its head is live and newer than the room:
    the copy is then made again, never copied back (unless the unmounted XFS proves damaged). An
    earlier version's LV (no tags) has its room saved to a file before anything is written."""
    shift = core.inplace.data_shift(room)
    tail_at = facts["device_bytes"] - shift
    lv = _lv_name(device)
    first = f"its first {shift} bytes"
    back = (
        f"dd if={device} of={device} bs=1M skip={tail_at} count={shift} "
        "iflag=skip_bytes,count_bytes,direct oflag=direct conv=notrunc,fsync"
    )
    again = (
        f"lvchange --deltag {core.inplace.HEAD_COPIED_TAG} --addtag {core.inplace.HEAD_COPY_BEGUN_TAG} {lv}"
    )
    saved = _saved_room(device)
    save = (
        f"save the room (dd if={device} of={saved} bs=1M skip={tail_at} count={shift} "
        "iflag=skip_bytes,count_bytes conv=excl,fsync) - a plaintext copy: shred -u it once the "
        "encryption runs - then "
        if stage == "unclear"
        else ""
    )
    if facts.get("mounted_from") == "device":
        advice = (
            f"{mountpoint} is mounted from {device}: its first bytes are live, newer than its room. Stop "
            f"HANA, unmount it, {save}have the copy made again ({again}) and apply again. Only if "
            f"xfs_repair -n {device} then reports damage did the header write tear {first}: copy them "
            f"back from the room instead ({back})"
        )
    elif stage == "torn":
        advice = (
            f"{first} are in its last {shift} bytes: copy them back ({back}), check the filesystem "
            f"(xfs_repair -n {device}), and apply again. Only if the XFS was mounted from {device} since "
            "the copy (a boot through /etc/fstab) and HANA wrote to it, its first bytes are newer than "
            f"the copy: then have the copy made again instead ({again}) and apply again"
        )
    elif facts.get("tail") == "partial":
        advice = (
            f"every sector where its room differs from {first} is zeros: the copy was cut off and {first} "
            f"are as they were: {save}have the copy made again ({again}) and apply again"
        )
    else:
        advice = (
            f"its room holds data where {first} differ: the header write was cut off, and {first} are "
            f"in its last {shift} bytes: {save}copy them back ({back}), check the filesystem (xfs_repair "
            f"-n {device}), and apply again. Only if the XFS was mounted from {device} since and HANA "
            f"wrote to it, {first} are newer: then have the copy made again instead ({again}) and apply again"
        )
    return f"refusing to encrypt {device} in place: it {why}. {advice}. Nothing was changed."


def _header_room(device, room, stripes, stripe_kib, found, facts):
    """The steps that grow the LV by ``room`` beyond its size before (inplace.room_plan), in its
    own stripes, all while the filesystem stays mounted: lvextend, the new room zeroed (what
    --init-only later moves there is then told from what was there), and the size before
    recorded in an LVM tag, last: a tag says the room beyond it is the formula's and zeroed."""
    if facts["fs_bytes"] is None or facts["device_bytes"] is None:
        raise core.inplace.InPlaceError(f"the size of {device} or of its XFS is not known")
    plain, short = core.inplace.room_plan(facts["device_bytes"], facts["fs_bytes"], facts["lv_tags"], room)
    if plain % core.inplace.MIB:
        raise core.inplace.InPlaceError(f"its size ({plain} bytes) is not whole MiB")
    tag = core.inplace.plain_tag(plain)
    if tag in facts["lv_tags"]:
        return []
    steps = []
    lv = _lv_name(device)
    if short:
        wanted = f"{-(-(facts['device_bytes'] + short) // core.inplace.MIB)}M"
        usable = [p for p in found["pvs"] if p["allocatable"]]
        plan = core.lvm.extension(lv, stripes, stripe_kib * 1024, wanted, found["segments"], usable)
        if plan["action"] != "extend":
            raise core.inplace.InPlaceError(
                f"its LV must grow by {short} bytes for the LUKS2 header: {plan['reason']}"
            )
        steps += [
            ("extend", f"extend {device} by {short} bytes for the LUKS2 header", a) for a in plan["argv"]
        ]
    end = -(-(facts["device_bytes"] + short) // core.inplace.MIB)
    steps += [
        (
            "zero",
            f"zero its room beyond {plain} bytes",
            [
                "dd",
                "if=/dev/zero",
                f"of={device}",
                "bs=1M",
                f"seek={plain // core.inplace.MIB}",
                f"count={end - plain // core.inplace.MIB}",
                "oflag=direct",
                "conv=notrunc",
                "status=none",
            ],
        ),
        (
            "tag",
            f"record {device}'s size ({plain} bytes) and today, the volume key's day, in its LVM tags",
            ["lvchange", "--addtag", tag, "--addtag", core.inplace.key_day_tag(datetime.date.today()), lv],
        ),
    ]
    return steps


def _under_reencryption(ret, device, header=None):
    """Is the LUKS2 ``device`` (whose parsed ``header`` the step may have read already) under
    re-encryption? Then ``ret`` says so and the step leaves it alone: a keyslot, a flag refresh,
    a resize or a header backup in the middle of cryptsetup's work would race it (the formula's
    own encryption in place: encrypted_in_place; another: the admin's)."""
    if header is None:
        if not os.path.exists(device):
            return False
        try:
            header = __salt__["hana_storage_host.luks_header"](device)
        except CommandExecutionError:
            return False  # no LUKS header (yet): the step decides
    fact = header.get("reencryption")
    if not fact:
        return False
    _done(ret, f"{device} is under LUKS2 re-encryption ({fact.get('mode')}): left as it is until it ends")
    return True


def _key_slots(device, key_file):
    return __salt__["hana_storage_host.key_slots"](device, key_file)


def _pillar_key_pending(path, pillar):
    """Does the pillar at ``pillar`` hold other key material than the file ``path`` (which
    ``key_present`` writes first in a real run)? Only asked with test=True."""
    key = _pillar_key(pillar)
    if key is None:
        return False
    try:
        return not key or not _key_file_matches(path, key)
    except OSError:
        return True


def _rotation_ready(ret, name, key_files, pillars):
    """None when ``name`` and every key file are there, else the state's return (test=True:
    what it would do once they are, also when a pillar key's file is not written yet)."""
    missing = [path for path in (name, *key_files) if not os.path.exists(path)]
    if __opts__["test"]:
        missing += [
            p
            for p, pillar in zip(key_files, pillars, strict=True)
            if p not in missing and _pillar_key_pending(p, pillar)
        ]
    if not missing:
        return None
    if __opts__["test"]:
        return _would(
            ret, f"{', '.join(missing)} not in place yet: the keyslots of {name} are checked once they are"
        )
    return _done(ret, f"{', '.join(missing)} not there: not touching the keyslots of {name}", result=False)


def key_enrolled(name, key_file, previous_key_file, pbkdf=None, key_pillar=None, previous_key_pillar=None):
    """
    While a volume's key is rotated (``key:previous`` in the pillar): the key in ``key_file``
    opens the LUKS device ``name``. A device that only the previous key opens gets a keyslot for
    the key, authorised by the previous key and made with the policy's ``pbkdf``; then the key
    is proven on it. The previous key's keyslot stays until ``previous_key_removed`` runs, once
    crypttab names the new key: a run killed at any point leaves a device that one of the two
    keys opens, and a boot in between unlocks with either.

    key_pillar, previous_key_pillar
        Where a pillar key's material is (the plan's ``key.pillar``): with test=True a key file
        that does not hold it yet is one ``key_present`` has still to write.
    """
    ret = _ret(name)
    if _under_reencryption(ret, name):
        return ret
    not_ready = _rotation_ready(ret, name, (key_file, previous_key_file), (key_pillar, previous_key_pillar))
    if not_ready:
        return not_ready
    current = _key_slots(name, key_file)
    if current["keyslots"]:
        return _done(ret, f"the key {key_file} opens {name} (keyslots {current['keyslots']})")
    if current["error"]:
        return _done(ret, f"cannot tell whether {key_file} opens {name}: {current['error']}", result=False)
    previous = _key_slots(name, previous_key_file)
    if not previous["keyslots"]:
        why = f" ({previous['error']})" if previous["error"] else ""
        return _done(
            ret,
            f"neither the key {key_file} nor the previous key {previous_key_file} opens {name}{why}: "
            "not adding a keyslot. Nothing was changed.",
            result=False,
        )
    if __opts__["test"]:
        return _would(
            ret,
            f"would add a keyslot for {key_file} to {name}, authorised by the previous key {previous_key_file}",
        )
    ok, err = _run(core.commands.luks_add_key(name, previous_key_file, key_file, pbkdf or {}))
    if not ok:
        return _done(ret, f"cryptsetup luksAddKey {name} failed: {err}", result=False)
    proven = _key_slots(name, key_file)
    if not proven["keyslots"]:
        return _done(
            ret,
            f"added a keyslot for {key_file} to {name}, but the key does not open it "
            f"({proven['error'] or 'refused'}); the previous key's keyslot stays",
            result=False,
        )
    return _done(
        ret,
        f"added keyslot {proven['keyslots']} for {key_file} to {name}; the previous key's stays until "
        "crypttab names the new key",
        enrolled={"keyslots": proven["keyslots"]},
    )


def previous_key_removed(name, key_file, previous_key_file, key_pillar=None, previous_key_pillar=None):
    """
    The end of a key rotation: the previous key (``previous_key_file``) opens no keyslot of the
    LUKS device ``name`` any more. Its keyslots are removed only while the key in ``key_file``
    opens another one (proven before and after); a previous key that opens the key's own
    keyslot is the same key, and nothing is removed. ``key_pillar``, ``previous_key_pillar``: as
    for ``key_enrolled``.
    """
    ret = _ret(name)
    if _under_reencryption(ret, name):
        return ret
    not_ready = _rotation_ready(ret, name, (key_file, previous_key_file), (key_pillar, previous_key_pillar))
    if not_ready:
        return not_ready
    previous = _key_slots(name, previous_key_file)
    if previous["error"]:
        return _done(
            ret,
            f"cannot tell which keyslots of {name} the previous key opens: {previous['error']}",
            result=False,
        )
    uuid, fingerprints, begun = _removals_begun(name)
    previous["keyslots"] = sorted(set(previous["keyslots"]) | set(begun))
    if not previous["keyslots"]:
        return _done(ret, f"the previous key {previous_key_file} opens no keyslot of {name}")
    current = _key_slots(name, key_file)
    if not current["keyslots"] and __opts__["test"] and not current["error"]:  # key_enrolled adds it first
        return _would(
            ret,
            f"would remove keyslots {previous['keyslots']} of {name} (the previous key's) once the key "
            f"{key_file} opens another one",
        )
    if not current["keyslots"]:
        why = f" ({current['error']})" if current["error"] else ""
        return _done(
            ret,
            f"the key {key_file} does not open {name}{why}: keeping the previous key's keyslots "
            f"{previous['keyslots']}, the only way in",
            result=False,
        )
    remove = [slot for slot in previous["keyslots"] if slot not in current["keyslots"]]
    if not remove:
        return _done(
            ret,
            f"the previous key {previous_key_file} opens the key's own keyslots {previous['keyslots']} of "
            f"{name}: it is the same key; name the key being rotated away as the previous key",
            result=False,
        )
    if __opts__["test"]:
        return _would(ret, f"would remove keyslots {remove} of {name} (the previous key's)")
    removed = []
    for slot in remove:
        marker = _mark_removal(uuid, slot, fingerprints)
        ok, err = _run(core.commands.luks_kill_slot(name, slot, key_file))
        if not ok:
            changes = {"removed": {"keyslots": removed}} if removed else {}
            return _done(ret, f"cryptsetup luksKillSlot {name} {slot} failed: {err}", result=False, **changes)
        os.unlink(marker)
        removed.append(slot)
    return _done(
        ret, f"removed keyslots {removed} of {name} (the previous key's)", removed={"keyslots": removed}
    )


def _mark_removal(uuid, slot, fingerprints):
    """Mark keyslot ``slot`` of the header ``uuid`` as one this formula removes (its
    fingerprint in hana_storage_host.retire_marker), before the first write that removes it.
    Returns the mark's path."""
    marker = __salt__["hana_storage_host.retire_marker"](uuid, slot)
    os.makedirs(os.path.dirname(marker), mode=0o700, exist_ok=True)
    core.files.replace_file(marker, fingerprints.get(slot, "").encode(), mode=0o600)
    return marker


def _removals_begun(name, header=None):
    """(the UUID of ``name``'s LUKS header, {keyslot: its fingerprint}, the keyslots whose
    luksKillSlot this formula began and did not see end: hana_storage_host.retire_marker, which
    holds the fingerprint of the keyslot it was for). A mark whose keyslot is gone, or is another
    keyslot now, is removed: that kill ended. ``header``: the header as just read, if it was."""
    header = header or __salt__["hana_storage_host.luks_header"](name)
    uuid = header.get("uuid")
    fingerprints = {int(s["id"]): str(s.get("fingerprint") or "") for s in header.get("keyslots") or []}
    if not isinstance(uuid, str):
        return uuid, fingerprints, []
    begun = []
    for slot in range(32):
        marker = __salt__["hana_storage_host.retire_marker"](uuid, slot)
        try:
            with open(marker, "rb") as handle:
                marked = handle.read().decode(errors="replace")
        except FileNotFoundError:
            continue
        if fingerprints.get(slot) and fingerprints[slot] == marked:
            begun.append(slot)
        elif not __opts__["test"]:
            os.unlink(marker)
    return uuid, fingerprints, begun


def clevis_bound(
    name, key_file, policy, header_backup=None, previous_key_file=None, reseal=False, fips=False
):
    """
    The LUKS2 device ``name`` is bound by Clevis to exactly the pillar's ``policy`` (the plan's
    ``key.clevis``: Tang servers with their thumbprints and threshold, the host's TPM2 with its
    PCR bank and PCRs, or both in one sss), in a keyslot of its own; the keyslot of ``key_file``
    (the recovery key) stays.

    A binding to the pillar's servers made with a Tang signing key the pillar no longer names
    (Tang's keys were rotated, HANA-KEY-004) is replaced. A TPM2 binding sealed to PCRs that
    changed since (the formula records a TPM2 binding's PCR values in a token of its own,
    ``core.tpm.PCR_TOKEN``), or one without a record that Clevis no longer opens, is replaced
    only with ``reseal`` (the pillar's ``tpm2_reseal``, given for the one apply after a planned
    change): otherwise the state fails and changes nothing, since sealing to whatever booted
    would bless a boot chain someone changed. A binding without a record that opens gets one.
    Under ``fips`` (the plan's ``luks.fips``), a binding whose keyslot FIPS mode refuses (argon2:
    clevis before version 19 made its keyslots with cryptsetup's default) is replaced by one whose
    keyslot it opens (clevis 19 and later make PBKDF2-SHA256); a clevis that makes argon2 again
    fails the state, its new keyslot removed and the old binding kept.

    Replacing binds anew, proves the new binding opens, then removes the old one, so that a run
    killed between them leaves a device that opens either way; when the header has no room for
    both, a binding proven not to open goes first. A keyslot the recovery key or the previous
    key opens is never removed, whatever a token says of it. A device bound to anything else, or
    with a Clevis token that is not one binding in one keyslot, is refused: that is for people
    to decide (HANA-KEY-003).

    ``header_backup``: the device's header backup (``header_backed_up``), made again once the
    keyslots changed; a backup HANA-KEY-007 says must be kept refuses the binding (nothing is
    changed: the header may have to be restored from it).
    """
    ret = _ret(name)
    if _under_reencryption(ret, name):
        return ret
    wanted = core.rules.describe_policy(policy)
    try:
        header = __salt__["hana_storage_host.luks_header"](name)
    except CommandExecutionError as error:
        if __opts__["test"]:
            return _would(ret, f"would bind {name} to {wanted} once it is LUKS ({error})")
        return _done(ret, f"{name}: {error}", result=False)
    if header.get("degraded"):
        return _done(
            ret,
            f"not binding {name}: its LUKS2 header is degraded (HANA-ENC-007), and clevis luks bind "
            "would rewrite it as it loads it, erasing what shows the damage: back it up and repair it first "
            "(cryptsetup luksHeaderBackup, then cryptsetup repair). Nothing was changed.",
            result=False,
        )
    tokens = [t for t in header.get("tokens", []) if t["type"] == "clevis"]
    odd = _odd_clevis_tokens(tokens)
    if odd:
        return _done(
            ret,
            f"{name}: Clevis token(s) {odd} are not one binding in a keyslot of its own (clevis luks bind "
            "makes that): not touching the device; check them with cryptsetup luksDump. Nothing was changed.",
            result=False,
        )
    by_verdict = {"matches": [], "stale": [], "foreign": []}
    for token in tokens:
        by_verdict[core.rules.binding_verdict(token["clevis"], policy)].append(token)
    if by_verdict["foreign"]:
        return _done(
            ret,
            f"{name} has a Clevis binding that is not the pillar's ({wanted}): not binding beside it; "
            "check it, then clevis luks unbind it",
            result=False,
        )
    dead, unrecorded = {}, []
    tpm2 = policy["tpm2"]
    if tpm2 and by_verdict["matches"]:
        drift = __salt__["hana_storage_host.pcr_drift"](name) if tpm2["pcr_ids"] else {}
        if "error" in drift:
            return _done(ret, f"{name}: its TPM2 binding cannot be checked: {drift['error']}", result=False)
        for token in by_verdict["matches"]:
            slot = token["keyslots"][0]
            if drift.get(slot):
                dead[slot] = (
                    f"keyslot {slot} is sealed to {', '.join(f'PCR {i}' for i in drift[slot])}, changed since"
                )
                continue
            # no record of its PCRs, or told to reseal (a cleared or replaced TPM keeps the PCRs):
            # ask the TPM about its share alone, so that a Tang outage is never taken for it
            if (tpm2["pcr_ids"] and slot not in drift) or reseal:
                unseals = __salt__["hana_storage_host.tpm2_unseals"](name, slot)
                if unseals["unseals"] is None:
                    return _done(
                        ret, f"{name}: its TPM2 binding cannot be checked: {unseals['error']}", result=False
                    )
                if not unseals["unseals"]:
                    dead[slot] = f"keyslot {slot}: the TPM no longer unseals it ({unseals['error']})"
                elif tpm2["pcr_ids"] and slot not in drift:
                    unrecorded.append(slot)
    if dead and not reseal:
        return _done(
            ret,
            f"{name}: its TPM2 binding no longer opens: {'; '.join(dead.values())}. If the change was "
            "planned (firmware, Secure Boot keys, boot loader, a new TPM), apply once with pillar "
            "hana:storage:tpm2_reseal true to bind again to the PCRs as they are now; if not, find out "
            "what changed the boot chain. Nothing was changed.",
            result=False,
        )
    refused = _fips_refused(header, by_verdict["matches"]) if fips else {}
    unrecorded = [slot for slot in unrecorded if slot not in refused]
    current = [
        t for t in by_verdict["matches"] if t["keyslots"][0] not in dead and t["keyslots"][0] not in refused
    ]
    old_slots = sorted(
        {int(t["keyslots"][0]) for t in by_verdict["stale"]} | {int(slot) for slot in {**dead, **refused}}
    )
    unproven = {}
    if current and old_slots:
        # the binding that is to stay, an earlier run's (killed before it removed the old one): it
        # must open its own keyslot before the old one goes, or the device keeps no binding that
        # does. One that does not is replaced too, but never freed to make room: a TPM or a Tang
        # server out of reach for a moment fails the proof as well
        for token in current:
            opens = __salt__["hana_storage_host.clevis_opens"](name, token["keyslots"][0])
            if not opens["opens"]:
                unproven[token["keyslots"][0]] = (
                    f"keyslot {token['keyslots'][0]} does not open ({opens['error']})"
                )
        current = [t for t in current if t["keyslots"][0] not in unproven]
        unrecorded = [slot for slot in unrecorded if slot not in unproven]
        old_slots = sorted(set(old_slots) | {int(slot) for slot in unproven})
    stale_records = core.tpm.stale_records(header)
    if current and not old_slots and not stale_records and not unrecorded:
        return _done(ret, f"{name} is bound to {wanted}")
    if header_backup and (old_slots or not current):  # the backup is made again below
        _problem, keep = _backup_verdict(name, header, header_backup, key_file, previous_key_file, policy)
        if keep:
            return _done(ret, f"not binding {name}: {keep} Nothing was changed.", result=False)
    kept, why_not = _keyslots_of_keys(name, old_slots, key_file, previous_key_file)
    if kept or why_not:
        return _done(
            ret,
            f"{name}: {why_not or ''}{'; ' if why_not and kept else ''}"
            + (
                f"keyslots {kept} that a Clevis token names are opened by the recovery or the previous key: "
                "a token on the key's keyslot is not Clevis's"
                if kept
                else ""
            )
            + "; not touching the device, check it with cryptsetup luksDump. Nothing was changed.",
            result=False,
        )
    why = "; ".join(
        [*dead.values(), *unproven.values(), *refused.values()]
        + (["made with a Tang key the pillar no longer names"] if by_verdict["stale"] else [])
    )
    if __opts__["test"]:
        steps = ([f"bind {name} to {wanted} and prove the new binding opens"] if not current else []) + (
            [
                f"remove the binding it replaces (keyslots {old_slots}: {why}; first, should the header "
                "have no room for both and the TPM no longer unseal it)"
            ]
            if old_slots
            else []
        )
        steps += [f"record the PCRs of keyslots {unrecorded}"] if unrecorded else []
        steps += [f"remove {len(stale_records)} PCR record(s) of no binding"] if stale_records else []
        return _would(ret, "would " + ", then ".join(steps))
    changes = {}
    if not current:
        ok, err = _bind_anew(name, key_file, policy, tokens, dead, changes, fips)
        if not ok:
            return _done(ret, err, result=False, **changes)
    for slot in unrecorded:
        ok, err = _record_pcrs(name, slot, policy["tpm2"])
        if not ok:
            return _done(ret, f"{name}: {err}", result=False, **changes)
        changes.setdefault("pcrs_recorded", []).append(int(slot))
    for slot in old_slots:
        if slot in changes.get("unbound", {}).get("keyslots", []):
            continue
        ok, err = _run_scratch(core.commands.clevis_unbind(name, slot))
        if not ok:
            return _done(
                ret, f"clevis luks unbind {name} keyslot {slot} failed: {err}", result=False, **changes
            )
        changes.setdefault("unbound", {"keyslots": []})["keyslots"].append(slot)
    for token_id in core.tpm.stale_records(__salt__["hana_storage_host.luks_header"](name)):
        ok, err = _run(core.commands.luks_token_remove(name, token_id))
        if not ok:
            return _done(
                ret,
                f"removing the PCR record token {token_id} of {name} failed: {err}",
                result=False,
                **changes,
            )
        changes.setdefault("pcr_records_removed", []).append(token_id)
    comment = f"bound {name} to {wanted}" if not current else f"{name} is bound to {wanted}"
    if old_slots:
        comment += f"; removed the binding it replaces ({why})"
    if header_backup and (not current or old_slots):
        ok, done = _back_up_header(name, header_backup, key_file, previous_key_file, policy)
        if not ok:
            return _done(ret, f"{comment}, but {done}", result=False, **changes)
        changes["header_backup"] = header_backup
        comment += f"; {done}"
    return _done(ret, comment, **changes)


def _fips_refused(header, tokens):
    """``{keyslot: why}`` of the Clevis ``tokens`` whose keyslot a host in FIPS mode cannot open."""
    refused = {str(slot): core.kdf.name(kdf) for slot, kdf in core.kdf.not_fips_usable(header["keyslots"])}
    slots = [t["keyslots"][0] for t in tokens]
    return {
        slot: f"keyslot {slot} is {refused[slot]}, which FIPS mode refuses"
        for slot in slots
        if slot in refused
    }


def _odd_clevis_tokens(tokens):
    """The ids of Clevis tokens that are not one binding in a keyslot no other token names."""
    slots = [s for t in tokens for s in t["keyslots"]]
    return [t["id"] for t in tokens if len(t["keyslots"]) != 1 or slots.count(t["keyslots"][0]) > 1]


def _keyslots_of_keys(device, slots, key_file, previous_key_file):
    """(those of ``slots`` the recovery key or the previous key opens, or that could not be
    tried; why none could be tried, or None): never a Clevis keyslot to remove."""
    if not slots:
        return [], None
    missing = [k for k in (key_file, previous_key_file) if k and not os.path.exists(k)]
    if missing:
        return [], f"the key files {missing} are not there: which keyslots they open cannot be told"
    kept = set()
    for key in [k for k in (key_file, previous_key_file) if k]:
        tried = __salt__["hana_storage_host.key_slots"](device, key, keyslots=slots)
        kept |= {int(s) for s in tried["keyslots"]}
        if tried["error"]:
            kept |= set(slots)
    return sorted(kept), None


def _bind_anew(name, key_file, policy, tokens, dead, changes, fips=False):
    """Bind ``name`` to ``policy`` in a new keyslot, prove that it opens (and, under ``fips``,
    that FIPS mode opens its keyslot), and record its PCRs (TPM2): (ok, error). A new binding
    that fails either proof is removed again at once. When the bind fails and the TPM still does
    not unseal a binding that no longer opens (``dead``: the header may have no room for two),
    that one is removed first and the bind tried again; the recovery key's keyslot stays either
    way."""
    before = {s for t in tokens for s in t["keyslots"]}
    ok, err = _run_scratch(core.commands.clevis_bind(name, key_file, policy))
    freed = []
    if not ok and dead:
        for slot in sorted(int(s) for s in dead):
            if __salt__["hana_storage_host.tpm2_unseals"](name, slot)["unseals"] is not False:
                return False, f"clevis luks bind {name} failed: {err}"
        for slot in sorted(int(s) for s in dead):
            gone, why = _run_scratch(core.commands.clevis_unbind(name, slot))
            if not gone:
                return (
                    False,
                    f"clevis luks bind {name} failed ({err}), and freeing keyslot {slot} failed: {why}",
                )
            freed.append(slot)
            changes.setdefault("unbound", {"keyslots": []})["keyslots"].append(slot)
        before -= {str(s) for s in dead}
        ok, err = _run_scratch(core.commands.clevis_bind(name, key_file, policy))
    old = (
        f"the binding that no longer opened was removed to make room (keyslots {freed}): {name} has no "
        "Clevis binding now and opens with the recovery key only; apply again once that is fixed"
        if freed
        else "kept the old binding"
    )
    if not ok:
        return False, f"clevis luks bind {name} failed: {err}" + (f"; {old}" if freed else "")
    header = __salt__["hana_storage_host.luks_header"](name)
    new = [
        s for t in header.get("tokens", []) if t["type"] == "clevis" for s in t["keyslots"] if s not in before
    ]
    changes["bound"] = {
        **(
            {
                "servers": [s["url"] for s in policy["tang"]["servers"]],
                "threshold": policy["tang"]["threshold"],
            }
            if policy["tang"]
            else {}
        ),
        **({"tpm2": policy["tpm2"]} if policy["tpm2"] else {}),
    }
    if len(new) != 1:
        return False, f"bound {name}, but its new Clevis keyslot cannot be told ({new}): {old}"
    opens = __salt__["hana_storage_host.clevis_opens"](name, new[0])
    refused = _fips_refused(header, [{"keyslots": [new[0]]}]) if fips else {}
    if not opens["opens"] or refused:
        # never left behind: the next run would take it for the binding that stays
        gone, why = _run_scratch(core.commands.clevis_unbind(name, new[0]))
        undone = "removed it again" if gone else f"removing it again failed ({why})"
        changes["bound_then_removed" if gone else "bound_not_removed"] = {
            "keyslots": [int(new[0])],
            **changes.pop("bound"),
        }
        if not opens["opens"]:
            return (
                False,
                f"bound {name}, but the new binding does not open ({opens['error']}): {undone}; {old}",
            )
        return False, (
            f"bound {name}, but {refused[new[0]]}: this host's clevis makes keyslots with cryptsetup's "
            f"default (clevis before version 19); update clevis and apply again. {undone.capitalize()}; {old}"
        )
    if policy["tpm2"] and policy["tpm2"]["pcr_ids"]:
        ok, err = _record_pcrs(name, new[0], policy["tpm2"])
        if not ok:
            return False, f"bound {name}, but {err}"
    return True, None


def _record_pcrs(device, slot, tpm2):
    """Record, in a token of the formula's own on Clevis keyslot ``slot``, the PCR values its
    TPM2 binding is sealed to (read now: just bound, or proven to open): (ok, error)."""
    try:
        values = __salt__["hana_storage_host.pcr_values"](tpm2["pcr_bank"], tpm2["pcr_ids"])
    except CommandExecutionError as error:
        return False, f"its PCR values were not recorded: {error}"
    for token in __salt__["hana_storage_host.luks_header"](device).get("tokens", []):
        if token["type"] == core.tpm.PCR_TOKEN and str(slot) in [str(s) for s in token["keyslots"]]:
            ok, err = _run(core.commands.luks_token_remove(device, token["id"]))  # replaced, not added to
            if not ok:
                return False, f"removing the old PCR record token {token['id']} failed: {err}"
    _forget_reads()
    result = __salt__["cmd.run_all"](
        core.commands.luks_token_import(device),
        python_shell=False,
        output_loglevel="quiet",
        ignore_retcode=True,
        stdin=core.tpm.pcr_token(slot, tpm2["pcr_bank"], values),
    )
    if result["retcode"]:
        return False, f"recording its PCR values failed: {_brief(result['stderr'] or result['stdout'])}"
    return True, None


def header_backed_up(name, backup, key_file, previous_key_file=None, policy=None, formatted_by=None):
    """
    ``backup`` is a root-only ``cryptsetup luksHeaderBackup`` of the LUKS device ``name`` whose
    metadata is the live header's (hana_storage_host.header_backup; HANA-KEY-006).

    A new backup is made from a copy of the header in memory (cryptsetup repairs a damaged header
    copy as it loads it: the device is only read), written beside the old one, and renamed over it
    only once it is proven: the key in ``key_file`` opens it, and every keyslot of it is one the
    pillar accounts for (the key's, ``previous_key_file``'s while a key is rotated, those of the
    Clevis bindings to the pillar's ``policy``). Until then the old backup stays; a run killed at any
    point leaves one of the two.

    A backup whose device lost what it holds (another UUID, keyslots gone: HANA-KEY-007) is never
    replaced: it may be the only way back to the data. Unless this run made that change itself:
    the state ``formatted_by`` formatted the device (allow_format), or this run's rotation or Tang
    states removed those keyslots.
    """
    ret = _ret(name)
    clash = _backup_clash(backup, key_file, previous_key_file)
    if clash:
        return _done(ret, f"{clash}. Nothing was changed.", result=False)
    try:
        live = __salt__["hana_storage_host.luks_header"](name)
    except CommandExecutionError as error:
        if __opts__["test"]:
            return _would(
                ret, f"would back up the LUKS header of {name} to {backup} once it is LUKS ({error})"
            )
        return _done(ret, f"{name}: {error}", result=False)
    if _under_reencryption(ret, name, live):
        return ret
    problem, keep = _backup_verdict(name, live, backup, key_file, previous_key_file, policy, formatted_by)
    if problem is None:
        return _done(ret, f"{backup} is a current backup of the LUKS header of {name}")
    if keep:
        return _done(ret, f"{keep} Nothing was changed.", result=False)
    if __opts__["test"]:
        return _would(
            ret, f"would back up the LUKS header of {name} to {backup} (the backup: {problem['text']})"
        )
    ok, done = _back_up_header(name, backup, key_file, previous_key_file, policy)
    if not ok:
        return _done(ret, done, result=False)
    return _done(ret, f"{done} (the backup: {problem['text']})", header_backup=backup)


def _backup_verdict(name, live, backup, key_file, previous_key_file, policy, formatted_by=None):
    """(what is wrong with ``backup`` of the live header ``live``, or None; why it must be kept
    as it is, or None). A backup whose device lost what it holds (HANA-KEY-007) is kept unless
    this run made that change itself: every state that writes a header backup asks here first."""
    fact = __salt__["hana_storage_host.header_backup"](backup)
    opens, retired = set(), set()
    if fact.get("exists") and "error" not in fact and core.rules.lost_keyslots(fact, live, policy):
        # keyslots gone that may have lost no access (see core.rules.lost_keyslots): tried here
        if core.rules.rewritten_keyslots(fact, live):
            for key in _key_files(key_file, previous_key_file):
                opens.update(_key_slots(name, key)["keyslots"])
        if _key_files(previous_key_file):
            retired.update(_key_slots(backup, previous_key_file)["keyslots"])
    problem = core.rules.header_backup_problem(fact, live, policy, opens, retired)
    if problem is None or problem["rule"] != "HANA-KEY-007":
        return problem, None
    if _changed_in_this_run(name, problem, fact, live, formatted_by, policy):
        return problem, None
    return problem, (
        f"not replacing the header backup {backup}: the LUKS header of {name} lost what it holds "
        f"({problem['text']}). If the volume's key no longer opens {name}, restore it: "
        f"{core.rules.restore_hint(name, backup)}. If that was done on purpose, move the backup "
        "aside and apply again."
    )


def _results_of(state_id):
    """The results of this run's states with the ID ``state_id`` so far (none for no ID)."""
    running = (globals().get("__running__") or {}).values()
    return [r for r in running if state_id and r.get("__id__") == state_id]


def _changed_by(state_id, change):
    """Did the state ``state_id`` of this run report the change ``change``?"""
    return any(change in (r.get("changes") or {}) for r in _results_of(state_id))


def _changed_in_this_run(device, problem, fact, live, formatted_by, policy=None):
    """Did this run itself make the change that sets ``device``'s header apart from its backup?"""
    running = (globals().get("__running__") or {}).values()
    if problem["code"] == "other_device":
        return _changed_by(formatted_by, "formatted")
    removed = {
        slot
        for r in running
        if r.get("name") == device and r.get("result") is True
        for change in ("removed", "unbound")
        for slot in ((r.get("changes") or {}).get(change) or {}).get("keyslots", [])
    }
    return set(core.rules.lost_keyslots(fact, live, policy)) <= removed


def _backup_clash(backup, *key_files):
    """Why ``backup`` (or the ``.new`` written beside it) must not be written: it is a key file.
    The pillar check refuses such names; this holds for a key file reached another way (a link)."""
    keys = {os.path.realpath(k) for k in key_files if k}
    for path in (backup, f"{backup}.new"):
        if os.path.realpath(path) in keys:
            return f"refusing to write a header backup to {path}: it is a key file of the volume"
    return None


def _back_up_header(device, backup, key_file, previous_key_file=None, policy=None):
    """Back ``device``'s LUKS header up to ``backup`` from a copy of it in memory, through a new
    file beside it that replaces the old one once it is proven (see header_backed_up): (ok, what
    was done or why not)."""
    clash = _backup_clash(backup, key_file, previous_key_file)
    if clash:
        return False, clash
    directory = os.path.dirname(backup)
    existing = directory
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    try:  # nothing is made under a directory others can change
        unsafe = _first_unsafe_directory(existing)
        if not unsafe:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            unsafe = _unsafe_directory(backup)
    except OSError as error:
        return False, f"cannot make the header backup directory {directory}: {error.strerror}"
    if unsafe:
        return False, f"refusing to keep header backups under {unsafe}: users other than root can change it"
    new = f"{backup}.new"
    if os.path.lexists(new):
        os.unlink(new)  # left by a run killed before its rename: cryptsetup never writes over a file
    ok, why = _make_proven_backup(device, new, key_file, previous_key_file, policy)
    if not ok:
        if os.path.lexists(new):
            os.unlink(new)
        return False, why
    core.files.install(new, backup, 0o400)
    return True, f"backed up the LUKS header of {device} to {backup}"


def _make_proven_backup(device, new, key_file, previous_key_file, policy):
    """luksHeaderBackup of a copy of ``device``'s header to ``new``, then the proof: the backup
    is the live header's, the key opens it, no keyslot in it is one the pillar cannot account for.
    (ok, why not)."""
    header = __salt__["hana_storage_host.luks_header"](device)
    size = core.luks.header_bytes(header)
    if size is None:
        return False, f"the LUKS header of {device} names no size a LUKS header has: not backing it up"
    with core.files.memory_copy(os.path.realpath(device), size) as copy:
        ok, err = _run(core.commands.luks_header_backup(copy, new))
    if not ok:
        return False, f"cryptsetup luksHeaderBackup of a copy of the header of {device} failed: {err}"
    made = __salt__["hana_storage_host.header_backup"](new)
    live = __salt__["hana_storage_host.luks_header"](device)
    if made.get("error") or (made["uuid"], made["fingerprint"]) != (live["uuid"], live.get("fingerprint")):
        return False, f"the header of {device} changed while it was backed up: run again"
    opens = __salt__["hana_storage_host.key_opens"](new, key_file)
    if not opens["opens"]:
        return False, (
            f"the volume's key {key_file} does not open the header of {device} "
            f"({opens['error'] or 'no keyslot takes it'}): not making a backup of it; the old one stays"
        )
    # every passphrase keyslot must be accounted for: the pillar's Clevis bindings' and the key's;
    # while one keyslot is left beside the bindings it is the key's, proven above (one KDF run),
    # otherwise each is tried with the key and the previous key
    clevis = core.rules.pillar_clevis_keyslots(live, policy)
    others = [
        str(k["id"]) for k in live["keyslots"] if k.get("kdf") is not None and str(k["id"]) not in clevis
    ]
    accounted = set(clevis) | (set(others) if len(others) == 1 else set())
    if len(others) > 1:
        for key in [k for k in (key_file, previous_key_file) if k and os.path.exists(k)]:
            accounted |= {str(s) for s in __salt__["hana_storage_host.key_slots"](new, key)["keyslots"]}
    unaccounted = [k for k in others if k not in accounted]
    if unaccounted:
        return False, (
            f"keyslots {', '.join(map(str, unaccounted))} of {device} open it and no key of the pillar "
            "accounts for them (HANA-KEY-005): not keeping a backup that holds them; the old one stays"
        )
    return True, None


def _created_in_this_run(state_id):
    """Did the state ``state_id`` of this run create its device (``changes: {created: ...}``)?"""
    return _changed_by(state_id, "created")


def pv_safe(name, vg, lv_dm_name=None, opened_by=None):
    """
    The opened LUKS device ``name`` (below LVM) is blank or already a PV of ``vg`` (held by its
    LV ``lv_dm_name`` once that exists), before ``pv_present`` runs ``pvcreate --yes`` on it,
    which wipes any signature. A device the
    volume's key opens may hold a filesystem, an md member or another VG's PV (a layout change,
    a re-used key): then the volume stops here, naming the device and what is on it.
    """
    ret = _ret(name)
    if not os.path.exists(name):
        if __opts__["test"]:
            return _would(ret, f"would check what {name} holds once it is opened")
        return _done(ret, f"{name} does not exist", result=False)
    verdict = core.safety.layer_verdict(
        "pv", _probe(name), False, own_holders=[lv_dm_name] if lv_dm_name else [], own_vg=vg
    )
    if verdict["verdict"] == "refuse":
        closed = _close_if_opened_here(opened_by, os.path.basename(name))
        return _done(
            ret,
            f"refusing to make {name} a PV of {vg}: it {verdict['reason']}. {_unchanged(closed)}",
            result=False,
        )
    return _done(ret, f"{name}: {verdict['reason']}")


def luks_opened(name, device, key_file, flags, previous_key_file=None):
    """
    ``device`` is open as /dev/mapper/``name``. A closed device is opened with the wanted
    dm-crypt ``flags`` active, but not stored in its LUKS2 header: nothing is written to a
    device before what it holds is known (``pv_safe`` below LVM, ``formatted`` above it);
    ``luks_flags`` stores them once it is. While a key is rotated the device may open only
    with ``previous_key_file`` yet. A mapping of that name on another device is refused.

    flags
        The plan's ``luks.flags``: every flag the formula decides on, each with its spellings
        (``dm``, ``header``, ``cryptsetup``) and whether it is ``wanted``.
    """
    ret = _ret(name)
    wanted = sorted(f["dm"] for f in flags if f["wanted"])
    table = __salt__["hana_storage_host.dm_tables"]().get(name)
    if table is not None and _under_reencryption(ret, device):
        return _done(ret, f"{device} is open as /dev/mapper/{name}; {ret['comment']}")
    if table is not None:
        segment = next((s for s in table if s["target"] == "crypt"), None)
        if segment is None or not _same_device(segment["device"], device):
            return _done(
                ret,
                f"/dev/mapper/{name} exists but is not a crypt mapping of {device}: not touching it",
                result=False,
            )
        return _done(ret, f"{device} is open as /dev/mapper/{name}")
    if __opts__["test"]:
        return _would(ret, f"would open {device} as {name} with flags {wanted or 'none'}")
    if not os.path.exists(device):
        return _done(ret, f"{device} does not exist", result=False)
    options = [f["cryptsetup"] for f in flags if f["wanted"]]
    options += core.pillar.unmanaged_flag_options(_header_flags(device))
    errors = []
    for key in _key_files(key_file, previous_key_file) or [key_file]:
        ok, err = _run(core.commands.luks_open(name, device, key, options, persistent=False))
        if ok:
            return _done(
                ret,
                f"opened {device} as /dev/mapper/{name} with flags {wanted or 'none'} (not stored in its "
                "header until what it holds is known)",
                opened={"device": device, "name": name, "flags": wanted},
            )
        errors.append(err)
    return _done(ret, f"cryptsetup open {device} failed: {'; '.join(errors)}", result=False)


def fips_keyslots(name, key_file, pbkdf):
    """
    Under FIPS (``compliance:fips``, or the host's mode): the key in ``key_file`` opens the LUKS
    device ``name`` through a keyslot FIPS mode opens (PBKDF2 with SHA-2, core.kdf), and no
    keyslot of the key is one FIPS mode refuses. As a rotation does, never in place: a keyslot
    made with the plan's ``pbkdf`` is added (authorised by the key) and proven to open, then the
    key's other keyslots are removed. They are marked first (hana_storage_host.retire_marker),
    before the add: a run killed anywhere in between is this formula's to finish. Killed at any
    point, the key opens the device. (``cryptsetup luksConvertKey`` rewrites the keyslot's area
    before its header: killed in between, no key opens it.)

    Keyslots the key does not open are left (a rotation's previous key: its own state removes
    them; another passphrase: a person, HANA-ENC-008 names them). A degraded header is refused
    (cryptsetup would repair it as it writes, and the damage is HANA-ENC-007's evidence) unless
    the marks say it is this formula's own write, cut short.

    pbkdf
        The plan's ``luks.pbkdf`` (PBKDF2-SHA256 under FIPS: the pillar check sees to it).
    """
    ret = _ret(name)
    if _under_reencryption(ret, name):
        return ret
    missing = [path for path in (name, key_file) if not os.path.exists(path)]
    if missing:
        if __opts__["test"]:
            return _would(
                ret,
                f"{', '.join(missing)} not in place yet: the keyslots of {name} are checked once they are",
            )
        return _done(
            ret, f"{', '.join(missing)} not there: not touching the keyslots of {name}", result=False
        )
    target = core.kdf.describe(pbkdf)
    if not core.kdf.fips_usable({"type": pbkdf.get("type", "argon2id"), "hash": pbkdf.get("hash")}):
        return _done(
            ret,
            f"refusing to make keyslots of {name} with {target}: FIPS mode opens PBKDF2 with SHA-2 only",
            result=False,
        )
    try:
        header = __salt__["hana_storage_host.luks_header"](name)
    except CommandExecutionError as error:
        return _done(ret, f"{name}: no readable LUKS header: {error}", result=False)
    uuid, fingerprints, begun = _removals_begun(name, header)
    refused = {int(slot) for slot, _ in core.kdf.not_fips_usable(header["keyslots"])}
    opened = _key_slots(name, key_file)
    if opened["error"]:
        return _done(
            ret,
            f"cannot tell which keyslots of {name} the key {key_file} opens: {opened['error']}",
            result=False,
        )
    if not opened["keyslots"] and not begun:
        return _done(
            ret, f"the key {key_file} opens no keyslot of {name}. Nothing was changed.", result=False
        )
    usable = sorted(set(opened["keyslots"]) - refused)
    retire = sorted((set(opened["keyslots"]) | set(begun)) & refused)
    others = sorted(refused - set(retire))
    left = (
        f"; keyslots {others} are not this key's (a rotation's previous key removes its own; another "
        "passphrase's are for a person: HANA-ENC-008)"
        if others
        else ""
    )
    if not retire:
        return _done(
            ret, f"the key {key_file} opens {name} through keyslots FIPS mode opens ({usable}){left}"
        )
    if header.get("degraded") and not begun:
        return _done(
            ret,
            f"refusing to change the keyslots of {name}: its LUKS2 header is degraded (HANA-ENC-007); "
            "cryptsetup would repair it as it writes. Back it up (cryptsetup luksHeaderBackup), repair "
            "it (cryptsetup repair) and apply again. Nothing was changed.",
            result=False,
        )
    if __opts__["test"]:
        add = "" if usable else f"add a keyslot with {target} for the key, then "
        return _would(
            ret, f"would {add}remove keyslots {retire} of {name} (the key's, refused in FIPS mode){left}"
        )
    changes = {}
    for slot in retire:  # before the add: a run killed from here on is this formula's to finish
        _mark_removal(uuid, slot, fingerprints)
    if not usable:
        ok, err = _run(core.commands.luks_add_key(name, key_file, key_file, pbkdf))
        if not ok:
            return _done(ret, f"cryptsetup luksAddKey {name} failed: {err}", result=False)
        try:
            after = {
                int(s)
                for s, _ in core.kdf.not_fips_usable(
                    __salt__["hana_storage_host.luks_header"](name)["keyslots"]
                )
            }
        except CommandExecutionError as error:
            return _done(ret, f"{name}: LUKS header unreadable after luksAddKey: {error}", result=False)
        proven = _key_slots(name, key_file)
        usable = sorted(set(proven["keyslots"]) - after)
        if not usable:
            return _done(
                ret,
                f"added a keyslot with {target} to {name}, but the key opens none FIPS mode opens "
                f"({proven['error'] or proven['keyslots']}); its keyslots {retire} stay",
                result=False,
            )
        changes["enrolled"] = {"keyslots": usable}
    removed = []
    for slot in retire:
        ok, err = _run(core.commands.luks_kill_slot(name, slot, key_file))
        if not ok:
            if removed:
                changes["removed"] = {"keyslots": removed}
            return _done(ret, f"cryptsetup luksKillSlot {name} {slot} failed: {err}", result=False, **changes)
        os.unlink(__salt__["hana_storage_host.retire_marker"](uuid, slot))
        removed.append(slot)
    changes["removed"] = {"keyslots": removed}
    return _done(
        ret,
        f"the key {key_file} opens {name} through keyslots {usable} ({target}); removed its keyslots "
        f"{removed}, which FIPS mode refuses{left}",
        **changes,
    )


def luks_flags(name, device, key_file, flags):
    """
    The open crypt device ``name`` (on ``device``) runs with exactly the wanted dm-crypt
    ``flags``, active in the table and stored in the LUKS2 header (``cryptsetup refresh
    --persistent``). Header flags outside ``flags`` (an admin's ``same-cpu-crypt``) are neither
    compared nor dropped. The fix of HANA-PERF-002, -003 and -004.
    """
    ret = _ret(name)
    if _under_reencryption(ret, device):
        return ret
    wanted = sorted(f["dm"] for f in flags if f["wanted"])
    want_stored = sorted(f["header"] for f in flags if f["wanted"])
    table = __salt__["hana_storage_host.dm_tables"]().get(name)
    if table is None:
        if __opts__["test"]:
            return _would(ret, f"would set the flags of {name} once it is open: {wanted or 'none'}")
        return _done(ret, f"/dev/mapper/{name} is not open: no flags to set", result=False)
    segment = next((s for s in table if s["target"] == "crypt"), None)
    if segment is None or not _same_device(segment["device"], device):
        return _done(
            ret,
            f"/dev/mapper/{name} exists but is not a crypt mapping of {device}: not touching it",
            result=False,
        )
    header = _header_flags(device)
    managed_in_header = {f["header"] for f in flags}
    stored = sorted(f for f in header if f in managed_in_header)
    persistent = stored != want_stored
    managed = {f["dm"] for f in flags}
    active = sorted(f for f in segment["flags"] if f in managed)
    if active == wanted and not persistent:
        return _done(ret, f"{name} runs with flags {wanted or 'none'} (active and stored)")
    change = {"active": {"old": active, "new": wanted}}
    if persistent:
        change["persistent"] = {"old": stored, "new": want_stored}
    if __opts__["test"]:
        return _would(ret, f"would refresh {name}: flags {change}")
    options = [f["cryptsetup"] for f in flags if f["wanted"]]
    options += core.pillar.unmanaged_flag_options(header)
    ok, err = _run(core.commands.luks_refresh(name, key_file, options, persistent))
    if not ok:
        return _done(ret, f"cryptsetup refresh {name} failed: {err}", result=False)
    return _done(ret, f"refreshed {name} to flags {wanted or 'none'}", flags=change)


def _unchanged(closed):
    """What a refusal left: nothing, or nothing but a look inside (``closed``: how it ended)."""
    return f"Nothing was written to any device; {closed}." if closed else "Nothing was changed."


def _close_if_opened_here(opened_by, crypt_name):
    """Close the mapping ``crypt_name`` if the state ``opened_by`` opened it in this run: what a
    refused volume's device holds was only looked at. (what was done, in words) or None."""
    if not crypt_name or not _changed_by(opened_by, "opened"):
        return None
    ok, err = _run(["cryptsetup", "close", crypt_name])
    return (
        f"/dev/mapper/{crypt_name}, opened by this run to look inside, was closed again"
        if ok
        else f"closing /dev/mapper/{crypt_name}, opened by this run to look inside, failed: {err}"
    )


def _header_flags(device):
    try:
        return __salt__["hana_storage_host.luks_header"](device)["flags"]
    except Exception:  # noqa: BLE001 - not LUKS (yet): no stored flags
        return []


def _same_device(table_device, path):
    """Does a dm table's ``major:minor``, or a path (a udev link and a node of its own alike),
    name the block device at ``path``?"""
    try:
        rdev = os.stat(path).st_rdev
        if table_device.startswith("/"):
            return os.stat(table_device).st_rdev == rdev
    except OSError:
        return False
    return table_device == f"{os.major(rdev)}:{os.minor(rdev)}"


CRYPTTAB, FSTAB = "/etc/crypttab", "/etc/fstab"


def _set_tab_entry(path, kind, key, line):
    """Give ``path`` the entry ``line`` for ``key`` (core.tab.set_entry), replacing the file
    whole (core.files.replace_file): "present", "new" or "change". Nothing is written
    with test=True or when the entry is there."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        text = ""
    text, status = core.tab.set_entry(text, kind, key, line)
    if status != "present" and not __opts__["test"]:
        core.files.replace_file(path, text.encode("utf-8"))
    return status


def crypttab_present(name, device, key_file, options):
    """/etc/crypttab has ``name <source> key_file options``, the file replaced whole (a kill
    never leaves it empty). The source is ``UUID=<LUKS UUID of device>``, or the multipath map's
    /dev/disk/by-id/dm-uuid-mpath-<wwid> when ``device`` is one (``core.stack.crypttab_source``)."""
    ret = _ret(name)
    if not os.path.exists(device):
        if __opts__["test"]:
            return _would(
                ret, f"would add {name} to /etc/crypttab by the UUID of {device} once it is formatted"
            )
        return _done(ret, f"{device} does not exist", result=False)
    try:
        uuid = __salt__["hana_storage_host.luks_header"](device)["uuid"]
    except Exception as error:  # noqa: BLE001 - CommandExecutionError: not LUKS
        if __opts__["test"]:
            return _would(ret, f"would add {name} to /etc/crypttab once {device} is formatted")
        return _done(ret, f"{device} has no LUKS header: {error}", result=False)
    try:
        source = core.stack.crypttab_source(uuid, __salt__["hana_storage_host.dm_uuid"](device))
        if not source.startswith("UUID=") and not _same_device(source, device):
            return _done(
                ret,
                f"{source} does not lead to {device}: udev's device-mapper rules (13-dm-disk.rules, in "
                "the device-mapper package) make that link for a multipath map, and a crypttab line naming "
                f"it would not open at boot without it. {_unchanged('')}",
                result=False,
            )
        line = core.tab.render_crypttab(name, source, key_file, options)
        status = _set_tab_entry(CRYPTTAB, "crypttab", name, line)
    except (OSError, UnicodeDecodeError, core.tab.TabError, CommandExecutionError) as error:
        return _done(ret, f"cannot update {CRYPTTAB}: {error}", result=False)
    if status == "present":
        return _done(ret, f"/etc/crypttab: {line}")
    verb = {"new": "add", "change": "update"}.get(status, status)
    if __opts__["test"]:
        return _would(ret, f"would {verb} /etc/crypttab: {line}")
    return _done(ret, f"/etc/crypttab: {verb} {line}", crypttab={status: line})


def units_enabled(name, units):
    """
    The systemd ``units`` are enabled for good (``systemctl enable``: the links their [Install]
    sections ask for, under /etc). systemctl does this with or without systemd running, so it
    holds in an image build or a rescue system too, where Salt's service.enabled finds no such
    unit.
    """
    ret = _ret(name)
    enabled = __salt__["hana_storage_host.unit_enabled"]
    disabled = [unit for unit in units if enabled(unit) not in core.readiness.ENABLED_FOR_GOOD]
    if not disabled:
        return _done(ret, f"{', '.join(units)}: enabled")
    argv = ["systemctl", "enable", *disabled]
    return _change(ret, argv, f"{' '.join(argv)} failed", f"enabled {', '.join(disabled)}", enabled=disabled)


# ---- LVM creation, activation, filesystem, mount ---------------------------------------------
#
# The VG and the LV are created here, not by Salt's lvm.vg_present and lv_present: those extend
# an existing VG even under test=True, resize an existing LV without its stripes, and let LVM
# put a new LV on any PV of the VG. An existing VG or LV grows in vg_extended and lv_extended.
# (No ``unless`` either: a state with unless/onlyif whose module has no mod_run_check makes
# Salt load every state and execution module to look for one, over a minute on a slow host.)


def pv_present(name):
    """``name`` is an LVM PV: ``pvcreate --yes`` if it is not, as Salt's ``lvm.pv_present`` does
    (the guard before this step proved the device blank, the volume's own, or the pillar's to
    format; LVM itself refuses a PV that belongs to a VG). One `pvs` serves every PV step of the
    run where Salt's ran `pvdisplay` for each, and four LVM commands to create one; a device
    the report does not list is read again before anything is written."""
    ret = _ret(name)
    found = __salt__["hana_storage_host.pv_names"]()
    if "error" not in found and _real(name) not in _reals(found["pvs"]):
        # "no PV" in a report that leaves out suspended devices, maybe read long before this
        # step: proven afresh, on a device that is not suspended now
        suspended = _suspended([name])
        if suspended:
            return _done(ret, f"{suspended}: not telling whether it is a PV yet; {RUN_AGAIN}", result=False)
        found = _afresh("pv_names")
    if "error" in found:
        return _done(ret, f"cannot read the PVs: {found['error']}", result=False)
    if _real(name) in _reals(found["pvs"]):
        return _done(ret, f"{name} is a PV")
    if not __opts__["test"] and not os.path.exists(name):
        return _done(ret, f"{name} does not exist", result=False)
    made = f"made {name} a PV"
    return _change(ret, ["pvcreate", "--yes", name], f"pvcreate {name} failed", made, created={"pv": name})


def vg_present(name, pvs):
    """The VG ``name`` exists: ``vgcreate`` over the pillar's ``pvs`` if it does not."""
    ret = _ret(name)
    room = __salt__["hana_storage_host.vg_pvs"](name)
    if "error" not in room and not room["pvs"]:
        room = _afresh("vg_pvs", name)
    if "error" in room:
        return _done(ret, f"cannot read the PVs of {name}: {room['error']}", result=False)
    if room["pvs"]:
        return _done(ret, f"volume group {name} exists (new PVs join it in vg_extended)")
    created = f"created volume group {name} on {', '.join(pvs)}"
    argv = core.lvm.vgcreate_command(name, pvs)
    return _change(ret, argv, f"vgcreate {name} failed", created, created={"vg": name, "pvs": pvs})


def lv_present(name, size, stripes, stripe_kib, pvs):
    """The LV ``name`` (/dev/<vg>/<lv>) exists: ``lvcreate`` of ``size`` in ``stripes`` of
    ``stripe_kib`` on the pillar's ``pvs`` if it does not."""
    ret = _ret(name)
    found = __salt__["hana_storage_host.lv_segments"](name)
    if "error" not in found and not found["segments"]:
        found = _afresh("lv_segments", name)
    if "error" in found:
        return _done(ret, f"cannot read the LVs: {found['error']}", result=False)
    if found["segments"]:
        return _done(ret, f"{name} exists (it grows in lv_extended)")
    created = f"created {name}: {size} in {stripes} stripe(s) on {', '.join(pvs)}"
    argv = core.lvm.lvcreate_command(name, size, stripes, stripe_kib * 1024, pvs)
    return _change(ret, argv, f"lvcreate {name} failed", created, created={"lv": name})


def lv_active(name):
    """The LV ``/dev/<vg>/<lv>`` is active (after a reboot without LVM autoactivation, say)."""
    ret = _ret(name)
    if os.path.exists(name):
        return _done(ret, f"{name} is active")
    vg, lv = name.split("/")[2:4]
    if not __salt__["lvm.lvdisplay"](name, quiet=True):
        if __opts__["test"]:
            return _would(ret, f"would activate {name} once it is created")
        return _done(ret, f"logical volume {name} does not exist", result=False)
    if __opts__["test"]:
        return _would(ret, f"would activate {name}")
    ok, err = _run(["lvchange", "--activate", "y", f"{vg}/{lv}"])
    if not ok:
        return _done(ret, f"lvchange -ay {vg}/{lv} failed: {err}", result=False)
    return _done(ret, f"activated {name}", activated=name)


def _real(path):
    return os.path.realpath(path)


RUN_AGAIN = "nothing was changed, run again"


def _suspended(devices):
    """Which of ``devices``, missing from an LVM report (which leaves out suspended devices), are
    suspended now: "<device> is suspended (...)", or "" when none is."""
    now = [device for device in devices if __salt__["hana_storage_host.dm_suspended"](device)]
    return (
        f"{', '.join(now)} {'is' if len(now) == 1 else 'are'} suspended (multipathd reloading?)"
        if now
        else ""
    )


def _reals(paths):
    return {_real(path) for path in paths}


def vg_extended(name, pvs):
    """
    Every PV the pillar gives the volume is in its VG ``name``: ``vgextend`` with those that are
    not yet (after ``pv-N`` made them PVs). Salt's ``lvm.vg_present`` extends an existing VG
    even under test=True, so it only creates the VG here.
    """
    ret = _ret(name)
    room = __salt__["hana_storage_host.vg_pvs"](name)
    if "error" not in room and (not room["pvs"] or not _reals(pvs) <= _reals(room["pvs"])):
        room = _afresh("vg_pvs", name)
    if "error" in room:
        return _done(ret, f"cannot read the PVs of {name}: {room['error']}", result=False)
    if not room["pvs"]:
        if __opts__["test"]:
            return _done(ret, f"{name} is not created yet: its PVs come with it")
        return _done(ret, f"volume group {name} does not exist", result=False)
    inside = _reals(room["pvs"])
    joining = [pv for pv in pvs if _real(pv) not in inside]
    if not joining:
        return _done(ret, f"{name} holds each of its PVs")
    suspended = _suspended(joining)
    if suspended:
        return _done(ret, f"{suspended}: not telling whether it is in {name} yet; {RUN_AGAIN}", result=False)
    added = f"added {', '.join(joining)} to {name}"
    argv = ["vgextend", name, *joining]
    return _change(ret, argv, f"vgextend {name} failed", added, extended={"vg": name, "pvs": joining})


# A new PV's room before it exists (test mode): its device less LVM's metadata area in front
# of the extents (pvcreate's default) and, below LVM, the LUKS2 header in front of the data
# (luksFormat's default); the apply reads the real figures.
PV_METADATA_BYTES = 1 << 20
LUKS2_HEADER_BYTES = 16 << 20


def lv_extended(name, stripes, stripe_kib, size, pvs, devices=None, grown_by=None):
    """
    The LV ``name`` (``/dev/<vg>/<lv>``) fills what its pillar ``size`` asks for, grown online
    in its own stripes: ``100%FREE`` grows it into the room new PVs brought to its VG, a size in
    bytes to that size. Each extension is one segment of ``stripes`` x ``stripe_kib`` over
    ``stripes`` of the pillar's PVs (``pvs``; never another PV of the VG, nor one LVM may not
    allocate); one that cannot be striped so is refused, and free space on fewer PVs than the
    stripes is left unused. lvextend changes no byte of the data already there.

    devices
        The pillar's devices under ``pvs`` (below LVM: the disks under the crypt devices): in
        test mode the room of a PV that does not exist yet is estimated from its device.
    grown_by
        The IDs of the states that grow each of ``pvs`` with its LUN (lun_grown): in test mode
        the room those say they would add is counted.
    """
    ret = _ret(name)
    if _under_reencryption(ret, name):
        return ret
    room = __salt__["hana_storage_host.lv_room"](name)
    plan = _extension_plan(name, stripes, stripe_kib, size, pvs, devices, room, grown_by)
    if plan["action"] != "none":  # growing, or failing: proven on reports read now
        room = _afresh("lv_room", name)
        plan = _extension_plan(name, stripes, stripe_kib, size, pvs, devices, room, grown_by)
    if plan["action"] == "error":
        return _done(ret, plan["reason"], result=False)
    if plan["action"] == "refuse":
        return _done(ret, f"not growing {name}: {plan['reason']}. Nothing was changed.", result=False)
    if plan["action"] == "none":
        return _done(ret, plan["reason"])
    commands = "; ".join(" ".join(argv) for argv in plan["argv"])
    if __opts__["test"]:
        once = " and".join(
            f" once {', '.join(listed)} {what}"
            for listed, what in ((plan["estimated"], "joined its VG"), (plan["grown"], "grew with its LUN"))
            if listed
        )
        once += " (their room estimated)" if once else ""
        return _would(ret, f"would grow {name} online by {plan['adds_bytes']} bytes{once}: {commands}")
    before = sum(segment["size"] for segment in room["segments"])
    for argv in plan["argv"]:
        ok, err = _run(argv)
        if not ok:
            return _done(ret, f"{' '.join(argv)} failed: {err}", result=False)
    return _done(
        ret,
        f"grew {name} online: {commands}",
        extended={"old": before, "new": before + plan["adds_bytes"], "stripes": stripes},
    )


def _extension_plan(name, stripes, stripe_kib, size, pvs, devices, room, grown_by=None):
    """lvm.extension's plan for the LV ``name`` from the reports in ``room`` (lv_room), with
    "estimated" and "grown": the PVs whose room test mode estimated (joining the VG, growing with
    their LUN: lun_grown's ``grown_by`` states); or {"action": "none"|"error", "reason"} before
    there is anything to plan."""
    if "error" in room:
        return {"action": "error", "reason": f"cannot read the LVM layout of {name}: {room['error']}"}
    if not room["segments"]:
        if __opts__["test"]:
            return {"action": "none", "reason": f"{name} is not created yet: nothing to grow"}
        return {"action": "error", "reason": f"logical volume {name} does not exist"}
    wanted = _reals(pvs)
    usable = [p for p in room["pvs"] if p["allocatable"] and _real(p["pv"]) in wanted]
    estimated, grown = [], []  # PVs whose room test mode estimated: joining the VG, growing with a LUN
    if __opts__["test"] and room["pvs"]:  # PVs an apply adds to the VG first (vg_extended)
        inside = {_real(p["pv"]) for p in room["pvs"]}
        extent = room["pvs"][0]["extent_bytes"]
        suspended = _suspended([pv for pv in pvs if _real(pv) not in inside and os.path.exists(pv)])
        if suspended:  # maybe a PV of the VG already: no room is promised for it
            return {
                "action": "error",
                "reason": f"{suspended}: not telling whether it is in its VG yet; {RUN_AGAIN}",
            }
        for pv, device in zip(pvs, devices or pvs, strict=False):
            if _real(pv) in inside:
                continue
            if pv == device or os.path.exists(pv):  # the disk itself (above LVM), or an opened LUKS device
                device_bytes, overhead = __salt__["hana_storage_host.block_bytes"](pv), PV_METADATA_BYTES
            else:  # below LVM, before luksFormat and open
                device_bytes = __salt__["hana_storage_host.block_bytes"](device)
                overhead = PV_METADATA_BYTES + LUKS2_HEADER_BYTES
            free = max((device_bytes or 0) - overhead, 0) // extent
            usable.append({"pv": pv, "free": free, "extent_bytes": extent, "allocatable": True})
            estimated.append(pv)
        for pv, device, state_id in zip(pvs, devices or pvs, grown_by or (), strict=False):
            entry = next((p for p in usable if p["pv"] == pv or _real(p["pv"]) == _real(pv)), None)
            if entry is None or pv in estimated or not _pending_in_this_run(state_id):
                continue
            growth = __salt__["hana_storage_host.lun_growth"](device, pv)
            if growth.get("adds_extents"):
                usable[usable.index(entry)] = {**entry, "free": entry["free"] + growth["adds_extents"]}
                grown.append(pv)
    lv = _lv_name(name)
    plan = core.lvm.extension(lv, stripes, stripe_kib * 1024, size, room["segments"], usable)
    return {**plan, "estimated": estimated, "grown": grown}


def _pending_in_this_run(state_id):
    """Did the state ``state_id`` of this (test) run say it would change something?"""
    return any(r.get("result") is None for r in _results_of(state_id))


LUN_STEPS = {"map": "multipathd resize map", "crypt": "cryptsetup resize", "pv": "pvresize"}


def _lun_argv(step, found, pv, key_file):
    if step == "map":
        return ["multipathd", "resize", "map", found["map"]]
    if step == "crypt":
        return core.commands.luks_resize(os.path.basename(pv), key_file)
    return ["pvresize", pv]


def _lun_steps_text(found, pv, key_file):
    return "; ".join(
        f"{' '.join(_lun_argv(s['step'], found, pv, key_file))} ({s['from']} to {s['to']} "
        f"{'extents' if s['step'] == 'pv' else 'bytes'})"
        for s in found["steps"]
    )


def lun_grown(name, pv, key_file=None):
    """
    The PV on the pillar's device ``name`` spans all of it after the LUN grew in place (resized
    on the SAN, a cloud volume made larger): ``multipathd resize map`` where ``name`` is a
    multipath map, below LVM ``cryptsetup resize`` of the LUKS device on it (the key on a
    file), then ``pvresize``. No byte of data moves or is written. The LV grows after this, in
    its own stripes, where every stripe's PV has the room (lv_extended). Paths of one LUN that
    disagree in size (rescanned in part) and a LUN that shrank are refused.

    pv
        The PV: ``name`` itself above LVM, the open LUKS device on it below.
    key_file
        Below LVM: a key file that opens the LUKS device (cryptsetup resize asks for the key).
    """
    ret = _ret(name)
    if not os.path.exists(pv):
        if __opts__["test"]:
            return _done(ret, f"{pv} is not there yet: nothing to grow")
        return _done(ret, f"{pv} does not exist", result=False)
    if pv != name and _under_reencryption(ret, name):  # below LVM: its mapping is cryptsetup's stack
        return ret
    found = __salt__["hana_storage_host.lun_growth"](name, pv)
    if "error" in found or found["steps"]:  # growing, or failing: proven on reports read now
        found = _afresh("lun_growth", name, pv)
    if "error" in found:
        return _done(
            ret, f"not growing {pv} with {name}: {found['error']}. Nothing was changed.", result=False
        )
    if not found["steps"]:
        return _done(ret, f"{pv} spans all of {name}")
    if not key_file and any(s["step"] == "crypt" for s in found["steps"]):
        return _done(
            ret,
            f"not growing {pv} with {name}: cryptsetup resize of {os.path.basename(pv)} needs the "
            "key on a file (key_file). Nothing was changed.",
            result=False,
        )
    planned = _lun_steps_text(found, pv, key_file)
    if __opts__["test"]:
        return _would(ret, f"would grow {pv} with {name}: {planned}")
    for step in found["steps"]:
        ok, err = _run(_lun_argv(step["step"], found, pv, key_file))
        if not ok:
            return _done(ret, f"{LUN_STEPS[step['step']]} of {name} failed: {err}", result=False)
    left = _afresh("lun_growth", name, pv)
    if "error" in left or left["steps"]:
        what = left.get("error") or _lun_steps_text(left, pv, key_file)
        return _done(ret, f"grew {pv} with {name}, but it is not done: {what}", result=False)
    grown = {s["step"]: {"old": s["from"], "new": s["to"]} for s in found["steps"]}
    return _done(ret, f"grew {pv} with {name}: {planned}", grown=grown)


def crypt_grown(name, device, key_file, grown_by=None):
    """
    The open crypt device ``name`` spans all of ``device`` (the LV it sits on, above LVM): after
    the LV grew, ``cryptsetup resize`` online, the key on a file. The data stays where it is.

    grown_by
        The ID of the state that grows ``device`` (lv_extended): when test mode says it would,
        this state says what it would run after it.
    """
    ret = _ret(name)
    if _under_reencryption(ret, device):
        return ret
    if __opts__["test"] and _pending_in_this_run(grown_by):
        argv = core.commands.luks_resize(name, key_file)
        return _would(ret, f"would run {' '.join(argv)} once {device} grew")
    table = __salt__["hana_storage_host.dm_tables"]().get(name)
    segment = next((s for s in table or [] if s["target"] == "crypt"), None)
    if segment is None or not _same_device(segment["device"], device):
        if __opts__["test"]:
            return _done(ret, f"{name} is not open yet: nothing to resize")
        return _done(ret, f"/dev/mapper/{name} is not an open crypt mapping of {device}", result=False)
    backing = __salt__["hana_storage_host.block_bytes"](device)
    if not backing:
        return _done(ret, f"the size of {device} cannot be read: not resizing {name}", result=False)
    have = sum(s["length"] for s in table) * 512
    want = backing - segment["offset"] * 512
    if have >= want:
        return _done(ret, f"{name} spans all of {device}")
    if __opts__["test"]:
        return _would(ret, f"would resize {name} online from {have} to {want} bytes (cryptsetup resize)")
    ok, err = _run(core.commands.luks_resize(name, key_file))
    if not ok:
        return _done(ret, f"cryptsetup resize {name} failed: {err}", result=False)
    return _done(ret, f"resized {name} online to all of {device}", resized={"old": have, "new": want})


def _dev_at(path):
    """``major:minor`` of the filesystem the directory ``path`` leads to, or None."""
    try:
        found = os.stat(path).st_dev
    except OSError:
        return None
    return f"{os.major(found)}:{os.minor(found)}"


def fs_grown(name, device, grown_by=None):
    """
    The XFS mounted at ``name`` from ``device`` fills its device (``xfs_growfs`` online, after
    the device under it grew). The fix of HANA-LAYOUT-009. A filesystem is never shrunk, and
    one that is not mounted from ``device``, or that the path ``name`` does not lead to (a mount
    over a parent directory hides it), is left alone.

    grown_by
        The ID of the state that grows ``device`` (lv_extended): when test mode says it would,
        this state says what it would run after it.
    """
    ret = _ret(name)
    if __opts__["test"] and _pending_in_this_run(grown_by):
        return _would(ret, f"would run {' '.join(core.commands.xfs_grow(name))} once {device} grew")
    try:
        live = _live_mount(name)
    except MountTableError as error:
        return _done(ret, f"{error}: not growing anything there", result=False)
    if not live or not os.path.exists(device) or live["dev"] != _dev_of(device):
        if __opts__["test"]:
            return _done(ret, f"{device} is not mounted at {name} yet: nothing to grow")
        return _done(ret, f"{device} is not mounted at {name}: not growing it", result=False)
    if _dev_at(name) != live["dev"]:
        return _done(
            ret,
            f"{name} leads to another filesystem than {device} mounted there (a mount over a parent "
            "directory hides it): not growing anything",
            result=False,
        )
    try:
        fs = __salt__["hana_storage_host.mounted_xfs_bytes"](name, live["dev"])
    except CommandExecutionError as error:
        return _done(ret, f"not growing the XFS at {name}: {error}", result=False)
    backing = __salt__["hana_storage_host.block_bytes"](device)
    if not backing:
        return _done(ret, f"the size of {device} cannot be read: not growing the XFS at {name}", result=False)
    if backing - fs < core.xfs.GROWABLE_BYTES:
        return _done(ret, f"the XFS at {name} fills {device}")
    argv = core.commands.xfs_grow(name)
    if __opts__["test"]:
        return _would(
            ret, f"would grow the XFS at {name} online from {fs} to {backing} bytes: {' '.join(argv)}"
        )
    ok, err = _run(argv)
    if not ok:
        return _done(ret, f"xfs_growfs {name} failed: {err}", result=False)
    try:
        grown = __salt__["hana_storage_host.mounted_xfs_bytes"](name, live["dev"])
    except CommandExecutionError as error:
        return _done(ret, f"xfs_growfs {name} ran; its new size is not read: {error}", result=False)
    return _done(ret, f"grew the XFS at {name} online to {grown} bytes", grown={"old": fs, "new": grown})


def formatted(
    name, stripe_kib=0, stripes=1, mkfs_options=(), may_wipe=False, opened_by=None, created_by=None
):
    """
    ``name`` holds XFS aligned to the stripe (su = stripe size, sw = stripes). A blank device is
    formatted; XFS is kept as it is (never formatted again); anything else is refused.

    created_by
        The ID of the state that creates ``name`` (below LVM: the volume's ``lvm.lv_present``):
        an LV it created in this run reads the noise of the LUKS devices under it, nobody's data.
    opened_by
        The ID of the state that opens ``name`` (above LVM): a mapping opened by this run only
        to look inside is closed again when the filesystem is refused.
    """
    ret = _ret(name)
    if not os.path.exists(name):
        if __opts__["test"]:
            aligned = f" aligned to {stripes} x {stripe_kib} KiB stripes" if stripes > 1 else ""
            return _would(ret, f"would create XFS on {name} once it exists{aligned}")
        return _done(ret, f"{name} does not exist", result=False)
    verdict = core.safety.layer_verdict(
        "xfs", _probe(name), may_wipe, created_now=_created_in_this_run(created_by)
    )
    if verdict["verdict"] == "use":
        return _done(ret, f"{name}: {verdict['reason']}")
    if verdict["verdict"] == "refuse":
        closed = (
            _close_if_opened_here(opened_by, os.path.basename(name))
            if name.startswith("/dev/mapper/")
            else None
        )
        return _done(
            ret,
            f"refusing to create a filesystem on {name}: it {verdict['reason']}. {_unchanged(closed)}",
            result=False,
        )
    # mkfs.xfs refuses to overwrite its own unfinished superblock without -f
    force = verdict["code"] == "interrupted_mkfs"
    argv = core.commands.mkfs_xfs(name, stripe_kib, stripes, list(mkfs_options), force=force)
    if __opts__["test"]:
        return _would(ret, f"would run {' '.join(argv)} ({verdict['reason']})")
    if verdict["verdict"] == "wipe" and not _wipe(ret, name, verdict["reason"]):
        return ret
    ok, err = _run(argv)
    if not ok:
        return _done(ret, f"mkfs.xfs {name} failed: {err}", result=False)
    _probe(name)  # forgets the payload mark: from now on the XFS inside is data
    return _done(ret, f"created XFS on {name}", formatted={"device": name, "command": " ".join(argv)})


def mounted(name, device, options, fstab_options):
    """
    ``device`` is mounted at ``name`` with ``options`` and /etc/fstab has it by filesystem UUID
    with ``fstab_options``. A mountpoint that holds another device is never unmounted.
    """
    ret = _ret(name)
    try:
        live = _live_mount(name)
    except MountTableError as error:
        return _done(ret, f"{error}: not mounting anything there", result=False)
    exists = os.path.exists(device)
    if live and (not exists or live["dev"] != _dev_of(device)):
        return _done(
            ret,
            f"{name} is mounted from {live['source']} ({live['fstype']}), not {device}: not touching "
            "it (unmount it yourself if it must go)",
            result=False,
        )
    if not exists:
        if __opts__["test"]:
            return _would(ret, f"would mount {device} at {name} and add it to /etc/fstab by UUID")
        return _done(ret, f"{device} does not exist", result=False)
    superblock = __salt__["hana_storage_host.xfs_superblock"](device)
    spec = f"UUID={superblock['uuid']}"
    line = core.tab.render_fstab(spec, name, "xfs", fstab_options)
    try:
        status = _set_tab_entry(FSTAB, "fstab", name, line)
    except (OSError, UnicodeDecodeError) as error:
        return _done(ret, f"cannot update {FSTAB}: {error}", result=False)
    todo = [] if status == "present" else [f"{'add' if status == 'new' else 'update'} /etc/fstab: {line}"]
    # only what the kernel shows can be compared: nofail, _netdev, x-systemd.* never show
    absent = [
        o
        for o in core.pillar.kernel_mount_options(options)
        if live and o not in live["options"] + live["super_options"]
    ]
    missing = [o for o in absent if not core.pillar.mount_only(o)]
    # mounted before the formula managed it (an existing host's volume): a remount cannot add
    # these, so none is tried; the next mount, as /etc/fstab has it, does
    later = [o for o in absent if core.pillar.mount_only(o)]
    note = f" ({','.join(later)}: from its next mount, as /etc/fstab has it)" if later else ""
    if not live:
        todo.append(f"mount {device} at {name}")
    elif missing:
        todo.append(f"remount {name} with {','.join(missing)}")
    if not todo:
        return _done(ret, f"{device} is mounted at {name}{note}; /etc/fstab: {line}")
    if __opts__["test"]:
        return _would(ret, "would " + "; ".join(todo))
    if status != "present":
        ret["changes"]["fstab"] = {status: line}
    if not live:
        os.makedirs(name, exist_ok=True)
        result = __salt__["mount.mount"](name, device, fstype="xfs", opts=",".join(options) or "defaults")
    elif missing:
        result = __salt__["mount.remount"](name, device, fstype="xfs", opts=",".join(options))
    else:
        result = True
    if result is not True:
        return _done(ret, f"mounting {device} at {name} failed: {result}", result=False)
    if not live or missing:
        ret["changes"]["mounted"] = {"device": device, "options": options}
    return _done(ret, "; ".join(todo) + note)


def _live_mount(mountpoint):
    found = [m for m in _mount_table(mountpoint) if m["mountpoint"] == mountpoint]
    return found[-1] if found else None


def _dev_of(path):
    rdev = os.stat(path).st_rdev
    return f"{os.major(rdev)}:{os.minor(rdev)}"


# ---- SCAP ------------------------------------------------------------------------------------


def scap_datastream(name):
    """
    ``name`` holds the formula's SCAP source data stream (hana_storage.scap_datastream), root's
    and readable by all (it holds no secret; scanners run as root). A data stream in place that
    differs only by when it was made is current: nothing is written.
    """
    ret = _ret(name)
    try:
        with open(name, encoding="utf-8") as handle:
            existing = handle.read()
    except FileNotFoundError:
        existing = None
    except (OSError, UnicodeDecodeError) as error:
        return _done(ret, f"cannot read {name}: {error}", result=False)
    when = core.scap.generated_at(existing) if existing else None
    if existing is not None and when and existing == core.scap.datastream(core.VERSION, generated=when):
        if os.stat(name).st_mode & 0o7777 == 0o644:
            return _done(ret, f"{name} is the SCAP data stream of hana-storage-formula {core.VERSION}")
    verb = "update" if existing is not None else "install"
    if __opts__["test"]:
        return _would(ret, f"would {verb} the SCAP data stream {name} (hana-storage-formula {core.VERSION})")
    try:
        os.makedirs(os.path.dirname(name), mode=0o755, exist_ok=True)
        core.files.replace_file(name, core.scap.datastream(core.VERSION).encode(), mode=0o644)
    except OSError as error:
        return _done(ret, f"cannot write {name}: {error}", result=False)
    done = {"install": "installed", "update": "updated"}[verb]
    return _done(ret, f"{done} the SCAP data stream {name}", datastream={done: name, "version": core.VERSION})
