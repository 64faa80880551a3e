"""Inspect, audit and validate encrypted SAP HANA storage.

Interfaces (stable): ``settings``, ``validate_pillar``; later ``inspect``, ``luks_header``,
``dm_tables``, ``audit``, ``remediate``. Pure logic lives in ``_utils/hana_storage_*`` and is
reached through ``__utils__``; this module only gathers facts from the host.
"""

import json
import logging
import os
import stat

import salt.utils.data
import salt.utils.platform
import salt.utils.yaml
from salt.exceptions import CommandExecutionError

log = logging.getLogger(__name__)

__virtualname__ = "hana_storage"

SCHEMA_URL = "salt://hana/storage/schema.json"
DEFAULTS_URL = "salt://hana/storage/parameters/defaults.yaml"
SYSTEM_MOUNTS = ("/", "/boot", "/boot/efi", "/usr", "/var")


def __virtual__():
    if not salt.utils.platform.is_linux():
        return False, "hana_storage: only Linux has dm-crypt, LVM and XFS"
    return __virtualname__


def _pillar_utils():
    return __utils__["hana_storage_pillar.merge"], __utils__["hana_storage_pillar.validate"]


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
    return salt.utils.yaml.safe_load(_formula_file(DEFAULTS_URL)) or {}


def _read(path):
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return ""


def _block_tree(name):
    """sysfs names of a block device, its parent disk and everything it sits on (dm slaves)."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or not os.path.exists(f"/sys/class/block/{current}"):
            continue
        seen.add(current)
        real = os.path.realpath(f"/sys/class/block/{current}")
        parent = os.path.basename(os.path.dirname(real))
        if os.path.exists(f"/sys/class/block/{parent}/{current}"):  # a partition: add its disk
            todo.append(parent)
        slaves = f"/sys/class/block/{current}/slaves"
        if os.path.isdir(slaves):
            todo.extend(os.listdir(slaves))
    return seen


def _system_devices():
    """Device paths that hold the running system (/, /boot, /usr, /var, swap), disks included."""
    names = set()
    for line in _read("/proc/self/mountinfo").splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] in SYSTEM_MOUNTS:
            dev = os.path.realpath(f"/sys/dev/block/{fields[2]}")
            if os.path.exists(dev):
                names |= _block_tree(os.path.basename(dev))
    for line in _read("/proc/swaps").splitlines()[1:]:
        path = line.split()[0] if line.split() else ""
        if path.startswith("/dev/"):
            names |= _block_tree(os.path.basename(os.path.realpath(path)))
    return sorted(f"/dev/{name}" for name in names)


def _device_facts(config):
    facts = {}
    for volume in (config.get("volumes") or {}).values():
        for device in (volume or {}).get("devices", []) if isinstance(volume, dict) else []:
            if not isinstance(device, str):
                continue
            try:
                mode = os.stat(device).st_mode
                facts[device] = {
                    "exists": True,
                    "block": stat.S_ISBLK(mode),
                    "realpath": os.path.realpath(device),
                }
            except OSError:
                facts[device] = {"exists": False}
    return facts


def _merged(pillar=None):
    merge, _ = _pillar_utils()
    if pillar is None:
        # not pillar.get: Salt 3008 masks the values it returns outside renderers
        pillar = salt.utils.data.traverse_dict_and_list(__pillar__, "hana:storage", {})
    if not isinstance(pillar, dict):
        return None, [f"hana:storage: must be a mapping, got {type(pillar).__name__}"]
    return merge(_defaults(), pillar), []


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
    _, validate = _pillar_utils()
    facts = None
    if host_checks:
        facts = {"devices": _device_facts(config), "system_devices": _system_devices()}
    return validate(config, _schema(), facts)


def settings(pillar=None, host_checks=True):
    """
    The normalised plan the states, the audit and the beacon work from.

    Returns ``{"valid": bool, "errors": [...], "config": {...} or None}``; the config never
    carries key material (a pillar key is named by its pillar path instead).

    CLI Example:

    .. code-block:: bash

        salt '*' hana_storage.settings
    """
    errors = validate_pillar(pillar, host_checks=host_checks)
    if errors:
        return {"valid": False, "errors": errors, "config": None}
    config, _ = _merged(pillar)
    return {"valid": True, "errors": [], "config": __utils__["hana_storage_pillar.normalize"](config)}
