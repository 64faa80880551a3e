"""Inspect, audit and validate encrypted SAP HANA storage.

Interfaces (stable): ``settings``, ``validate_pillar``, ``inspect``, ``luks_header``,
``dm_tables``, ``audit``, ``probe``, ``remediate``, ``io_check``, ``evidence``, ``scap_record``,
``scap_datastream``. Here: the pillar and its plan,
the audit, remediation and the I/O check. The host's facts are gathered by
``hana_storage_host`` (read-only, never a state), the rules, parsers and commands are pure code
in the formula's package ``hana_storage_core`` (``_utils/``). Nothing here writes to a device: ``remediate`` goes through the
formula's states, ``io_check`` writes one test file on a mounted volume.
"""

import contextlib
import copy
import hashlib
import importlib.util
import json
import logging
import os
import secrets
import time

import hana_storage_core as core  # the loader puts its utils directories on sys.path while loading this
import salt.utils.args
import salt.utils.data
import salt.utils.path
import salt.utils.platform
import salt.utils.yaml
from salt.exceptions import CommandExecutionError

core = core.fresh()  # after a saltutil.sync, the files it brought, not those this process imported first

log = logging.getLogger(__name__)

__virtualname__ = "hana_storage"

SCHEMA_URL = "salt://hana/storage/schema.json"
DEFAULTS_URL = "salt://hana/storage/parameters/defaults.yaml"


def __virtual__():
    if not salt.utils.platform.is_linux():
        return False, "hana_storage: only Linux has dm-crypt, LVM and XFS"
    if not salt.utils.path.which("dmsetup"):
        return False, "hana_storage: dmsetup not found (install the dmsetup or device-mapper package)"
    if importlib.util.find_spec("jsonschema") is None:
        return False, (
            "hana_storage: the jsonschema Python package is missing from the Python that runs Salt "
            "(hana.storage.packages installs it; by hand: salt-pip install jsonschema)"
        )
    return __virtualname__


def _host(name):
    return __salt__[f"hana_storage_host.{name}"]


# ---- the pillar ------------------------------------------------------------------------------


def _formula_file(url):
    """Read a file of the formula through the fileserver, cached for this process."""
    cache = __context__.setdefault("hana_storage.files", {})
    if url not in cache:
        text = __salt__["cp.get_file_str"](url)
        if not text:
            raise CommandExecutionError(
                f"cannot read {url}: is the formula in file_roots? (see conf/master.d/hana-storage.conf)"
            )
        cache[url] = text
    return cache[url]


def _schema():
    return json.loads(_formula_file(SCHEMA_URL))


def _defaults():
    """The formula's defaults, parsed once per process like the file is read (merge copies them)."""
    if "hana_storage.defaults" not in __context__:
        __context__["hana_storage.defaults"] = salt.utils.yaml.safe_load(_formula_file(DEFAULTS_URL)) or {}
    return __context__["hana_storage.defaults"]


def _merged(pillar=None):
    if pillar is None:
        # not pillar.get: Salt 3008 masks the values it returns outside renderers
        pillar = salt.utils.data.traverse_dict_and_list(__pillar__, "hana:storage", {})
    if not isinstance(pillar, dict):
        return None, [f"hana:storage: must be a mapping, got {type(pillar).__name__}"]
    return core.pillar.merge(_defaults(), pillar), []


def _pillar_devices(config):
    """The device paths a (not yet validated) config names."""
    volumes = config.get("volumes") if isinstance(config.get("volumes"), dict) else {}
    return [
        device
        for volume in volumes.values()
        if isinstance(volume, dict) and isinstance(volume.get("devices"), list)
        for device in volume["devices"]
        if isinstance(device, str)
    ]


def _lv_paths(config):
    """The LV paths a (not yet validated) config names."""
    volumes = config.get("volumes") if isinstance(config.get("volumes"), dict) else {}
    return [
        core.pillar.lv_path(name, volume)
        for name, volume in volumes.items()
        if isinstance(volume, dict) and all(isinstance(volume.get(k, ""), str) for k in ("vg", "lv"))
    ]


def validate_pillar(pillar=None, host_checks=True):
    """
    Validate ``hana:storage`` (JSON Schema, then semantic and host checks).

    Returns a list of errors, each naming its key path; an empty list means valid.

    pillar
        A ``hana:storage`` mapping to check instead of this minion's pillar.
    host_checks
        Also check devices on this host (exist, are block devices, do not hold the system).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.validate_pillar
    """
    config, errors = _merged(pillar)
    if errors:
        return errors
    facts = None
    if host_checks:
        backups = (config.get("header_backup") or {}).get("directory")
        facts = {
            "devices": _host("device_facts")(_pillar_devices(config)),
            "system_devices": _host("system_devices")(),
            "paths": _host("path_facts")([backups] if isinstance(backups, str) else []),
            "lvs": _host("lv_geometry")(_lv_paths(config)),
            **_host("boot_facts")(),
        }
    return core.pillar.validate(config, _schema(), facts, core.rules.auto_rules())


def settings(pillar=None, host_checks=True):
    """
    The normalised plan the states, the audit and the beacon work from.

    Returns ``{"valid": bool, "errors": [...], "config": {...} or None}``; the config never
    carries key material (a pillar key is named by its pillar path instead).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.settings
    """
    systemd = (__grains__.get("systemd") or {}).get("version")  # the crypttab reader
    boot = _host("boot_facts")()  # the memory a keyslot may have (core.kdf)
    if not host_checks:
        # depends on the pillar and these facts alone: worked out once (a state run renders many SLS)
        config, errors = _merged(pillar)
        digest = hashlib.sha256(
            json.dumps([config, errors, systemd, boot], sort_keys=True, default=str).encode()
        ).hexdigest()
        cached = __context__.get("hana_storage.plan")
        if cached and cached[0] == digest:
            return copy.deepcopy(cached[1])
    errors = validate_pillar(pillar, host_checks=host_checks)
    if errors:
        result = {"valid": False, "errors": errors, "config": None}
    else:
        config, _ = _merged(pillar)
        plan = core.pillar.normalize(
            config, systemd, boot["memory"].get("total_kib"), boot["crypttab"], boot["fips"]
        )
        result = {"valid": True, "errors": [], "config": plan}
    if not host_checks:
        __context__["hana_storage.plan"] = (digest, copy.deepcopy(result))
    return result


def _plan(pillar=None):
    """The plan for read-only work: host checks off, so a missing disk is audited, not refused."""
    result = settings(pillar, host_checks=False)
    if not result["valid"]:
        raise CommandExecutionError(core.pillar.validation_summary(result["errors"]))
    return result["config"]


# ---- public functions ------------------------------------------------------------------------


def dm_tables():
    """
    The parsed ``dmsetup table`` of every mapped device, keys redacted.

    Returns ``{name: [segment, ...]}``; a crypt segment carries cipher, key type and size
    (never the key), iv_offset, device, offset, flags and sector_size.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.dm_tables
    """
    return _host("dm_tables")()


def luks_header(device):
    """
    Parse the LUKS1/LUKS2 header of a device natively (both LUKS2 copies, checksums verified).

    device
        A block device (or a file holding a header), e.g. ``/dev/vdc`` or ``/dev/vg/lv``.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.luks_header /dev/vdc
    """
    return _host("luks_header")(device)


def xfs_superblock(device):
    """
    The XFS superblock of a device: UUID, label, block size, stripe unit and width (bytes), and
    whether mkfs.xfs finished.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.xfs_superblock /dev/mapper/hana_data
    """
    return _host("xfs_superblock")(device)


def inspect():
    """
    Every block device's stack: kind, dm table (keys redacted), LUKS header summary,
    LVM segments, slaves/holders and mountpoints.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.inspect
    """
    return _host("inspect")()


def probe(devices, key_file=None):
    """
    What is on each device, as the data-loss guard sees it (``hana_storage_host.probe``):
    signatures, partition table, PV and its VG, LUKS header and whether ``key_file`` opens it,
    holders, mountpoints, where a device without a signature holds data, an XFS superblock's
    state. Read-only: not a byte of any device changes.

    devices
        A device path, a comma-separated list or a list.
    key_file
        A key file to test LUKS devices with (on an in-memory copy of the header), or a list of
        them (a key and, while it is rotated, its previous key): ``key_opens`` when one opens it.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.probe /dev/vdb,/dev/vdc
    """
    return _host("probe")(devices, key_file=key_file)


def audit(pillar=None, volumes=None):
    """
    Compliance of this host against its ``hana:storage`` pillar.

    Returns ``{"compliant": bool, "findings": [...], "volumes": {...}}``; each finding has
    rule, severity, volume, mountpoint, device, expected, actual, remediation (auto|manual)
    and message. Rule IDs are stable (see the README's rule table).

    pillar
        A ``hana:storage`` mapping to audit against instead of this minion's pillar.
    volumes
        Audit only these volumes (names; a list or comma-separated). The beacon's audit of what
        a kernel event touched: it takes the LVM report of an earlier audit in this process
        while no LV's table and no block device changed since (a full audit reads it afresh).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.audit
        salt '*' hana_storage.audit volumes=log
    """
    plan = _plan(pillar)
    if volumes:
        wanted = set(salt.utils.args.split_input(volumes))
        plan = dict(plan, volumes={n: v for n, v in plan["volumes"].items() if n in wanted})
    facts = _host("facts")(plan, reuse_lvm=bool(volumes))
    report = core.rules.audit(plan, facts)
    for name, disks in facts["disks"].items():  # kernel names, for the beacon to map uevents
        report["volumes"][name]["disks"] = disks
    if pillar is None and not volumes:
        __context__[LAST_FULL_AUDIT] = (time.monotonic(), report)  # for scap_record, in-process
    return report


# The beacon's full audit, kept in the loader's context for scap_record: the record is made of
# the host's own audit, never of a report a caller hands it (anyone who may publish
# hana_storage.* could otherwise write a passing SCAP result for any host).
LAST_FULL_AUDIT = "hana_storage.last_full_audit"
FRESH_AUDIT_SECONDS = 60


def evidence(pillar=None):
    """
    This host's part of the fleet's evidence report (``salt-run hana_storage.report
    format=html``): a full audit, each finding with the facts it was judged on (the device's
    dm table and its LUKS header's summary: parsed, never key material), and each volume's keys:
    source, key file mode and last change, the Tang servers and the thumbprints each device's
    Clevis binding names, header backups and their dates. Read-only.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.evidence
    """
    plan = _plan(pillar)
    facts = _host("facts")(plan)
    report = core.rules.audit(plan, facts)
    return core.evidence.host_evidence(plan, facts, report, __opts__.get("id", ""), time.time())


def scap_record():
    """
    Record this host's audit against its own pillar where the formula's SCAP data stream reads
    it, when ``hana:storage:compliance:scap`` is enabled: the status file
    /var/lib/hana-storage/audit.status (rule IDs, volume and device names, the boot and the
    uptime until which it counts; never key material), replaced whole. The beacon records each
    of its full audits (this process's full audit of the last minute); where no beacon runs,
    call it before a scan: it audits now.

    Returns ``{"written": the file or None, "error": why not, or None, "compliant"}``.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.scap_record
    """
    plan = _plan()
    stashed = __context__.get(LAST_FULL_AUDIT)
    if stashed is not None and time.monotonic() - stashed[0] < FRESH_AUDIT_SECONDS:
        report = stashed[1]
    else:
        report = audit()
    scap = plan["compliance"]["scap"]
    result = {"written": None, "error": None, "compliant": report["compliant"]}
    if not scap["enabled"]:
        return result
    ignored = set(plan["compliance"].get("ignore_rules", []))
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot_id = handle.read().strip()
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        text = core.scap.status_text(
            report,
            checked=[rule for rule in core.rules.RULES if rule not in ignored],
            host=__opts__.get("id", ""),
            audited=time.time(),
            boot_id=boot_id,
            uptime=uptime,
            max_age=scap["max_age"],
        )
        os.makedirs(os.path.dirname(core.scap.STATUS), mode=0o755, exist_ok=True)
        core.files.replace_file(core.scap.STATUS, text.encode(), mode=0o644)
    except (OSError, ValueError, IndexError) as error:
        log.error("hana_storage: cannot record the audit for SCAP in %s: %s", core.scap.STATUS, error)
        return dict(result, error=f"{core.scap.STATUS}: {error}")
    return dict(result, written=core.scap.STATUS)


def boot_readiness(clevis_timeout=None):
    """
    Will this host unlock its storage at the next boot, without Salt? For each /etc/crypttab
    line systemd opens at boot (not ``noauto``), whether the path it will take opens the device
    now: the device there, the key file there and opening the header (on a copy), or for a Clevis
    line the password agent and remote-cryptsetup.target enabled, ``_netdev`` on the line, and
    Clevis unlocking a keyslot now - which asks the Tang servers (or the TPM), unlike the audit.
    With a ``hana:storage`` pillar, a crypt device the boot should open (a key file or Tang
    volume) that no line names (``not_in_crypttab``), or whose line has ``noauto``, is not ready
    either; with an invalid one nothing is ready (what the boot should open is not known). Run it
    before a reboot or a patch day; it changes nothing.

    clevis_timeout
        Seconds Clevis may take to answer for a keyslot (default 30; the whole check gives Clevis
        four times that): more for a host whose TPM or Tang servers answer slowly.

    Returns ``{"ready": bool, "lines": [{"name", "device", "at_boot", "ready", "problems":
    [{"code", "cause", "fix"}]}]}`` (codes: ``core.readiness.PROBLEMS``), or ``{"ready": False,
    "error": ...}`` when /etc/crypttab cannot be read. The job's retcode is 1 unless ready.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.boot_readiness
        salt '*' hana_storage.boot_readiness clevis_timeout=90
    """
    seen = _host("boot_path")(**({} if clevis_timeout is None else {"clevis_timeout": clevis_timeout}))
    plan, invalid = _plan_if_any()
    if "error" in seen or invalid:
        result = {"ready": False, "error": seen.get("error") or invalid}
    else:
        result = core.readiness.verdict(seen["lines"], seen["facts"], plan)
    if not result["ready"]:
        __context__["retcode"] = 1
    return result


def _plan_if_any():
    """(the plan or None, why not): None without a ``hana:storage`` pillar (crypttab is all there
    is to judge); with an invalid one, what the formula should open at boot is not known."""
    if not salt.utils.data.traverse_dict_and_list(__pillar__, "hana:storage", {}):
        return None, None
    try:
        return _plan(), None
    except CommandExecutionError as error:
        return (
            None,
            f"the hana:storage pillar is invalid, so what the boot should open is not known: {error}"[:1000],
        )


def scap_datastream():
    """
    The formula's SCAP 1.3 source data stream (text): an XCCDF 1.2 benchmark with the profile
    ``xccdf_org.hana-storage-formula_profile_hana_storage``, one rule per audit rule, each with
    its references to the controls it evidences, checked by OVAL over the status file
    ``record_audit`` writes. ``hana.storage.compliance`` puts it at
    /usr/share/xml/scap/hana-storage/hana-storage-ds.xml.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.scap_datastream
    """
    return core.scap.datastream(core.VERSION)


# ---- remediation -----------------------------------------------------------------------------


SKIP_REASONS = {
    "manual_rule": "manual rule: never remediated automatically",
    "not_allowed": "not allowed by hana:storage:compliance:remediation",
    "not_mounted": "volume not mounted (HANA-MOUNT-001 is manual)",
    "no_fix": "no safe fix for this device",
}


REMEDIATION_PASSES = 2

# One remediation at a time on a host, the audit before its fixes and the one after included: a
# second one (another master's, or the same master's for another rule of the same drift) then
# audits what the first left and finds its finding fixed. Salt's state queue cannot order them:
# it sees jobs of state.* functions only, and this job is hana_storage.remediate.
REMEDIATION_LOCK = "remediate.lock"  # in <cachedir>/hana_storage (core.beacon_memory.memory_dir)
# seconds a remediation may wait in all: for the one before it, then for a state job running (an
# apply) before each fix. The master waits 600 s for the return (its REMEDIATE_TIMEOUT): a return
# after that is one it no longer reads, and the finding is remediated again.
REMEDIATION_WAIT = 300
_pause = time.sleep  # the state wait's poll (tests make it instant)


def remediate(rules=None, pillar=None):
    """
    Apply the safe fixes, and only those: dm-crypt flags (``cryptsetup refresh --persistent``),
    crypttab, fstab and live mount options, key file mode. Never formats, opens, closes or
    unmounts anything. Works from this minion's own audit, for the rules with a fix in the rule
    table (``core.rules.RULES``) that ``hana:storage:compliance:remediation:rules``
    allows (default: all of them).

    rules
        Only these rule IDs (a list or comma-separated); default: every auto rule (a manual
        one is never fixed here, so asking for it only reports it skipped).

    Returns ``{"result", "fixed", "failed", "skipped", "remaining"}``. ``remaining`` is what a
    second audit after the fixes still finds of those rules (the first one when nothing was
    fixed): a fix counts once that audit no longer finds it. ``result`` is True only when nothing
    of those rules is left: no fix failed, none was skipped, none remains. Each skipped entry
    names its ``code``: ``manual_rule`` (never remediated automatically), ``not_allowed`` (not in
    ``hana:storage:compliance:remediation``), ``not_mounted`` (fstab needs the volume mounted),
    ``no_fix`` (no safe fix for this device); ``reason`` says it in words.

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.remediate
        salt '*' hana_storage.remediate rules=HANA-PERF-002
    """
    plan = _plan(pillar)
    policy = plan["compliance"]["remediation"]
    auto = core.rules.auto_rules()
    allowed = set(policy.get("rules", auto)) if policy.get("enabled", True) else set()
    wanted = set(salt.utils.args.split_input(rules) if rules else auto)
    deadline = time.monotonic() + REMEDIATION_WAIT
    try:
        with core.beacon_memory.memory_dir(__opts__.get("cachedir")) as (directory, folder):
            with core.files.exclusive(REMEDIATION_LOCK, REMEDIATION_WAIT, dir_fd=directory) as held:
                if held:
                    return _remediate(plan, wanted, allowed, deadline)
        why = f"another remediation of this host held {folder}/{REMEDIATION_LOCK} for {REMEDIATION_WAIT} s"
    except (OSError, core.beacon_memory.MemoryProblem) as error:
        why = f"its lock cannot be taken: {error}"
    __context__["retcode"] = 1
    return {
        "result": False,
        "fixed": [],
        "failed": [
            {"rule": rule, "volume": None, "device": None, "comment": f"{why}: nothing was done"}
            for rule in sorted(wanted)
        ],
        "skipped": [],
        "remaining": [],
    }


def _remediate(plan, wanted, allowed, deadline):
    report = core.rules.audit(plan, _host("facts")(plan))
    fixed, failed, skipped = [], [], []
    done, seen = set(), set()
    # A fix may raise another finding (a flags fix makes the header backup stale): the audit after
    # the fixes is worked through once more, for what it finds that was not there before.
    for _pass in range(REMEDIATION_PASSES):
        new = [
            f
            for f in sorted(report["findings"], key=core.rules.fix_order)
            if f["rule"] in wanted and (f["rule"], f["volume"], f["device"]) not in seen
        ]
        changed = False
        for finding in new:
            rule = finding["rule"]
            seen.add((rule, finding["volume"], finding["device"]))
            entry = {"rule": rule, "volume": finding["volume"], "device": finding["device"]}
            fix = core.rules.fix_for(plan, finding, report["volumes"][finding["volume"]])
            if fix.get("code") != "manual_rule" and rule not in allowed:
                fix = {"code": "not_allowed"}
            if "code" in fix:
                skipped.append({**entry, "code": fix["code"], "reason": SKIP_REASONS[fix["code"]]})
                continue
            fun, kwargs = fix["state"], fix["kwargs"]
            if (fun, kwargs["name"]) in done:
                fixed.append({**entry, "changes": "fixed with an earlier finding"})
                continue
            done.add((fun, kwargs["name"]))
            state = _run_state(fun, kwargs, deadline)
            if state.get("result") is True:
                changed = True
                fixed.append({**entry, "changes": state.get("changes", {}), "comment": state.get("comment")})
            else:
                failed.append({**entry, "comment": state.get("comment")})
        if not changed:
            break
        report = core.rules.audit(plan, _host("facts")(plan))
    after = report
    remaining = [f for f in after["findings"] if f["rule"] in wanted]
    result = not failed and not skipped and not remaining
    if not result:
        __context__["retcode"] = 1
    return {"result": result, "fixed": fixed, "failed": failed, "skipped": skipped, "remaining": remaining}


def _run_state(fun, kwargs, deadline):
    """The return of state ``fun`` run now through ``state.single``: {"result", "comment", ...}.

    Never ``queue=True``: on Salt's current patch releases (3006.30, 3007.17, 3008.5) that files
    the call in the minion's state queue when any state job runs, or any job waits in its job
    queue, and returns {"result": True, "comment": "Job queued for execution"} at once - a fix
    that has not run. A state job running now (``state.running``) is waited for here until
    ``deadline`` (time.monotonic()). state.single also answers a list for errors of its own
    (a state function not synced: "Specified state ... was not found"), which are not waited on."""
    try:
        running = __salt__["state.running"]()
        while running:
            if time.monotonic() >= deadline:
                return {
                    "result": False,
                    "comment": f"a state job ran for all of the remediation's {REMEDIATION_WAIT} s: {running}",
                }
            _pause(2)
            running = __salt__["state.running"]()
        ret = __salt__["state.single"](fun, queue=False, **kwargs)
        if isinstance(ret, list) and __salt__["state.running"]() and time.monotonic() < deadline:
            return _run_state(fun, kwargs, deadline)  # a state job began between the look and the call
    except Exception as error:  # noqa: BLE001 - Salt's own errors (SaltInvocationError...): a failed fix
        return {
            "result": False,
            "comment": f"state.single {fun} raised {type(error).__name__}: {str(error)[:300]}",
        }
    state = next(iter(ret.values()), None) if isinstance(ret, dict) and len(ret) == 1 else None
    if isinstance(state, dict) and "result" in state:
        return state
    return {"result": False, "comment": f"state.single {fun} ran no state: {str(ret)[:500]}"}


# ---- the HANA I/O check ----------------------------------------------------------------------

IO_CHECK_DIR = ".hana_storage_io_check."
SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _run(argv):
    """Run a command; (stdout, error or None). Output is never logged."""
    result = __salt__["cmd.run_all"](argv, python_shell=False, output_loglevel="quiet", ignore_retcode=True)
    if result["retcode"]:
        return None, f"{argv[0]} exited {result['retcode']}: {result['stderr'].strip()[:300]}"
    return result["stdout"], None


def _size_bytes(size):
    text = str(size).strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (text[:-1], text[-1]) if text[-1:] in SIZE_UNITS else (text, "")
    if not (number.isascii() and number.isdigit()) or int(number) <= 0:
        raise CommandExecutionError(f"size {size!r}: expected a positive number with K, M, G or T")
    return int(number) * SIZE_UNITS[unit]


@contextlib.contextmanager
def _io_check_file(mountpoint, dev, size_bytes):
    """A new root-only test file on the filesystem mounted at ``mountpoint``, named to fio by
    ``/proc/<pid>/fd/<n>``, removed afterwards.

    Whoever can write the mount root (``<sid>adm``) could plant a symlink under any name: the
    directory and the file are created here with O_EXCL and O_NOFOLLOW relative to descriptors,
    and fio opens the very inode made here, never a path someone else can redirect.
    """
    root = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    directory = f"{IO_CHECK_DIR}{secrets.token_hex(8)}"
    handle = workdir = None
    try:
        st_dev = os.fstat(root).st_dev
        if f"{os.major(st_dev)}:{os.minor(st_dev)}" != dev:
            raise CommandExecutionError(f"{mountpoint} is not the root of the mount it was ({dev})")
        os.mkdir(directory, 0o700, dir_fd=root)
        workdir = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        handle = os.open("io_check", flags, 0o600, dir_fd=workdir)
        _lay_out(handle, size_bytes)
        yield core.files.fd_path(handle)
    finally:
        if handle is not None:
            os.close(handle)
            os.unlink("io_check", dir_fd=workdir)
        if workdir is not None:
            os.close(workdir)
            os.rmdir(directory, dir_fd=root)
        os.close(root)


def _lay_out(fd, size_bytes, chunk=1 << 20):
    """Write the test file to its full size, as fio's own layout would: fio re-creates a file that
    is too small by unlinking its name, which a /proc/<pid>/fd link does not allow."""
    zeros = bytes(chunk)
    written = 0
    while written < size_bytes:
        written += os.write(fd, zeros[: min(chunk, size_bytes - written)])
    os.fsync(fd)


def io_check(volumes=None, size="1G", runtime=30, kpis=None, pillar=None):
    """
    Measure a mounted HANA volume with fio, the way SAP HCMT's file-system tests do: the log as
    sequential overwrite (4K, 16K, 1M, queue depth 1), the data volume as random read and write
    (16K, 64K, 1M, 16M). Each job's MB/s and latency is checked against the KPIs (defaults: log
    250 MB/s with 1 MB blocks and 1 ms for 4K/16K, data 400 MB/s read and 250 MB/s write with 16 MB
    blocks; override with ``kpis={'log:write:1m': {'min_mb_s': 400}}``).

    Writes only a test file of ``size`` in a new root-only directory in the mountpoint (never
    through a path others can redirect), removed afterwards; a volume that is
    not mounted, or lacks the space, is refused (never measure the root filesystem underneath).
    Needs fio. Numbers from a virtual machine are the hypervisor's, not the storage's.

    CLI Example:

    .. code-block:: bash

        salt 'hana*' hana_storage.io_check volumes='[log, data]' size=4G runtime=60
    """
    if not salt.utils.path.which("fio"):
        raise CommandExecutionError("hana_storage.io_check needs fio (install the fio package)")
    plan = _plan(pillar)
    try:
        kpi_table = core.fio.kpis(kpis)
    except ValueError as error:  # the fio util's FioError
        raise CommandExecutionError(str(error)) from None
    names = (
        salt.utils.args.split_input(volumes)
        if volumes
        else [n for n in ("log", "data") if n in plan["volumes"]]
    )
    size_bytes = _size_bytes(size)
    report, passed = {}, True
    for name in names:
        volume = plan["volumes"].get(name)
        if volume is None:
            raise CommandExecutionError(f"volume {name!r} is not in hana:storage:volumes")
        mountpoint = volume["mountpoint"]
        dev = _host("mounted_at")(mountpoint)
        if not dev:
            raise CommandExecutionError(f"{mountpoint} is not mounted: refusing to measure what lies beneath")
        stats = os.statvfs(mountpoint)
        if stats.f_bavail * stats.f_frsize < size_bytes * 1.1:
            raise CommandExecutionError(f"{mountpoint} has less free space than {size} plus 10%")
        profile = "log" if name == "log" else "data"
        jobs = []
        with _io_check_file(mountpoint, dev, size_bytes) as path:
            for job in core.fio.profile_jobs(profile):
                out, error = _run(core.fio.fio_argv(path, job, size, int(runtime)))
                if error:
                    raise CommandExecutionError(f"fio on {mountpoint} ({job['rw']} {job['bs']}): {error}")
                try:
                    result = core.fio.parse_result(out)
                except ValueError as parse_error:
                    raise CommandExecutionError(f"fio on {mountpoint}: {parse_error}") from None
                check = core.fio.verdict(profile, job, result, kpi_table)
                passed = passed and (check is None or check["passed"])
                jobs.append({**job, **result, "kpi": check})
        report[name] = {"mountpoint": mountpoint, "profile": profile, "jobs": jobs}
    virtual = __grains__.get("virtual", "physical")
    result = {"passed": passed, "volumes": report, "size": size, "runtime_s": int(runtime)}
    if virtual != "physical":
        result["note"] = f"measured in a virtual machine ({virtual}): the numbers are the hypervisor's"
    if not passed:
        __context__["retcode"] = 1
    return result
