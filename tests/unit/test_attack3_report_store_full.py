"""Attack: a full disk under the master's cachedir denies the fleet its evidence report.

``report format=json|html`` keeps the fleet's compliance in the store's history and reads the
history and journal back, and is meant to go on without them when the store fails ("the report
has no history: the store failed"). But it catches only ``StoreError``, and the local store's
``_keep`` lets the ``OSError`` of its ``os.write`` through (ENOSPC, EDQUOT, EIO: ``_open`` alone
wraps its errors; ``update`` knows it and catches OSError from ``_keep`` itself). A cachedir
file system that is full - the very day an auditor asks for the report, often written with
``out=`` to another file system - makes the runner die with a traceback and write nothing.
Expected: the report is written, with the history it could get (at least this run's summary).
"""

import errno
import json

from hana_storage_core import store

from tests.unit.test_evidence import host_part, report_runner, returns_of


def test_the_report_is_written_when_the_store_cannot_keep_its_history(tmp_path, monkeypatch):
    runner = report_runner(tmp_path, monkeypatch, returns_of([host_part("hana-01")]), "runner_attack3_full")
    append = store.LocalStore._append

    def full_disk(self, name, line):
        if name.startswith(store.HISTORY):
            raise OSError(errno.ENOSPC, "No space left on device")
        return append(self, name, line)

    monkeypatch.setattr(store.LocalStore, "_append", full_disk)
    out = tmp_path / "elsewhere" / "evidence.json"
    result = runner.report(format="json", out=str(out))  # OSError today: nothing written
    assert result["written"] == str(out)
    doc = json.loads(out.read_text())
    assert doc["history"] == [doc["summary"]]
