"""The formula's pure modules (``_utils/hana_storage_*.py``) as Salt's loader hands them to a loader
module in ``__utils__``: ``{"hana_storage_<module>.<name>": object}``."""

import importlib

from tests.conftest import REPO

UTILS = {}
for path in sorted((REPO / "_utils").glob("hana_storage_*.py")):
    module = importlib.import_module(path.stem)
    UTILS |= {
        f"{path.stem}.{name}": getattr(module, name) for name in dir(module) if not name.startswith("_")
    }
