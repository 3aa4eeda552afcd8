"""Loading a script of ``bench/`` in a test (the scripts are not a package): :func:`load_bench`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str, module_name: str | None = None) -> ModuleType:
    """Execute ``bench/<script>.py`` as the module ``module_name`` (default: ``script``) and return it. ``bench/``
    goes on ``sys.path`` first, so the scripts' imports of each other (``from engine import ...``) work, and the
    module is registered in ``sys.modules`` before it runs (dataclasses look their module up while it executes)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(module_name or script, BENCH / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
