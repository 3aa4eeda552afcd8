"""Shared test helpers."""

import importlib
import os
from types import ModuleType

import pytest


def require(name: str) -> ModuleType:
    """Import an optional oracle package: skip the test when it is missing, but fail when CI=true."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is required in CI (install the test extra): {exc}")
        pytest.skip(f"{name} is not installed: {exc}")
