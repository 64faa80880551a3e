"""Shared test set-up: make the formula's pure modules importable without the Salt loader."""

import pathlib
import shutil
import sys
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
for sub in ("_utils", "lab"):
    path = str(REPO / sub)
    if path not in sys.path:
        sys.path.insert(0, path)


@pytest.fixture(scope="session")
def salt_factories_default_root_dir():
    """A root of its own for each session: pytest-salt-factories writes its daemon scripts there
    with this venv's site-packages baked in (a second Salt line must not start the first one's
    Salt), and daemons of an earlier session must not meet this one's keys. Short, under /tmp:
    Salt's unix sockets live below it."""
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"hsf{pathlib.Path(sys.prefix).name}-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


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


def pytest_configure(config):
    from tests.support.budget import ModuleBudget

    config.pluginmanager.register(ModuleBudget(), "hana-storage-module-budget")
