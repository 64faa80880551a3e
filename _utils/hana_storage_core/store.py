"""
Where triage keeps what it has done, so that no occurrence of a finding is acted on twice: per
minion and rule, the occurrences handled, the occurrences being handled now, each under a lease,
and per finding the time of its last remediation (the cooldown).

A record, ``{"cooldown": {key: time}, "handled": {key: since}, "held": {key: {"since", "owner",
"until"}}}`` (``key``: the finding's ``rule|volume|device``), changes only through the pure functions below (``claim``, ``renew``, ``complete``,
``release``), each inside one atomic read-modify-write of a store:

* ``local`` (the default): a file per minion and rule under the master's cachedir, changed under
  ``flock``. Zero set-up, one master.
* ``redis``: a key per minion and rule on a Redis server all masters share (hot multi-master),
  changed in a ``WATCH``/``MULTI`` transaction, with the server's clock (``TIME``) so that the
  masters' clocks need not agree. Redis because a SLES or RHEL site can start it from its own
  packages with one command (``systemctl start redis``; valkey on the newest releases), its
  transactions give the compare-and-set a claim needs and nothing more, and Salt has no store
  with an atomic compare-and-set of its own (its ``cache`` modules only read and write).

A lease is what lets another master take over: a master that dies after claiming an occurrence
stops renewing the lease, and once it has run out (``lease`` seconds, renewed every third of it
while a remediation runs) the next master to see the occurrence claims it, cooldown or not - the
cooldown was started by that very occurrence. Until then, a claim answers ``held`` and says when
to look again.

Each completed action is also tallied in the store (``tallies``: counts per action and rule), so
the metrics of every master that shares it agree.

The outbox: the events an action puts out (an alert, a remediation's outcome) are added to the
store in the very change that completes or releases the occurrence, each under an ``event_id``
and due for delivery ``redeliver`` seconds later. The master that made the change puts them on its
bus at once; once the bus has carried one, it is ``confirm``ed (removed). One that is still there
when due (its master died before its bus carried it, or the bus refused it) is ``overdue``: a
master claims it, due again a ``redeliver`` later, and puts it on its own bus, with the same
``event_id``. So what a master decided is never lost with it, nor decided twice; a consumer that
must not see an event twice drops a repeated ``event_id`` (a master that died after its bus carried
an event and before confirming it). Only the outbox's two tags (``OUTBOX_TAGS``) leave it: any
other entry is dropped and logged.

Whoever can write to a Redis server is not a master. So every value the Redis store writes (a
record, an outbox entry) carries an HMAC-SHA256 under a key only the masters hold: derived from
the private key they share, ``<pki_dir>/master.pem`` (``mac_key``), and bound to the value's name
(``action:<minion>@<rule>``, ``outbox:<event_id>``), so a value is not valid under another name.
A Redis writer without master.pem can delete or replay what the masters wrote, not forge it:
a record that does not verify is read as empty, so triage acts on the occurrence again, maybe
twice (never silenced: the safe direction); an outbox entry that does not verify is dropped; a
replayed one is an event the masters decided, sent again with its ``event_id``, which
consumers drop as a repeat. Each cluster of hot masters has its own key prefix by default
(``cluster_prefix``: from the master.pub they share), so two clusters on one Redis share no
record, cooldown or outbox. The tallies (``HINCRBY``, added to by every master at once) carry no
MAC: a Redis writer can change the counts of ``hana_storage_triage_actions_total``, nothing
triage decides. It cannot add a series: ``tallies`` reads only the fields triage makes, an
action of ``TALLY_ACTIONS`` and a rule of the master's table (``tally_name``); any other field
is dropped and logged.
"""

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import threading
import time

from . import evidence, files, limits, rules

try:
    import redis
except ImportError:  # only the redis driver needs it (requirements/master.in)
    redis = None

TALLY = "tallies"  # the local store's file, and the Redis hash, of the completed actions
OUTBOX = "outbox"  # the local store's directory (a file per event), the Redis hash (event_id: event)
DUE = "outbox-due"  # the Redis sorted set: event_id by when it is due for delivery again
TALLY_LOG = "tallies.log"  # the local store's completed actions, one line each, counted into TALLY
ROTATE_BYTES = 1 << 20  # a counted log this large is emptied (about 40,000 actions)
JOURNAL = "journal"  # each tallied action: when, who, what, its events (the evidence report's history)
HISTORY = "history"  # the fleet's compliance at each evidence report (core.evidence.snapshot)
# How much of each the store keeps, newest: a year of hourly snapshots, and some months of a
# fleet's actions; the local store keeps a file of about JOURNAL_BYTES and the one before it.
JOURNAL_MAX, HISTORY_MAX = 20000, 9000
JOURNAL_BYTES = 4 << 20
WATCH_ATTEMPTS = 50  # a transaction retried this often lost to other masters every time
REDELIVER = 60  # seconds: an event not confirmed by then is put on a bus again (hana_storage:lease)
OUTBOX_TAGS = ("hana/storage/alert", "hana/storage/remediation")  # the only events the outbox holds
MAC_LABEL = b"hana_storage store mac v1\0"  # what the store's MAC key is derived for (mac_key)
MAC_HEX = 64  # a sealed value: the HMAC-SHA256 in hex, then the value
NOTED_MAX = 256  # distinct causes of dropped or unverified store contents logged, then no more
# What triage tallies, each per rule (the runner's _claim, _complete and _release): the tallies'
# only fields, so whoever writes to the store cannot name a series of the exporter.
TALLY_ACTIONS = ("alerted", "remediated", "remediation-failed")

log = logging.getLogger(__name__)


class StoreError(Exception):
    """The store could not be read or changed: nothing was decided."""


def failures():
    """What a store raises when it decided nothing (the loader hands out functions, not classes)."""
    return StoreError


def mac_key(private_der):
    """The store's MAC key: SHA-256 of a label and the masters' private key (DER). Hot masters
    share master.pem, so they share this key; a Redis writer without master.pem cannot make it."""
    return hashlib.sha256(MAC_LABEL + private_der).digest()


def cluster_prefix(master_pub):
    """The default Redis key prefix of a cluster of hot masters: ``hana_storage:`` and the first
    16 hex digits of the SHA-256 of the master.pub they share (the bytes of the file, as
    ``sha256sum <pki_dir>/master.pub`` prints it): another cluster has another key."""
    return f"hana_storage:{hashlib.sha256(master_pub).hexdigest()[:16]}:"


def seal(secret, name, text):
    """``text`` as the Redis store writes it under ``name``: its MAC (hex), then the text."""
    return _mac(secret, name, text) + text


def unseal(secret, name, sealed):
    """The text ``seal`` sealed under ``name``, or None when the MAC does not verify."""
    sealed = sealed.decode("utf-8", "replace") if isinstance(sealed, bytes) else sealed
    if not isinstance(sealed, str) or len(sealed) < MAC_HEX:
        return None
    text = sealed[MAC_HEX:]
    return text if hmac.compare_digest(sealed[:MAC_HEX], _mac(secret, name, text)) else None


def _mac(secret, name, text):
    return hmac.new(secret, f"{name}\0{text}".encode(), hashlib.sha256).hexdigest()


_NOTED, _NOTED_LOCK = set(), threading.Lock()


def _note(cause, message, *args):
    """Log a warning about what the store holds once per ``cause``, for at most NOTED_MAX causes:
    whoever writes to the store must not fill the master's log."""
    with _NOTED_LOCK:
        if cause in _NOTED or len(_NOTED) > NOTED_MAX:
            return
        _NOTED.add(cause)
        if len(_NOTED) > NOTED_MAX:
            message, args = "hana_storage: more store contents were dropped; not logged further", ()
    log.warning(message, *args)


def outbox_entry(text, event_id):
    """The event an outbox entry holds (``{"event_id", "tag", "data"}``), or (None, why) for an
    entry that is not one: not JSON, another shape or event_id, a tag outside OUTBOX_TAGS."""
    try:
        event = json.loads(text)
    except (TypeError, ValueError):
        return None, "not JSON"
    if (
        not isinstance(event, dict)
        or event.get("event_id") != event_id
        or not isinstance(event.get("data"), dict)
    ):
        return None, "not an outbox event"
    if event.get("tag") not in OUTBOX_TAGS:
        return None, f"tag {str(event.get('tag'))[:100]!r}"
    return event, None


def _dropped(where, event_id, why):
    _note(
        ("outbox", where, why),
        "hana_storage: an entry was dropped from the outbox of %s (%s): only the masters' own %s events "
        "are sent (event_id %r)",
        where,
        why,
        " and ".join(OUTBOX_TAGS),
        str(event_id)[:64],
    )


def tally_name(action, rule):
    """The tallies' field of ``action`` on ``rule``: ``<action>|<rule>``."""
    if action not in TALLY_ACTIONS or rule not in rules.RULES:
        raise ValueError(f"triage tallies no {action!r} of {rule!r}")
    return f"{action}|{rule}"


def journal_entry(now, minion, rule, tally, events, extra):
    """What the journal keeps of an action the store tallied (``tally``: its tally name)."""
    return {
        "ts": round(now, 3),
        "minion": minion,
        "rule": rule,
        "action": tally.partition("|")[0],
        "event_ids": [e["event_id"] for e in events],
        **{k: v for k, v in (extra or {}).items() if k in ("key", "master") and isinstance(v, str)},
    }


def valid_journal_entry(entry):
    """A journal entry as journal_entry makes it (read back from what anyone may have written)."""
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("ts"), int | float)
        and isinstance(entry.get("minion"), str)
        and entry.get("rule") in rules.RULES
        and entry.get("action") in TALLY_ACTIONS
        and isinstance(entry.get("event_ids"), list)
        and all(isinstance(e, str) for e in entry["event_ids"])
        and all(isinstance(entry.get(k, ""), str) for k in ("key", "master"))
    )


def known_tallies(counts, where):
    """The counts (``{name: count}``, names and counts as read) of the fields ``tally_name``
    makes; any other field, or a count that is not a whole number of at least 0, is dropped and
    logged once for ``where``."""
    kept, dropped = {}, []
    for name, count in counts.items():
        name = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
        action, _, rule = name.partition("|")
        try:
            count = int(count)
        except (TypeError, ValueError):
            count = -1
        if action in TALLY_ACTIONS and rule in rules.RULES and count >= 0:
            kept[name] = count
        else:
            dropped.append(name)
    if dropped:
        _note(
            ("tallies", where),
            "hana_storage: %d fields of the tallies of %s are not an action of triage's on a rule of "
            "the master's table, or not a count: not served (the first: %r)",
            len(dropped),
            where,
            dropped[0][:100],
        )
    return kept


# ---- the record and its changes (pure) -------------------------------------------------------


def empty():
    return {"cooldown": {}, "handled": {}, "held": {}}


def load(text):
    """The record in ``text``; one that is empty, unreadable or of another shape is empty (it never
    blocks an action). An older record held one cooldown for the minion and rule (``at``, or the
    record was only that time), or no leases: that cooldown names no finding, so it cools none."""
    try:
        loaded = json.loads(text) if text else {}
    except ValueError:
        loaded = {}
    if not isinstance(loaded, dict):
        return empty()
    record = empty()
    for field in ("cooldown", "handled", "held"):
        if isinstance(loaded.get(field), dict):
            record[field] = loaded[field]
    record["cooldown"] = {
        key: at
        for key, at in record["cooldown"].items()
        if isinstance(at, int | float) and not isinstance(at, bool)
    }
    record["held"] = {
        key: lease
        for key, lease in record["held"].items()
        if isinstance(lease, dict) and isinstance(lease.get("until"), int | float)
    }
    return record


def dump(record):
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def claim(record, now, key, since, cooldown, owner, lease):
    """Whether ``owner`` acts on the occurrence ``key`` first reported at ``since``.

    Returns ``{"verdict": ...}``: "act" (it holds the occurrence until ``now + lease``),
    "duplicate" (handled already), "held" (another claim's lease runs; ``retry_in`` seconds) or
    "cooldown" (this finding was acted on within ``cooldown`` seconds: triage passes the cooldown
    for a remediation, and 0 for an alert, which every occurrence gets).
    """
    if record["handled"].get(key) == since:
        return {"verdict": "duplicate"}
    held = record["held"].get(key)
    taking_over = held is not None and held.get("since") == since
    if taking_over and held["until"] > now:
        return {"verdict": "held", "retry_in": round(held["until"] - now, 3)}
    # cooldowns that ran out are dropped: the record keeps one per finding cooling down now
    record["cooldown"] = {k: at for k, at in record["cooldown"].items() if at <= now < at + cooldown}
    if not taking_over and key in record["cooldown"]:
        return {"verdict": "cooldown"}
    if cooldown > 0:
        record["cooldown"][key] = now
    record["held"][key] = {"since": since, "owner": owner, "until": now + lease}
    return {"verdict": "act", "took_over": taking_over}


def renew(record, now, key, owner, lease):
    """Extend ``owner``'s lease; False when it holds the occurrence no more."""
    held = record["held"].get(key)
    if held is None or held.get("owner") != owner:
        return False
    held["until"] = now + lease
    return True


def complete(record, key, since, owner):
    """The occurrence is handled. False when it was handled already (by a master that took it over
    after ``owner``'s lease ran out): ``owner``'s action is then the second one.

    The record remembers at most ``limits.MAX_HANDLED`` handled occurrences: this one and the
    others first reported last (``since``)."""
    first = record["handled"].get(key) != since
    if record["held"].get(key, {}).get("owner") == owner:
        del record["held"][key]
    record["handled"][key] = since
    if len(record["handled"]) > limits.MAX_HANDLED:
        others = sorted(
            ((k, s) for k, s in record["handled"].items() if k != key), key=_reported_at, reverse=True
        )
        record["handled"] = {**dict(others[: limits.MAX_HANDLED - 1]), key: since}
    return first


def _reported_at(entry):
    """The order of handled occurrences to keep: by ``since``, one without a time the oldest."""
    since = entry[1]
    return since if isinstance(since, int | float) and not isinstance(since, bool) else float("-inf")


def release(record, key, owner, keep_cooldown):
    """Give the occurrence up unhandled, so a later event acts on it again; without
    ``keep_cooldown`` the cooldown goes too (the action never happened)."""
    if record["held"].get(key, {}).get("owner") != owner:
        return False
    del record["held"][key]
    if not keep_cooldown:
        record["cooldown"].pop(key, None)
    return True


# ---- the stores -------------------------------------------------------------------------------


class LocalStore:
    """Records as files under ``<cachedir>/hana_storage/actions``, one per minion and rule.

    No MAC here: the files are the master user's, in its 0700 cachedir, and whoever can write them
    can read master.pem too (the same user, or root), and so make any MAC. The outbox's entries
    are checked all the same (``outbox_entry``): only its two tags are ever sent.

    Tallies: each completed action appends its name to a log (``tallies.log``) holding a shared
    lock, so that actions on different records never wait for each other; ``tallies()`` counts
    the log's new lines into the counts (``tallies``) holding the exclusive one. One counts file
    changed per action under one exclusive lock would queue every triage thread of every
    process on it, behind a holder that waits for its own process's GIL.
    """

    driver = "local"

    def __init__(self, cachedir, redeliver=REDELIVER):
        self.root = os.path.join(cachedir, "hana_storage", "actions")
        self.outbox = os.path.join(self.root, OUTBOX)
        self.redeliver = redeliver

    # The outbox: a file per event, named by its event_id, its mtime when it is due. A claim of
    # an overdue event sets the mtime on, under the outbox's lock (the triage engine claims them;
    # a redeliver runner job may run beside it).

    def _add(self, event, due):
        path = os.path.join(self.outbox, _event_file(event["event_id"]))
        try:
            os.makedirs(self.outbox, mode=0o700, exist_ok=True)
            data = json.dumps(event, sort_keys=True, default=str).encode()
            files.replace_file(path, data, mode=0o600, mtime=due)  # whole or not at all
        except OSError as error:
            raise StoreError(f"the local store's outbox at {self.outbox}: {error}") from None

    def confirm(self, event_ids):
        """The bus carried these events: they leave the outbox."""
        for event_id in event_ids:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.outbox, _event_file(event_id)))

    def overdue(self, limit=500):
        """Events whose delivery is due and not confirmed, claimed (due again a ``redeliver``
        later): put them on the bus again."""
        now, claimed = time.time(), []
        with self._file_lock(OUTBOX + ".lock", fcntl.LOCK_EX):
            try:
                names = os.listdir(self.outbox)
            except FileNotFoundError:
                return []
            for name in (n for n in names if n.endswith(".json")):
                path = os.path.join(self.outbox, name)
                try:
                    if os.stat(path).st_mtime > now:
                        continue
                    with open(path, encoding="utf-8") as handle:
                        text = handle.read()
                    os.utime(path, (now + self.redeliver, now + self.redeliver))
                except (OSError, ValueError):
                    continue  # confirmed meanwhile: not an event
                event, why = outbox_entry(text, name[: -len(".json")])
                if why:  # half-written by a master that died, or not the masters' own
                    _dropped(self.outbox, name, why)
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    continue
                claimed.append(event)
                if len(claimed) == limit:
                    break
        return claimed

    def update(self, minion, rule, change, tally=None, outbox=None, journal=None):
        """``change(record, now)``'s return, the record written back if it changed; ``tally``
        (a function of that return: a tally name or None) counted once the record is written;
        ``outbox`` (a function of it: events ``{"event_id", "tag", "data"}``) added to the outbox
        before the record is written, under the record's lock: a master that dies between the two
        leaves an event of an action it did not record, delivered, and acted on again (never an
        action recorded and lost). A tallied action is also kept in the journal, with what
        ``journal`` (a function of the return: {"key", "master"}) adds."""
        with self._locked(f"{minion}@{rule}") as (record, now):
            result = change(record, now)
            events = list(outbox(result)) if outbox else []
            for event in events:
                self._add(event, now + self.redeliver)
        name = tally(result) if tally else None
        if name:
            with self._file_lock(TALLY_LOG + ".lock", fcntl.LOCK_SH):
                self._append(TALLY_LOG, f"{name}\n")
            entry = journal_entry(now, minion, rule, name, events, journal(result) if journal else None)
            try:
                self._keep(JOURNAL, entry)
            except StoreError as error:  # the action is recorded and its events queued: deliver them
                log.error("hana_storage: an action is missing from the journal: %s", error)
        return result

    def _keep(self, name, entry):
        """Append ``entry`` to the kept log ``name`` (a JSON line); a log past JOURNAL_BYTES becomes
        ``name.1`` (the one before is dropped), under an exclusive lock while appends share one."""
        line = json.dumps(entry, sort_keys=True, separators=(",", ":")) + "\n"
        path = os.path.join(self.root, f"{name}.log")
        try:
            with self._file_lock(f"{name}.lock", fcntl.LOCK_SH):
                self._append(f"{name}.log", line)
            if os.path.getsize(path) > JOURNAL_BYTES:
                with self._file_lock(f"{name}.lock", fcntl.LOCK_EX):
                    if os.path.getsize(path) > JOURNAL_BYTES:
                        os.replace(path, path + ".1")
        except FileNotFoundError:
            pass  # rotated by another process after the append (_open wraps its own errors)
        except OSError as error:  # a full disk, a lost directory: the caller decides
            raise StoreError(f"the local store's {name} at {path}: {error}") from None

    def _kept(self, name, valid, limit):
        """The newest ``limit`` entries of the kept log ``name`` that ``valid`` accepts, oldest first."""
        entries = []
        with self._file_lock(f"{name}.lock", fcntl.LOCK_SH):
            for suffix in (".log.1", ".log"):
                try:
                    with open(
                        os.path.join(self.root, name + suffix), encoding="utf-8", errors="replace"
                    ) as log:
                        for line in log:
                            try:
                                entry = json.loads(line)
                            except ValueError:
                                continue  # a line cut short by a master that died: not an entry
                            if valid(entry):
                                entries.append(entry)
                except FileNotFoundError:
                    continue
                except OSError as error:
                    raise StoreError(f"the local store's {name}: {error}") from None
        return entries[-limit:]

    def actions(self, limit=JOURNAL_MAX):
        """What triage did (journal entries), oldest first."""
        return self._kept(JOURNAL, valid_journal_entry, limit)

    def add_snapshot(self, entry):
        """Keep the fleet's compliance (core.evidence.snapshot) in the history."""
        self._keep(HISTORY, entry)

    def history(self, limit=HISTORY_MAX):
        """The kept snapshots, oldest first."""
        return self._kept(HISTORY, evidence.valid_snapshot, limit)

    def tallies(self):
        """The counts, with the lines the log holds beyond ``offset`` (how far it is counted)
        added. A log over ROTATE_BYTES is emptied once the counts that include it are written,
        then the offset is set back: an offset beyond the log's end (a master died between the
        two) is read as the log's start."""
        with self._file_lock(TALLY_LOG + ".lock", fcntl.LOCK_EX):
            with self._locked(TALLY, raw=True) as (summary, _now):
                if not isinstance(summary.get("counts"), dict):  # written before the log: counts alone
                    counts = {k: v for k, v in summary.items() if type(v) is int}
                    summary.clear()
                    summary.update(counts=counts, offset=0)
                counts, offset = summary["counts"], summary.get("offset")
                with os.fdopen(self._open(TALLY_LOG, os.O_RDONLY | os.O_CREAT), "rb") as log:
                    size = os.fstat(log.fileno()).st_size
                    log.seek(offset if type(offset) is int and 0 <= offset <= size else 0)
                    for name in filter(None, log.read().decode("utf-8", "replace").split("\n")):
                        counts[name] = counts.get(name, 0) + 1
                summary["offset"] = size
                result = known_tallies(counts, self.root)
            if size > ROTATE_BYTES:
                os.truncate(os.path.join(self.root, TALLY_LOG), 0)
                with self._locked(TALLY, raw=True) as (summary, _now):
                    summary["offset"] = 0
        return result

    @contextlib.contextmanager
    def _file_lock(self, name, mode):
        descriptor = self._open(name, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(descriptor, mode)
            yield
        finally:
            os.close(descriptor)

    def _append(self, name, line):
        """One write in append mode: appends of a line each never interleave."""
        descriptor = self._open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(descriptor, line.encode())
        finally:
            os.close(descriptor)

    def _open(self, name, flags):
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        try:
            return os.open(os.path.join(self.root, name), flags | os.O_CLOEXEC, 0o600)
        except OSError as error:
            raise StoreError(f"the local store at {self.root}: {error}") from None

    @contextlib.contextmanager
    def _locked(self, name, raw=False):
        """The record (or, ``raw``, the JSON mapping) in file ``name``, under an exclusive lock;
        written back on exit when it changed. ``name`` holds a verified minion id (``valid_id``:
        no path separators) and a rule of the table."""
        descriptor = self._open(name, os.O_RDWR | os.O_CREAT)
        with os.fdopen(descriptor, "r+", encoding="utf-8") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # per open file: excludes threads and processes alike
            text = handle.read()
            if raw:
                try:
                    value = json.loads(text) if text else {}
                except ValueError:
                    value = {}
                value = value if isinstance(value, dict) else {}
            else:
                value = load(text)
            before = json.dumps(value, sort_keys=True)
            yield value, time.time()
            if json.dumps(value, sort_keys=True) != before:
                handle.seek(0)
                handle.truncate()
                handle.write(json.dumps(value, sort_keys=True))


class RedisStore:
    """Records as Redis keys ``<prefix>action:<minion>@<rule>``, the tallies as the hash
    ``<prefix>tallies``; every change is one ``WATCH``/``MULTI`` transaction timed by the server.
    Records and outbox entries are sealed with ``secret`` (``mac_key``: the masters' shared key)."""

    driver = "redis"

    def __init__(self, url, prefix, secret, timeout=5, redeliver=REDELIVER):
        if redis is None:
            raise StoreError(
                "the redis store needs the Python package redis on the master (requirements/master.in)"
            )
        if not isinstance(secret, bytes) or not secret:
            raise StoreError("the redis store needs the masters' shared key (from master.pem)")
        if not isinstance(prefix, str) or not prefix:
            raise StoreError(f"hana_storage:store:prefix must be a non-empty string, not {prefix!r}")
        self.secret = secret
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        except ValueError as error:
            raise StoreError(f"not a Redis URL: {error}") from None
        self.prefix = prefix
        self.redeliver = redeliver

    def update(self, minion, rule, change, tally=None, outbox=None, journal=None):
        name = f"action:{minion}@{rule}"
        key = self.prefix + name

        def read_change_write(pipe, now):
            sealed = pipe.get(key)
            text = unseal(self.secret, name, sealed) if sealed else ""
            if text is None:
                _note(
                    ("record", name),
                    "hana_storage: the record %s in Redis does not verify with the masters' key: "
                    "read as empty (its occurrences may be acted on again)",
                    key,
                )
            record = load(text or "")
            before = dump(record)
            result = change(record, now)
            tally_name = tally(result) if tally else None
            pipe.multi()
            if dump(record) != before:
                pipe.set(key, seal(self.secret, name, dump(record)))
            events = list(outbox(result)) if outbox else []
            if tally_name:
                pipe.hincrby(self.prefix + TALLY, tally_name, 1)
                entry = journal_entry(
                    now, minion, rule, tally_name, events, journal(result) if journal else None
                )
                self._keep(pipe, JOURNAL, entry, JOURNAL_MAX)
            for event in events:
                text = json.dumps(event, sort_keys=True, default=str)
                pipe.hset(
                    self.prefix + OUTBOX,
                    event["event_id"],
                    seal(self.secret, f"outbox:{event['event_id']}", text),
                )
                pipe.zadd(self.prefix + DUE, {event["event_id"]: now + self.redeliver})
            return result, True

        return self._transaction(key, read_change_write)

    def confirm(self, event_ids):
        if not event_ids:
            return
        try:
            with self.client.pipeline() as pipe:
                pipe.hdel(self.prefix + OUTBOX, *event_ids)
                pipe.zrem(self.prefix + DUE, *event_ids)
                pipe.execute()
        except redis.RedisError as error:
            raise StoreError(f"the redis store: {error}") from None

    def overdue(self, limit=500):
        due = self.prefix + DUE

        def claim_overdue(pipe, now):
            event_ids = pipe.zrangebyscore(due, "-inf", now, start=0, num=limit)
            if not event_ids:
                return [], False
            texts = pipe.hmget(self.prefix + OUTBOX, event_ids)
            pipe.multi()
            pipe.zadd(due, dict.fromkeys(event_ids, now + self.redeliver), xx=True)
            return list(zip(event_ids, texts, strict=True)), True

        events, dropped = [], []
        for event_id, sealed in self._transaction(due, claim_overdue):
            if sealed is None:
                continue  # confirmed meanwhile: nothing
            event_id = event_id.decode("utf-8", "replace")
            text = unseal(self.secret, f"outbox:{event_id}", sealed)
            event, why = outbox_entry(text, event_id) if text is not None else (None, "no valid MAC")
            if why:
                _dropped(f"Redis ({self.prefix})", event_id, why)
                dropped.append(event_id)
            else:
                events.append(event)
        self.confirm(dropped)
        return events

    def _transaction(self, watched, body):
        """``body(pipe, now)``'s result, in one ``WATCH``/``MULTI`` transaction on the key
        ``watched``, timed by the server's clock. ``body`` reads through ``pipe``, calls
        ``pipe.multi()`` and queues its writes, and returns (result, whether to write). It runs
        again when another master changed ``watched`` between its read and the write."""
        try:
            with self.client.pipeline() as pipe:
                for _attempt in range(WATCH_ATTEMPTS):
                    try:
                        pipe.watch(watched)
                        seconds, micros = pipe.time()
                        result, write = body(pipe, seconds + micros / 1e6)
                        if write:
                            pipe.execute()
                        return result
                    except redis.WatchError:
                        continue  # another master changed it between our read and write
        except redis.RedisError as error:
            raise StoreError(f"the redis store: {error}") from None
        raise StoreError(f"the redis store: {watched} changed under {WATCH_ATTEMPTS} transactions in a row")

    def tallies(self):
        try:
            counts = self.client.hgetall(self.prefix + TALLY)
        except redis.RedisError as error:
            raise StoreError(f"the redis store: {error}") from None
        return known_tallies(counts, f"Redis ({self.prefix})")

    def _keep(self, pipe, name, entry, most):
        """Queue ``entry`` onto the list ``name`` (newest first, sealed under the list's name: a
        Redis writer can drop or repeat entries, not make one), trimmed to ``most``."""
        text = json.dumps(entry, sort_keys=True, separators=(",", ":"))
        pipe.lpush(self.prefix + name, seal(self.secret, name, text))
        pipe.ltrim(self.prefix + name, 0, most - 1)

    def _kept(self, name, valid, limit):
        try:
            sealed = self.client.lrange(self.prefix + name, 0, limit - 1)
        except redis.RedisError as error:
            raise StoreError(f"the redis store: {error}") from None
        entries = []
        for value in reversed(sealed):
            text = unseal(self.secret, name, value)
            try:
                entry = json.loads(text) if text is not None else None
            except ValueError:
                entry = None
            if valid(entry):
                entries.append(entry)
            else:
                _note((name, "invalid"), "hana_storage: entries of %s in Redis do not verify: left out", name)
        return entries

    def actions(self, limit=JOURNAL_MAX):
        return self._kept(JOURNAL, valid_journal_entry, limit)

    def add_snapshot(self, entry):
        try:
            with self.client.pipeline() as pipe:
                self._keep(pipe, HISTORY, entry, HISTORY_MAX)
                pipe.execute()
        except redis.RedisError as error:
            raise StoreError(f"the redis store: {error}") from None

    def history(self, limit=HISTORY_MAX):
        return self._kept(HISTORY, evidence.valid_snapshot, limit)


_OPENED = {}  # one store (and Redis connection pool, shared by threads) per settings


def _event_file(event_id):
    """The local outbox's file of an event: event ids are made by triage (hex), checked anyway."""
    if not isinstance(event_id, str) or not event_id.isalnum():
        raise StoreError(f"not an event id: {event_id!r}")
    return f"{event_id}.json"


def open_store(settings, cachedir, redeliver=REDELIVER, cluster=None):
    """The store the triage settings name: ``{"driver": "local"}`` (default) or ``{"driver":
    "redis", "url": "redis://host:6379/0", "prefix": "..."}``. ``cluster``: (the MAC key, the
    default prefix) of this master's cluster (``mac_key``, ``cluster_prefix``), which the redis
    driver needs; an explicit ``prefix`` wins. StoreError for settings it cannot use."""
    settings = settings or {}
    if not isinstance(settings, dict):
        raise StoreError(f"hana_storage:store must be a mapping, not {settings!r}")
    driver = settings.get("driver", "local")
    secret, prefix = cluster or (None, None)
    prefix = settings.get("prefix") or prefix
    ident = (
        driver,
        settings.get("url"),
        prefix,
        secret and hashlib.sha256(secret).digest(),
        cachedir,
        redeliver,
    )
    if ident not in _OPENED:
        if driver == "local":
            _OPENED[ident] = LocalStore(cachedir, redeliver)
        elif driver == "redis":
            if not isinstance(settings.get("url"), str):
                raise StoreError("hana_storage:store:url is needed for the redis driver")
            _OPENED[ident] = RedisStore(settings["url"], prefix, secret, redeliver=redeliver)
        else:
            raise StoreError(f"hana_storage:store:driver {driver!r} is not one of local, redis")
    return _OPENED[ident]
