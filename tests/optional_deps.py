"""Optional test oracles: `require(name)` imports one, skipping the test when it is missing (failing under CI=true).

Imported as `from optional_deps import require` (a unique module name: every test folder shares `sys.path`)."""

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
