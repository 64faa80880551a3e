"""Attack: two processes of one master keep the local journal and history at the same time."""

import contextlib
import fcntl
import os

from hana_storage_core import evidence, store


def test_a_kept_log_rotated_by_another_process_in_between_is_not_an_error(tmp_path, monkeypatch):
    """LocalStore._keep appends under a shared lock, then reads the log's size without a lock,
    and when it is big takes the exclusive lock and reads the size again to rotate. The reactor's
    runner processes, the triage engine and a ``report``/``snapshot`` runner share one local store:
    when another process rotated the log between this one's two looks (and nothing was appended
    since), the second ``os.path.getsize`` raises FileNotFoundError. That is no StoreError, so
    ``_recorded`` does not catch it: a triage job that already wrote its record and tally dies
    with a traceback before it delivers its events, and ``report``/``snapshot`` write nothing."""
    monkeypatch.setattr(store, "JOURNAL_BYTES", 200)
    kept = store.LocalStore(str(tmp_path))
    entry = evidence.snapshot(
        {"a": {"compliant": True, "volumes": {"v": {"compliant": True}}}}, 1_790_000_000
    )
    for _ in range(3):  # the history is not big yet after these
        kept.add_snapshot(entry)
    path = os.path.join(kept.root, f"{store.HISTORY}.log")
    real_lock = kept._file_lock

    @contextlib.contextmanager
    def other_process_rotates_first(name, mode):
        if mode == fcntl.LOCK_EX and os.path.exists(path):
            os.replace(path, path + ".1")  # the other process's rotation, under the same lock
        with real_lock(name, mode):
            yield

    monkeypatch.setattr(kept, "_file_lock", other_process_rotates_first)
    kept.add_snapshot(entry)  # big now: this process rotates too, after the other one did
    assert kept.history()


def test_an_action_whose_journal_line_cannot_be_written_is_still_delivered(tmp_path, monkeypatch):
    """The record and its outbox events are written before the journal line: a full disk or a
    lost journal file then costs the journal one line, never the events of an action done."""
    from tests.unit.test_evidence import act

    kept = store.LocalStore(str(tmp_path))

    append = kept._append

    def no_space(name, line):
        if name.startswith(store.JOURNAL):
            raise OSError(28, "No space left on device")
        return append(name, line)

    monkeypatch.setattr(kept, "_append", no_space)
    result, event = act(kept, "hana-01", "HANA-PERF-002", "remediated", "HANA-PERF-002|data|/dev/x")
    assert result is True
    assert os.listdir(kept.outbox) == [store._event_file(event["event_id"])]
