"""The controls the audit's rules give evidence for: one table, read by the rule table (each rule
names its controls), the SCAP data stream (XCCDF ``<reference>``), the evidence report and the
README. Pure data.

A control is named by a short key; its entry says which catalogue it comes from, its identifier
there, its title and where to read it. The CCEs are the SCAP Security Guide's for its rule
``encrypt_partitions`` on each platform: an auditor's SCAP tooling maps them to that rule.
"""

from typing import NamedTuple


class Control(NamedTuple):
    catalogue: str  # NIST SP 800-53 Rev. 5, PCI DSS v4.0, CCE, SAP
    ident: str  # the control's identifier in its catalogue
    title: str
    href: str  # the catalogue's address (XCCDF <reference href>), "" where there is no public one
    note: str = ""  # what evidence the formula gives for it, where that needs saying


NIST = "NIST SP 800-53 Rev. 5"
NIST_HREF = "https://csrc.nist.gov/pubs/sp/800/53/r5/upd1/final"
PCI = "PCI DSS v4.0"
PCI_HREF = "https://www.pcisecuritystandards.org/document_library/"
CCE = "CCE"
CCE_HREF = "https://ncp.nist.gov/cce"
SAP = "SAP"

CONTROLS = {
    "SC-28": Control(NIST, "SC-28", "Protection of Information at Rest", NIST_HREF),
    "SC-28(1)": Control(
        NIST, "SC-28(1)", "Protection of Information at Rest: Cryptographic Protection", NIST_HREF
    ),
    "SC-12": Control(NIST, "SC-12", "Cryptographic Key Establishment and Management", NIST_HREF),
    "SC-13": Control(NIST, "SC-13", "Cryptographic Protection", NIST_HREF),
    "IA-5": Control(NIST, "IA-5", "Authenticator Management", NIST_HREF),
    "CP-9": Control(NIST, "CP-9", "System Backup", NIST_HREF),
    "CM-6": Control(NIST, "CM-6", "Configuration Settings", NIST_HREF),
    "CP-10": Control(NIST, "CP-10", "System Recovery and Reconstitution", NIST_HREF),
    "SI-7": Control(NIST, "SI-7", "Software, Firmware, and Information Integrity", NIST_HREF),
    "PCI-3.5.1.2": Control(
        PCI,
        "3.5.1.2",
        "Disk-level or partition-level encryption used to render PAN unreadable",
        PCI_HREF,
        "a supporting control: disk-level encryption alone does not render PAN unreadable on "
        "non-removable media; PCI DSS asks for another mechanism beside it there",
    ),
    "PCI-3.6.1": Control(
        PCI, "3.6.1", "Procedures to protect cryptographic keys against disclosure and misuse", PCI_HREF
    ),
    "PCI-3.7.1": Control(PCI, "3.7.1", "Key management: generation of strong cryptographic keys", PCI_HREF),
    "PCI-3.7.2": Control(PCI, "3.7.2", "Key management: secure distribution of cryptographic keys", PCI_HREF),
    "PCI-3.7.3": Control(PCI, "3.7.3", "Key management: secure storage of cryptographic keys", PCI_HREF),
    "PCI-3.7.4": Control(
        PCI, "3.7.4", "Key management: key changes at the end of the cryptoperiod", PCI_HREF
    ),
    "PCI-3.7.5": Control(PCI, "3.7.5", "Key management: retirement or replacement of keys", PCI_HREF),
    "PCI-3.7.7": Control(
        PCI, "3.7.7", "Key management: prevention of unauthorized substitution of keys", PCI_HREF
    ),
    "CCE-85719-3": Control(
        CCE, "CCE-85719-3", "SCAP Security Guide encrypt_partitions, SUSE Linux Enterprise 15", CCE_HREF
    ),
    "CCE-80789-1": Control(CCE, "CCE-80789-1", "SCAP Security Guide encrypt_partitions, RHEL 8", CCE_HREF),
    "CCE-90849-1": Control(CCE, "CCE-90849-1", "SCAP Security Guide encrypt_partitions, RHEL 9", CCE_HREF),
    "SAP-405827": Control(
        SAP,
        "405827",
        "SAP Note 405827: Linux: Recommended file systems (XFS for SAP HANA)",
        "https://me.sap.com/notes/405827",
    ),
    "SAP-STORAGE": Control(
        SAP,
        "HANA-STORAGE-REQUIREMENTS",
        "SAP HANA Storage Requirements (whitepaper): data and log volumes, throughput and latency",
        "",
    ),
    "SAP-HCMT": Control(
        SAP,
        "HCMT",
        "SAP HANA Hardware and Cloud Measurement Tools: storage KPIs for data and log",
        "",
    ),
}

# The controls every rule of a kind gives evidence for (the rule table adds its own).
AT_REST = ("SC-28", "SC-28(1)", "PCI-3.5.1.2")
ENCRYPTED_PARTITIONS = ("CCE-85719-3", "CCE-80789-1", "CCE-90849-1")
KEYS = ("SC-12", "PCI-3.6.1")


def references(keys):
    """The controls named by ``keys``, in order, each once: [Control]."""
    return [CONTROLS[key] for key in dict.fromkeys(keys)]
