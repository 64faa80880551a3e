"""The formula's own code, under the thin loader modules (``_modules``, ``_states``, ``_beacons``,
``_runners``, ``_engines``): parsers, the plan, the rules, the guard's verdicts, the events, the
triage store, and the few file operations the formula makes itself.

It lives under ``_utils/`` so that ``saltutil.sync_all`` (or ``sync_utils``) brings it to every
minion and master with the loader modules, from the same file_roots: Salt copies the package to
``<cachedir>/extmods/utils/hana_storage_core/``. The loaders of execution modules, states,
runners and engines put their utils directories on ``sys.path`` while they load a module, so
those modules ``import hana_storage_core`` like any package; the beacon loader does not, and
the beacon adds them itself. Salt's utils loader also loads the package, as a utils module it
never uses.

``fresh()`` is how a loader module imports it. Python keeps an imported package for the life of
the process, while ``saltutil.sync_all`` replaces its files under a running minion and reloads
the loader modules: a reloaded module would otherwise run on the package the process imported
first.
"""

import importlib
import os
import sys

from . import (  # noqa: F401 - the package's modules, as core.<module> for its users
    beacon_memory,
    commands,
    controls,
    crypto,
    dm,
    events,
    evidence,
    files,
    fio,
    inplace,
    kdf,
    kernel_watch,
    limits,
    luks,
    lun,
    lvm,
    move_runner,
    moves,
    pillar,
    readiness,
    reencrypt,
    report,
    rules,
    safety,
    scap,
    signing,
    stack,
    store,
    tab,
    tpm,
    xfs,
)

VERSION = "0.3.0"  # the formula's (FORMULA's version): in the SCAP data stream and the evidence report
HERE = os.path.dirname(os.path.abspath(__file__))


def _stamp():
    """What the package's files are now: each .py file's size and modification time."""
    stamp = {}
    for name in sorted(os.listdir(HERE)):
        if name.endswith(".py"):
            info = os.stat(os.path.join(HERE, name))
            stamp[name] = (info.st_size, info.st_mtime_ns)
    return stamp


LOADED = _stamp()


def fresh():
    """This package as its files are now: the one imported, unless a sync changed a file since;
    then the package and its modules are imported again (returned). Loader modules call it when
    they are loaded."""
    current = sys.modules[__name__]  # this module, or a newer import of it another module made
    try:
        if current._stamp() == current.LOADED:
            return current
    except OSError:
        return current  # the files are being replaced: the next load looks again
    for name in [n for n in sys.modules if n == __name__ or n.startswith(__name__ + ".")]:
        del sys.modules[name]
    return importlib.import_module(__name__)
