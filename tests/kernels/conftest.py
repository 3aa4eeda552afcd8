"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest
from kernel_cases import ENTRY_POINTS
from kernel_oracles import count_calls


@pytest.fixture(scope="module", autouse=True)
def library(kernel_library):
    """The built kernel library (tests/conftest.py's ``kernel_library``: turned off on purpose skips these tests; a
    library that could not be built skips them, but fails them under CI=true)."""
    return kernel_library


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of every kernel entry point (the callers look them up on the module at each call)."""
    return count_calls(monkeypatch, *ENTRY_POINTS)
