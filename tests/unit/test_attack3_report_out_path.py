"""Attack: ``report``'s ``out`` replaces any file the master's user can write.

``salt-run hana_storage.report format=html out=<path>`` writes the page with
``core.files.replace_file(out, ..., mode=0o640)``: whatever is at ``out`` - /etc/shadow,
/etc/salt/master, a key under /etc/hana-storage/keys, last month's signed-off evidence - is
replaced whole, silently, by the master's user (root). Whoever may run this one runner function
(an auditor granted ``@runner: [hana_storage.report]`` through salt-api's external_auth, the use
the evidence report is made for) can so destroy any file on the master, and put text of a
compromised minion's choosing into it (the HTML keeps a finding message's newlines). A mistyped
``out`` loses data the same way. Expected: ``out`` never replaces an existing file that is not
a report (refuse, or confine ``out`` to a reports directory, or write only a new file).
"""

import contextlib

from tests.unit.test_evidence import host_part, report_runner, returns_of


def test_the_report_never_replaces_a_file_that_is_not_a_report(tmp_path, monkeypatch):
    runner = report_runner(tmp_path, monkeypatch, returns_of([host_part("hana-01")]), "runner_attack3_out")
    victim = tmp_path / "etc" / "shadow"
    victim.parent.mkdir()
    victim.write_text("root:$6$saltsalt$hash:19000:0:99999:7:::\n")
    with contextlib.suppress(Exception):  # refusing is fine; replacing it is not
        runner.report(format="html", out=str(victim))
    assert victim.read_text().startswith("root:$6$"), "the report replaced a file that is not a report"
