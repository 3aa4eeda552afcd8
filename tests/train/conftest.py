"""Fixtures of the training tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Train with one torch thread: small models, and a busy 2-core machine makes OpenMP spin-waits costly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
