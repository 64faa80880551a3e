"""Shared test set-up: make the formula's pure modules importable without the Salt loader."""

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
for sub in ("_utils", "lab"):
    path = str(REPO / sub)
    if path not in sys.path:
        sys.path.insert(0, path)
