"""The TPM2 side of Clevis bindings: the PCR values a binding's policy was sealed to, recorded in
a LUKS2 token of the formula's own, and how they compare with the TPM's values now. Pure code:
the execution module reads the PCRs (sysfs, or tpm2_pcrread on kernels before 5.12)."""

import json
import re

# A token of the formula's own beside a Clevis TPM2 binding, on the binding's keyslot: the PCR
# values its policy was sealed to, so that a changed PCR can be named (the sealed policy holds
# only their digest)
PCR_TOKEN = "hana-storage-pcrs"
PCR_VALUE = re.compile(r"^[0-9a-f]{40,128}$")


def pcr_record(token):
    """{"pcr_bank", "values": {pcr id (int): hex digest}} of a PCR_TOKEN, or {"error"}."""
    bank, values = token.get("pcr_bank"), token.get("values")
    if not isinstance(bank, str) or not isinstance(values, dict):
        return {"error": "a PCR record without pcr_bank and values"}
    try:
        read = {int(k): v for k, v in values.items()}
    except (TypeError, ValueError):
        return {"error": "a PCR record naming no PCR"}
    if not all(0 <= k <= 23 and isinstance(v, str) and PCR_VALUE.match(v) for k, v in read.items()):
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


def pcr_drift(header, current):
    """{Clevis keyslot id (str): [PCR ids that changed since it was bound]} for each Clevis TPM2
    binding of the parsed ``header`` that has a PCR record, with ``current`` {bank: {pcr id:
    hex}} the TPM's values now (a bank missing: not compared). Bindings without a record (not
    made by the formula) are left out: which PCR changed cannot be told for them."""
    records = {
        slot: token["pcrs"]
        for token in header.get("tokens", [])
        if token["type"] == PCR_TOKEN and "error" not in token.get("pcrs", {"error": 1})
        for slot in token["keyslots"]
    }
    drift = {}
    for token in header.get("tokens", []):
        if token["type"] != "clevis" or not (token["clevis"].get("tpm2")):
            continue
        for slot in token["keyslots"]:
            record = records.get(slot)
            now = current.get(record["pcr_bank"]) if record else None
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
            bank = banks.setdefault(found.group(1), {})
        elif (found := PCRREAD_VALUE.match(line)) and bank is not None:
            bank[int(found.group(1))] = found.group(2).lower()
        else:
            raise PcrReadError(f"tpm2_pcrread line {number} is not a bank or a PCR: {line.strip()[:80]!r}")
    return banks
