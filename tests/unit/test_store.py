"""The triage store: the record's changes (pure), and both drivers - local files and a real
redis-server - deciding one claim among concurrent masters."""

import hashlib
import json
import threading
import time

import pytest
from hana_storage_core import store as store

from tests.support.redis_store import STORE_ACL, as_user, redis_server

KEY, SINCE = "HANA-ENC-001|data|/dev/vdb", 1000.0
OTHER = "HANA-ENC-001|log|/dev/vdc"  # the same rule on another volume
SECRET = store.mac_key(b"a master key")  # what the masters of one cluster share


# ---- the record (pure) ---------------------------------------------------------------------------


def test_one_claim_acts_and_the_occurrence_is_handled_once():
    record = store.empty()
    assert store.claim(record, 10.0, KEY, SINCE, 300, "a", 60) == {"verdict": "act", "took_over": False}
    assert store.claim(record, 11.0, KEY, SINCE, 300, "b", 60) == {"verdict": "held", "retry_in": 59.0}
    assert store.complete(record, KEY, SINCE, "a") is True
    assert record["held"] == {} and record["handled"] == {KEY: SINCE}
    assert store.claim(record, 12.0, KEY, SINCE, 300, "b", 60) == {"verdict": "duplicate"}
    # the same finding again, a new occurrence: the rule's cooldown holds it back
    assert store.claim(record, 13.0, KEY, SINCE + 5, 300, "b", 60) == {"verdict": "cooldown"}
    assert store.claim(record, 311.0, KEY, SINCE + 5, 300, "b", 60)["verdict"] == "act"


def test_a_record_remembers_a_bounded_number_of_handled_occurrences_the_newest(monkeypatch):
    """A minion names its findings' keys: however many it names, its record keeps the newest
    MAX_HANDLED (by when they were first reported) and the one just handled."""
    monkeypatch.setattr(store.limits, "MAX_HANDLED", 4)
    record = store.empty()
    for n in range(10):
        store.complete(record, f"HANA-ENC-001|data|/dev/vd{n}", 1000.0 + n, "a")
    assert sorted(record["handled"].values()) == [1006.0, 1007.0, 1008.0, 1009.0]
    store.complete(record, KEY, 1.0, "a")  # an old occurrence handled now: kept
    assert record["handled"][KEY] == 1.0 and len(record["handled"]) == 4
    record["handled"]["HANA-ENC-001|data|/dev/odd"] = "not a time"
    store.complete(record, OTHER, 2000.0, "a")
    assert "HANA-ENC-001|data|/dev/odd" not in record["handled"] and len(record["handled"]) == 4


def test_a_lease_that_ran_out_is_taken_over_cooldown_or_not():
    """The holder died: its cooldown was started by this very occurrence, so it does not defer
    the takeover; the dead holder's late completion is the second one, and says so."""
    record = store.empty()
    store.claim(record, 10.0, KEY, SINCE, 300, "a", 60)
    assert store.renew(record, 40.0, KEY, "b", 60) is False  # only the holder renews
    assert store.renew(record, 40.0, KEY, "a", 60) is True
    assert store.claim(record, 99.0, KEY, SINCE, 300, "b", 60)["verdict"] == "held"
    assert store.claim(record, 100.5, KEY, SINCE, 300, "b", 60) == {"verdict": "act", "took_over": True}
    assert store.release(record, KEY, "a", keep_cooldown=False) is False  # not a's any more
    assert store.complete(record, KEY, SINCE, "b") is True
    assert store.complete(record, KEY, SINCE, "a") is False


def test_a_release_lets_the_next_event_act():
    record = store.empty()
    store.claim(record, 10.0, KEY, SINCE, 300, "a", 60)
    assert store.release(record, KEY, "a", keep_cooldown=True) is True
    assert store.claim(record, 11.0, KEY, SINCE, 300, "b", 60) == {"verdict": "cooldown"}
    store.claim(record, 311.0, KEY, SINCE, 300, "b", 60)
    store.release(record, KEY, "b", keep_cooldown=False)  # the alert never left: no cooldown either
    assert store.claim(record, 312.0, KEY, SINCE, 300, "a", 60)["verdict"] == "act"


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[1, 2]", "true", '{"at": "x", "handled": [], "held": {"k": {"until": "x"}}}'],
)
def test_an_unreadable_record_never_blocks_an_action(text):
    record = store.load(text)
    assert record == store.empty()
    assert store.claim(record, 10.0, KEY, SINCE, 300, "a", 60)["verdict"] == "act"


def test_an_older_record_loads_without_its_rules_cooldown():
    """A record from before the cooldown per finding held one time per minion and rule (``at``, or
    the record was that number): it says not which finding it cooled, so it cools none."""
    assert store.load("1234.5") == store.empty()
    old = store.load(json.dumps({"at": 5.0, "handled": {KEY: SINCE}}))
    assert old == {**store.empty(), "handled": {KEY: SINCE}}
    assert store.claim(old, 6.0, KEY, SINCE, 300, "a", 60) == {"verdict": "duplicate"}
    assert store.claim(old, 6.0, OTHER, SINCE, 300, "a", 60)["verdict"] == "act"


def test_the_cooldown_is_per_finding():
    """Regression (issue 29, item 7): a remediation of a rule on one volume held back the same
    rule on another volume (``cooldown``: not recorded). Each finding cools down on its own."""
    record = store.empty()
    assert store.claim(record, 10.0, KEY, SINCE, 300, "a", 60)["verdict"] == "act"
    assert store.complete(record, KEY, SINCE, "a")
    assert store.claim(record, 15.0, OTHER, SINCE + 5, 300, "a", 60)["verdict"] == "act"
    assert store.claim(record, 16.0, KEY, SINCE + 6, 300, "a", 60) == {"verdict": "cooldown"}
    assert store.claim(record, 311.0, KEY, SINCE + 6, 300, "a", 60)["verdict"] == "act"


def test_without_a_cooldown_every_occurrence_acts_once():
    """A manual rule's claim (cooldown 0): each new occurrence is alerted, a repeat is a duplicate."""
    record = store.empty()
    for n in range(3):
        assert store.claim(record, 10.0 + n, KEY, SINCE + n, 0, "a", 60)["verdict"] == "act"
        assert store.complete(record, KEY, SINCE + n, "a")
        assert store.claim(record, 10.5 + n, KEY, SINCE + n, 0, "a", 60) == {"verdict": "duplicate"}
    assert record["cooldown"] == {}


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ("redis://x", "must be a mapping"),
        ({"driver": "etcd"}, "not one of local, redis"),
        ({"driver": "redis"}, "url is needed"),
        ({"driver": "redis", "url": "http://127.0.0.1"}, "not a Redis URL"),
    ],
)
def test_store_settings_it_cannot_use_are_a_clear_error(settings, says, tmp_path):
    with pytest.raises(store.StoreError, match=says):
        store.open_store(settings, str(tmp_path), cluster=(SECRET, "hana_storage:test:"))


# ---- the drivers ---------------------------------------------------------------------------------


@pytest.fixture(params=["local", "redis"])
def two_masters(request, tmp_path, redis_url):
    """Two stores over the same records, as two masters open them (own connections, own locks)."""
    if request.param == "local":
        return store.LocalStore(str(tmp_path)), store.LocalStore(str(tmp_path))
    prefix = f"test-{time.monotonic_ns()}:"
    return store.RedisStore(redis_url, prefix, SECRET), store.RedisStore(redis_url, prefix, SECRET)


def test_concurrent_masters_make_exactly_one_claim(two_masters):
    """16 threads on two masters claim the same occurrence at once: one acts, and completing it
    is tallied once, the same tally on either master."""
    verdicts, start = [], threading.Barrier(16)

    def contend(n):
        mine = two_masters[n % 2]
        start.wait()
        verdict = mine.update(
            "db1", "HANA-ENC-001", lambda r, now: store.claim(r, now, KEY, SINCE, 300, n, 60)
        )
        verdicts.append((n, verdict["verdict"]))

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [n for n, verdict in verdicts if verdict == "act"]
    assert len(winners) == 1 and sorted(v for _, v in verdicts).count("held") == 15, verdicts
    first = two_masters[0].update(
        "db1",
        "HANA-ENC-001",
        lambda r, _now: store.complete(r, KEY, SINCE, winners[0]),
        tally=lambda first: "alerted|HANA-ENC-001" if first else None,
    )
    assert first is True
    assert two_masters[0].tallies() == two_masters[1].tallies() == {"alerted|HANA-ENC-001": 1}


def test_redis_leases_run_on_the_servers_clock(redis_url, monkeypatch):
    """A master whose clock is an hour ahead still gives a lease of ``lease`` seconds."""
    shared = store.RedisStore(redis_url, f"clock-{time.monotonic_ns()}:", SECRET)
    server_now = shared.client.time()[0]
    monkeypatch.setattr(time, "time", lambda: server_now + 3600)
    shared.update("db1", "HANA-ENC-001", lambda r, now: store.claim(r, now, KEY, SINCE, 300, "a", 60))
    sealed = shared.client.get(f"{shared.prefix}action:db1@HANA-ENC-001")
    (lease,) = store.load(store.unseal(SECRET, "action:db1@HANA-ENC-001", sealed))["held"].values()
    assert server_now + 55 < lease["until"] < server_now + 65


def test_an_unreachable_redis_is_a_store_error():
    unreachable = store.RedisStore("redis://127.0.0.1:1/0", "hana_storage:", SECRET, timeout=1)
    with pytest.raises(store.StoreError, match="redis store"):
        unreachable.update(
            "db1", "HANA-ENC-001", lambda r, now: store.claim(r, now, KEY, SINCE, 300, "a", 60)
        )


# ---- the runner's lease renewal, loaded by Salt's loader ----------------------------------------


def test_a_remediation_renews_its_lease_through_salts_loader(tmp_path, caplog):
    """Regression: the renewer thread ran outside the loader's context, where Salt's dunders
    (kept in contextvars) are None: every renewal failed ("'NoneType' object is not
    subscriptable", in the VM tier's master log), so a remediation that outlasted its lease was
    taken over and made twice. The tests that load the runner with plain dunders never saw it."""
    import os

    import salt.config
    import salt.loader

    from tests.conftest import REPO

    lease = 0.6
    opts = salt.config.master_config(os.devnull)
    opts.update(
        runner_dirs=[str(REPO / "_runners")],
        utils_dirs=[str(REPO / "_utils")],
        cachedir=str(tmp_path),
        hana_storage={"lease": lease, "cooldown": 300},
    )
    runners = salt.loader.runner(opts, utils=salt.loader.utils(opts))
    runner = runners["hana_storage.triage"].func.__globals__  # the module as the loader loaded it

    def remediation_outlasting_its_lease():
        assert runner["_claim"]("db1", "HANA-PERF-002", KEY, SINCE)["verdict"] == "act"
        with runner["_renewing"]("db1", [("HANA-PERF-002", KEY)]):
            time.sleep(lease * 2.5)
        return runner["_store"]().update(
            "db1",
            "HANA-PERF-002",
            lambda record, now: store.claim(record, now, KEY, SINCE, 300, "other", lease),
        )

    assert runners.run(remediation_outlasting_its_lease)["verdict"] == "held"
    assert "renewing the lease" not in caplog.text


def test_the_engines_redeliver_opens_the_redis_store_through_salts_loader(tmp_path, redis_url, keys):
    """Regression: the store's key and prefix were made in a callback that the store's open_store
    (a utils function) called, where the runner's __utils__ is not: every redeliver of the
    triage engine failed with the redis store ("KeyError: '__utils__'", in the hot masters' logs)."""
    import os

    import salt.config
    import salt.loader

    from tests.conftest import REPO

    pki = tmp_path / "pki"
    pki.mkdir()
    (pki / "master.pem").write_text(keys[0])
    (pki / "master.pub").write_text(keys[1])
    opts = salt.config.master_config(os.devnull)
    opts.update(
        runner_dirs=[str(REPO / "_runners")],
        utils_dirs=[str(REPO / "_utils")],
        cachedir=str(tmp_path),
        pki_dir=str(pki),
        hana_storage={"store": {"driver": "redis", "url": redis_url}},
    )
    runners = salt.loader.runner(opts, utils=salt.loader.utils(opts))
    assert runners["hana_storage.redeliver"]() == 0
    assert runners["hana_storage.tallies"]() == {}


@pytest.fixture(scope="module")
def keys():
    from tests.support.keys import keypair

    return keypair()


# ---- the local store's tallies -----------------------------------------------------------------


def alerted(local, minion, rule="HANA-ENC-001"):
    """One completed action on (minion, rule), tallied as triage tallies it."""
    key = f"{rule}|data|/dev/vdb"
    local.update(minion, rule, lambda r, now: store.claim(r, now, key, SINCE, 0, "me", 60))
    local.update(
        minion,
        rule,
        lambda r, _now: store.complete(r, key, SINCE, "me"),
        tally=lambda first: f"alerted|{rule}" if first else None,
    )


def test_an_actions_tally_does_not_queue_behind_another_one(tmp_path):
    """Regression (issue 17, fleet triage): every completed action read, changed and wrote one
    counts file under one exclusive lock. A thread holding it waited for its process's GIL
    meanwhile, and every triage thread of every process queued behind it. Here the counts file
    is held, as such a thread held it: an action is tallied all the same."""
    import fcntl

    local = store.LocalStore(str(tmp_path))
    alerted(local, "db0")
    with open(tmp_path / "hana_storage" / "actions" / store.TALLY, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = threading.Event()
        threading.Thread(target=lambda: (alerted(local, "db1"), done.set()), daemon=True).start()
        assert done.wait(5), "the tally waited for the counts file"
    assert local.tallies() == {"alerted|HANA-ENC-001": 2}


def test_tallies_are_exact_across_processes_while_they_are_counted(tmp_path):
    import multiprocessing

    def work(n):
        local = store.LocalStore(str(tmp_path))
        for i in range(40):
            alerted(local, f"p{n}-{i}")
            if i % 10 == 0:
                local.tallies()  # counted while the others append

    workers = [multiprocessing.get_context("fork").Process(target=work, args=(n,)) for n in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
        assert worker.exitcode == 0
    assert store.LocalStore(str(tmp_path)).tallies() == {"alerted|HANA-ENC-001": 160}


def test_a_long_log_is_emptied_once_counted_and_a_fold_that_died_is_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "ROTATE_BYTES", 100)
    local = store.LocalStore(str(tmp_path))
    for i in range(30):
        alerted(local, f"db{i}", rule=("HANA-ENC-001", "HANA-KEY-001")[i % 2])
        if i % 7 == 0:
            local.tallies()
    log = tmp_path / "hana_storage" / "actions" / store.TALLY_LOG
    assert local.tallies() == {"alerted|HANA-ENC-001": 15, "alerted|HANA-KEY-001": 15}
    assert log.stat().st_size <= store.ROTATE_BYTES, "emptied whenever counted past the bound"
    # a master that died after emptying a counted log, before setting the offset back
    counts = tmp_path / "hana_storage" / "actions" / store.TALLY
    summary = json.loads(counts.read_text())
    assert summary["offset"] == log.stat().st_size
    counts.write_text(json.dumps(dict(summary, offset=store.ROTATE_BYTES + 21)))
    log.write_text("")
    alerted(local, "db99")
    assert local.tallies() == {"alerted|HANA-ENC-001": 16, "alerted|HANA-KEY-001": 15}


def test_counts_written_before_the_log_are_kept(tmp_path):
    actions = tmp_path / "hana_storage" / "actions"
    actions.mkdir(parents=True)
    (actions / store.TALLY).write_text(json.dumps({"alerted|HANA-ENC-001": 7, "remediated|HANA-PERF-002": 2}))
    local = store.LocalStore(str(tmp_path))
    alerted(local, "db1")
    assert local.tallies() == {"alerted|HANA-ENC-001": 8, "remediated|HANA-PERF-002": 2}
    assert local.tallies() == {"alerted|HANA-ENC-001": 8, "remediated|HANA-PERF-002": 2}


def test_only_the_fields_triage_tallies_are_read(tmp_path, caplog):
    """The tallies are the exporter's series: a field that is not an action of triage's on a rule
    of the table, or a count that is not one, is dropped and logged once, never served."""
    local = store.LocalStore(str(tmp_path))
    alerted(local, "db1")
    with open(tmp_path / "hana_storage" / "actions" / store.TALLY_LOG, "a") as log:
        log.write("made-up|HANA-ENC-001\nalerted|RULE-0\nalerted\n")
    assert local.tallies() == {"alerted|HANA-ENC-001": 1}
    assert local.tallies() == {"alerted|HANA-ENC-001": 1}
    assert caplog.text.count("not an action of triage's") == 1
    assert store.known_tallies({b"remediated|HANA-PERF-002": b"2", b"alerted|HANA-KEY-001": b"x"}, "t") == {
        "remediated|HANA-PERF-002": 2
    }
    assert store.tally_name("remediation-failed", "HANA-KEY-001") == "remediation-failed|HANA-KEY-001"
    for action, rule in (("made-up", "HANA-KEY-001"), ("alerted", "RULE-0"), ("alerted", "a|b")):
        with pytest.raises(ValueError):
            store.tally_name(action, rule)


# ---- the outbox ------------------------------------------------------------------------------------


@pytest.fixture(params=["local", "redis"])
def outboxes(request, tmp_path, redis_url):
    """Two masters' stores over one outbox, events due again 0.5 s after they are added or claimed."""
    if request.param == "local":
        return store.LocalStore(str(tmp_path), redeliver=0.5), store.LocalStore(str(tmp_path), redeliver=0.5)
    prefix = f"outbox-{time.monotonic_ns()}:"
    return tuple(store.RedisStore(redis_url, prefix, SECRET, redeliver=0.5) for _ in range(2))


def alert_event(n=0):
    return {"event_id": f"e{n:04d}", "tag": "hana/storage/alert", "data": {"minion": "db1", "n": n}}


def test_an_actions_events_are_added_with_its_change_and_only_then(outboxes):
    """The events go into the outbox in the change that records the action: a change that adds
    none, or a claim that lost, leaves the outbox as it was."""
    a, b = outboxes
    claim = a.update(
        "db1",
        "HANA-ENC-001",
        lambda r, now: store.claim(r, now, KEY, SINCE, 300, "a", 60),
        outbox=lambda verdict: [alert_event(1)] if verdict["verdict"] == "act" else [],
    )
    lost = b.update(
        "db1",
        "HANA-ENC-001",
        lambda r, now: store.claim(r, now, KEY, SINCE, 300, "b", 60),
        outbox=lambda verdict: [alert_event(2)] if verdict["verdict"] == "act" else [],
    )
    assert (claim["verdict"], lost["verdict"]) == ("act", "held")
    assert a.overdue() == [] and b.overdue() == [], "not due before its master had time to deliver it"
    time.sleep(0.6)
    assert b.overdue() == [alert_event(1)]


def test_an_overdue_event_is_claimed_by_one_master_until_it_is_due_again(outboxes):
    """The master that decided died before its bus carried the events: the other masters put
    each on a bus once per ``redeliver`` - two masters looking at once share them, none twice -
    until one is confirmed."""
    a, b = outboxes
    a.update("db1", "HANA-ENC-001", lambda r, now: None, outbox=lambda _: [alert_event(n) for n in range(40)])
    time.sleep(0.6)
    claimed, start = [], threading.Barrier(4)

    def look(mine):
        start.wait()
        claimed.extend(event["event_id"] for event in mine.overdue(limit=15))

    threads = [threading.Thread(target=look, args=(outboxes[n % 2],)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed += [event["event_id"] for event in a.overdue()]
    assert sorted(claimed) == [f"e{n:04d}" for n in range(40)], "each once"
    assert a.overdue() == [] and b.overdue() == []
    b.confirm([f"e{n:04d}" for n in range(39)])
    time.sleep(0.6)
    assert [event["event_id"] for event in a.overdue()] == ["e0039"], "confirmed: gone; the rest due again"


def test_a_local_outbox_keeps_no_half_written_event_and_no_foreign_name(tmp_path):
    local = store.LocalStore(str(tmp_path), redeliver=0)
    local.update("db1", "HANA-ENC-001", lambda r, now: None, outbox=lambda _: [alert_event(1)])
    (tmp_path / "hana_storage" / "actions" / "outbox" / "e0002.json").write_text('{"event_id": "e00')
    assert local.overdue() == [alert_event(1)]
    with pytest.raises(store.StoreError, match="not an event id"):
        local.confirm(["../tallies"])
    mode = (tmp_path / "hana_storage" / "actions" / "outbox" / "e0001.json").stat().st_mode & 0o777
    assert mode == 0o600


# ---- the Redis store's integrity, credentials and transport (issue 29, item 4) -------------------------


def test_a_value_is_valid_only_under_its_name_and_the_masters_key():
    sealed = store.seal(SECRET, "action:db1@HANA-ENC-001", '{"handled": {}}')
    assert store.unseal(SECRET, "action:db1@HANA-ENC-001", sealed) == '{"handled": {}}'
    assert store.unseal(SECRET, "action:db1@HANA-ENC-001", sealed.encode()) == '{"handled": {}}'
    assert store.unseal(SECRET, "action:db2@HANA-ENC-001", sealed) is None, "copied to another record"
    assert store.unseal(store.mac_key(b"another cluster"), "action:db1@HANA-ENC-001", sealed) is None
    for forged in ('{"handled": {}}', "", "0" * 64 + '{"handled": {}}', sealed[:-1] + "]", None, 7):
        assert store.unseal(SECRET, "action:db1@HANA-ENC-001", forged) is None
    assert store.mac_key(b"a master key") == SECRET and len(SECRET) == 32
    assert store.cluster_prefix(b"pub") == f"hana_storage:{hashlib.sha256(b'pub').hexdigest()[:16]}:"


def test_a_record_copied_to_another_minion_is_read_as_empty(redis_url, caplog):
    """db1's record (an occurrence handled) copied over db2's: it would silence db2's alert."""
    shared = store.RedisStore(redis_url, f"copied-{time.monotonic_ns()}:", SECRET)
    shared.update("db1", "HANA-ENC-001", lambda r, now: store.complete(r, KEY, SINCE, "a"))
    raw = shared.client.get(f"{shared.prefix}action:db1@HANA-ENC-001")
    shared.client.set(f"{shared.prefix}action:db2@HANA-ENC-001", raw)
    verdict = shared.update(
        "db2", "HANA-ENC-001", lambda r, now: store.claim(r, now, KEY, SINCE, 300, "a", 60)
    )
    assert verdict["verdict"] == "act" and "does not verify" in caplog.text
    assert shared.update(
        "db1", "HANA-ENC-001", lambda r, now: store.claim(r, now, KEY, SINCE, 300, "a", 60)
    ) == {"verdict": "duplicate"}


def test_only_the_outbox_tags_leave_the_outbox(outboxes, caplog):
    """An entry that is not one of the masters' alert or remediation events is dropped, logged
    once per cause; the masters' own events go out."""
    a, _b = outboxes
    a.update("db1", "HANA-ENC-001", lambda r, now: None, outbox=lambda _: [alert_event(1)])
    if a.driver == "redis":
        a.client.hset(a.prefix + store.OUTBOX, "e0002", json.dumps({**alert_event(2), "tag": "salt/auth"}))
        a.client.zadd(a.prefix + store.DUE, {"e0002": 0})
        sealed = store.seal(SECRET, "outbox:e0003", json.dumps({**alert_event(3), "tag": "salt/auth"}))
        a.client.hset(a.prefix + store.OUTBOX, "e0003", sealed)  # even under the masters' MAC
        a.client.zadd(a.prefix + store.DUE, {"e0003": 0})
    else:
        outbox = f"{a.outbox}/e0002.json"
        with open(outbox, "w") as forged:
            json.dump({**alert_event(2), "tag": "salt/auth"}, forged)
    time.sleep(0.6)
    assert a.overdue() == [alert_event(1)]
    assert "dropped from the outbox" in caplog.text and "'salt/auth'" in caplog.text
    caplog.clear()
    time.sleep(0.6)
    assert a.overdue() == [alert_event(1)], "the dropped entries are gone"
    assert "dropped" not in caplog.text


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    """A redis-server whose user ``hana`` may run the store's commands on one prefix only."""
    users = {"hana": ("hana-password", f"~hana_storage:cluster-a:* {STORE_ACL}")}
    with redis_server(tmp_path_factory.mktemp("acl-redis"), users=users) as url:
        yield as_user(url, "hana", "hana-password")


def everything_a_store_does(shared):
    """Claim, complete with an event in the outbox and a tally, redeliver, confirm, count."""
    verdict = shared.update(
        "db1", "HANA-ENC-001", lambda r, now: store.claim(r, now, KEY, SINCE, 300, "a", 60)
    )
    assert verdict["verdict"] == "act"
    shared.update(
        "db1",
        "HANA-ENC-001",
        lambda r, _now: store.complete(r, KEY, SINCE, "a"),
        tally=lambda first: "alerted|HANA-ENC-001" if first else None,
        outbox=lambda _first: [alert_event(1)],
    )
    time.sleep(0.6)
    assert shared.overdue() == [alert_event(1)]
    shared.confirm(["e0001"])
    assert shared.tallies() == {"alerted|HANA-ENC-001": 1}


def test_an_acl_user_restricted_to_its_prefix_runs_the_store(acl_redis):
    everything_a_store_does(store.RedisStore(acl_redis, "hana_storage:cluster-a:", SECRET, redeliver=0.5))
    outside = store.RedisStore(acl_redis, "hana_storage:cluster-b:", SECRET)
    with pytest.raises(store.StoreError, match="redis store.*(permission|NOPERM)"):
        outside.update("db1", "HANA-ENC-001", lambda r, now: store.claim(r, now, KEY, SINCE, 300, "a", 60))


def test_a_wrong_password_is_a_clear_store_error(acl_redis):
    for url in (as_user(acl_redis, "hana", "wrong"), acl_redis.replace("hana-password@", "@")):
        with pytest.raises(store.StoreError, match="redis store"):
            store.RedisStore(url, "hana_storage:cluster-a:", SECRET).tallies()


def test_the_store_over_tls_verifies_the_servers_certificate(tmp_path):
    with redis_server(tmp_path / "tls", tls=True) as url:
        assert url.startswith("rediss://") and "ssl_ca_certs=" in url
        everything_a_store_does(store.RedisStore(url, "hana_storage:tls:", SECRET, redeliver=0.5))
        unverified = store.RedisStore(url.split("?")[0], "hana_storage:tls:", SECRET)  # no CA: the system's
        with pytest.raises(store.StoreError, match="certificate verify failed"):
            unverified.tallies()
