"""Fixtures of the engine tests (helpers live in engine_oracles.py)."""

import pytest
import torch
from engine_oracles import tiny_model


@pytest.fixture(scope="session")
def model64():
    return tiny_model(torch.float64)


@pytest.fixture(scope="session")
def model32():
    return tiny_model(torch.float32)
