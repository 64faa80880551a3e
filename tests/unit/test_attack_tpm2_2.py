"""Attack 2: "bind the new binding first, then unbind the old" cannot work for Tang (2+ servers)
with a TPM2 policy: one such Clevis token takes ~6.7 KB (2 servers) / ~9 KB (3 servers) of the
12 KiB LUKS2 JSON area of a default luksFormat, so the second `clevis luks bind` fails
("Failed to import token") and clevis_bound can never replace a binding whose PCRs changed
(nor one made with a rotated Tang key), although the documented fix is "state.apply binds again"."""

import json
import shutil
import subprocess

import pytest
from hana_storage_core import commands

pytestmark = pytest.mark.skipif(
    not shutil.which("swtpm") or not shutil.which("clevis-encrypt-tpm2"), reason="no swtpm/clevis tpm2"
)


def test_a_second_tang_and_tpm2_binding_fits_beside_the_first(tmp_path):
    from swtpm_server import SwtpmServer
    from tang_server import TangServer

    image, key = tmp_path / "h.img", tmp_path / "k"
    key.write_bytes(b"r" * 64)
    subprocess.run(["truncate", "-s", "20M", str(image)], check=True)
    luks = {"type": "luks2", "cipher": "aes-xts-plain64", "key_size": 512, "sector_size": 4096,
            "pbkdf": {"type": "pbkdf2", "force_iterations": 1000}}  # fmt: skip
    subprocess.run(commands.luks_format(str(image), str(key), luks), check=True)  # the formula's format
    with SwtpmServer(tmp_path) as tpm, TangServer(tmp_path / "a") as a, TangServer(tmp_path / "b") as b:
        servers = [{"url": s.url, "thumbprint": s.thumbprint} for s in (a, b)]
        policy = {
            "tang": {"servers": servers, "threshold": 1},
            "tpm2": {"pcr_bank": "sha256", "pcr_ids": [7]},
        }
        first = tpm.run(*commands.clevis_bind(str(image), str(key), policy))
        assert first.returncode == 0, first.stderr
        dump = subprocess.run(
            ["cryptsetup", "luksDump", "--dump-json-metadata", str(image)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        sizes = [len(json.dumps(t)) for t in json.loads(dump)["tokens"].values()]
        # what clevis_bound does after a PCR change: bind again beside the old binding
        second = tpm.run(*commands.clevis_bind(str(image), str(key), policy))
        assert second.returncode == 0, (sizes, second.stderr.decode())
