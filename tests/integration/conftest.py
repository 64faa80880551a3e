"""A real salt-master and salt-minion (pytest-salt-factories) serving the formula's file_roots."""

import pytest
import yaml

from tests.conftest import REPO
from tests.support.master import formula_master

pytestmark = pytest.mark.integration


@pytest.fixture(scope="package")
def pillar_tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("pillar")
    (root / "top.sls").write_text("base:\n  '*':\n    - hana\n")
    (root / "hana.sls").write_text("{}\n")
    return root


@pytest.fixture(scope="package")
def master(salt_factories, pillar_tree):
    # file_recv: the openscap module pushes its results to the master (test_openscap_minion.py);
    # the runner makes the evidence report (test_evidence_report.py)
    overrides = formula_master(
        pillar_tree, file_recv=True, runner_dirs=[str(REPO / "_runners")], utils_dirs=[str(REPO / "_utils")]
    )
    factory = salt_factories.salt_master_daemon("hana-master", overrides=overrides)
    with factory.started(start_timeout=120):
        yield factory


@pytest.fixture(scope="package")
def minion(master):
    factory = master.salt_minion_daemon("hana-minion")
    with factory.started(start_timeout=120):
        sync = factory.salt_call_cli(timeout=120).run("saltutil.sync_all")
        assert sync.returncode == 0, sync
        yield factory


@pytest.fixture
def set_pillar(pillar_tree, minion):
    """Write hana:storage for the minion and refresh its pillar."""

    def setter(storage):
        (pillar_tree / "hana.sls").write_text(yaml.safe_dump({"hana": {"storage": storage}}))
        ret = minion.salt_call_cli(timeout=60).run("saltutil.refresh_pillar", wait=True)
        assert ret.returncode == 0, ret

    return setter
