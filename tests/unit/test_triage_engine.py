"""The reactor's hand-off to the triage engine: reactor/triage.sls rendered by Salt's own py
renderer, and the engine's loop on a real datagram socket (its triage replaced by a recorder)."""

import importlib.util
import json
import os
import socket
import threading
import time

import pytest
import salt.utils.templates
from hana_storage_core import rules as rules

from tests.conftest import REPO

REACTOR = REPO / "salt" / "hana" / "storage" / "reactor" / "triage.sls"
TAG = "salt/beacon/db1/hana_storage/violation"
RUNNER_REACTION = "runner.hana_storage.triage"


def load_engine():
    spec = importlib.util.spec_from_file_location(
        "triage_engine_under_test", REPO / "_engines/hana_storage_triage.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def engine():
    return load_engine()


@pytest.fixture
def sock_dir(tmp_path):
    # AF_UNIX paths are short (108 bytes): pytest's tmp_path can be longer
    path = f"/tmp/hsf-{os.getpid()}-{time.monotonic_ns()}"
    os.mkdir(path, 0o700)
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def react(sock_dir, tag, data):
    """What Salt's py renderer makes of the reactor SLS for one event (as the reactor calls it)."""
    opts = {"sock_dir": sock_dir}
    rendered = salt.utils.templates.py(
        str(REACTOR), True, __salt__={}, salt={}, __grains__={}, grains={}, __opts__=opts, opts=opts,
        __pillar__={}, pillar={}, __env__="base", saltenv="base", __sls__="", sls="", tag=tag, data=data,
    )  # fmt: skip
    assert rendered["result"], rendered
    return rendered["data"]


def test_the_reactor_the_runner_and_the_engine_name_one_socket(engine):
    """The reactor hands off to it; the runner asks whether the engine runs (which confirms the
    outbox's events from its bus): three files, one socket."""
    namespace = {}
    exec(compile(REACTOR.read_text(), str(REACTOR), "exec"), namespace)  # noqa: S102 - our own file
    spec = importlib.util.spec_from_file_location("runner_socket_name", REPO / "_runners/hana_storage.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    assert namespace["ENGINE_SOCKET"] == runner.ENGINE_SOCKET == engine.SOCKET_NAME


def test_the_runner_the_engine_and_the_store_name_one_pair_of_outbox_tags(engine):
    """What the outbox holds, what the engine confirms and all that redeliver ever sends."""
    from hana_storage_core import store as store

    spec = importlib.util.spec_from_file_location("runner_outbox_tags", REPO / "_runners/hana_storage.py")
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    assert set(engine.OUTBOX_TAGS) == set(store.OUTBOX_TAGS) == {runner.ALERT_TAG, runner.REMEDIATION_TAG}


def test_without_the_engine_the_reactor_starts_the_runner_job(sock_dir):
    data = {"rule": "HANA-PERF-002", "sig": "x"}
    reaction = react(sock_dir, TAG, data)
    assert reaction == {"hana-storage-triage": {RUNNER_REACTION: [{"args": [{"tag": TAG}, {"data": data}]}]}}


def test_with_the_engine_the_event_is_handed_off_whole(sock_dir, engine):
    data = {"rule": "HANA-PERF-002", "sig": "x", "nested": {"a": [1, 2]}}
    with engine.bound(os.path.join(sock_dir, engine.SOCKET_NAME)) as sock:
        assert oct(os.stat(os.path.join(sock_dir, engine.SOCKET_NAME)).st_mode & 0o777) == "0o600"
        assert react(sock_dir, TAG, data) == {}
        sock.settimeout(5)
        assert engine.parse(sock.recv(engine.MAX_DATAGRAM)) == (TAG, data)
    assert not os.path.exists(os.path.join(sock_dir, engine.SOCKET_NAME)), "the socket is removed on exit"


def test_events_that_are_not_for_triage_start_nothing(sock_dir):
    assert react(sock_dir, "salt/beacon/db1/hana_storage/resolved", {"rule": "HANA-PERF-002"}) == {}
    assert react(sock_dir, "salt/beacon/db1/hana_storage/audit", {"compliant": True}) == {}
    audit = {"since": {"HANA-PERF-002|data|/dev/x": 1.0}}
    assert (
        RUNNER_REACTION in react(sock_dir, "salt/beacon/db1/hana_storage/audit", audit)["hana-storage-triage"]
    )


def test_a_full_socket_falls_back_to_the_runner_job(sock_dir, engine):
    """Nobody reading: once the kernel's queue is full, the reactor must not block but start jobs."""
    with engine.bound(os.path.join(sock_dir, engine.SOCKET_NAME)):
        reactions = [react(sock_dir, TAG, {"n": n, "pad": "x" * 4096}) for n in range(3000)]
    handed, started = [r for r in reactions if not r], [r for r in reactions if r]
    assert handed and started, (len(handed), len(started))
    assert all(RUNNER_REACTION in r["hana-storage-triage"] for r in started)


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xff\xfe", b"[]", b'{"tag": 1, "data": {}}', b'{"tag": "t"}', b'{"tag": "t", "data": [1]}'],
)
def test_a_malformed_hand_off_is_a_clear_error(engine, payload):
    with pytest.raises(engine.MalformedEvent):
        engine.parse(payload)


def running(engine, sock_dir, triage):
    """The engine's loop in a thread with ``triage`` as its runner; the socket's path once bound."""
    engine.__opts__ = {"sock_dir": sock_dir}
    engine.__runners__ = {
        "hana_storage.triage": triage,
        "hana_storage.delivered": lambda tag, data: True,
        "hana_storage.redeliver": lambda: 0,
        "hana_storage.verify_master": lambda tag, data: None,
    }
    engine.follow_bus = lambda later, delivered, settle, verify: (
        threading.Event().wait()
    )  # no master's bus here
    kwargs = {"workers": 2, "remediation_workers": 2, "backlog": 4}
    threading.Thread(target=engine.start, kwargs=kwargs, daemon=True).start()
    path = os.path.join(sock_dir, engine.SOCKET_NAME)
    eventually(lambda: os.path.exists(path), "the engine never bound its socket")
    return path


def eventually(check, what, timeout=10):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def hand_off(path, *events):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        for event in events:
            sender.sendto(event if isinstance(event, bytes) else json.dumps(event).encode(), path)


def test_the_engine_triages_each_hand_off_and_drops_malformed_ones(sock_dir, engine, caplog):
    seen = []

    def triage(tag, data):
        if data.get("boom"):
            raise RuntimeError("one event's failure")
        seen.append((tag, data))

    path = running(engine, sock_dir, triage)
    hand_off(path, b"not json", {"tag": TAG, "data": {"boom": True}})
    hand_off(
        path,
        *(
            {"tag": TAG, "data": {"n": n, "rule": r}}
            for n, r in enumerate(("HANA-PERF-002", "HANA-ENC-001", None))
        ),
    )
    eventually(lambda: len(seen) == 3, f"three triaged: {seen}")
    assert sorted(d["n"] for _t, d in seen) == [0, 1, 2]
    eventually(lambda: "dropped a malformed hand-off" in caplog.text, "the malformed hand-off logged")
    eventually(lambda: f"triage of {TAG} failed" in caplog.text, "the failed triage logged")


def test_an_occurrence_another_master_holds_is_triaged_again_when_its_lease_runs_out(sock_dir, engine):
    """Hot masters: the other master holds the occurrence (it may have died holding it). The
    engine triages the event again once the lease has run out, and stops when it is handled."""
    calls = []
    answers = iter(
        [
            {"action": "held", "retry_in": 0.3},
            {
                "action": "reconciled",
                "findings": [{"action": "duplicate"}, {"action": "held", "retry_in": 0.2}],
            },
            {"action": "alerted"},
        ]
    )

    def triage(tag, data):
        calls.append(time.monotonic())
        return next(answers)

    path = running(engine, sock_dir, triage)
    hand_off(path, {"tag": TAG, "data": {"rule": "HANA-ENC-001"}})
    eventually(lambda: len(calls) == 3, f"triaged three times: {calls}")
    time.sleep(1)
    assert len(calls) == 3, "handled: not triaged again"
    assert (
        calls[1] - calls[0] >= 0.3 + engine.RETRY_MARGIN and calls[2] - calls[1] >= 0.2 + engine.RETRY_MARGIN
    )
    assert engine.held_for({"action": "held", "retry_in": "soon"}) is None
    assert engine.held_for(None) is None


def test_events_that_may_remediate_go_to_their_own_pool(engine):
    """A remediation call holds its thread for seconds: alerts must not queue behind it."""
    auto = set(rules.auto_rules())
    assert engine.may_remediate(TAG, {"rule": "HANA-PERF-002"}, auto)
    assert not engine.may_remediate(TAG, {"rule": "HANA-ENC-001"}, auto)
    assert not engine.may_remediate(TAG, {"rule": ["HANA-PERF-002"]}, auto)
    audit = "salt/beacon/db1/hana_storage/audit"
    assert engine.may_remediate(audit, {"since": {"HANA-PERF-002|data|/dev/x": 1.0}}, auto)
    assert not engine.may_remediate(audit, {"since": {"HANA-ENC-001|data|/dev/x": 1.0}}, auto)
    assert not engine.may_remediate(audit, {"since": ["HANA-PERF-002|data|/dev/x"]}, auto)


def test_the_outbox_events_the_bus_carries_are_confirmed_once_settled(engine):
    """What leaves triage's outbox: an alert or remediation event the master's bus carried,
    SETTLE seconds later (a subscriber that reads slowly gets it later), and nothing else."""
    confirmed, later = [], engine.Later()
    bus = [
        {"tag": "hana/storage/alert", "data": {"event_id": "a1"}},
        {"tag": "hana/storage/triaged", "data": {"event_id": "t1"}},
        {"tag": "hana/storage/remediation", "data": {"event_id": "r1"}},
        None,
        "garbage",
        {"tag": "hana/storage/alert", "data": {"boom": True}},
    ]

    def delivered(tag, data):
        if data.get("boom"):
            raise RuntimeError("the store went away")
        confirmed.append((time.monotonic(), tag, data["event_id"]))

    passed = time.monotonic()
    engine.confirm_each(bus, later, delivered, 0.3)
    eventually(lambda: len(confirmed) == 2, f"two confirmed: {confirmed}")
    assert [(tag, event_id) for _at, tag, event_id in confirmed] == [
        ("hana/storage/alert", "a1"),
        ("hana/storage/remediation", "r1"),
    ]
    assert all(at - passed >= 0.3 for at, _tag, _id in confirmed)


def test_only_the_masters_outbox_events_wait_and_only_so_many(engine, caplog):
    """Any minion can fire hana/storage/alert: an event waits to be confirmed only once the
    master's signature verifies (``verify``), each event_id once, at most ``waiting`` at a time;
    what is not held is logged once per cause and interval, and stays in the outbox."""
    from hana_storage_core import limits

    confirmed, later, waiting = [], engine.Later(), limits.waiting(3)

    def verify(tag, data):
        return None if data.get("sig") == "good" else {"code": "forged_master_event", "reason": "forged"}

    def alert(n, sig="good"):
        return {"tag": "hana/storage/alert", "data": {"event_id": f"{n:032x}", "sig": sig, "pad": "x" * 1000}}

    bus = [alert(n, "bad") for n in range(5000)] + [
        alert(1),
        alert(1),
        alert(2),
        alert(3),
        alert(4),
        alert(5),
    ]
    engine.confirm_each(
        bus, later, lambda tag, data: confirmed.append(data["event_id"]), 0.3, verify, waiting
    )
    with later._wake:
        held = sum(len(batch.events) for _when, _order, _function, (_d, _w, batch) in later._due)
    assert held == 3 and len(waiting) == 3 and waiting.refused == 2
    assert caplog.text.count("not confirmed: forged") == 1 and caplog.text.count("wait to be confirmed") == 1
    eventually(lambda: len(confirmed) == 3, f"three confirmed: {confirmed}")
    assert sorted(confirmed) == [f"{n:032x}" for n in (1, 2, 3)]
    eventually(lambda: len(waiting) == 0, "the confirmed ones no longer wait")
    engine.confirm_each(
        [alert(4)], later, lambda tag, data: confirmed.append(data["event_id"]), 0.3, verify, waiting
    )
    eventually(lambda: len(confirmed) == 4, "room again once confirmed")


def test_an_event_is_confirmed_before_it_is_due_again(engine):
    """Confirmation waits ``settle`` seconds; an event is sent again ``lease`` seconds after it
    was decided: a lease of 5 s (the integration tier's) settles in 2.5 s."""
    assert engine.settle_within(30, 60) == 30.0
    assert engine.settle_within(30, 5) == 2.5
    assert engine.settle_within(30, None) == 30.0
