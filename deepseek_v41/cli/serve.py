"""``dsv41 serve``: load a model directory and serve the OpenAI-compatible API with uvicorn.

SIGTERM / SIGINT drain: the server stops accepting connections, ``/health`` turns 503, running requests get up to
``--drain-timeout`` seconds to finish, then the rest are aborted and the process exits. A failure of the engine
loop is permanent: every request in flight gets the 503 ``engine_dead``, the cause is logged and the process exits
with status 1 within seconds, so that a supervisor restarts it (as vLLM does). Heavy imports (torch,
FastAPI) happen inside the command so that ``dsv41 --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from pathlib import Path
from typing import NoReturn

import torch
import typer

from deepseek_v41 import __version__
from deepseek_v41.cli import parallel
from deepseek_v41.config import ConfigError
from deepseek_v41.disagg.config import ECTransferConfig, KVTransferConfig
from deepseek_v41.disagg.encoder_only import describe_load
from deepseek_v41.dtypes import DTYPES
from deepseek_v41.dtypes import resolve_dtype as resolve
from deepseek_v41.engine import LLM
from deepseek_v41.engine import options as engine_options
from deepseek_v41.engine.async_engine import AsyncLLMEngine, engine_thread
from deepseek_v41.engine.data_parallel import DataParallelEngine
from deepseek_v41.model.checkpoint import CheckpointError
from deepseek_v41.server import options
from deepseek_v41.server.app import build_app
from deepseek_v41.server.common import ServerConfig
from deepseek_v41.server.encode_app import build_encode_app
from deepseek_v41.server.generation_config import GenerationConfigError, describe, load_sampling_defaults
from deepseek_v41.server.launch import ConnectionLimits, make_server
from deepseek_v41.server.media import (
    DEFAULT_MAX_IMAGE_BYTES,
    MediaConfig,
    env_allow_redirects,
    env_fetch_timeout,
    parse_limit_mm_per_prompt,
)
from deepseek_v41.server.media import (
    describe as describe_media,
)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "deepseek_v41" / "prefix-cache"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
REPLAY_MODES = ("bounded", "exact")


def fail(message: str) -> NoReturn:
    """Print ``error: message`` on stderr and exit with status 2 (a usage error, as click's own checks)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def available_devices() -> list[str]:
    """The torch devices this process can run on: ``cpu``, then ``cuda`` / ``cuda:0`` ... and ``mps`` when present."""

    out = ["cpu"]
    if torch.cuda.is_available():
        out += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def check_device(device: str, option: str = "--device"):
    """``device`` parsed as a ``torch.device`` that exists here; exits 2 with the available devices otherwise (a
    malformed name, CUDA on a CPU-only torch or machine, a CUDA index beyond the GPUs, a type this CLI cannot
    run on such as ``meta``)."""

    available = ", ".join(available_devices())
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        fail(f"{option} {device!r} is not a torch device name; available here: {available}")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            fail(f"{option} {device!r}: {why}; available here: {available}")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            fail(f"{option} {device!r}: there are {torch.cuda.device_count()} CUDA device(s); available here: "
                 f"{available}")
    elif parsed.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            fail(f"{option} {device!r}: MPS is not available; available here: {available}")
    elif parsed.type != "cpu":
        fail(f"{option} {device!r}: device type {parsed.type!r} is not supported (cpu, cuda or mps); available "
             f"here: {available}")
    return parsed


def resolve_dtype(dtype: str, device, model_dir: Path | None = None, option: str = "--dtype"):
    """The torch dtype of ``--dtype`` (one of :data:`DTYPES`; ``auto`` = the torch_dtype ``model_dir``'s config
    records, else bfloat16 where ``device`` computes bf16 natively, else float32:
    :func:`deepseek_v41.dtypes.resolve_dtype`) for the parsed ``device``; exits 2 with the reason and the allowed
    values otherwise."""

    try:
        return resolve(dtype, device, model_dir, option)
    except ValueError as exc:
        fail(str(exc))


def _positive_int(value: str, flag: str) -> int:
    """A ``flag`` value as an integer >= 1, vLLM's ``k`` / ``K`` suffixes allowed (:func:`options.human_readable_int`);
    a usage error (exit 2) naming the flag otherwise."""
    try:
        number = options.human_readable_int(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if number < 1:
        raise typer.BadParameter(f"{number} is not >= 1")
    return number


def choose_model(positional: Path | None, option: Path | None, usage: str) -> Path:
    """The model directory given as the positional MODEL or as ``--model`` (either, or both when they name the same
    directory), as ``vllm serve MODEL``; exits 2 when they differ or neither is given (``usage`` shows the form)."""
    if positional is not None and option is not None and positional.resolve() != option.resolve():
        fail(f"the model is given twice and differently: MODEL {positional} and --model {option}; give one")
    model = positional if positional is not None else option
    if model is None:
        fail(f"give the model directory: {usage} (or --model MODEL)")
    return model


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    out = []
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def _remove_created(dirs: list[Path]) -> None:
    """After a failed start: remove the directories of :func:`_missing_dirs` (they did not exist before this
    process) as far as they are empty, empty subdirectories the engine made in them included; files are never
    deleted, so a directory holding one stays."""
    if not dirs:
        return
    for root, _, _ in os.walk(dirs[-1], topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(root)


def _print_version(value: bool) -> None:
    if value:

        typer.echo(__version__)
        raise typer.Exit()


def serve(
    model_tag: Path | None = typer.Argument(None, metavar="MODEL", show_default=False, help="Model directory "
                                           "(config.json, safetensors, tokenizer.json), as `vllm serve MODEL`."),
    model: Path | None = typer.Option(None, "--model", help="The model directory, as the positional MODEL."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=1, max=65535, help="Port to listen on."),
    api_key: list[str] = typer.Option([], "--api-key", help="Accepted bearer key (repeat for several; default: "
                                      "$DSV41_API_KEY, else $VLLM_API_KEY); none = no auth. Each key gets its own "
                                      "prefix-cache salt."),
    served_model_name: list[str] = typer.Option([], "--served-model-name", help="Name(s) clients use as 'model' "
                                                "(repeatable; default: the model directory's name)."),
    max_model_len: int | None = typer.Option(None, parser=lambda v: _positive_int(v, "--max-model-len"),
                                             metavar="INTEGER", help="Prompt + output tokens at most, e.g. 4096, "
                                             "4k (= 4000) or 4K (= 4096) (default: the model's, capped at 32768)."),
    cache_dir: Path | None = typer.Option(None, help="Directory of the persistent prefix cache (default "
                                          "~/.cache/deepseek_v41/prefix-cache); created once the settings are "
                                          "checked."),
    max_num_seqs: int = typer.Option(64, min=1, help="Sequences in the running batch at most."),
    max_num_batched_tokens: int = typer.Option(4096, min=1, help="Tokens per engine step at most."),
    block_size: int = typer.Option(16, min=1, help="Tokens per KV page."),
    num_kv_pages: int | None = typer.Option(None, min=1, help="Pages in the global KV pool (default: from "
                                            "memory)."),
    kv_cache_memory_bytes: int | None = typer.Option(None, min=1, help="Byte budget of the global KV pool."),
    prefill_mode: str | None = typer.Option(None, help="'ced' (default when the layout allows) or 'exact'."),
    dtype: str = typer.Option("auto", help=f"Weights dtype: {', '.join(DTYPES)} (auto = the checkpoint's "
                              "torch_dtype, else bfloat16 where the device has native bf16, else float32)."),
    device: str = typer.Option("cpu", help="torch device, e.g. cpu, cuda or cuda:1 (checked at start)."),
    seed: int = typer.Option(0, help="Seed of requests that do not give one."),
    threads: int | None = typer.Option(None, min=1, help="torch threads for the engine (1 avoids OpenMP "
                                       "spin-waits on a busy machine; default: torch's)."),
    enable_prefix_caching: bool = typer.Option(True, help="Share and persist the KV of common prefixes "
                                               "(SPEC.md §4.3)."),
    swa_pool_bytes: int | None = typer.Option(None, min=0, help="Host bytes for SWA snapshots (default 10% of "
                                              "RAM; 0 = no snapshots, hits use replay)."),
    replay: str = typer.Option("bounded", help="Hits without a snapshot: 'bounded' (replay one window) or "
                               "'exact' (replay the whole prefix)."),
    redis_url: str | None = typer.Option(None, help="Share the SWA snapshots and the KV pages with other "
                                         "servers through Redis, e.g. redis://localhost:6379/0."),
    speculative: str | None = typer.Option(None, help="Speculative decoding: 'dspark' drafts with the checkpoint's "
                                          "DSpark draft (default: off)."),
    speculative_max_len: int | None = typer.Option(None, min=1, help="Drafts verified per step at most (default "
                                                   "and maximum: the checkpoint's dspark_block_size)."),
    max_body_mb: float = typer.Option(32.0, help="Largest request body, MiB (> 0)."),
    drain_timeout: float = typer.Option(30.0, min=0, help="Seconds running requests get to finish on SIGTERM or "
                                                           "SIGINT (Ctrl-C)."),
    timeout_keep_alive: float = typer.Option(5.0, help="Seconds an idle kept-alive connection stays open (> 0; "
                                             "uvicorn's default)."),
    timeout_header: float = typer.Option(10.0, help="Seconds a client has to send a whole request head (> 0); "
                                         "then 408 and the connection is closed."),
    timeout_body: float = typer.Option(60.0, help="Seconds a client has to send a whole request body once its "
                                       "head arrived (> 0); then 408 and the connection is closed."),
    timeout_write: float = typer.Option(60.0, help="Seconds a response may stall on a client that reads nothing "
                                        "(> 0); then the connection is dropped and its request aborted."),
    limit_concurrency: int | None = typer.Option(None, min=1, help="Open connections at most; a new one beyond "
                                                 "gets a 503 (default: the open-file limit minus 128, at most "
                                                 "4096)."),
    log_stats_interval: float = typer.Option(10.0, min=0, help="Seconds between throughput log lines (0 = off)."),
    log_level: str = typer.Option("info", help=f"uvicorn / server log level: {', '.join(LOG_LEVELS)}."),
    uvicorn_log_level: str | None = typer.Option(None, help="Log level of uvicorn alone (default: the one of "
                                                 "--log-level)."),
    generation_config: str = typer.Option("auto", help="Sampling defaults for requests that do not set them: "
                                          "'auto' = the model's generation_config.json (temperature, top_p, top_k, "
                                          "min_p, repetition_penalty, max_new_tokens -> max_tokens), 'vllm' = none, "
                                          "or a folder holding a generation_config.json."),
    override_generation_config: str | None = typer.Option(None, help="JSON object over the generation config, "
                                                          "e.g. '{\"temperature\": 0.6}' (vLLM's)."),
    structured_outputs_config: str | None = typer.Option(None, help="Constrained decoding, a JSON object (vLLM's): "
                                                         "'{\"backend\": \"auto\"|\"xgrammar\"|\"guidance\", "
                                                         "\"disable_any_whitespace\": true|false}' (default: "
                                                         "auto, true)."),
    allowed_media_domains: list[str] = typer.Option([], "--allowed-media-domains", help="Hosts image URLs may be "
                                                    "fetched from (repeatable or comma-separated; '*' = any). "
                                                    "Default: none, URL fetching is off (data URLs always work)."),
    allowed_local_media_path: Path | None = typer.Option(None, help="Directory file:// image URLs may read below "
                                                         "(default: none, file URLs are refused)."),
    limit_mm_per_prompt: str | None = typer.Option(None, help="Images per request at most, as vLLM: "
                                                   "'{\"image\": N}' (default 16)."),
    media_fetch_timeout: float | None = typer.Option(None, help="Seconds one image URL fetch may take in all "
                                                     "(default: $VLLM_IMAGE_FETCH_TIMEOUT, else 5)."),
    max_image_bytes: int | None = typer.Option(None, parser=lambda v: _positive_int(v, "--max-image-bytes"),
                                               metavar="INTEGER", help="Encoded bytes per image at most (fetched, "
                                               "read or in a data URL), e.g. 5M (default 20M = 20 MiB)."),
    encoder_cache_size: int | None = typer.Option(None, min=0, help="Encoder cache budget in encoder tokens "
                                                  "(aligner rows) of a model with a vision tower: images seen again "
                                                  "are not re-encoded (default 16 x max_image_tokens; 0 = none)."),
    allowed_origins: str = typer.Option('["*"]', help="CORS: allowed origins, a JSON list or one value."),
    allowed_methods: str = typer.Option('["*"]', help="CORS: allowed methods, a JSON list or one value."),
    allowed_headers: str = typer.Option('["*"]', help="CORS: allowed headers, a JSON list or one value."),
    allow_credentials: bool = typer.Option(False, "--allow-credentials", help="CORS: allow credentials."),
    gpu_memory_utilization: float | None = typer.Option(None, help="Fraction of the memory free once the weights "
                                                        "are loaded (device memory; RAM on CPU) the KV pool may "
                                                        "take, in (0, 1]; an upper bound: the pool holds at most "
                                                        "max_num_seqs x max_model_len tokens (default: that, at "
                                                        "most 1 GiB)."),
    kv_cache_dtype: str = typer.Option("auto", help="Only 'auto': the KV format is fixed by the model."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Accepted for vLLM scripts: the engine "
                                       "always runs eagerly (no CUDA graphs)."),
    enable_log_requests: bool = typer.Option(False, "--enable-log-requests", help="Log one line per request "
                                             "(id, prompt tokens, sampling parameters; never the prompt)."),
    disable_log_requests: bool = typer.Option(False, "--disable-log-requests", help="Accepted for vLLM "
                                              "scripts: requests are not logged unless --enable-log-requests."),
    enable_auto_tool_choice: bool = typer.Option(False, "--enable-auto-tool-choice", help="Accepted for vLLM "
                                                 "scripts: tool_choice 'auto' is always served."),
    tool_call_parser: str | None = typer.Option(None, help="Only 'deepseek_v41' (the model's DSML tool calls "
                                                "are always parsed)."),
    chat_template: str | None = typer.Option(None, help="Refused: V4.1 prompts come from the official encoder, "
                                             "not a Jinja template."),
    disable_log_stats: bool = typer.Option(False, "--disable-log-stats", help="Same as --log-stats-interval 0 (no "
                                           "throughput log lines)."),
    kv_transfer_config: str | None = typer.Option(None, help="Disaggregated prefill / decode (vLLM's): a JSON "
                                                  "object '{\"kv_connector\": \"SharedStorageConnector\" | "
                                                  "\"RedisConnector\" | \"NixlConnector\", \"kv_role\": "
                                                  "\"kv_producer\" | \"kv_consumer\" | \"kv_both\", "
                                                  "\"kv_connector_extra_config\": {...}}' (README: Disaggregated "
                                                  "serving)."),
    ec_transfer_config: str | None = typer.Option(None, help="Disaggregated vision encoding: '{\"ec_connector\": "
                                                  "\"SharedStorageConnector\", \"ec_role\": \"ec_producer\" | "
                                                  "\"ec_consumer\" | \"ec_both\", \"ec_connector_extra_config\": "
                                                  "{\"shared_storage_path\": DIR}}'."),
    tensor_parallel_size: int = parallel.tensor_parallel_size_option(),
    enable_expert_parallel: bool = parallel.enable_expert_parallel_option(),
    expert_parallel_size: int | None = parallel.expert_parallel_size_option(),
    distributed_executor_backend: str | None = parallel.backend_option(),
    nnodes: int = parallel.nnodes_option(),
    node_rank: int = parallel.node_rank_option(),
    master_addr: str = parallel.master_addr_option(),
    master_port: int = parallel.master_port_option(),
    headless: bool = parallel.headless_option(),
    distributed_timeout_s: float = parallel.timeout_option(),
    shard_engram: bool = parallel.shard_engram_option(),
    data_parallel_size: int = parallel.data_parallel_size_option(),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", "-pp", help="Only 1 (no pipeline "
                                               "parallelism)."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Accepted for vLLM scripts: no "
                                           "code from the model directory is ever run."),
) -> None:
    """Serve the OpenAI-compatible API (chat, completions, models, tokenize, metrics) for a model directory.

    Every setting is checked before anything is loaded or created: a bad one exits with status 2 and a message on
    stderr, and leaves no cache directory behind (one the start created is removed again if the start fails).
    """
    api_key = api_keys(api_key)
    # Checks that need no heavy import come first, so that a typo fails fast.
    model = choose_model(model_tag, model, "dsv41 serve MODEL")
    for flag, level in (("--log-level", log_level), ("--uvicorn-log-level", uvicorn_log_level)):
        if level is not None and level.lower() not in LOG_LEVELS:
            fail(f"{flag} must be one of {', '.join(LOG_LEVELS)}, got {level!r}")

    if chat_template is not None:
        fail(options.chat_template_refusal(chat_template))
    for why in (options.check_tool_call_parser(tool_call_parser),
                engine_options.check_kv_cache_dtype(kv_cache_dtype, "--kv-cache-dtype")):
        if why is not None:
            fail(why)
    try:
        cors = {name: options.json_list(value, flag) for name, value, flag in (
            ("allow_origins", allowed_origins, "--allowed-origins"),
            ("allow_methods", allowed_methods, "--allowed-methods"),
            ("allow_headers", allowed_headers, "--allowed-headers"))}
    except ValueError as exc:
        fail(str(exc))
    if enable_log_requests and disable_log_requests:
        fail("--enable-log-requests and --disable-log-requests contradict each other; give one")
    why = engine_options.check_parallel_size("--pipeline-parallel-size", pipeline_parallel_size)
    if why is not None:
        fail(why)
    parallel_config = parallel.parallel_config(fail, tensor_parallel_size, enable_expert_parallel,
                                               expert_parallel_size, distributed_executor_backend, nnodes, node_rank,
                                               master_addr, master_port, headless, distributed_timeout_s,
                                               shard_engram, data_parallel_size)
    if disable_log_stats:
        log_stats_interval = 0.0
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        fail(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not max_body_mb > 0:
        fail(f"--max-body-mb must be > 0, got {max_body_mb}")
    for flag, value in (("--timeout-keep-alive", timeout_keep_alive), ("--timeout-header", timeout_header),
                        ("--timeout-body", timeout_body), ("--timeout-write", timeout_write)):
        if not value > 0:
            fail(f"{flag} must be > 0 seconds, got {value}")
    if replay not in REPLAY_MODES:
        fail(f"--replay must be one of {', '.join(REPLAY_MODES)}, got {replay!r}")
    if speculative_max_len is not None and speculative is None:
        fail("--speculative-max-len needs --speculative dspark (speculative decoding is off)")
    if not model.is_dir():
        fail(f"model directory {model} not found")
    try:
        kv_transfer = None if kv_transfer_config is None else KVTransferConfig.from_cli(kv_transfer_config)
        ec_transfer = None if ec_transfer_config is None else ECTransferConfig.from_cli(ec_transfer_config)
    except ValueError as exc:
        fail(str(exc))
    media = _media_config(allowed_media_domains, allowed_local_media_path, limit_mm_per_prompt, media_fetch_timeout,
                          max_image_bytes)


    try:
        defaults, defaults_origin = load_sampling_defaults(generation_config, model, override_generation_config)
    except GenerationConfigError as exc:
        fail(str(exc))
    structured = None
    if structured_outputs_config is not None:
        try:
            structured = json.loads(structured_outputs_config)
        except json.JSONDecodeError as exc:
            fail(f"--structured-outputs-config must be a JSON object, e.g. '{{\"backend\": \"xgrammar\"}}': {exc}")
        if not isinstance(structured, dict):
            fail(f"--structured-outputs-config must be a JSON object, got {structured_outputs_config!r}")


    torch_device = check_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, model)


    logging.basicConfig(level=log_level.upper() if log_level.lower() != "trace" else 5,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("deepseek_v41.server")
    if parallel_config.headless:
        log.info("headless node %d of %d: running ranks for the engine at %s:%d", node_rank, nnodes, master_addr,
                 master_port)
        parallel.run_headless(parallel_config, model)
    if threads is not None:
        torch.set_num_threads(threads)
    cache_path = (cache_dir or DEFAULT_CACHE_DIR).expanduser()
    engine_args = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       block_size=block_size, max_model_len=max_model_len, num_kv_pages=num_kv_pages,
                       kv_cache_memory_bytes=kv_cache_memory_bytes, prefill_mode=prefill_mode, seed=seed,
                       cache_dir=str(cache_path),  # SPEC.md §4.3: serve persists by default
                       enable_prefix_caching=enable_prefix_caching, swa_pool_bytes=swa_pool_bytes, replay=replay,
                       redis_url=redis_url,
                       speculative=speculative, speculative_max_len=speculative_max_len,
                       structured_outputs_config=structured, encoder_cache_size=encoder_cache_size,
                       kv_transfer_config=kv_transfer,
                       ec_transfer_config=None if ec_transfer is None else ec_transfer.to_dict())
    # LLM turns the fraction into the pool's budget (engine.options) and logs the budget and the pool allocated.
    vllm_options = dict(gpu_memory_utilization=gpu_memory_utilization, pipeline_parallel_size=pipeline_parallel_size,
                        kv_cache_dtype=kv_cache_dtype, trust_remote_code=trust_remote_code,
                        **parallel.llm_kwargs(parallel_config))
    if ec_transfer is not None and ec_transfer.encode_only:
        if kv_transfer is not None:
            fail("an encode server (ec_role ec_producer) runs the vision tower only: it takes no "
                 "--kv-transfer-config")
        _serve_encoder(model, ec_transfer, torch_dtype, torch_device, served_model_name, media, encoder_cache_size,
                       api_key, max_body_mb, host, port, drain_timeout, (uvicorn_log_level or log_level).lower(),
                       ConnectionLimits(timeout_keep_alive, timeout_header, timeout_body, limit_concurrency,
                                        timeout_write), log)
        return
    created = _missing_dirs(cache_path)  # what the engine's persistent store will create
    started = False
    llms: list[LLM] = []
    try:
        replicas = parallel_config.data_parallel_size
        if replicas > 1 and vllm_options["gpu_memory_utilization"] is not None:  # the device's share, split
            vllm_options["gpu_memory_utilization"] /= replicas
        # A one-process engine loads on the thread that will step it (engine_thread: one OpenMP team); a
        # multi-rank engine loads here, on the thread its worker processes stay tied to (PR_SET_PDEATHSIG).
        threads = [engine_thread() if parallel_config.world_size == 1 else None for _ in range(replicas)]
        try:
            for thread in threads:  # each replica its own engine and KV pool
                build = functools.partial(LLM, model, dtype=torch_dtype, device=str(torch_device), **vllm_options,
                                          **engine_args)
                if thread is None:
                    llms.append(build())
                    continue
                loading = thread.submit(build)
                try:
                    llms.append(loading.result())
                except KeyboardInterrupt:
                    # Ctrl-C during the load: the engine thread cannot be interrupted and the interpreter would
                    # wait for it at exit, i.e. for the whole load. Clean up and leave now, as a Ctrl-C exits.
                    log.warning("interrupted while loading the model: exiting")
                    for replica in llms:
                        replica.shutdown()
                    _remove_created(created)
                    logging.shutdown()
                    os._exit(130)
        except (ValueError, FileNotFoundError, ConfigError, CheckpointError) as exc:
            fail(str(exc))
        except RuntimeError as exc:  # a worker rank failed to start (named in the message)
            log.error("%s", exc)
            raise typer.Exit(1) from exc
        llm = llms[0]
        engine = AsyncLLMEngine(llm.engine, executor=threads[0]) if len(llms) == 1 else \
            DataParallelEngine([AsyncLLMEngine(replica.engine, executor=thread)
                                for replica, thread in zip(llms, threads, strict=True)])
        if len(llms) > 1:
            log.info("data parallel: %d engine replicas, each its own KV pool, sharing %s; requests routed by "
                     "prefix affinity, else to the least loaded replica", len(llms), cache_path)
        config = ServerConfig(served_model_names=served_model_name or [default_model_name(model)],
                              model_aliases=[] if served_model_name else model_path_aliases(model),
                              model_path=str(model), api_keys=api_key, sampling_defaults_origin=defaults_origin,
                              max_body_bytes=int(max_body_mb * 1024 * 1024), log_stats_interval_s=log_stats_interval,
                              drain_timeout_s=drain_timeout, sampling_defaults=defaults, **cors,
                              allow_credentials=allow_credentials, log_requests=enable_log_requests, media=media,
                              dev_mode=os.environ.get("DSV41_SERVER_DEV_MODE", "0") not in ("", "0"))
        app = build_app(engine, config)
        if config.dev_mode:
            log.warning("DSV41_SERVER_DEV_MODE: development routes on (POST /reset_prefix_cache), guarded by no "
                        "API key; do not serve them on a public address")
        limits = ConnectionLimits(timeout_keep_alive, timeout_header, timeout_body, limit_concurrency, timeout_write)
        server = make_server(app, host, port, drain_timeout, (uvicorn_log_level or log_level).lower(), limits)
        log.info("serving %s as %s on http://%s:%d (max_model_len %d, %d KV pages, %s, %s; %s, %s; at most %d "
                 "connections)", model, config.served_model_names, host, port, engine.max_model_len,
                 engine.stats["kv_pages_total"], torch_dtype, torch_device, _prefix_line(llm, cache_path),
                 _speculative_line(llm), limits.limit_concurrency)
        log.info("%s; CORS origins %s", describe(defaults, defaults_origin), cors["allow_origins"])
        if llm.engine.config.vision_config is not None:
            log.info("%s", describe_media(media))
        if kv_transfer is not None:
            log.info("%s", describe_kv_transfer(llm, kv_transfer))
        if config.model_aliases:
            log.info("requests may also name the model by its path: %s (vLLM's default served name)",
                     ", ".join(config.model_aliases))
        try:
            server.run()
        finally:
            started = bool(getattr(server, "started", False))
        if server.exit_code:
            log.error("exiting with status %d after the engine failure above", server.exit_code)
            raise typer.Exit(server.exit_code)
    finally:
        for replica in llms:
            replica.shutdown()  # a parallel engine's workers: stopped and reaped before the process exits
        if not started:
            _remove_created(created)


def _serve_encoder(model: Path, ec_transfer: ECTransferConfig, dtype, device, served_model_name: list[str], media,
                   encoder_cache_size: int | None, api_key: list[str], max_body_mb: float, host: str, port: int,
                   drain_timeout: float, log_level: str, limits: ConnectionLimits, log) -> None:
    """Serve an encode server (``ec_role`` ec_producer: the vision tower and aligner only, issue 29) until SIGTERM;
    exits 2 for a model it cannot load."""
    try:
        app = build_encode_app(model, ec_transfer, dtype, str(device),
                               served_model_names=served_model_name or [default_model_name(model)],
                               model_aliases=[] if served_model_name else model_path_aliases(model), media=media,
                               encoder_cache_size=encoder_cache_size, api_keys=api_key,
                               max_body_bytes=int(max_body_mb * 1024 * 1024))
    except (ValueError, FileNotFoundError, ConfigError, CheckpointError) as exc:
        fail(str(exc))
    server = make_server(app, host, port, drain_timeout, log_level, limits)
    log.info("encode server (ec_producer over %s at %s): %s on http://%s:%d", ec_transfer.ec_connector,
             ec_transfer.ec_connector_extra_config.get("shared_storage_path"), model, host, port)
    server.run()
    if server.exit_code:
        raise typer.Exit(server.exit_code)


def describe_kv_transfer(llm: LLM, transfer: KVTransferConfig) -> str:
    """The start line of a disaggregated server: its role, connector, and for a producer what it loaded."""
    connector = llm.engine.prefix_cache.connector
    connector.contains("0" * 64)  # one probe now: an unreachable Redis is logged at start, not at the first request
    where = getattr(connector, "directory", None) or transfer.kv_connector_extra_config.get("url", "")
    line = f"{transfer.kv_role} over {transfer.kv_connector}{f' at {where}' if where else ''}"
    if transfer.prefill_only:
        line += ("; every request is prefill-only: its global KV pages go to the connector, nothing is sampled, "
                 "the decoder never runs")
    return f"{line}; {describe_load(llm.model)}"


def _media_config(domains: list[str], local_path: Path | None, limit: str | None, timeout: float | None,
                  max_bytes: int | None) -> MediaConfig:
    """The media flags as a :class:`MediaConfig` (:mod:`deepseek_v41.server.media`); exits 2 naming the flag for a
    bad value."""
    if local_path is not None and not local_path.is_dir():
        fail(f"--allowed-local-media-path {local_path} is not a directory")
    try:
        return MediaConfig(
            allowed_media_domains=[d for value in domains for d in value.split(",")],
            allowed_local_media_path=str(local_path.resolve()) if local_path is not None else None,
            limit_images=parse_limit_mm_per_prompt(limit) if limit is not None else MediaConfig.limit_images,
            fetch_timeout_s=timeout if timeout is not None else env_fetch_timeout(),
            max_image_bytes=max_bytes if max_bytes is not None else DEFAULT_MAX_IMAGE_BYTES,
            allow_redirects=env_allow_redirects())
    except ValueError as exc:
        fail(str(exc).replace("fetch_timeout_s", "--media-fetch-timeout"))


API_KEY_ENV = ("DSV41_API_KEY", "VLLM_API_KEY")  # read in this order when --api-key is not given


def api_keys(given: list[str]) -> list[str]:
    """The accepted bearer keys: the ``--api-key`` values when any is given, else the key in the first of
    :data:`API_KEY_ENV` that is set and not empty (as vLLM reads ``VLLM_API_KEY``), else none (no auth)."""
    if given:
        return list(given)
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return [os.environ[name]]
    return []


def default_model_name(model: Path) -> str:
    """The served model name when ``--served-model-name`` is not given: the model directory's name (``v41-tiny``
    for ``checkpoints/v41-tiny/``), not its path."""
    return model.expanduser().resolve().name or str(model)


def model_path_aliases(model: Path) -> list[str]:
    """The other names a request's ``model`` may use when ``--served-model-name`` is not given: the model path as
    given on the command line (vLLM's default served name), with and without a trailing slash, and its absolute and
    resolved forms (``checkpoints/v41-tiny``, ``/work/checkpoints/v41-tiny``). ``/v1/models`` lists only the
    served name."""
    given = str(model)
    forms = [given, given.rstrip("/") or given, given.rstrip("/") + "/", str(model.expanduser().absolute()),
             str(model.expanduser().resolve())]
    served = default_model_name(model)
    return [name for name in dict.fromkeys(forms) if name != served]


def _prefix_line(llm, cache_path: Path) -> str:
    """The prefix-caching part of the startup line: off, or on with its cache directory and SWA pool."""
    pc = llm.engine.prefix_cache
    if pc is None:
        return "prefix caching off"
    pool = pc.swa_pool
    capacity = getattr(pool, "capacity_bytes", None)
    snapshots = ("no SWA snapshots" if pool is None else
                 f"SWA pool {capacity / 2**20:.0f} MiB" if capacity is not None else f"SWA pool in {pool.url}")
    where = f"cache dir {cache_path}" if pc.page_store is not None else "pages persisted in the KV connector only"
    return f"prefix caching on, {where}, {snapshots}"


def _speculative_line(llm) -> str:
    """The speculative part of the startup line: off, or the method and the drafts verified per step at most."""
    spec = llm.engine.speculator
    if spec is None:
        return "speculative decoding off"
    return f"speculative decoding {llm.engine.args.speculative} (up to {spec.max_len} drafts per step)"
