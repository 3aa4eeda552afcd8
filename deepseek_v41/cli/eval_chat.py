"""``dsv41 eval-chat`` and ``dsv41 eval-chat-table``: a checkpoint on the held-out chat split, and the model card's
tables comparing such reports (:mod:`deepseek_v41.train.chat_eval`).

``eval-chat`` prints a summary on stdout (``--json``: the report instead), progress on stderr (a bar on a terminal,
else a line every few seconds) and a line of running metrics every ``--log-every`` answers. A bad file or option
exits with status 2 and an ``error: ...`` line; a constrained answer that ended and is not a valid call exits with
status 1 after the report is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from deepseek_v41.config import ConfigError
from deepseek_v41.progress import Progress
from deepseek_v41.train.chat_eval import (
    MAX_TOKENS,
    ChatEvalError,
    ConstrainedCallError,
    card_tables,
    eval_chat_command,
    json_safe,
)


def eval_chat(
    model: Path = typer.Option(..., help="Model folder (config.json, safetensors, tokenizer.json)."),
    data: Path = typer.Option(..., help="Held-out chat records (heldout.jsonl of the chat data)."),
    limit: int | None = typer.Option(None, help="Evaluate the first N records only (default: all)."),
    out: Path | None = typer.Option(None, help="Write the JSON report here (per-kind counts, metrics, records)."),
    max_tokens: int = typer.Option(MAX_TOKENS, help="Greedy tokens per answer at most."),
    batch_size: int = typer.Option(8, help="Records answered together (max_num_seqs)."),
    max_model_len: int = typer.Option(4096, help="Tokens per sequence; longer prompts are skipped and counted."),
    dtype: str = typer.Option("float32", help="auto | bfloat16 | float32 | float16."),
    device: str = typer.Option("cpu", help="torch device."),
    threads: int | None = typer.Option(None, help="torch threads (1 avoids OpenMP spin-waits on a busy machine)."),
    log_every: int = typer.Option(25, help="A line of running metrics on stderr every N answers."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
) -> None:
    """Answer quality and tool-call rates of a checkpoint on the held-out chat split (greedy)."""
    if log_every < 1:
        typer.echo(f"error: --log-every must be at least 1, got {log_every}", err=True)
        raise typer.Exit(2)
    try:
        with Progress("dsv41 eval-chat", unit="answers") as progress:
            report = eval_chat_command(model, data, limit, out, max_tokens, batch_size, max_model_len, dtype, device,
                                       threads, progress=progress, log=lambda line: typer.echo(line, err=True),
                                       log_every=log_every)
    except ConstrainedCallError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    except (FileNotFoundError, ChatEvalError, ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(json.dumps(json_safe(report), indent=2, ensure_ascii=False))
        return
    typer.echo(card_tables({model.name: report}))
    if out is not None:
        typer.echo(f"report written to {out}")


def eval_chat_table(
    reports: list[str] = typer.Argument(..., help="NAME=REPORT.json pairs (or REPORT.json: named by its model)."),
) -> None:
    """Print the model card's Markdown tables comparing `dsv41 eval-chat` reports (e.g. plain against chat)."""
    loaded = {}
    for spec in reports:
        name, _, path = spec.rpartition("=")
        try:
            report = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(report, dict) or not {"answers", "tool_calls", "no_tool"} <= set(report):
                raise ValueError("it lacks the answers / tool_calls / no_tool of a report")
            label = name or Path(report["model"]).name
            if label in loaded:
                raise ValueError(f"the name {label!r} is given twice; name each report (NAME=REPORT.json)")
            loaded[label] = report
        except (OSError, ValueError, KeyError, TypeError) as exc:
            typer.echo(f"error: {spec}: not an eval-chat report ({exc})", err=True)
            raise typer.Exit(2) from exc
    typer.echo(card_tables(loaded))
