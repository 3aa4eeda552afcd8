"""Fixtures of the kernel tests."""

from __future__ import annotations

import os

import pytest
from kernel_cases import ENTRY_POINTS
from kernel_oracles import count_calls

from deepseek_v41 import kernels


@pytest.fixture(scope="module", autouse=True)
def library():
    """The built kernel library: its absence skips these tests, but fails them under CI=true."""
    lib = kernels.library()
    if lib is None:
        message = "the fused CPU kernels could not be built or were turned off (DSV41_CPU_KERNELS=0)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must build them")
        pytest.skip(message)
    return lib


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of every kernel entry point (the callers look them up on the module at each call)."""
    return count_calls(monkeypatch, *ENTRY_POINTS)
