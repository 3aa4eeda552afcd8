"""The distributed tests use the server tests' helpers (tests/server/serving_helpers.py: serve_process, free_port,
run_serve), as the server tests do."""

import sys
from pathlib import Path

SERVER_TESTS = str(Path(__file__).resolve().parents[1] / "server")
if SERVER_TESTS not in sys.path:
    sys.path.insert(0, SERVER_TESTS)
