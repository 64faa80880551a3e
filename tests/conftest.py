"""Shared test set-up: make the formula's pure modules importable without the Salt loader."""

import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
for sub in ("_utils", "lab"):
    path = str(REPO / sub)
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="session")
def salt_factories_default_root_dir():
    """One root per venv (Salt line): pytest-salt-factories writes its daemon scripts there once,
    with that venv's site-packages baked in, and a second line must not start the first one's Salt.
    Short, under /tmp: Salt's unix sockets live below it."""
    root = pathlib.Path("/tmp") / f"hsf{pathlib.Path(sys.prefix).name}"
    root.mkdir(mode=0o700, exist_ok=True)
    return root


def shipped_reactor():
    """The reactor map of conf/master.d/hana-storage.conf, its paths pointed at this checkout."""
    import yaml

    conf = yaml.safe_load((REPO / "conf" / "master.d" / "hana-storage.conf").read_text())
    checkout = "/srv/formulas/hana-storage-formula"
    return [
        {tag: [path.replace(checkout, str(REPO)) for path in paths]}
        for entry in conf["reactor"]
        for tag, paths in entry.items()
    ]


def pytest_sessionfinish(session, exitstatus):
    """Drop what Salt's deferred start-up log handler queued during the tests.

    Importing Salt installs a handler that keeps records until logging is configured and prints
    them at exit - by then to pytest's closed capture stream, which only produces noise.
    """
    try:
        from salt._logging import impl
    except ImportError:
        return
    handler = impl.get_temp_handler()
    if handler is not None:
        handler.sync_with_handlers([])
