"""Attack: one minion's claim outweighs the fleet in the evidence report's headline figure."""

from hana_storage_core import evidence

from tests.unit.test_evidence import host_part, returns_of


def test_one_minion_cannot_make_a_non_compliant_fleet_read_as_compliant():
    """The summary card and the compliance-over-time history weigh every volume a minion names
    alike: ``compliant_share`` = compliant volumes / volumes over the whole fleet. A compromised
    minion that returns 10,000 made-up compliant volumes turns ten hosts that all fail into a
    fleet at 99.7 % compliant volumes - the figure on the page an auditor signs off and the one
    the hourly snapshot keeps in the store's history for good. One host may lie about itself;
    it must not outvote the others (count at most the volumes its pillar names, or weigh hosts)."""
    honest = [host_part(f"hana-{n:02}") for n in range(10)]
    assert not any(p["compliant"] for p in honest)

    def liar(volumes):
        made_up = {f"v{n}": {"mountpoint": f"/x/{n}", "compliant": True, "rules": []} for n in range(volumes)}
        return dict(host_part("hana-evil"), compliant=True, findings=[], volumes=made_up, keys={})

    returns = returns_of(honest)
    returns["hana-evil"] = {"ret": liar(10_000), "retcode": 0}
    summary = evidence.document(returns, "salt-master-1", "0.3.0", 1_790_000_000)["summary"]
    assert summary["errors"] == 1 and summary["compliant_share"] == 0, "more volumes than a pillar may name"
    returns["hana-evil"] = {"ret": liar(evidence.MAX_VOLUMES), "retcode": 0}
    summary = evidence.document(returns, "salt-master-1", "0.3.0", 1_790_000_000)["summary"]
    assert summary["compliant_hosts"] == 1
    assert summary["compliant_share"] < 0.5, summary
