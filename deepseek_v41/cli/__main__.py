"""``python -m deepseek_v41.cli``: the ``dsv41`` command line."""

from deepseek_v41.cli.main import app

app()
