"""Re-review #5 (regression): the formula's LUKS2 metadata area holds two bindings of what the
pillar allows. (A 64 KiB area did not:
The schema takes up to 16 Tang servers; each adds ~2.4 KiB to a Tang+TPM2 token. With 12
servers the second `clevis luks bind` (what replacing a stale binding - a Tang key rotation,
HANA-KEY-004 - does before it unbinds) fails with "Error saving metadata" on a header this
formula formatted; replacing a binding bound anew before it unbound, so the state failed on every
apply and remediation.)"""

# ruff: noqa: F811, F401
import subprocess

from hana_storage_core import commands

from tests.unit.test_tpm2 import tpm_and_tang


def test_two_tang_tpm2_bindings_of_16_servers_fit_the_formulas_header(tpm_and_tang, tmp_path):
    tpm_server, tang, _second = tpm_and_tang
    urls = [tang.url] + [f"http://localhost:{tang.port}/x{i}/.." for i in range(15)]
    policy = {
        "tang": {"servers": [{"url": u, "thumbprint": tang.thumbprint} for u in urls], "threshold": 1},
        "tpm2": {"pcr_bank": "sha256", "pcr_ids": [7]},
    }
    image, key = tmp_path / "h.img", tmp_path / "k"
    key.write_bytes(b"r" * 64)
    subprocess.run(["truncate", "-s", "20M", str(image)], check=True)
    fmt = commands.luks_format(
        str(image), str(key), {"type": "luks2", "cipher": "aes-xts-plain64", "key_size": 512,
                               "sector_size": 512, "pbkdf": {"type": "pbkdf2", "force_iterations": 1000}},
    )  # fmt: skip
    assert "--luks2-metadata-size" in fmt
    subprocess.run(fmt, check=True, capture_output=True)
    first = tpm_server.run(*commands.clevis_bind(str(image), str(key), policy))
    assert first.returncode == 0, first.stderr
    second = tpm_server.run(*commands.clevis_bind(str(image), str(key), policy))
    said = second.stderr if isinstance(second.stderr, str) else second.stderr.decode()
    assert second.returncode == 0, said
