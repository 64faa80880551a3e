"""Bounds on what one minion can cost the master's triage: a token bucket per sender, and at most
one report (a log line, a ``hana/storage/rejected`` event) per sender and interval, counting what
it held back. Pure bookkeeping under a lock; the triage runner keeps one of each per process.
The sizes below bound what the master keeps of a minion's findings (triage's records, the
exporter's open findings).

Any minion can put any tag on the master's bus, so the key is the minion a tag claims when that
minion has an accepted key, and one shared key (``UNKNOWN``) for every other claim: made-up ids
share one bucket and one report, and the number of keys stays that of the accepted minions.
"""

import collections
import hashlib
import threading
import time

UNKNOWN = "*"  # the key of every claim naming no accepted minion (never an accepted id: "*" is refused)
MAX_KEYS = 100_000  # keys remembered; the least recently used goes first (its bucket starts full again)
# A finding's key as the beacon makes it (core.events.finding_key) is ``rule|volume|device``: a
# rule (13 characters), a pillar volume (at most 16) and a device path (/dev/mapper/ and a
# device-mapper name of at most 127): under 200 characters. A longer one is kept as its hash.
MAX_FINDING_KEY = 256
# Occurrences a triage record (one per minion and rule) remembers as handled, the newest kept.
# A record holds one per finding of its rule (a volume and a device): 512 is 8 volumes with the
# pillar's most devices (64) each. Each key is at most MAX_FINDING_KEY long, so a record that
# every event of its minion and rule reads and writes stays under 150 KB. One pruned is an old occurrence: if an
# audit event lists it again, it is acted on again (a repeat, never a silenced finding).
MAX_HANDLED = 512
# Open findings the exporter keeps per minion: as many as triage takes from one audit event
# (max_audit_findings' default). A host has a few volumes and rules; more is a minion naming
# made-up keys, and each one kept would cost memory until the minion's next audit event.
MAX_OPEN_FINDINGS = 1000
# Outbox events the triage engine holds until it confirms them, ``settle`` (30) s after its bus
# carried them: only events the master signed (checked as they pass), each event_id once. 30 s of
# 300 outcome events a second (issue 17's rate; one master reaches 50-100, docs/benchmarks.md) is
# 9,000. One beyond it is not confirmed by the engine: it stays in the outbox and is sent again
# when due, a repeat consumers drop, never a loss.
MAX_UNCONFIRMED = 10_000
HASHED = "sha256:"  # what a hashed finding key starts with (one the beacon makes starts with its rule)


class Buckets:
    """A token bucket per key: ``burst`` events at once, then ``rate`` events per second."""

    def __init__(self, rate, burst, keys=MAX_KEYS):
        self.rate, self.burst, self.keys = float(rate), float(burst), int(keys)
        self._tokens = collections.OrderedDict()  # key -> (tokens, when)
        self._lock = threading.Lock()

    def allow(self, key, now=None):
        """Whether one more event of ``key`` may be handled now (it takes a token)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, then = self._tokens.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + max(0.0, now - then) * self.rate)
            allowed = tokens >= 1
            self._tokens[key] = (tokens - 1 if allowed else tokens, now)
            if len(self._tokens) > self.keys:
                self._tokens.popitem(last=False)
        return allowed


class Reports:
    """At most one report per key every ``interval`` seconds."""

    def __init__(self, interval, keys=MAX_KEYS):
        self.interval, self.keys = float(interval), int(keys)
        self._last = collections.OrderedDict()  # key -> (when reported, held back since)
        self._lock = threading.Lock()

    def due(self, key, now=None):
        """None when ``key`` was reported less than ``interval`` seconds ago (this one is held back
        and counted); else the number held back since its last report (0 the first time)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            when, held = self._last.pop(key, (None, 0))
            if when is not None and now - when < self.interval:
                self._last[key] = (when, held + 1)
                return None
            self._last[key] = (now, 0)
            if len(self._last) > self.keys:
                self._last.popitem(last=False)
        return held


class Waiting:
    """At most ``most`` distinct keys waiting at once (events waiting to be confirmed); those
    refused because it was full are counted (``refused``)."""

    def __init__(self, most):
        self.most, self.refused = int(most), 0
        self._keys = set()
        self._lock = threading.Lock()

    def __len__(self):
        return len(self._keys)

    def enter(self, key):
        """Whether ``key`` waits now: "entered", "waiting" (it waited already) or "full" (it
        does not; counted in ``refused``)."""
        with self._lock:
            if key in self._keys:
                return "waiting"
            if len(self._keys) >= self.most:
                self.refused += 1
                return "full"
            self._keys.add(key)
            return "entered"

    def leave(self, key):
        with self._lock:
            self._keys.discard(key)


def waiting(most):
    """A Waiting (the loader hands out functions, not classes)."""
    return Waiting(most)


def finding_key(key):
    """``key`` (a finding's key, from an event) as triage records it: as it is, or, when longer
    than MAX_FINDING_KEY, ``sha256:`` and its SHA-256 in hex: the same finding keeps one key,
    and whatever a minion names costs its record at most MAX_FINDING_KEY characters."""
    if len(key) <= MAX_FINDING_KEY:
        return key
    return HASHED + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def buckets(rate, burst):
    """A Buckets (the loader hands out functions, not classes)."""
    return Buckets(rate, burst)


def reports(interval):
    """A Reports (the loader hands out functions, not classes)."""
    return Reports(interval)


def unknown():
    return UNKNOWN
