"""The ``dsv41`` command line: :data:`app` (typer) and its subcommands, one module each (``serve``, ``generate``;
the training, report and data commands in :mod:`deepseek_v41.cli.main`). The top layer of the package: nothing
in it imports this package (docs/ARCHITECTURE.md, tests/test_layers.py)."""

from deepseek_v41.cli.main import app

__all__ = ["app"]
