"""The disaggregation tests use the server tests' helpers (tests/server/serving_helpers.py), the engine tests'
oracles (tests/engine/engine_oracles.py) and the process helpers of the distributed tests."""

import sys
from pathlib import Path

for folder in ("server", "engine", "distributed"):
    path = str(Path(__file__).resolve().parents[1] / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
