"""The beacon's memory on disk: what each beacon instance of a minion has reported (its open
findings and the ``since`` of each), in ``<cachedir>/hana_storage/beacon-memory.json`` (0600,
replaced whole, under a lock), so that a new loader or a restarted minion does not report an open
finding again. Findings as reported, never key material. Files, no Salt.

``state`` is the beacon's state (its ``__context__`` entry): ``known``, ``since``, ``ended``,
``instance`` (this instance's name in the file), ``saved`` and ``memory_error`` are read and
written here.
"""

import contextlib
import json
import logging
import os
import stat

from . import events, files

log = logging.getLogger(__name__)

MEMORY_DIR = "hana_storage"
MEMORY_FILE = "beacon-memory.json"
MEMORY_LOCK = "beacon-memory.lock"  # flock'ed; never replaced, unlike the file it guards
MEMORY_VERSION = 1
MEMORY_MAX_BYTES = 16 << 20
MEMORY_LOCK_SECONDS = 2  # a save waits this long for another instance's, then gives up (logged)
MEMORY_REFRESH_SECONDS = 3600  # an unchanged record is rewritten this often (its "written" time)
MEMORY_EXPIRE_SECONDS = 7 * 86400  # another instance's record not written for this long is dropped


class MemoryProblem(Exception):
    """The memory file cannot be used: it is logged, and the beacon goes on with what it holds."""


@contextlib.contextmanager
def memory_dir(cachedir):
    """A descriptor of <cachedir>/hana_storage, made 0700 if missing, refused unless it is ours
    alone (a directory, not a symlink, owned by this user, writable by nobody else)."""
    if not cachedir:
        raise MemoryProblem("the minion has no cachedir")
    path = os.path.join(cachedir, MEMORY_DIR)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise MemoryProblem(f"{path}: {error.strerror}") from None
    try:
        info = os.fstat(descriptor)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise MemoryProblem(
                f"{path} is not this user's alone (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
            )
        yield descriptor, path
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def memory_lock(directory, path):
    """The memory's lock, held exclusively (every instance and process of this minion)."""
    with files.exclusive(MEMORY_LOCK, MEMORY_LOCK_SECONDS, directory, poll=0.02) as held:
        if not held:
            raise MemoryProblem(
                f"{path}/{MEMORY_LOCK} held for over {MEMORY_LOCK_SECONDS} s by another process"
            )
        yield


def read_memory(directory, path):
    """The memory file's content: {"version", "instances": {instance: record}}; an empty one when
    there is none. A file that is not this user's regular 0600 file, or that does not parse, is
    MemoryProblem (the next save replaces it)."""
    where = f"{path}/{MEMORY_FILE}"
    try:
        descriptor = os.open(MEMORY_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except FileNotFoundError:
        return {"version": MEMORY_VERSION, "instances": {}}
    except OSError as error:  # ELOOP: a symlink
        raise MemoryProblem(f"{where}: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise MemoryProblem(
                f"{where} ignored: not a regular file of this user with mode 0600 "
                f"(owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
            )
        raw = handle.read(MEMORY_MAX_BYTES + 1)
    if len(raw) > MEMORY_MAX_BYTES:
        raise MemoryProblem(f"{where} ignored: larger than {MEMORY_MAX_BYTES} bytes")
    try:
        content = json.loads(raw.decode("utf-8"))
    except ValueError as error:
        raise MemoryProblem(f"{where} ignored: not JSON ({error})") from None
    if not isinstance(content, dict) or content.get("version") != MEMORY_VERSION:
        raise MemoryProblem(f"{where} ignored: not a version {MEMORY_VERSION} beacon memory")
    instances = content.get("instances")
    if not isinstance(instances, dict):
        raise MemoryProblem(f"{where} ignored: no instances")
    records = {name: _record(raw) for name, raw in instances.items() if isinstance(name, str)}
    return {"version": MEMORY_VERSION, "instances": {k: v for k, v in records.items() if v}}


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _record(raw):
    """One instance's record, cleaned: {known, since, ended, written}; None if it is no record.

    A finding is kept only with its own key and the since of its occurrence: one without a since
    would be reported again (a new occurrence), never given a made-up time.
    """
    if not isinstance(raw, dict) or not _number(raw.get("written")):
        return None
    key = events.finding_key
    since = raw.get("since") if isinstance(raw.get("since"), dict) else {}
    known = {}
    for name, finding in (raw.get("known") if isinstance(raw.get("known"), dict) else {}).items():
        try:
            ours = isinstance(finding, dict) and key(finding) == name
        except (KeyError, TypeError):
            ours = False
        if ours and _number(since.get(name)):
            known[name] = finding
    ended = raw.get("ended") if isinstance(raw.get("ended"), dict) else {}
    return {
        "known": known,
        "since": {k: since[k] for k in known},
        "ended": {k: v for k, v in ended.items() if isinstance(k, str) and _number(v)},
        "written": raw["written"],
    }


def write_memory(directory, content):
    """Replace the memory file whole (0600, core.files) in the directory held open as ``directory``."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str).encode()
    files.replace_file(MEMORY_FILE, text, mode=0o600, dir_fd=directory)


def _failed(state, error):
    message = str(error)
    if message != state.get("memory_error"):
        state["memory_error"] = message
        log.warning("hana_storage beacon: memory file: %s; going on with the memory of this process", message)


def restore(state, cachedir):
    """A new context: what this instance had reported, from the memory file, if it is usable."""
    try:
        with memory_dir(cachedir) as (directory, path), memory_lock(directory, path):
            record = read_memory(directory, path)["instances"].get(state["instance"])
    except (MemoryProblem, OSError) as error:
        _failed(state, error)
        return
    if record:
        state.update(known=record["known"], since=record["since"], ended=record["ended"])
        state["saved"] = (_kept(state), record["written"])
        log.info("hana_storage beacon: %d open finding(s) remembered from %s", len(record["known"]), path)


def _kept(state):
    """What the memory file keeps of this instance, as comparable text."""
    known = state["known"]
    since = state.setdefault("since", {})
    ended = state.setdefault("ended", {})
    return json.dumps(
        {"known": known, "since": {k: since[k] for k in known if k in since}, "ended": ended},
        sort_keys=True,
        default=str,
    )


def remember(state, cachedir, fresh, wall, force=False):
    """Give each fresh finding key its since, and write this instance's record if it changed.

    ``fresh``: keys of findings that appeared to this instance. An occurrence another instance
    (another master connection) has open, and this one did not see end, keeps that instance's
    since: the first time any instance saw it. Otherwise it starts now. Without a usable memory
    file, since is now and the beacon goes on with what this process holds.
    """
    since, ended = state.setdefault("since", {}), state.setdefault("ended", {})
    saved = state.get("saved")
    if not fresh and not force and saved and saved[0] == _kept(state):
        if wall - saved[1] < MEMORY_REFRESH_SECONDS:
            return
    if state.get("instance") is None:
        since.update((k, since.get(k, wall)) for k in fresh)
        return
    try:
        with memory_dir(cachedir) as (directory, path), memory_lock(directory, path):
            try:
                others = read_memory(directory, path)["instances"]
            except MemoryProblem as error:
                _failed(state, error)  # replaced below by a good one
                others = {}
            others = {
                name: record
                for name, record in others.items()
                if name != state["instance"] and wall - record["written"] < MEMORY_EXPIRE_SECONDS
            }
            for key in fresh:
                seen = [
                    record["since"][key]
                    for record in others.values()
                    if key in record["known"] and record["since"][key] != ended.get(key)
                ]
                since[key] = min(seen) if seen else wall
            held = {(key, record["since"][key]) for record in others.values() for key in record["known"]}
            for key in [k for k, first in ended.items() if (k, first) not in held]:
                del ended[key]  # no instance holds that occurrence any more
            kept = _kept(state)
            mine = dict(json.loads(kept), written=wall)
            write_memory(
                directory, {"version": MEMORY_VERSION, "instances": {**others, state["instance"]: mine}}
            )
            state["saved"] = (kept, wall)
            state["memory_error"] = None
    except (MemoryProblem, OSError, ValueError) as error:
        _failed(state, error)
        since.update((k, since.get(k, wall)) for k in fresh)
