"""Fixtures of the server tests (the helpers live in serving_helpers.py): one tiny model directory and one live
server for the whole session."""

import pytest
from serving_helpers import save_tiny_model, start_server


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    save_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def server(model_dir):
    live = start_server(model_dir)
    yield live
    live.stop()
