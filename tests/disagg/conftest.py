"""The disaggregation tests use the server tests' helpers (tests/server/serving_helpers.py) and the engine tests'
oracles (tests/engine/engine_oracles.py)."""

import sys
from pathlib import Path

for folder in ("server", "engine"):
    path = str(Path(__file__).resolve().parents[1] / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
