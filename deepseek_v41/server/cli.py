"""``dsv41 serve``: load a model directory and serve the OpenAI-compatible API with uvicorn.

SIGTERM / SIGINT drain: the server stops accepting connections, ``/health`` turns 503, running requests get up to
``--drain-timeout`` seconds to finish, then the rest are aborted and the process exits. Heavy imports (torch,
FastAPI) happen inside the command so that ``dsv41 --help`` stays fast.
"""

from __future__ import annotations

import logging
from pathlib import Path

import typer

_DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "deepseek_v41" / "prefix-cache"


def serve(
    model: Path = typer.Option(..., "--model", help="Model directory (config.json, safetensors, tokenizer.json)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    api_key: list[str] = typer.Option([], "--api-key", help="Accepted bearer key (repeat for several); none = "
                                      "no auth. Each key gets its own prefix-cache salt."),
    served_model_name: list[str] = typer.Option([], "--served-model-name", help="Name(s) clients use as 'model' "
                                                "(repeatable; default: the --model path)."),
    max_model_len: int | None = typer.Option(None, help="Prompt + output tokens at most (default: the model's, "
                                             "capped at 32768)."),
    cache_dir: Path | None = typer.Option(None, help="Directory of the persistent prefix cache (default "
                                          "~/.cache/deepseek_v41/prefix-cache)."),
    max_num_seqs: int = typer.Option(64, help="Sequences in the running batch at most."),
    max_num_batched_tokens: int = typer.Option(4096, help="Tokens per engine step at most."),
    block_size: int = typer.Option(16, help="Tokens per KV page."),
    num_kv_pages: int | None = typer.Option(None, help="Pages in the global KV pool (default: from memory)."),
    kv_cache_memory_bytes: int | None = typer.Option(None, help="Byte budget of the global KV pool."),
    prefill_mode: str | None = typer.Option(None, help="'ced' (default when the layout allows) or 'exact'."),
    dtype: str = typer.Option("auto", help=f"Weights dtype: {', '.join(_DTYPES)} (auto = float32 on CPU, "
                              "bfloat16 on GPU)."),
    device: str = typer.Option("cpu", help="torch device, e.g. cpu or cuda."),
    seed: int = typer.Option(0, help="Seed of requests that do not give one."),
    threads: int | None = typer.Option(None, help="torch threads for the engine (1 avoids OpenMP spin-waits on a "
                                       "busy machine; default: torch's)."),
    enable_prefix_caching: bool = typer.Option(True, help="Share and persist the KV of common prefixes "
                                               "(SPEC.md §4.3)."),
    swa_pool_bytes: int | None = typer.Option(None, help="Host bytes for SWA snapshots (default 10% of RAM; "
                                              "0 = no snapshots, hits use replay)."),
    replay: str = typer.Option("bounded", help="Hits without a snapshot: 'bounded' (replay one window) or "
                               "'exact' (replay the whole prefix)."),
    redis_url: str | None = typer.Option(None, help="Share the SWA pool and the page index with other "
                                         "servers through Redis, e.g. redis://localhost:6379/0."),
    speculative: str | None = typer.Option(None, help="Speculative decoding: 'dspark' drafts with the checkpoint's "
                                          "DSpark draft (default: off)."),
    speculative_max_len: int | None = typer.Option(None, help="Drafts verified per step at most (default and "
                                                   "maximum: the checkpoint's dspark_block_size)."),
    max_body_mb: float = typer.Option(32.0, help="Largest request body, MiB."),
    drain_timeout: float = typer.Option(30.0, help="Seconds running requests get to finish on SIGTERM."),
    log_stats_interval: float = typer.Option(10.0, help="Seconds between throughput log lines (0 = off)."),
    log_level: str = typer.Option("info", help="uvicorn / server log level."),
) -> None:
    """Serve the OpenAI-compatible API (chat, completions, models, tokenize, metrics) for a model directory."""

    import torch

    from deepseek_v41.engine import LLM
    from deepseek_v41.engine.async_engine import AsyncLLMEngine
    from deepseek_v41.server.app import build_app
    from deepseek_v41.server.common import ServerConfig
    from deepseek_v41.server.launch import make_server

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("deepseek_v41.server")
    if dtype not in _DTYPES:
        raise typer.BadParameter(f"must be one of {', '.join(_DTYPES)}", param_hint="--dtype")
    if not model.is_dir():
        typer.echo(f"error: model directory {model} not found", err=True)
        raise typer.Exit(2)
    if threads is not None:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, "bfloat16" if dtype == "auto" and device != "cpu" else
                          "float32" if dtype == "auto" else dtype)
    engine_args = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       block_size=block_size, max_model_len=max_model_len, num_kv_pages=num_kv_pages,
                       kv_cache_memory_bytes=kv_cache_memory_bytes, prefill_mode=prefill_mode, seed=seed,
                       cache_dir=str(cache_dir or DEFAULT_CACHE_DIR),  # SPEC.md §4.3: serve persists by default
                       enable_prefix_caching=enable_prefix_caching, swa_pool_bytes=swa_pool_bytes, replay=replay,
                       redis_url=redis_url,
                       speculative=speculative, speculative_max_len=speculative_max_len)
    try:
        llm = LLM(model, dtype=torch_dtype, device=device, **engine_args)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    engine = AsyncLLMEngine(llm.engine)
    config = ServerConfig(served_model_names=served_model_name or [str(model)], model_path=str(model),
                          api_keys=list(api_key), max_body_bytes=int(max_body_mb * 1024 * 1024),
                          log_stats_interval_s=log_stats_interval, drain_timeout_s=drain_timeout)
    app = build_app(engine, config)
    server = make_server(app, host, port, drain_timeout, log_level)
    log.info("serving %s as %s on http://%s:%d (max_model_len %d, %d KV pages)", model, config.served_model_names,
             host, port, engine.max_model_len, engine.stats["kv_pages_total"])
    server.run()
