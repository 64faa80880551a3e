"""What one minion may cost triage: the token buckets and the reports (issue 29, item 11)."""

import threading

from hana_storage_core import limits as limits


def test_a_bucket_takes_a_burst_then_its_rate():
    buckets = limits.buckets(rate=2, burst=3)
    assert [buckets.allow("db1", now=0.0) for _ in range(4)] == [True, True, True, False]
    assert buckets.allow("db2", now=0.0), "a bucket per key"
    assert buckets.allow("db1", now=0.5) and not buckets.allow("db1", now=0.5), "2 per second"
    assert [buckets.allow("db1", now=100.0) for _ in range(4)] == [True, True, True, False], (
        "never above the burst"
    )


def test_a_dropped_event_takes_no_token_and_threads_share_the_bucket():
    buckets = limits.Buckets(rate=0.0001, burst=50)
    allowed, start = [], threading.Barrier(8)

    def flood():
        start.wait()
        allowed.extend(buckets.allow("db1", now=1.0) for _ in range(100))

    threads = [threading.Thread(target=flood) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert allowed.count(True) == 50


def test_keys_are_bounded_the_oldest_forgotten():
    buckets = limits.Buckets(rate=0.0001, burst=1, keys=3)
    for key in ("a", "b", "c", "d"):
        assert buckets.allow(key, now=0.0)
    assert len(buckets._tokens) == 3
    assert buckets.allow("a", now=0.0), "forgotten: a full bucket again"
    assert not buckets.allow("d", now=0.0)


def test_one_report_per_key_and_interval_counting_what_it_held_back():
    reports = limits.reports(interval=60)
    assert reports.due("db1", now=0.0) == 0
    assert [reports.due("db1", now=t) for t in (1.0, 2.0, 59.0)] == [None, None, None]
    assert reports.due("db2", now=2.0) == 0
    assert reports.due("db1", now=60.5) == 3
    assert reports.due("db1", now=61.0) is None
    bounded = limits.Reports(interval=60, keys=2)
    for key in ("a", "b", "c"):
        bounded.due(key, now=0.0)
    assert list(bounded._last) == ["b", "c"]


def test_made_up_ids_share_one_key_that_no_minion_can_have():
    assert limits.unknown() == "*"


def test_a_finding_key_longer_than_any_the_beacon_makes_is_kept_as_its_hash():
    real = "HANA-ENC-001|data|/dev/mapper/" + "d" * 127
    assert limits.finding_key(real) == real
    long = "HANA-ENC-001|data|" + "k" * 100_000
    hashed = limits.finding_key(long)
    assert hashed.startswith("sha256:") and len(hashed) <= limits.MAX_FINDING_KEY
    assert limits.finding_key(long) == hashed, "the same finding keeps one key"
    assert limits.finding_key(long + "k") != hashed
    assert limits.finding_key("x" * limits.MAX_FINDING_KEY) == "x" * limits.MAX_FINDING_KEY
