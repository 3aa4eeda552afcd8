"""``dsv41 router``: the OpenAI-compatible front of an encode / prefill / decode deployment (issue 29).

Each ``POST /v1/chat/completions`` or ``/v1/completions`` goes through three stages (the protocol of
``DISAGG_DESIGN.md``; vLLM's disaggregated proxy and SGLang's mini load balancer are the behavioural references):

1. **encode** (chat requests with image parts, when ``--encode`` servers are given): the body is POSTed to an
   encode server, which writes the images' aligner rows to its EC connector and answers ``ec_transfer_params``. A
   failure only costs time: the prefill server then encodes the images itself (``router_fallbacks{reason="encode"}``).
2. **prefill**: the body with ``stream: false``, no ``stream_options`` / ``n`` / ``min_tokens``, ``max_tokens`` (and,
   for chat, ``max_completion_tokens``) 1 and ``kv_transfer_params: {"do_remote_decode": true}`` goes to a prefill
   server, which answers once the prompt's KV pages are in the connector, with ``kv_transfer_params``. A 4xx is the
   client's error and is returned as is; a refused or reset connection, a timeout, a 5xx or an answer without
   ``kv_transfer_params`` moves on to the next prefill server, and when none answers the request goes to the decode
   server alone, which then prefills it itself (``router_fallbacks{reason="prefill"}``).
3. **decode**: the client's own body plus the prefill's ``kv_transfer_params`` goes to a decode server; its status,
   headers and body are relayed as they come (SSE chunk by chunk), so usage (``cached_tokens`` included) is the
   decode server's. A decode server that refuses the connection or answers 503 before any byte is skipped for the
   next (``router_fallbacks{reason="decode"}``); with none left the client gets a 503.

The client's ``Authorization`` header goes to every backend unchanged (the servers salt their prefix caches per
API key, so prefill and decode must see the same key) with one ``X-Request-Id`` for all stages. ``--api-key``
guards the router's own ``/v1`` routes.

**Prefix affinity**: the request's prompt material is cut into chunks (chat: the canonical JSON of each message in
order; completions: the prompt in ``affinity_chunk_chars`` characters, or ``affinity_chunk_chars // 4`` token ids)
and chain-hashed from a root of the route, model, ``cache_salt``, tools and the ``Authorization`` value. A bounded
LRU map per role sends a request to the healthy server that served the longest matching chain (it holds those
pages on its device tier), unless that server has ``affinity_max_imbalance`` more requests in flight than the least
loaded one; otherwise the least loaded (fewest in flight, then fewest served) is chosen.

**Health**: every ``health_interval_s`` each backend's ``GET /health`` is polled; a failing one is not chosen until
it answers 200 again, and a backend whose connection is refused during a request is marked down at once. The
router's ``GET /health`` is 200 while a decode server is up (503 otherwise and while draining); ``GET /v1/models``
is the first healthy decode server's.

**Metrics** (own registry, ``model_name`` = the decode servers' first served model once known):
``dsv41:router_requests{route,status}``, ``dsv41:router_fallbacks{reason}``, ``dsv41:router_backend_up{role,url}``,
``dsv41:router_stage_seconds{stage}`` (decode: to the first body byte of the decode response),
``dsv41:router_kv_transfer_bytes`` and ``dsv41:router_prompt_tokens`` (the prefill responses' ``transfer_bytes`` and
prompt tokens, so their ratio is the KV bytes moved per prompt token), ``dsv41:router_affinity_hits`` (decode
servers chosen by prefix) and ``dsv41:router_prefill_affinity_hits``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import Receive, Scope, Send

from deepseek_v41.chat.images import IMAGE_PART_TYPES
from deepseek_v41.server.errors import error_body
from deepseek_v41.server.streaming import ClientDisconnected, until_disconnect

logger = logging.getLogger("deepseek_v41.router")

Role = Literal["encode", "prefill", "decode"]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# Fields the prefill request drops: it samples one token it does not return, as one sequence.
_PREFILL_DROPPED = ("stream_options", "n", "best_of", "min_tokens")
# Upstream response headers relayed to the client (hop-by-hop and length headers are the router's own).
_RELAYED_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "x-request-id")


def backend_url(url: str, flag: str) -> str:
    """``url`` checked as a backend's base URL (``http://host:port``, an optional trailing ``/``) and returned
    without the trailing slash. ValueError naming ``flag`` for another scheme, a missing host, a bad port, or a path,
    query or credentials (the router appends ``/v1/...`` itself)."""
    example = f"{flag} http://127.0.0.1:8100"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{flag} {url!r} is not a valid URL ({exc}); e.g. {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {url!r} is not an http(s) URL with a host; e.g. {example}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{flag} {url!r}: give the server's base URL only (no path such as /v1, query or "
                         f"credentials); e.g. {example}")
    if port == 0:
        raise ValueError(f"{flag} {url!r}: port 0 is not a server's port")
    return url.rstrip("/")


@dataclass
class RouterConfig:
    """Settings of :func:`build_router_app` (the ``dsv41 router`` flags).

    ``decode`` / ``prefill`` / ``encode``: backend base URLs (at least one decode server; no prefill server = every
    request prefills on its decode server, no encode server = prefill servers encode images themselves); checked and
    normalised by :func:`backend_url`. ``api_keys``: bearer keys the router's ``/v1`` routes accept (none = open).
    Times in seconds; ``request_timeout_s`` bounds a backend's silence (connect, a whole prefill, the wait between
    two decode chunks). ValueError for a bad value, naming the flag.
    """

    decode: list[str]
    prefill: list[str] = field(default_factory=list)
    encode: list[str] = field(default_factory=list)
    api_keys: list[str] = field(default_factory=list)
    health_interval_s: float = 2.0      # seconds between two polls of every backend's /health
    health_timeout_s: float = 5.0       # a /health answer slower than this counts as down
    request_timeout_s: float = 600.0    # read / write / pool timeout of a backend request
    connect_timeout_s: float = 5.0      # TCP connect timeout of a backend request
    max_body_bytes: int = 32 * 2**20    # largest client body (413 beyond)
    affinity_chunk_chars: int = 512     # completions prompt chunk (characters; token-id prompts: a quarter of it)
    affinity_max_entries: int = 200_000  # chain hashes remembered per role (LRU)
    affinity_max_imbalance: int = 16    # in-flight requests over the least loaded beyond which affinity yields

    def __post_init__(self) -> None:
        if not self.decode:
            raise ValueError("at least one --decode URL is required (the decode servers relay the answers)")
        for role in ("decode", "prefill", "encode"):
            urls = [backend_url(u, f"--{role}") for u in getattr(self, role)]
            dup = sorted({u for u in urls if urls.count(u) > 1})
            if dup:
                raise ValueError(f"--{role} {dup[0]} is given twice")
            setattr(self, role, urls)
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        for name in ("max_body_bytes", "affinity_chunk_chars", "affinity_max_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.affinity_max_imbalance < 0:
            raise ValueError(f"affinity_max_imbalance must be >= 0, got {self.affinity_max_imbalance}")


@dataclass
class Backend:
    """One backend server: its ``role``, base ``url``, health, requests in flight and requests sent so far."""

    role: Role
    url: str
    up: bool = True
    outstanding: int = 0
    served: int = 0
    asked_model: bool = False  # its /v1/models was read since it last came up


class PrefixAffinity:
    """Bounded LRU map chain-hash -> backend URL: which server last served each prompt prefix.

    ``match(hashes, urls)``: the URL among ``urls`` mapped from the longest prefix of ``hashes`` and that prefix's
    length in chunks, or ``(None, 0)``. ``record(hashes, url)``: every prefix of the request now points to ``url``.
    """

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._map: OrderedDict[bytes, str] = OrderedDict()

    def match(self, hashes: list[bytes], urls: set[str]) -> tuple[str | None, int]:
        for depth in range(len(hashes), 0, -1):
            url = self._map.get(hashes[depth - 1])
            if url in urls:
                self._map.move_to_end(hashes[depth - 1])
                return url, depth
        return None, 0

    def record(self, hashes: list[bytes], url: str) -> None:
        for h in hashes:
            self._map[h] = url
            self._map.move_to_end(h)
        while len(self._map) > self.max_entries:
            self._map.popitem(last=False)


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def prefix_hashes(route: str, body: dict[str, Any], authorization: str, chunk_chars: int) -> list[bytes]:
    """The chain hashes of a request's prompt material, one per chunk (module docstring): a request whose prompt
    extends another's shares its hashes as a prefix. Empty when the body has no prompt the router can read (the
    backend then reports the error)."""
    root = _canonical([route, body.get("model"), body.get("cache_salt"), body.get("tools"),
                       body.get("chat_template_kwargs"), authorization])
    pieces: list[bytes] = []
    if route == CHAT:
        messages = body.get("messages")
        pieces = [_canonical(m) for m in messages] if isinstance(messages, list) else []
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: the first one's prefix
        if isinstance(prompt, str):
            pieces = [prompt[i:i + chunk_chars].encode() for i in range(0, len(prompt), chunk_chars)]
        elif isinstance(prompt, list):
            step = max(1, chunk_chars // 4)
            pieces = [_canonical(prompt[i:i + step]) for i in range(0, len(prompt), step)]
    out, h = [], hashlib.blake2b(root, digest_size=16).digest()
    for piece in pieces:
        h = hashlib.blake2b(h + piece, digest_size=16).digest()
        out.append(h)
    return out


def has_images(body: dict[str, Any]) -> bool:
    """Whether a chat body has an image content part (``image_url``, ``input_image``, ``image``)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                             for p in content):
            return True
    return False


def prefill_request(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill stage's body: ``body`` without :data:`_PREFILL_DROPPED`, not streamed, one token, and
    ``kv_transfer_params: {"do_remote_decode": true}`` (prefill-only on a kv_producer / kv_both server)."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    if route == CHAT:
        out["max_completion_tokens"] = 1
    return out


class RouterMetrics:
    """The router's prometheus metrics (module docstring) in their own registry."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.requests = Counter("dsv41:router_requests", "Client requests answered, by route and HTTP status.",
                                [*m, "route", "status"], registry=r)
        self.fallbacks = Counter("dsv41:router_fallbacks", "Requests a stage's servers did not answer: encode = "
                                 "the prefill server encoded the images, prefill = the decode server prefilled, "
                                 "decode = another decode server was tried.", [*m, "reason"], registry=r)
        self.backend_up = Gauge("dsv41:router_backend_up", "1 while the backend answers /health with 200.",
                                ["role", "url"], registry=r)
        self.stage_seconds = Histogram("dsv41:router_stage_seconds", "Seconds per stage (decode: to the first body "
                                       "byte of the decode response).", [*m, "stage"], buckets=_STAGE_BUCKETS,
                                       registry=r)
        self.kv_transfer_bytes = Counter("dsv41:router_kv_transfer_bytes", "KV payload bytes the prefill servers "
                                         "wrote for the router's requests (their transfer_bytes).", m, registry=r)
        self.prompt_tokens = Counter("dsv41:router_prompt_tokens", "Prompt tokens of the requests prefilled on a "
                                     "prefill server (router_kv_transfer_bytes / this = KV bytes per token).", m,
                                     registry=r)
        self.affinity_hits = Counter("dsv41:router_affinity_hits", "Requests sent to a decode server that served "
                                     "a prefix of their prompt before.", m, registry=r)
        self.prefill_affinity_hits = Counter("dsv41:router_prefill_affinity_hits", "Requests sent to a prefill "
                                             "server that served a prefix of their prompt before.", m, registry=r)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, status, None, code), status_code=status)


def _passthrough(response: httpx.Response) -> Response:
    return Response(response.content, status_code=response.status_code,
                    media_type=response.headers.get("content-type"))


class _StageFailed(Exception):
    """A backend did not answer usefully (refused, reset, timed out, 5xx, or a reply without the stage's params)."""


class RelayResponse(Response):
    """Relays a streamed backend response (status, :data:`_RELAYED_HEADERS`, body chunks as they arrive) and always
    closes it, so that a client disconnect closes the backend connection (which aborts its request) at once."""

    def __init__(self, upstream: httpx.Response, on_first_byte, on_close):
        super().__init__(status_code=upstream.status_code)
        self.upstream, self.on_first_byte, self.on_close = upstream, on_first_byte, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k.encode(), v.encode()) for k, v in self.upstream.headers.items() if k.lower() in
                   _RELAYED_HEADERS]

        async def relay() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
            first = True
            try:
                async for chunk in self.upstream.aiter_raw():
                    if first:
                        self.on_first_byte()
                        first = False
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:  # the decode server died mid-response: the client sees the cut
                logger.warning("the decode response from %s broke off: %r", self.upstream.url, exc)
                if self.upstream.headers.get("content-type", "").startswith("text/event-stream"):
                    error = error_body(f"the decode server failed mid-stream ({type(exc).__name__})", 502, None,
                                       "backend_failed")
                    await send({"type": "http.response.body", "body": b"data: " + json.dumps(error).encode()
                                + b"\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        sender, watcher = asyncio.ensure_future(relay()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watcher, sender):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError, ClientDisconnected):
                    await task
            await self.upstream.aclose()
            self.on_close()


class Router:
    """The routing state and stages behind :func:`build_router_app` (module docstring).

    ``draining`` turns on at shutdown (``/health`` and new requests answer 503). ``engine`` / ``num_requests`` are
    what :class:`deepseek_v41.server.launch.DrainingServer` reads to drain: the router is its own "engine" (requests
    in flight; it has no engine loop that can fail, so ``on_dead`` is never called).
    """

    def __init__(self, config: RouterConfig):
        self.config = config
        self.backends = {role: [Backend(role, url) for url in getattr(config, role)]
                         for role in ("encode", "prefill", "decode")}
        self.affinity = {role: PrefixAffinity(config.affinity_max_entries) for role in ("prefill", "decode")}
        self.metrics = RouterMetrics()
        self.model_name = ""
        self.draining = False
        self.num_requests = 0
        self.on_dead = None
        self.client: httpx.AsyncClient | None = None
        self._health_client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        for role, backends in self.backends.items():
            for b in backends:
                self.metrics.backend_up.labels(role, b.url).set(1)

    @property
    def engine(self) -> Router:
        return self

    # lifecycle ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the backend clients, poll every backend once, then keep polling in the background."""
        c = self.config
        timeout = httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, trust_env=False,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._health_client = httpx.AsyncClient(timeout=c.health_timeout_s, trust_env=False)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="dsv41-router-health")

    async def close(self) -> None:
        """Stop polling and close the clients (their connections)."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for client in (self.client, self._health_client):
            if client is not None:
                await client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        """One poll of every backend's ``GET /health`` (200 = up); learns the model name from a decode server."""
        await asyncio.gather(*(self._check(b) for backends in self.backends.values() for b in backends))

    async def _check(self, backend: Backend) -> None:
        try:
            up = (await self._health_client.get(backend.url + "/health")).status_code == 200
        except httpx.HTTPError:
            up = False
        self._set_up(backend, up, "its /health does not answer 200")
        if up and backend.role == "decode" and not self.model_name and not backend.asked_model:
            backend.asked_model = True
            headers = {"Authorization": f"Bearer {self.config.api_keys[0]}"} if self.config.api_keys else {}
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                self.model_name = (await self._health_client.get(backend.url + "/v1/models", headers=headers)
                                   ).json()["data"][0]["id"]

    def _set_up(self, backend: Backend, up: bool, why: str) -> None:
        if up != backend.up:
            if up:
                logger.info("%s server %s is up again", backend.role, backend.url)
            else:
                logger.warning("%s server %s is down (%s); not routing to it until /health answers 200",
                               backend.role, backend.url, why)
        backend.up = up
        backend.asked_model &= up
        self.metrics.backend_up.labels(backend.role, backend.url).set(int(up))

    # choosing -------------------------------------------------------------------------------------------------
    def choose(self, role: Role, hashes: list[bytes], exclude: set[str]) -> tuple[Backend | None, bool]:
        """The backend of ``role`` for a request with prefix ``hashes`` (module docstring: affinity within
        ``affinity_max_imbalance``, else the least loaded), skipping ``exclude``; and whether affinity chose it.
        ``(None, False)`` when no healthy backend is left."""
        healthy = [b for b in self.backends[role] if b.up and b.url not in exclude]
        if not healthy:
            return None, False
        least = min(healthy, key=lambda b: (b.outstanding, b.served))
        if role in self.affinity and hashes:
            url, _ = self.affinity[role].match(hashes, {b.url for b in healthy})
            if url is not None:
                best = next(b for b in healthy if b.url == url)
                if best.outstanding - least.outstanding <= self.config.affinity_max_imbalance:
                    return best, True
        return least, False

    def _stage_failed(self, backend: Backend, what: str, exc: Exception | None = None) -> None:
        logger.warning("%s server %s failed %s: %s", backend.role, backend.url, what,
                       repr(exc) if exc is not None else "")
        if isinstance(exc, httpx.ConnectError):  # nothing listens: down until /health says otherwise
            self._set_up(backend, False, "connection refused")

    async def _post(self, backend: Backend, route: str, body: dict[str, Any], headers: dict[str, str]
                    ) -> httpx.Response:
        """POST ``body`` to ``backend``; a 200 or 4xx response, or _StageFailed (logged)."""
        backend.outstanding += 1
        backend.served += 1
        try:
            response = await self.client.post(backend.url + route, json=body, headers=headers)
        except httpx.HTTPError as exc:
            self._stage_failed(backend, route, exc)
            raise _StageFailed from exc
        finally:
            backend.outstanding -= 1
        if response.status_code >= 500:
            self._stage_failed(backend, route, RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}"))
            raise _StageFailed
        return response

    # stages ---------------------------------------------------------------------------------------------------
    async def encode(self, route: str, body: dict[str, Any], headers: dict[str, str]) -> bool:
        """The encode stage on the least loaded encode servers in turn; whether one wrote the images' rows."""
        tried: set[str] = set()
        start = time.monotonic()
        try:
            while (backend := self.choose("encode", [], tried)[0]) is not None:
                tried.add(backend.url)
                try:
                    response = await self._post(backend, route, body, headers)
                except _StageFailed:
                    continue
                if response.status_code == 200 and isinstance(_json(response).get("ec_transfer_params"), dict):
                    return True
                logger.warning("encode server %s answered %d without ec_transfer_params: %s", backend.url,
                               response.status_code, response.text[:200])
                return False  # a 4xx: the prefill server will answer the client the same
            return False
        finally:
            self.metrics.stage_seconds.labels(self.model_name, "encode").observe(time.monotonic() - start)

    async def prefill(self, route: str, body: dict[str, Any], headers: dict[str, str], hashes: list[bytes]
                      ) -> dict[str, Any] | Response | None:
        """The prefill stage: the prefill response's ``kv_transfer_params``, the response of a 4xx to relay, or
        None when no prefill server answered."""
        tried: set[str] = set()
        request = prefill_request(route, body)
        start = time.monotonic()
        while True:
            backend, hit = self.choose("prefill", hashes, tried)
            if backend is None:
                return None
            tried.add(backend.url)
            try:
                response = await self._post(backend, route, request, headers)
            except _StageFailed:
                continue
            if response.status_code != 200:
                return _passthrough(response)
            data = _json(response)
            params = data.get("kv_transfer_params")
            if not isinstance(params, dict):
                self._stage_failed(backend, "to prefill", RuntimeError("a 200 without kv_transfer_params: is it "
                                                                       "started with --kv-transfer-config "
                                                                       "'{\"kv_role\": \"kv_producer\", ...}'?"))
                continue
            m = self.metrics
            m.stage_seconds.labels(self.model_name, "prefill").observe(time.monotonic() - start)
            m.kv_transfer_bytes.labels(self.model_name).inc(_number(params.get("transfer_bytes")))
            usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
            m.prompt_tokens.labels(self.model_name).inc(
                _number(params.get("num_prompt_tokens", usage.get("prompt_tokens"))))
            if hit:
                m.prefill_affinity_hits.labels(self.model_name).inc()
            if hashes:
                self.affinity["prefill"].record(hashes, backend.url)
            return params

    async def decode(self, route: str, body: dict[str, Any], headers: dict[str, str], hashes: list[bytes],
                     done) -> Response:
        """The decode stage: the decode server's response relayed (:class:`RelayResponse`; ``done`` is called
        when it ends), or a 503 when no decode server answered."""
        tried: set[str] = set()
        start = time.monotonic()
        m = self.metrics
        while True:
            backend, hit = self.choose("decode", hashes, tried)
            if backend is None:
                return _error(503, f"no decode server answered (tried {sorted(tried) or 'none: all are down'})",
                              "no_backend")
            tried.add(backend.url)
            backend.outstanding += 1
            backend.served += 1
            try:
                upstream = await self.client.send(self.client.build_request("POST", backend.url + route, json=body,
                                                                            headers=headers), stream=True)
            except httpx.HTTPError as exc:
                backend.outstanding -= 1
                self._stage_failed(backend, route, exc)
                m.fallbacks.labels(self.model_name, "decode").inc()
                continue
            except BaseException:  # cancelled: the client went away
                backend.outstanding -= 1
                raise
            if upstream.status_code == 503:  # draining or its engine died: another may answer
                await upstream.aclose()
                backend.outstanding -= 1
                self._stage_failed(backend, route, RuntimeError("HTTP 503"))
                m.fallbacks.labels(self.model_name, "decode").inc()
                continue
            if upstream.status_code == 200:
                if hit:
                    m.affinity_hits.labels(self.model_name).inc()
                if hashes:
                    self.affinity["decode"].record(hashes, backend.url)

            def first_byte() -> None:
                m.stage_seconds.labels(self.model_name, "decode").observe(time.monotonic() - start)

            def closed(backend: Backend = backend) -> None:
                backend.outstanding -= 1
                done()

            return RelayResponse(upstream, first_byte, closed)

    async def generate(self, route: str, body: dict[str, Any], authorization: str, request_id: str) -> Response:
        """One client request (its JSON ``body``, ``Authorization`` header value or "", request id) through the
        stages (module docstring)."""
        headers = {"X-Request-Id": request_id}
        if authorization:
            headers["Authorization"] = authorization
        hashes = prefix_hashes(route, body, authorization, self.config.affinity_chunk_chars)
        if self.backends["encode"] and route == CHAT and has_images(body) and \
                not await self.encode(route, body, headers):
            self.metrics.fallbacks.labels(self.model_name, "encode").inc()
        params = None
        if self.backends["prefill"]:
            params = await self.prefill(route, body, headers, hashes)
            if isinstance(params, Response):
                return params
            if params is None:
                logger.warning("no prefill server answered: the decode server prefills the request itself")
                self.metrics.fallbacks.labels(self.model_name, "prefill").inc()
        decode_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if params is not None:
            decode_body["kv_transfer_params"] = params
        self.num_requests += 1
        response = None
        try:
            response = await self.decode(route, decode_body, headers, hashes, self._request_done)
            return response
        finally:
            if not isinstance(response, RelayResponse):
                self._request_done()

    def _request_done(self) -> None:
        self.num_requests -= 1


async def _read_json(request: Request, limit: int) -> dict[str, Any] | Response:
    """The request's body as a JSON object, or the 413 / 400 error response (the body is not read past
    ``limit`` bytes)."""
    too_large = _error(413, f"the request body is larger than the {limit} bytes this router accepts",
                       "request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        return too_large
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            return too_large
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return _error(400, f"the body is not valid JSON: {exc}", "invalid_json")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object", "invalid_json")
    return body


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else 0.0


class _KeyGuard:
    """ASGI middleware: a bearer key of ``keys`` on every ``/v1`` route, else an OpenAI-shaped 401."""

    def __init__(self, app, keys: list[str]):
        self.app, self.keys = app, [key.encode() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not any(given and hmac.compare_digest(key, given) for key in self.keys):
                await _error(401, "Incorrect API key provided: send 'Authorization: Bearer <key>' with one of the "
                             "router's --api-key values", "invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_router_app(config: RouterConfig) -> FastAPI:
    """The router's FastAPI app (module docstring). ``app.state.router`` is the :class:`Router`;
    ``app.state.server`` the same object for :func:`deepseek_v41.server.launch.make_server`'s drain. The backend
    clients and the health loop live in the app's lifespan."""
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            router.draining = True
            await router.close()

    app = FastAPI(title="dsv41 router", lifespan=lifespan)
    app.state.router = app.state.server = router
    if config.api_keys:
        app.add_middleware(_KeyGuard, keys=config.api_keys)

    async def generate(request: Request, route: str) -> Response:
        if router.draining:
            response = _error(503, "the router is shutting down; retry on another replica", "shutting_down")
        else:
            body = await _read_json(request, config.max_body_bytes)  # whole, before watching for a disconnect
            if isinstance(body, Response):
                response = body
            else:
                work = router.generate(route, body, request.headers.get("authorization", ""),
                                       request.headers.get("x-request-id") or uuid.uuid4().hex)
                try:
                    response = await until_disconnect(request, work)
                except ClientDisconnected:
                    response = Response(status_code=499)
        router.metrics.requests.labels(router.model_name, route, str(response.status_code)).inc()
        return response

    @app.post(CHAT)
    async def chat_completions(request: Request):
        return await generate(request, CHAT)

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await generate(request, COMPLETIONS)

    @app.get("/v1/models")
    async def models(request: Request):
        auth = request.headers.get("authorization")
        for backend in router.backends["decode"]:
            if backend.up:
                try:
                    return _passthrough(await router.client.get(backend.url + "/v1/models",
                                                                headers={"Authorization": auth} if auth else {}))
                except httpx.HTTPError as exc:
                    router._stage_failed(backend, "/v1/models", exc)
        return _error(503, "no decode server is up", "no_backend")

    @app.get("/health")
    async def health():
        if router.draining:
            return _error(503, "the router is shutting down", "shutting_down")
        if not any(b.up for b in router.backends["decode"]):
            return _error(503, "no decode server is up", "no_backend")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
