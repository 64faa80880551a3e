"""Attack 6: pcr_values takes whatever a sysfs PCR file holds: "" or garbage becomes a "PCR
value", compared with the record (a false "PCR 7 changed": clevis_bound binds again and removes
a binding that still opens) and written into a new record (which pcr_record then rejects)."""

import importlib.util

import pytest
from salt.exceptions import CommandExecutionError

from tests.conftest import REPO


@pytest.fixture
def module(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location(
        "host_module_attack6", REPO / "_modules" / "hana_storage_host.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "TPM_SYSFS", str(tmp_path))
    (tmp_path / "pcr-sha256").mkdir()
    return module


@pytest.mark.parametrize("content", ["", "\n", "garbage\n", "00" * 20 + "\n", "0x" + "00" * 32])
def test_a_sysfs_pcr_that_is_no_sha256_digest_is_an_error(module, tmp_path, content):
    (tmp_path / "pcr-sha256" / "7").write_text(content)
    with pytest.raises(CommandExecutionError):
        print(module.pcr_values("sha256", [7]))
