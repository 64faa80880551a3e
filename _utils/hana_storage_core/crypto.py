"""The kernel's crypto drivers, as /proc/crypto lists them. Pure code, no I/O.

dm-crypt asks the kernel's crypto API for an algorithm such as ``xts(aes)`` (the dm cipher
``aes-xts-plain64``) and gets the registered driver of the highest priority whose self-test
passed: ``xts-aes-aesni`` where the CPU has AES-NI (x86), ``p8_aes_xts`` with POWER8+ VMX,
``xts-aes-ce`` with the ARMv8 crypto extensions; without them it builds the algorithm from
the table-driven C implementation, ``xts(ecb(aes-generic))``, several times slower.
/proc/crypto lists an algorithm once something has used it, so every crypt device that is
open has its algorithm there.
"""

import re

_FIELD = re.compile(r"^(?P<key>[a-z][a-z0-9 _-]*?)\s*:\s?(?P<value>.*)$")
_CIPHER = re.compile(r"^(?P<cipher>[a-z0-9_]+)-(?P<mode>[a-z0-9_]+)(?:-\S+)?$")


class ProcCryptoError(ValueError):
    """/proc/crypto text that cannot be parsed."""


def parse_proc_crypto(text):
    """[{name, driver, module, priority, selftest, type, ...}] from /proc/crypto."""
    if not isinstance(text, str):
        raise ProcCryptoError(f"/proc/crypto must be text, got {type(text).__name__}")
    entries, entry = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            if entry:
                entries.append(_checked(entry, number))
            entry = {}
            continue
        match = _FIELD.match(line)
        if not match:
            raise ProcCryptoError(f"line {number}: not 'field : value': {line[:80]!r}")
        key, value = match["key"].strip(), match["value"].strip()
        if key == "name" and entry:
            raise ProcCryptoError(f"line {number}: a new entry without the blank line before it")
        entry[key] = value
    if entry:
        entries.append(_checked(entry, len(text.splitlines())))
    return entries


def _checked(entry, number):
    for key in ("name", "driver", "priority"):
        if key not in entry:
            raise ProcCryptoError(f"the entry ending at line {number} has no {key}")
    if not (entry["priority"].isascii() and entry["priority"].isdigit()):
        raise ProcCryptoError(f"the entry ending at line {number}: priority {entry['priority']!r}")
    return {**entry, "priority": int(entry["priority"])}


def algorithm_of(cipher):
    """The crypto API name of a dm-crypt cipher: ``aes-xts-plain64`` -> ``xts(aes)``; None for a
    cipher that names no mode (``cipher_null``)."""
    match = _CIPHER.match(cipher or "")
    return f"{match['mode']}({match['cipher']})" if match else None


def driver_of(entries, algorithm):
    """The driver the kernel hands out for ``algorithm``: {driver, module, priority, generic},
    or None when nothing registered it."""
    usable = [e for e in entries if e["name"] == algorithm and e.get("selftest", "passed") != "unknown"]
    if not usable:
        return None
    best = max(usable, key=lambda e: e["priority"])
    return {
        "driver": best["driver"],
        "module": best.get("module", "kernel"),
        "priority": best["priority"],
        "generic": "generic" in best["driver"],
    }
