"""The fleet compliance report: rows from every minion's audit, and a plain text table. Pure code."""


def fleet(returns):
    """``returns``: LocalClient full returns of ``hana_storage.audit`` -> {"rows", "minions", "summary"}."""
    rows, minions = [], {}
    for minion in sorted(returns):
        ret = returns[minion]
        audit = ret.get("ret") if isinstance(ret, dict) else None
        if not isinstance(audit, dict) or "volumes" not in audit or ret.get("retcode"):
            error = audit if isinstance(audit, str) else "no audit returned"
            minions[minion] = {
                "compliant": None,
                "error": error.strip().splitlines()[-1][:200] if error else "",
            }
            rows.append(
                {
                    "minion": minion,
                    "volume": "-",
                    "mountpoint": "-",
                    "compliant": "error",
                    "rules": minions[minion]["error"],
                }
            )
            continue
        minions[minion] = {
            "compliant": audit["compliant"],
            "findings": len(audit["findings"]),
            "volumes": {n: v["compliant"] for n, v in audit["volumes"].items()},
        }
        for name in sorted(audit["volumes"]):
            volume = audit["volumes"][name]
            rows.append(
                {
                    "minion": minion,
                    "volume": name,
                    "mountpoint": volume["mountpoint"],
                    "compliant": "yes" if volume["compliant"] else "NO",
                    "rules": ", ".join(volume["rules"]) or "-",
                }
            )
    audited = [m for m in minions.values() if m["compliant"] is not None]
    summary = {
        "minions": len(minions),
        "compliant": sum(1 for m in audited if m["compliant"]),
        "not_compliant": sum(1 for m in audited if not m["compliant"]),
        "errors": len(minions) - len(audited),
    }
    return {"rows": rows, "minions": minions, "summary": summary}


COLUMNS = ("minion", "volume", "mountpoint", "compliant", "rules")


def table(rows):
    """Rows as an aligned text table with a header."""
    if not rows:
        return "no minion answered"
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in COLUMNS)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in COLUMNS).rstrip() for r in rows]
    return "\n".join(lines)
