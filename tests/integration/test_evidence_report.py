"""The evidence report the way a person reads it: made by the real runner on a real master from a
real minion's evidence, then rendered by headless Chromium (Debian's chromium): a screenshot, and
the DOM after layout - every host there, nothing wider than the page, no secret."""

import base64
import json
import shutil
import subprocess
import time

import jsonschema
import pytest
from hana_storage_core import evidence, rules

from tests.conftest import REPO

pytestmark = pytest.mark.integration

MATERIAL = base64.b64encode(b"\x05" * 64).decode()
STORAGE = {
    "packages": {"install": False},
    "key": {"source": "pillar", "material": MATERIAL},
    "volumes": {
        "data": {"mountpoint": "/hana/evidence-data", "devices": ["/dev/hana-evidence-missing-0"]},
        "log": {"mountpoint": "/hana/evidence-log", "devices": ["/dev/hana-evidence-missing-1"]},
    },
}
# what the page's layout must satisfy once Chromium has laid it out (run in a copy without the
# page's Content-Security-Policy, which forbids any script)
LAYOUT_CHECK = """<script>
addEventListener("load", () => {
  const doc = document.documentElement, out = {};
  out.overflow = doc.scrollWidth - doc.clientWidth;
  out.empty = [...document.querySelectorAll("section")].filter(s => s.offsetHeight < 20).map(s => s.id);
  out.charts = [...document.querySelectorAll("svg")].map(s => s.getBoundingClientRect().width);
  out.cells = [...document.querySelectorAll("td, th")].filter(c => c.scrollWidth > c.clientWidth + 1).length;
  out.hosts = [...document.querySelectorAll("#matrix tr[data-host]")].map(r => r.dataset.host);
  const pre = document.createElement("pre"); pre.id = "layout-check"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def chromium():
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "headless Chromium is needed (tools/install-deps.sh installs Debian's chromium)"
    return found


def render(page, screenshot=None, width=1280):
    """Chromium's DOM of ``page`` after layout (with LAYOUT_CHECK's result), and a screenshot."""
    checked = page.with_suffix(".checked.html")
    text = page.read_text()
    text = text.replace(
        text[text.index('<meta http-equiv="Content-Security-Policy"') :].split(">", 1)[0] + ">", ""
    )
    checked.write_text(text.replace("</body>", LAYOUT_CHECK + "</body>"))
    base = [
        chromium(),
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--window-size={width},2400",
    ]
    if screenshot:
        subprocess.run(
            [*base, f"--screenshot={screenshot}", page.as_uri()], check=True, capture_output=True, timeout=120
        )
    dom = subprocess.run(
        [*base, "--virtual-time-budget=5000", "--dump-dom", checked.as_uri()],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    start = dom.index('<pre id="layout-check">') + len('<pre id="layout-check">')
    return dom, json.loads(dom[start : dom.index("</pre>", start)].replace("&quot;", '"'))


def test_the_runner_writes_an_evidence_report_chromium_renders(master, minion, set_pillar, tmp_path):
    set_pillar(STORAGE)
    run = master.salt_run_cli(timeout=300)
    page, data = tmp_path / "evidence.html", tmp_path / "evidence.json"
    snap = run.run("hana_storage.snapshot")  # what the shipped schedule runs hourly
    assert snap.returncode == 0 and snap.data["hosts"] >= 1 and snap.data["volumes"] >= 2, snap
    ret = run.run("hana_storage.report", "format=html", f"out={page}")
    assert ret.returncode == 0 and ret.data["written"] == str(page), ret
    ret = run.run("hana_storage.report", "format=json", f"out={data}")
    assert ret.returncode == 0, ret
    doc = json.loads(data.read_text())
    jsonschema.validate(doc, evidence.SCHEMA)
    assert minion.id in doc["hosts"] and len(doc["history"]) >= 3  # the snapshot, and each report's
    assert {f["rule"] for f in doc["hosts"][minion.id]["findings"]} >= {"HANA-MOUNT-001"}
    readiness = doc["hosts"][minion.id]["readiness"]  # this machine's own /etc/crypttab, judged
    assert readiness["ready"] in (True, False) and abs(readiness["checked"] - time.time()) < 600
    assert 'id="readiness"' in page.read_text()
    assert oct(page.stat().st_mode & 0o777) == "0o640"

    shot = REPO / "build" / "evidence-report.png"
    shot.parent.mkdir(exist_ok=True)
    dom, layout = render(page, screenshot=shot)
    assert shot.stat().st_size > 10_000  # a page was drawn
    assert layout["hosts"] == [minion.id]
    assert layout["overflow"] <= 0 and layout["empty"] == [] and layout["cells"] == 0, layout
    assert all(width > 100 for width in layout["charts"]), layout
    for text in (page.read_text(), data.read_text(), dom):
        assert MATERIAL not in text and base64.b64decode(MATERIAL).hex() not in text


def test_a_large_fleet_page_keeps_its_layout(tmp_path):
    """Forty hosts, half failing a handful of rules, long device names: the page stays as wide as
    the window (the matrix scrolls inside its own box), every host in the matrix."""
    hosts, failing = (
        {},
        ["HANA-ENC-001", "HANA-PERF-002", "HANA-KEY-006", "HANA-LAYOUT-006", "HANA-MOUNT-001"],
    )
    for n in range(40):
        name = f"hana-prod-{n:03d}.datacenter-frankfurt.example.com"
        findings = [
            {"rule": rule, "severity": rules.RULES[rule].severity, "volume": "data", "mountpoint": "/hana/data",
             "device": "/dev/disk/by-id/dm-uuid-mpath-3600a098038304437415d4b6a59684a52" + "x" * 20,
             "expected": "x", "actual": "y", "remediation": rules.RULES[rule].remediation, "message": "m " * 40,
             "evidence": {"dm_table": [], "luks_header": None}}
            for rule in (failing if n % 2 else [])
        ]  # fmt: skip
        hosts[name] = {
            "ret": {"host": name, "audited": int(time.time()), "compliant": not findings, "findings": findings,
                    "volumes": {"data": {"mountpoint": "/hana/data", "compliant": not findings, "rules": []}},
                    "keys": {}},
            "retcode": 0,
        }  # fmt: skip
    history = [  # two days of hourly snapshots: the fleet fixed a volume every few hours
        evidence.snapshot(
            {
                "a": {
                    "compliant": False,
                    "volumes": {f"v{v}": {"compliant": v < 4 + n // 8} for v in range(10)},
                }
            },
            1_700_000_000 + n * 3600,
        )
        for n in range(48)
    ]
    doc = evidence.document(hosts, "salt-master-1", "0.3.0", time.time(), history=history)
    page = tmp_path / "fleet.html"
    page.write_text(evidence.html(doc))
    _dom, layout = render(page, screenshot=REPO / "build" / "evidence-fleet.png")
    assert sorted(layout["hosts"]) == sorted(hosts)
    assert layout["overflow"] <= 0 and layout["empty"] == [], layout
    assert layout["cells"] == 0, layout
