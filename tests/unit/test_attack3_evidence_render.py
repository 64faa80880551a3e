"""Attack: a minion's evidence return that passes the host schema still breaks the HTML report.

``evidence.host_parts`` checks each minion's return against the strict host schema and keeps it
when it matches, so ``evidence.html`` renders what the schema lets through. But the schema does
not require what the page reads: a LUKS header summary needs only ``keyslots`` and ``clevis``
(``_evidence`` reads version, uuid, cipher, key_size, sector_size and flags), a keyslot needs
nothing (``_evidence`` reads id, type and kdf), a Tang server needs only its ``url`` (``_keys``
reads its thumbprint). One compromised (or older/newer) minion that leaves one of them out makes
``html()`` raise KeyError: ``salt-run hana_storage.report format=html`` writes no page for the
whole fleet. Expected: what the schema accepts renders (``.get`` with a default), or the schema
requires every field the page reads, so that such a part becomes that host's error.
"""

import jsonschema
import pytest
from hana_storage_core import evidence

from tests.unit.test_evidence import host_part, returns_of

FULL_HEADER = {
    "version": 2, "uuid": "u", "cipher": "aes-xts-plain64", "key_size": 512, "sector_size": 4096,
    "flags": [], "keyslots": [], "clevis": [], "degraded": False,
}  # fmt: skip


def _header_without_version(part):
    part["findings"][0]["evidence"]["luks_header"] = {"keyslots": [], "clevis": []}


def _keyslot_without_id(part):
    part["findings"][0]["evidence"]["luks_header"] = dict(FULL_HEADER, keyslots=[{}])


def _tang_without_thumbprint(part):
    part["keys"]["data"]["tang"] = [{"url": "http://tang.example"}]


@pytest.mark.parametrize(
    "change",
    [_header_without_version, _keyslot_without_id, _tang_without_thumbprint],
    ids=lambda f: f.__name__,
)
def test_a_part_the_host_schema_accepts_renders(change):
    hostile = host_part("hana-evil")
    change(hostile)
    returns = returns_of([host_part("hana-01")])
    returns["hana-evil"] = {"ret": hostile, "retcode": 0}
    doc = evidence.document(returns, "salt-master-1", "0.3.0", 1_790_000_000)
    jsonschema.validate(doc, evidence.SCHEMA)
    page = evidence.html(doc)  # KeyError today: no page for any host
    assert 'data-host="hana-01"' in page and 'data-host="hana-evil"' in page
