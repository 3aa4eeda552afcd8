"""Fixtures of the kernel tests."""

from __future__ import annotations

import os

import pytest

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
