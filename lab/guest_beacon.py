"""Run inside the lab guest: the formula's beacon, loaded through Salt's loader as the minion does
(with the lab's masterless minion config). Prints one JSON line.

``python3 guest_beacon.py once``
    A full audit: the events of the tick that starts it and of the tick after it ended, or the
    exception a tick raised. (The lab's Salt server answers the same from its loaded minion:
    ``Lab.beacon_once``.)
``python3 guest_beacon.py bench``
    CPU cost of an idle tick against a full audit. A full audit is forced by clearing the
    beacon's last-audit time, and counted from the tick that starts it to the tick that collects
    it; an idle tick is a call with no uevent, no mount change and no full audit due or running.
    CPU time counts this process (every thread) and, for the full audit, the subprocesses it
    waits for (dmsetup, lvs); an idle tick must run none.
"""

import json
import os
import resource
import sys
import time
import traceback

import salt.config
import salt.loader
import salt.minion

CONFIG = [{"interval": 1}, {"full_audit_interval": 3600}, {"uevents": True}]
FULL_SAMPLES, IDLE_SAMPLES, TICKS = 5, 7, 2000


def cpu():
    own = time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own, children.ru_utime + children.ru_stime


def load(minion=None):
    """The beacon and its __context__, fresh; from ``minion`` (a loaded SMinion) or a new one."""
    if minion is None:
        opts = salt.config.minion_config("/run/salt/etc/minion")
        opts["log_level"] = "warning"
        minion = salt.minion.SMinion(opts)
    beacons = salt.loader.beacons(minion.opts, minion.functions)
    return beacons["hana_storage.beacon"], beacons.pack["__context__"]


def full_audit(tick, context):
    """The events of a full audit: it runs in a thread of the beacon's, collected by a tick."""
    events = tick(CONFIG)
    running = context["hana_storage.beacon"]["full"]
    if running is not None:
        running.thread.join()
        events += tick(CONFIG)
    return events


def once(minion=None):
    """{"events": [...]} of one full audit, or {"raised": the traceback of the tick}."""
    tick, context = load(minion)
    try:
        return {"events": full_audit(tick, context)}
    except Exception:  # noqa: BLE001 - the caller wants to see it, not die of it
        return {"raised": traceback.format_exc()}


def bench():
    tick, context = load()
    full_audit(tick, context)  # first tick: opens the uevent socket, full audit, warm caches
    full = []
    for _ in range(FULL_SAMPLES):
        context["hana_storage.beacon"]["next_full"] = None
        own0, kids0 = cpu()
        full_audit(tick, context)
        own1, kids1 = cpu()
        full.append((own1 - own0) + (kids1 - kids0))
    idle, idle_children = [], 0.0
    for _ in range(IDLE_SAMPLES):
        own0, kids0 = cpu()
        for _ in range(TICKS):
            assert tick(CONFIG) == [], "an idle tick emitted events"
        own1, kids1 = cpu()
        idle.append((own1 - own0) / TICKS)
        idle_children += kids1 - kids0
    print(
        json.dumps(
            {
                "full_audit_cpu_s": full,
                "idle_tick_cpu_s": idle,
                "idle_children_cpu_s": idle_children,
                "ticks_per_sample": TICKS,
                "devices": len(os.listdir("/sys/class/block")),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "once":
        print(json.dumps(once(), default=repr))
    else:
        bench()
