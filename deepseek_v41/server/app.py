"""The FastAPI application: routes, API keys, the body limit and the engine's lifecycle (SPEC.md §4.6).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``),
``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET /health``, ``GET /metrics``; with
``ServerConfig.dev_mode`` also ``POST /reset_prefix_cache`` (200 when reset, 409 while requests hold KV pages
unless ``?reset_running_requests=true``; :meth:`LLMEngine.reset_prefix_cache`, run on the engine's thread between
steps). As in vLLM, the
API keys guard the ``/v1`` routes only (a CORS preflight needs none); each key gets its own prefix-cache salt, so
no prompt of one key can hit another key's cache. Bodies over ``max_body_bytes`` get a 413; every refusal is an
OpenAI-shaped error. CORS follows ``ServerConfig.allow_*`` (FastAPI's ``CORSMiddleware``, vLLM's defaults).
A client that disconnects cancels its request (see :mod:`deepseek_v41.server.streaming`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepseek_v41 import __version__
from deepseek_v41.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineDrainingError
from deepseek_v41.server.chat import chat_completion, prepare_chat
from deepseek_v41.server.common import (
    ServerConfig,
    ServerState,
    check_common,
    engine_unavailable,
    key_salt,
)
from deepseek_v41.server.completions import completion
from deepseek_v41.server.errors import (
    APIError,
    error_body,
    error_response,
    install_error_handlers,
    validation_error,
)
from deepseek_v41.server.metrics import ServerMetrics
from deepseek_v41.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from deepseek_v41.server.streaming import ClientDisconnected, until_disconnect
from deepseek_v41.server.text import check_text_fits, decode, encode

logger = logging.getLogger("deepseek_v41.server")


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than the {limit} bytes this server accepts")


class _Guard:
    """ASGI middleware: bearer keys on ``/v1`` (401), body size limit (413), the key's salt into request.state."""

    def __init__(self, app: ASGIApp, keys: list[str], max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.keys = [(key.encode(), key_salt(key)) for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        salt = None
        if self.keys and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            salt = next((s for key, s in self.keys if given and hmac.compare_digest(key, given)), None)
            if salt is None:
                await _send_error(send, 401, "Incorrect API key provided: send 'Authorization: Bearer <key>' with "
                                  "one of the server's --api-key values", "invalid_api_key")
                return
        scope.setdefault("state", {})["key_salt"] = salt
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _send_error(send, 413, f"the request body is larger than the {self.max_body_bytes} bytes this "
                              f"server accepts", "request_too_large")
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise _BodyTooLarge(self.max_body_bytes)
            return message

        await self.app(scope, counted, send)


async def _send_error(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, status, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def _run(request: Request, work) -> Response:
    """Refuse after an engine failure (503 engine_dead) and while draining; cancel the work when the client goes
    away."""
    state = _state(request)
    if state.engine.errored:  # the server is going down because of it: say why
        work.close()
        raise engine_unavailable(state.engine.dead_error())
    if state.draining:
        work.close()
        raise APIError("the server is shutting down; retry on another replica", None, "shutting_down", 503)
    try:
        return await until_disconnect(request, work)
    except ClientDisconnected:
        return Response(status_code=499)


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The application serving ``engine``. The engine loop starts with the app's lifespan and stops (after
    draining for ``config.drain_timeout_s``) when the server shuts down."""
    spec_positions = getattr(engine.engine.config, "dspark_block_size", 0) or 0
    metrics = ServerMetrics(engine, config.served_model_names[0], spec_positions)
    state = ServerState(config, engine, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        ticker = asyncio.create_task(_log_loop(metrics, config.log_stats_interval_s))
        try:
            yield
        finally:
            state.draining = True
            ticker.cancel()
            await engine.shutdown(config.drain_timeout_s)

    app = FastAPI(title="deepseek_v41 OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(_Guard, keys=config.api_keys, max_body_bytes=config.max_body_bytes)
    # Added last, so outermost: a browser's preflight (OPTIONS, no API key) is answered here, and every response,
    # a 401 or 413 of the guard included, carries the CORS headers the browser needs to read it (vLLM's setup).
    app.add_middleware(CORSMiddleware, allow_origins=config.allow_origins, allow_methods=config.allow_methods,
                       allow_headers=config.allow_headers, allow_credentials=config.allow_credentials)

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineDrainingError)
    async def _unavailable(request: Request, exc: EngineDeadError | EngineDrainingError) -> JSONResponse:
        return error_response(engine_unavailable(exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", 500, None, "internal_error"), 500)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        arrival = time.time()
        return await _run(request, chat_completion(state, body, request.state.key_salt, arrival))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        arrival = time.time()
        return await _run(request, completion(state, body, request.state.key_salt, arrival))

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(state, name) for name in config.served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if not model_id or not state.accepts_model(model_id):
            raise APIError(f"The model '{model_id}' does not exist", "model", "model_not_found", 404)
        return _model_card(state, model_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_common(state, body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", "prompt", "invalid_value")
        if state.tokenizer is None:
            raise APIError("this model has no tokenizer.json", "prompt", "invalid_value")
        if body.messages is not None:
            try:
                chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                             reasoning_effort=body.reasoning_effort,
                                             chat_template_kwargs=body.chat_template_kwargs)
            except ValidationError as exc:
                raise validation_error(exc) from exc
            plan = await prepare_chat(state, chat, check_length=False)
            ids = plan.prompt_ids if plan.prompt_ids is not None else plan.ids  # image spans expanded
        else:
            check_text_fits(state, body.prompt, "prompt")
            (ids,) = await encode(state, [body.prompt], body.add_special_tokens)
        result = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            result["token_strs"] = await decode(state, [[t] for t in ids])
        return result

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_common(state, body)
        if state.tokenizer is None:
            raise APIError("this model has no tokenizer.json", "tokens", "invalid_value")
        if body.tokens and max(body.tokens) >= state.vocab_size:
            raise APIError(f"token ids must be in [0, {state.vocab_size})", "tokens", "invalid_value")
        (text,) = await decode(state, [body.tokens])
        return {"prompt": text}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        if engine.errored:
            raise engine_unavailable(engine.dead_error())
        if state.draining:
            raise APIError("the server is shutting down", None, "shutting_down", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if config.dev_mode:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False):
            if reset_external:  # vLLM's switch for its external KV connector; ours are the disk / Redis tiers
                raise APIError("reset_external is not supported: the persistent tiers (disk pages, Redis) are kept; "
                               "start the server with another --cache-dir to begin a new one", "reset_external",
                               "unsupported", 400)
            if state.draining:
                raise APIError("the server is shutting down", None, "shutting_down", 503)
            if not await engine.reset_prefix_cache(reset_running_requests):
                raise APIError("the prefix cache was not reset: requests hold KV pages; retry when they are done",
                               None, "requests_running", 409)
            return Response(status_code=200)

    return app


def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "dsv41",
            "root": state.config.model_path or name, "parent": None, "max_model_len": state.engine.max_model_len}


async def _log_loop(metrics: ServerMetrics, interval_s: float) -> None:
    if interval_s <= 0:
        return
    while True:
        await asyncio.sleep(interval_s)
        metrics.log_throughput()
