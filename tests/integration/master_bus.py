"""The master's event bus and exporter as the integration tests use them (fixtures: conftest.py)."""

import time
import urllib.request

import salt.utils.event
from prometheus_client.parser import text_string_to_metric_families

from tests import beacon_events
from tests.support.master import triage_results


class Bus:
    """The master's event bus and exporter, as the tests use them."""

    def __init__(self, factory, metrics_url):
        self.factory, self.metrics_url = factory, metrics_url
        self.id = factory.id

    def fire(self, tag, data):
        """Put an event on the master's bus, as a minion's beacon event arrives there."""
        with salt.utils.event.get_master_event(
            self.factory.config, self.factory.config["sock_dir"], listen=False
        ) as bus:
            assert bus.fire_event(data, tag)

    def fire_beacon(self, minion, event, data):
        """A beacon event of ``minion`` (a minion daemon factory), signed with its own key."""
        self.fire(
            f"salt/beacon/{minion.id}/hana_storage/{event}",
            beacon_events.sign(minion.key_path, minion.id, event, data),
        )

    def events(self, event_listener, tag, after):
        return sorted(event_listener.get_events([(self.id, tag)], after_time=after), key=lambda e: e.stamp)

    def triage_returns(self, event_listener, after, minion):
        """What triage returned for ``minion``'s events since ``after``, oldest first."""
        return [r for r in triage_results(event_listener, self.id, after) if r.get("minion") == minion]

    def metrics(self):
        """{(name, frozenset(labels)): value} of the exporter's /metrics now."""
        text = urllib.request.urlopen(self.metrics_url, timeout=30).read().decode()
        return {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def metric(self, name, **labels):
        return self.metrics().get((name, frozenset(labels.items())), 0)


PROBE_MINION = "hana-reactor-probe"


def wait_for_reactor(factory, event_listener, timeout=120):
    """Wait until the master's reactor reacts: Salt reports the master started before the reactor
    subscribes to the bus, and an event fired in between starts no reaction (a test that fires
    one at once then waits in vain on a busy machine). The probe is a violation of a minion with
    no key: triage rejects it (its return names ``PROBE_MINION``, so tests can tell it apart)."""
    deadline = time.monotonic() + timeout
    with salt.utils.event.get_master_event(factory.config, factory.config["sock_dir"], listen=False) as bus:
        while True:
            fired = time.time()
            assert bus.fire_event({"probe": True}, f"salt/beacon/{PROBE_MINION}/hana_storage/violation")
            time.sleep(5)
            if any(
                r.get("minion") == PROBE_MINION for r in triage_results(event_listener, factory.id, fired)
            ):
                break
            assert time.monotonic() < deadline, f"the reactor of {factory.id} never reacted"
    time.sleep(5)  # an earlier probe still being triaged on a slow machine: let it finish first


def wait_until(check, timeout=120, what="the condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
