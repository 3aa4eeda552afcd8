"""``dsv41 router``: the OpenAI-compatible front of disaggregated encode / prefill / decode servers (issue 29).

The app is :func:`deepseek_v41.disagg.router.build_router_app`; it runs under the server's uvicorn launcher
(:func:`deepseek_v41.server.launch.make_server`), so SIGTERM / SIGINT drain as ``dsv41 serve`` does: the listening
socket closes, ``/health`` and new requests answer 503, and running requests get up to ``--drain-timeout`` seconds.
"""

from __future__ import annotations

import logging

import typer

from deepseek_v41.cli.serve import LOG_LEVELS, api_keys, fail
from deepseek_v41.disagg.router import RouterConfig, build_router_app
from deepseek_v41.server.launch import ConnectionLimits, make_server


def router(
    prefill: list[str] = typer.Option([], "--prefill", metavar="URL", help="Base URL of a prefill server "
                                      "(kv_producer), e.g. http://127.0.0.1:8100 (repeatable; none = decode servers "
                                      "prefill)."),
    decode: list[str] = typer.Option([], "--decode", metavar="URL", help="Base URL of a decode server "
                                     "(kv_consumer), e.g. http://127.0.0.1:8200 (repeatable; at least one)."),
    encode: list[str] = typer.Option([], "--encode", metavar="URL", help="Base URL of an encode server "
                                     "(ec_producer), e.g. http://127.0.0.1:8300 (repeatable; none = prefill servers "
                                     "encode images)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=1, max=65535, help="Port to listen on."),
    api_key: list[str] = typer.Option([], "--api-key", metavar="KEY", help="Accepted bearer key of the "
                                      "router's /v1 routes (repeatable; default: $DSV41_API_KEY, else "
                                      "$VLLM_API_KEY); none = no auth. The client's Authorization header is "
                                      "forwarded to every backend."),
    health_interval_s: float = typer.Option(2.0, help="Seconds between two GET /health of every backend (> 0)."),
    request_timeout_s: float = typer.Option(600.0, help="Seconds a backend may stay silent in a request (a whole "
                                            "prefill, or between two decode chunks) before it counts as failed "
                                            "(> 0)."),
    max_body_mb: float = typer.Option(32.0, help="Largest request body, MiB (> 0)."),
    drain_timeout: float = typer.Option(30.0, min=0, help="Seconds running requests get to finish on SIGTERM."),
    log_level: str = typer.Option("info", help=f"Log level: {', '.join(LOG_LEVELS)}."),
) -> None:
    """Route OpenAI requests through encode -> prefill -> decode servers (prefix affinity, health checks, fallback
    to plain prefill on the decode server when no prefill server answers)."""
    if log_level.lower() not in LOG_LEVELS:
        fail(f"--log-level {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    if not max_body_mb > 0:
        fail(f"--max-body-mb must be > 0, got {max_body_mb}")
    try:
        config = RouterConfig(decode=decode, prefill=prefill, encode=encode, api_keys=api_keys(api_key),
                              health_interval_s=health_interval_s, request_timeout_s=request_timeout_s,
                              max_body_bytes=int(max_body_mb * 2**20))
    except ValueError as exc:
        fail(str(exc))
    logging.basicConfig(level=log_level.upper() if log_level.lower() != "trace" else 5,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if log_level.lower() not in ("debug", "trace"):  # httpx logs every request (each health poll) at info
        logging.getLogger("httpx").setLevel(logging.WARNING)
    log = logging.getLogger("deepseek_v41.router")
    server = make_server(build_router_app(config), host, port, drain_timeout, log_level.lower(), ConnectionLimits())
    log.info("routing on http://%s:%d: encode %s, prefill %s, decode %s; %s", host, port, config.encode or "none",
             config.prefill or "none (decode servers prefill)", config.decode,
             "API keys required" if config.api_keys else "no API key")
    server.run()
