"""Bounds on what one minion can cost the master's triage: a token bucket per sender, and at most
one report (a log line, a ``hana/storage/rejected`` event) per sender and interval, counting what
it held back. Pure bookkeeping under a lock; the triage runner keeps one of each per process.

Any minion can put any tag on the master's bus, so the key is the minion a tag claims when that
minion has an accepted key, and one shared key (``UNKNOWN``) for every other claim: made-up ids
share one bucket and one report, and the number of keys stays that of the accepted minions.
"""

import collections
import threading
import time

UNKNOWN = "*"  # the key of every claim naming no accepted minion (never an accepted id: "*" is refused)
MAX_KEYS = 100_000  # keys remembered; the least recently used goes first (its bucket starts full again)


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


def buckets(rate, burst):
    """A Buckets (the loader hands out functions, not classes)."""
    return Buckets(rate, burst)


def reports(interval):
    """A Reports (the loader hands out functions, not classes)."""
    return Reports(interval)


def unknown():
    return UNKNOWN
