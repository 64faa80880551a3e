"""
Prometheus exporter for HANA storage compliance, on the master's event bus.

Listens to the hana_storage beacon's events (``salt/beacon/<minion>/hana_storage/...``) and the
triage runner's (``hana/storage/...``) and serves, on ``http://<bind>:<port>/metrics``:

=============================================== ==================================================
``hana_storage_compliant{minion,volume}``       1 when the volume passes every rule, else 0
``hana_storage_findings{minion,rule,severity}`` findings open now
``hana_storage_violations_total{...}``          findings that appeared (minion, rule, severity)
``hana_storage_resolved_total{minion,rule}``    findings that cleared
``hana_storage_remediations_total{...}``        remediations run (minion, rule, result)
``hana_storage_alerts_total{minion,rule}``      alerts raised (manual rules, auto ones not fixed)
``hana_storage_rejected_events_total{reason}``  events whose sender could not be verified
``hana_storage_findings_held_back_total{...}``  open findings not kept (minion): it had
                                                ``MAX_OPEN_FINDINGS`` open already
``hana_storage_last_audit_timestamp_seconds``   when the minion's last full audit ran
``hana_storage_events_total{event}``            events processed, per kind
``hana_storage_boot_ready{minion}``             1 when the minion would unlock its storage at its
                                                next boot, 0 when not (the runner's
                                                ``readiness``, and each evidence report)
``hana_storage_boot_readiness_timestamp_seconds`` when that was checked (minion)
``hana_storage_triage_actions_total{...}``      actions triage completed (action, rule), read
                                                from triage's store when scraped: with hot
                                                masters sharing a store, every master serves
                                                the fleet's numbers, its own and the others'
=============================================== ==================================================

Beacon events count only when the minion's signature verifies (the runner's ``verify``), so a
minion cannot make another one look compliant. The triage runner's events (``hana/storage/*``)
count only when the master's signature verifies (the runner's ``verify_master``, with
``<pki_dir>/master.pub``): Salt lets any minion fire a tag with that prefix (``event.send`` with
a ``preload``), and a forged remediation failure or alert must not reach a metric. What fails
is counted as ``hana_storage_rejected_events_total{reason="forged_master_event"}`` instead, and
logged with the id Salt recorded for its sender. ``verify_signatures: false`` turns off both
checks (a test bus only). An alert or remediation event seen again with the same ``event_id``
(triage sent it again) is counted once.

Every label value is the master's, never the event's, so a minion cannot make series without
bound: a rule and its severity come from the master's rule table (a rule it does not know is
counted as ``rule="unknown", severity="unknown"``), an event name from ``EVENTS`` (else
``other``), a remediation's result from ``RESULTS``, and a minion has at most ``MAX_VOLUMES``
volumes (the first by name). What it keeps of a minion is bounded as well: at most
``core.limits.MAX_OPEN_FINDINGS`` open findings (more are counted as held back, and logged at most
once per minion every ``REPORT_INTERVAL`` seconds, with the number held back since), each under a
key of at most ``core.limits.MAX_FINDING_KEY`` characters. Series of what is gone are dropped, as
a stale 0 or 1 would keep an alert firing: a volume no longer in a minion's audit event loses ``hana_storage_compliant``, and
a minion whose key is no longer accepted (``<pki_dir>/minions/<id>`` gone; looked at every
``PRUNE_EVERY`` seconds) loses all its series.

.. code-block:: yaml

    engines:
      - hana_storage_exporter:
          bind: 127.0.0.1     # loopback by default; put a reverse proxy in front to expose it
          port: 9723
          verify_signatures: true
"""

import collections
import logging
import os
import time

import hana_storage_core as core  # the loader puts its utils directories on sys.path while loading this
import salt.utils.event

core = core.fresh()  # after a saltutil.sync, the files it brought, not those this process imported first

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily

    HAS_PROMETHEUS = True
except ImportError:
    HAS_PROMETHEUS = False

log = logging.getLogger(__name__)

__virtualname__ = "hana_storage_exporter"

BEACON_PREFIX = "salt/beacon/"
RUNNER_PREFIX = "hana/storage/"
SEEN_OUTCOMES = 100_000  # event_ids remembered: far more than a lease's worth of outcomes
UNKNOWN = "unknown"  # the label of a rule (and its severity) the master's table does not have
EVENTS = (
    "violation",
    "resolved",
    "audit",
    "error",
    "alert",
    "remediation",
    "rejected",
    "triaged",
    "readiness",
)
RESULTS = ("fixed", "absent", "not-fixed", "failed")  # a remediation's results
MAX_VOLUMES = 32  # volumes exported per minion: a HANA host has a handful
PRUNE_EVERY = 60  # seconds between two looks for minions whose key is no longer accepted
REPORT_INTERVAL = 60  # seconds: at most one log line per minion about open findings held back
CLOCK_SKEW = 300  # seconds a readiness check may lie ahead of this master's clock (another master's)


def __virtual__():
    if not HAS_PROMETHEUS:
        return False, "hana_storage_exporter needs the prometheus_client Python package on the master"
    return __virtualname__


class Metrics:
    """The exporter's state: open findings per minion, and the Prometheus series they drive.
    ``accepted(minion)``: whether the minion's key is still accepted (``prune``)."""

    def __init__(self, registry, accepted=None):
        gauge, counter = prometheus_client.Gauge, prometheus_client.Counter
        self.registry, self.accepted = registry, accepted or (lambda _minion: True)
        self.table = {rule: entry["severity"] for rule, entry in core.rules.rule_table().items()}
        self.labelled = {}  # minion -> {(metric, label values)} exported for it
        self.compliant = gauge(
            "hana_storage_compliant",
            "1 when the volume passes every rule, 0 when not",
            ["minion", "volume"],
            registry=registry,
        )
        self.findings = gauge(
            "hana_storage_findings", "Findings open now", ["minion", "rule", "severity"], registry=registry
        )
        self.violations = counter(
            "hana_storage_violations",
            "Findings that appeared",
            ["minion", "rule", "severity"],
            registry=registry,
        )
        self.resolved = counter(
            "hana_storage_resolved", "Findings that cleared", ["minion", "rule"], registry=registry
        )
        self.remediations = counter(
            "hana_storage_remediations", "Remediations run", ["minion", "rule", "result"], registry=registry
        )
        self.alerts = counter(
            "hana_storage_alerts",
            "Alerts raised: manual findings, and auto ones not fixed",
            ["minion", "rule"],
            registry=registry,
        )
        self.rejected = counter(
            "hana_storage_rejected_events",
            "Events whose sender could not be verified",
            ["reason"],
            registry=registry,
        )
        self.last_audit = gauge(
            "hana_storage_last_audit_timestamp_seconds",
            "When the last full audit ran",
            ["minion"],
            registry=registry,
        )
        self.boot_ready = gauge(
            "hana_storage_boot_ready",
            "1 when the minion would unlock its storage at its next boot, 0 when not",
            ["minion"],
            registry=registry,
        )
        self.readiness_checked = gauge(
            "hana_storage_boot_readiness_timestamp_seconds",
            "When the minion's boot readiness was last checked",
            ["minion"],
            registry=registry,
        )
        self.in_place = gauge(
            "hana_storage_in_place_progress_ratio",
            "How far the encryption in place of a volume is (0-1), while it is under way",
            ["minion", "volume"],
            registry=registry,
        )
        self.events = counter("hana_storage_events", "Events processed", ["event"], registry=registry)
        self.held_back = counter(
            "hana_storage_findings_held_back",
            f"Open findings not kept: the minion had {core.limits.MAX_OPEN_FINDINGS} open already",
            ["minion"],
            registry=registry,
        )
        # the rule table itself, so a dashboard or an alert can show a rule's controls and severity
        rule_info = gauge(
            "hana_storage_rule_info",
            "Each audit rule (always 1): its severity, remediation and the controls it gives evidence for",
            ["rule", "severity", "remediation", "controls"],
            registry=registry,
        )
        for rule_id, rule in core.rules.RULES.items():
            rule_info.labels(rule_id, rule.severity, rule.remediation, ",".join(rule.controls)).set(1)
        self.reports = core.limits.reports(REPORT_INTERVAL)
        self.open = {}  # minion -> core.events.OpenFindings
        self.volumes = {}  # minion -> volumes exported (at most MAX_VOLUMES)
        self.series = {}  # minion -> (rule, severity) label pairs exported
        self.outcomes = collections.OrderedDict()  # the event_ids of the last SEEN_OUTCOMES outcomes
        self.checked = {}  # minion -> when its boot readiness counted now was checked

    def labels(self, metric, minion, *values):
        """``metric``'s child for ``minion`` and ``values``, remembered so ``forget`` can drop it."""
        self.labelled.setdefault(minion, set()).add((metric, (minion, *values)))
        return metric.labels(minion, *values)

    def rule(self, rule):
        """(rule, severity) as the master's table has them; (UNKNOWN, UNKNOWN) for another rule."""
        return (
            (rule, self.table[rule]) if isinstance(rule, str) and rule in self.table else (UNKNOWN, UNKNOWN)
        )

    def forget(self, minion, keep=lambda metric, values: False):
        """Drop ``minion``'s series (those ``keep`` does not keep) from the registry."""
        for metric, values in list(self.labelled.get(minion, ())):
            if not keep(metric, values):
                self.labelled[minion].discard((metric, values))
                metric.remove(*values)

    def prune(self):
        """Drop every series of the minions whose key is no longer accepted, and what is kept
        about them."""
        for minion in set(self.labelled) | set(self.open) | set(self.volumes):
            if not self.accepted(minion):
                self.forget(minion)
                for state in (self.labelled, self.open, self.volumes, self.series, self.checked):
                    state.pop(minion, None)

    def exported_volumes(self, minion, volumes):
        """The volumes exported for ``minion``: the ones it had, then the others by name, at most
        MAX_VOLUMES."""
        had = self.volumes.get(minion, set())
        names = sorted({v for v in volumes if isinstance(v, str)}, key=lambda v: (v not in had, v))
        return set(names[:MAX_VOLUMES])

    def first_time(self, event_id):
        """Whether an alert or remediation event is new: one that triage sent again (no bus had
        carried it when its master died, or it was not confirmed in time) keeps its event_id."""
        if event_id is None:
            return True
        if event_id in self.outcomes:
            return False
        self.outcomes[event_id] = None
        if len(self.outcomes) > SEEN_OUTCOMES:
            self.outcomes.popitem(last=False)
        return True

    def audit(self, minion, data):
        open_findings, dropped = core.events.OpenFindings(), 0
        for key in data.get("open") or {}:
            finding = core.events.parse_finding_key(key)  # ValueError: the event is not counted
            dropped += not open_findings.add(key, finding["volume"], *self.rule(finding["rule"]))
        volumes = self.exported_volumes(minion, data.get("volumes") or {})
        self.forget(  # the volumes the minion no longer has
            minion, keep=lambda metric, values: metric is not self.compliant or values[1] in volumes
        )
        self.volumes[minion] = volumes
        self._in_place(minion, data.get("volumes") or {}, volumes)
        self.open[minion] = open_findings
        self.labels(self.last_audit, minion).set(float(data.get("ts") or 0))
        self._held_back(minion, dropped)
        self._refresh(minion)

    def _in_place(self, minion, reported, volumes):
        """The progress of each volume the audit says is being encrypted in place; a volume no
        longer under way drops its series."""
        self.forget(minion, keep=lambda metric, values: metric is not self.in_place)
        for name in sorted(volumes):
            entry = reported.get(name)
            percent = core.events.in_place_percent(entry.get("in_place")) if isinstance(entry, dict) else None
            if percent is not None:
                self.labels(self.in_place, minion, name).set(percent / 100)

    def violation(self, minion, data):
        rule, severity = self.rule(data["rule"])
        found = self.open.setdefault(minion, core.events.OpenFindings())
        kept = found.add(data["key"], data["volume"], rule, severity)  # ValueError: not counted
        self.labels(self.violations, minion, rule, severity).inc()
        self._held_back(minion, not kept)
        self.volumes[minion] = self.exported_volumes(
            minion, self.volumes.get(minion, set()) | {data["volume"]}
        )
        self._refresh(minion)

    def clear(self, minion, data):
        self.labels(self.resolved, minion, self.rule(data["rule"])[0]).inc()
        if minion in self.open:
            self.open[minion].remove(data["key"])
        self._refresh(minion)

    def readiness(self, data):
        """A ``hana/storage/readiness`` event: {"minion", "ready": True or False, "checked": when,
        by the master's clock}. One checked before the last one counted (a report and the
        schedule overlapping, a replay within max_event_age) changes nothing."""
        minion, ready, checked = data["minion"], data["ready"], data["checked"]
        if (
            not isinstance(minion, str)
            or not (ready is True or ready is False)
            or isinstance(checked, bool)
            or not isinstance(checked, int | float)
            # a check "from the future" (or NaN) would hold the gauge
            or not (checked <= time.time() + CLOCK_SKEW)
        ):
            raise ValueError(
                "a readiness event names a minion, whether it is ready and when that was checked (not later than now)"
            )
        if checked < self.checked.get(minion, float("-inf")):
            return
        self.checked[minion] = checked
        self.labels(self.boot_ready, minion).set(1 if ready else 0)
        self.labels(self.readiness_checked, minion).set(float(checked))

    def _held_back(self, minion, dropped):
        """Count ``dropped`` open findings of ``minion`` not kept, and log it at most once per
        REPORT_INTERVAL with the number held back since the last line."""
        if not dropped:
            return
        self.labels(self.held_back, minion).inc(dropped)
        events = self.reports.due(minion)
        if events is not None:
            more = f", and those of {events} more events since the last report" if events else ""
            log.warning(
                "hana_storage_exporter: %s has %d open findings already: %d more not kept%s "
                "(hana_storage_findings_held_back_total counts them all)",
                minion,
                core.limits.MAX_OPEN_FINDINGS,
                dropped,
                more,
            )

    def _refresh(self, minion):
        """The minion's compliant and findings series from its open findings' counts: as many
        steps as exported volumes and rules, however many findings are open."""
        found = self.open.get(minion) or core.events.OpenFindings()
        for volume in self.volumes.get(minion, ()):
            self.labels(self.compliant, minion, volume).set(0 if found.failing(volume) else 1)
        counts = found.counts()
        for labels in self.series.get(minion, set()) | set(counts):
            self.labels(self.findings, minion, *labels).set(counts.get(labels, 0))
        self.series[minion] = self.series.get(minion, set()) | set(counts)


class StoreTallies:
    """``hana_storage_triage_actions_total{action,rule}`` out of ``read()`` (the triage runner's
    ``tallies``: {"<action>|<rule>": count}) at each scrape. The store reads only the fields
    triage makes (the store's ``known_tallies``), so whoever writes to Redis names no series."""

    def __init__(self, read):
        self.read = read

    def collect(self):
        family = CounterMetricFamily(
            "hana_storage_triage_actions",
            "Actions triage completed, from its store",
            labels=["action", "rule"],
        )
        try:
            tallies = self.read()
        except Exception as error:  # noqa: BLE001 - a scrape without these series, and why in the log
            log.warning("hana_storage_exporter: triage's store could not be read: %s", error)
            tallies = {}
        for name, count in sorted(tallies.items()):
            action, _, rule = name.partition("|")
            family.add_metric([action, rule], count)
        yield family


def handle(metrics, tag, data, verify=None, verify_master=None):
    """Update ``metrics`` from one event. ``verify(tag, data)`` (a beacon event) and
    ``verify_master(tag, data)`` (an event of the master's, ``hana/storage/*``) return None or
    ``{"code", "reason"}``: why it is not counted."""
    if tag.startswith(BEACON_PREFIX):
        minion, event = core.events.minion_of_tag(tag)
        if minion is None:
            return
        problem = verify(tag, data) if verify else None
        if problem:
            metrics.rejected.labels(problem["code"]).inc()
            return
        if event == "audit":
            metrics.audit(minion, data)
        elif event == "violation":
            metrics.violation(minion, data)
        elif event == "resolved":
            metrics.clear(minion, data)
        metrics.events.labels(_event_label(event)).inc()  # counted once handled: a malformed one raised above
    elif tag.startswith(RUNNER_PREFIX):
        problem = verify_master(tag, data) if verify_master else None
        if problem:
            metrics.rejected.labels(problem["code"]).inc()
            log.warning(
                "hana_storage_exporter: %s not counted, %s (sent by %s)",
                tag,
                problem["reason"],
                data.get("id") or "no minion id",
            )
            return
        event = tag[len(RUNNER_PREFIX) :]
        if event in ("remediation", "alert") and not metrics.first_time(data.get("event_id")):
            return
        if event == "remediation":
            result = data["result"] if data["result"] in RESULTS else UNKNOWN
            metrics.labels(metrics.remediations, data["minion"], metrics.rule(data["rule"])[0], result).inc()
        elif event == "alert":
            metrics.labels(metrics.alerts, data["minion"], metrics.rule(data["rule"])[0]).inc()
        elif event == "readiness":
            metrics.readiness(data)
        metrics.events.labels(_event_label(event)).inc()


def _event_label(event):
    return event if event in EVENTS else "other"


def _accepted(minion):
    """Whether the master still accepts ``minion``'s key."""
    return os.path.isfile(os.path.join(__opts__["pki_dir"], "minions", minion))


def start(bind="127.0.0.1", port=9723, verify_signatures=True):
    """
    Serve the metrics and follow the master's event bus until the master stops.
    """
    registry = prometheus_client.CollectorRegistry()
    metrics = Metrics(registry, accepted=_accepted)
    registry.register(StoreTallies(__runners__["hana_storage.tallies"]))
    prometheus_client.start_http_server(int(port), addr=bind, registry=registry)
    log.info("hana_storage_exporter: serving metrics on http://%s:%s/metrics", bind, port)
    verify = __runners__["hana_storage.verify"] if verify_signatures else None
    verify_master = __runners__["hana_storage.verify_master"] if verify_signatures else None
    pruned = time.monotonic()
    with salt.utils.event.get_master_event(__opts__, __opts__["sock_dir"], listen=True) as bus:
        while True:
            if time.monotonic() - pruned > PRUNE_EVERY:
                metrics.prune()
                pruned = time.monotonic()
            event = bus.get_event(full=True, wait=5)
            if not event or not isinstance(event.get("data"), dict):
                continue
            tag = event["tag"]
            if not (
                tag.startswith(RUNNER_PREFIX) or (tag.startswith(BEACON_PREFIX) and "/hana_storage/" in tag)
            ):
                continue
            try:
                handle(metrics, tag, event["data"], verify, verify_master)
            except (KeyError, TypeError, ValueError) as error:
                log.warning("hana_storage_exporter: malformed event %s: %s", tag, error)
