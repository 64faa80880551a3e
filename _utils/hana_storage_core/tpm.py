"""The TPM2 side of Clevis bindings: the PCR values a binding's policy was sealed to, recorded in
a LUKS2 token of the formula's own, and how they compare with the TPM's values now. Pure code:
the execution module reads the PCRs (sysfs, or tpm2_pcrread on kernels before 5.12)."""

import json
import re

# A token of the formula's own beside a Clevis TPM2 binding, on the binding's keyslot: the PCR
# values its policy was sealed to, so that a changed PCR can be named (the sealed policy holds
# only their digest)
PCR_TOKEN = "hana-storage-pcrs"
# the PCR banks a policy may name, with the length of their digests in hex
BANKS = {"sha1": 40, "sha256": 64, "sha384": 96, "sha512": 128}
HEX = re.compile(r"^[0-9a-f]+$")


def valid_value(bank, value):
    """Is ``value`` a PCR value of ``bank`` (lowercase hex of the bank's digest length)?"""
    return isinstance(value, str) and len(value) == BANKS.get(bank, -1) and bool(HEX.match(value))


def pcr_record(token):
    """{"pcr_bank", "values": {pcr id (int): hex digest}} of a PCR_TOKEN, or {"error"}."""
    bank, values = token.get("pcr_bank"), token.get("values")
    if bank not in BANKS or not isinstance(values, dict):
        return {"error": "a PCR record without a known pcr_bank and its values"}
    try:
        read = {int(k): v for k, v in values.items()}
    except (TypeError, ValueError):
        return {"error": "a PCR record naming no PCR"}
    if not all(0 <= k <= 23 and valid_value(bank, v) for k, v in read.items()):
        return {"error": "a PCR record with values no PCR has"}
    return {"pcr_bank": bank, "values": read}


def pcr_token(keyslot, bank, values):
    """The PCR_TOKEN (JSON text) recording ``values`` ({pcr id: hex}) for Clevis keyslot ``keyslot``."""
    return json.dumps(
        {
            "type": PCR_TOKEN,
            "keyslots": [str(keyslot)],
            "pcr_bank": bank,
            "values": {str(k): v for k, v in values.items()},
        },
        sort_keys=True,
    )


def records(header):
    """{Clevis keyslot id (str): its PCR record} for the TPM2 bindings of a parsed ``header``
    that have exactly one valid record of exactly their policy's bank and PCRs. Anything else
    (two records for a keyslot, a record of other PCRs, one on a keyslot no TPM2 binding has) is
    no record: which PCR changed is then not known, and the binding is asked instead."""
    policies = {
        token["keyslots"][0]: token["clevis"]["tpm2"]
        for token in header.get("tokens", [])
        if token["type"] == "clevis"
        and (token.get("clevis") or {}).get("tpm2")
        and len(token["keyslots"]) == 1
    }
    found = {}
    for token in header.get("tokens", []):
        record = token.get("pcrs") if token["type"] == PCR_TOKEN else None
        if not record or "error" in record or len(token["keyslots"]) != 1:
            continue
        slot = token["keyslots"][0]
        policy = policies.get(slot)
        if (
            policy
            and record["pcr_bank"] == policy["pcr_bank"]
            and sorted(record["values"]) == policy["pcr_ids"]
        ):
            found[slot] = None if slot in found else {**record, "token": token["id"]}
    return {slot: record for slot, record in found.items() if record}


def stale_records(header):
    """The ids of the PCR record tokens of ``header`` that ``records`` does not take: of a
    binding gone (clevis luks unbind removes its keyslot and its own token, not ours), of other
    PCRs than their binding's, or one of two for a keyslot."""
    taken = {record["token"] for record in records(header).values()}
    return [t["id"] for t in header.get("tokens", []) if t["type"] == PCR_TOKEN and t["id"] not in taken]


def wanted_pcrs(header):
    """{bank: [pcr ids]}: the PCRs to read to compare the records of ``header`` with the TPM."""
    wanted = {}
    for record in records(header).values():
        wanted.setdefault(record["pcr_bank"], set()).update(record["values"])
    return {bank: sorted(ids) for bank, ids in wanted.items()}


def pcr_drift(header, current):
    """{Clevis keyslot id (str): [PCR ids that changed since it was bound]} for each Clevis TPM2
    binding of the parsed ``header`` that has a record (``records``), with ``current`` {bank:
    {pcr id: hex}} the TPM's values now (a bank missing: not compared). Bindings without a record
    are left out: which PCR changed cannot be told for them."""
    drift = {}
    for slot, record in records(header).items():
        now = current.get(record["pcr_bank"])
        if now is not None:
            drift[slot] = sorted(i for i, value in record["values"].items() if now.get(i) != value)
    return drift


PCRREAD_BANK = re.compile(r"^\s*(sha1|sha256|sha384|sha512|sm3_256)\s*:\s*$")
PCRREAD_VALUE = re.compile(r"^\s*(\d{1,2})\s*:\s*0x([0-9A-Fa-f]+)\s*$")


class PcrReadError(ValueError):
    """tpm2_pcrread said something that is not a PCR listing."""


def parse_pcrread(text):
    """{bank: {pcr id: lowercase hex}} from ``tpm2_pcrread`` (tpm2-tools 4 and 5)."""
    banks, bank = {}, None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if found := PCRREAD_BANK.match(line):
            name = found.group(1)
            bank = banks.setdefault(name, {})
        elif (found := PCRREAD_VALUE.match(line)) and bank is not None:
            bank[int(found.group(1))] = found.group(2).lower()
            if name in BANKS and not valid_value(name, found.group(2).lower()):
                raise PcrReadError(f"tpm2_pcrread line {number}: not a {name} value")
        else:
            raise PcrReadError(f"tpm2_pcrread line {number} is not a bank or a PCR: {line.strip()[:80]!r}")
    return banks
