"""The ``dsv41`` command line (typer)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deepseek_v41.config import ConfigError, load_config
from deepseek_v41.server.cli import serve

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="DeepSeek-V4.1-Flash: model, inference engine and accounting.")


@app.callback()
def main() -> None:
    """DeepSeek-V4.1-Flash in PyTorch."""


@app.command()
def report(
    config: str = typer.Option("flash", help="Preset name (flash, tiny), a model directory or a config.json."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    plot: Path | None = typer.Option(None, help="Directory to write PNG plots into."),
) -> None:
    """KV bytes per token, window bytes, generations table: computed from the code."""
    from deepseek_v41.analysis.report import build_report, plot_report, print_report

    try:
        cfg = load_config(config)
    except (ConfigError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    data = build_report(cfg, name=config)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        print_report(data)
    if plot is not None:
        for path in plot_report(data, plot):
            typer.echo(f"wrote {path}", err=as_json)


app.command()(serve)


if __name__ == "__main__":
    app()
