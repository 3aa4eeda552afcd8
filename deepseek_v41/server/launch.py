"""Running the app under uvicorn with a drain on shutdown.

:class:`DrainingServer` marks the app as draining as soon as shutdown begins (SIGTERM, SIGINT or
``should_exit``): ``/health`` and new requests answer 503 while uvicorn lets running responses finish for up to
``timeout_graceful_shutdown`` seconds; the lifespan then aborts what is left and stops the engine loop.

A failure of the engine loop is permanent for this process, so (as vLLM does) the server logs the cause and shuts
down by itself: every request in flight has already been answered with the 503 ``engine_dead``, and ``exit_code``
turns 1 so that ``dsv41 serve`` exits non-zero and a supervisor (systemd, Kubernetes) restarts it.

Slow and idle clients cannot hold connections (:class:`ConnectionLimits`, :class:`GuardedH11Protocol`): a request
head must arrive within ``timeout_header`` seconds of the connection (or of its first byte on a kept-alive one), a
body within ``timeout_body`` seconds of its head; past either the server answers 408 and closes. An idle kept-alive
connection is closed after ``timeout_keep_alive`` seconds (uvicorn's own timer). A client that stops reading a
response (its buffers full, so the server cannot send) is dropped after ``timeout_write`` seconds without progress,
which aborts its request. Beyond ``limit_concurrency`` open connections a new one gets a 503 and is closed at once,
so a flood of connections cannot exhaust the open-file limit and the server keeps accepting. A response that keeps
flowing has no time limit (streams run as long as they run).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("deepseek_v41.server")


# File descriptors kept free for the engine (cache pages, Redis, logs) when the connection limit is derived from
# the open-file limit.
FD_RESERVE = 128
MAX_DEFAULT_CONNECTIONS = 4096


@dataclass
class ConnectionLimits:
    """Per-connection limits of the HTTP server (uvicorn's names where uvicorn has the setting).

    ``timeout_keep_alive``: seconds an idle kept-alive connection stays open (uvicorn's default, 5).
    ``timeout_header``: seconds to receive a whole request head, from the connection (or the first byte of a
    request on a kept-alive connection); then 408 and close.
    ``timeout_body``: seconds to receive a whole request body once its head arrived; then 408 and close.
    ``timeout_write``: seconds a response may stall on a client that reads nothing (writing paused: the transport's
    buffer is full); then the connection is dropped and its request aborted.
    ``limit_concurrency``: open connections at most; a new one beyond gets a 503 and is closed. None = the process's
    open-file limit minus :data:`FD_RESERVE`, at most :data:`MAX_DEFAULT_CONNECTIONS`.
    """

    timeout_keep_alive: float = 5.0
    timeout_header: float = 10.0
    timeout_body: float = 60.0
    limit_concurrency: int | None = None
    timeout_write: float = 60.0

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "timeout_header", "timeout_body", "timeout_write"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if self.limit_concurrency is None:
            self.limit_concurrency = default_limit_concurrency()
        if self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be at least 1, got {self.limit_concurrency}")


def default_limit_concurrency() -> int:
    """The open-file limit (soft) minus :data:`FD_RESERVE`, within [16, :data:`MAX_DEFAULT_CONNECTIONS`]."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_DEFAULT_CONNECTIONS
    return max(16, min(MAX_DEFAULT_CONNECTIONS, soft - FD_RESERVE))


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "service_unavailable", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the read deadlines and the connection limit of :class:`ConnectionLimits`.

    Deadlines follow h11's view of the client: while it is sending a request head (``IDLE`` with bytes received,
    or a fresh connection) the head deadline runs, while it sends a body (``SEND_BODY``) the body deadline runs,
    and once the request is complete none does. Each deadline counts from the start of its phase, not from the last
    byte, so trickling one byte at a time does not extend it.
    """

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "head" or "body" while a deadline runs
        self._stalled: asyncio.TimerHandle | None = None  # runs while writing is paused

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limit = self.limits.limit_concurrency
        if len(self.connections) > limit or len(self.tasks) >= limit:
            logger.warning("connection limit reached (%d open, --limit-concurrency %d): refusing %s",
                           len(self.connections) - 1, limit, self.client)
            transport.write(_raw_response(503, "Service Unavailable", f"the server has {limit} connections open, its "
                                          f"limit (--limit-concurrency); retry later", "too_many_connections"))
            transport.close()
            return
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # a request head is arriving (a kept-alive connection's idle wait is uvicorn's)
            self._arm("head")
        elif state is h11.SEND_BODY:
            self._arm("body")
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.limits.timeout_write, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _write_stalled(self) -> None:
        self._stalled = None
        logger.info("dropping %s: it read nothing of its response for %gs (--timeout-write)", self.client,
                    self.limits.timeout_write)
        self.transport.abort()  # close() would wait for a buffer that never drains

    def _arm(self, phase: str) -> None:
        if self._phase == phase:
            return  # the deadline runs from the start of the phase
        self._disarm()
        timeout = self.limits.timeout_header if phase == "head" else self.limits.timeout_body
        self._phase = phase
        self._deadline = self.loop.call_later(timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self) -> None:
        phase, self._deadline, self._phase = self._phase, None, None
        if self.transport.is_closing():
            return
        timeout = self.limits.timeout_header if phase == "head" else self.limits.timeout_body
        logger.info("closing %s: the request %s did not arrive within %gs", self.client, phase, timeout)
        if self.cycle is None or not self.cycle.response_started:
            flag = "--timeout-header" if phase == "head" else "--timeout-body"
            self.transport.write(_raw_response(408, "Request Timeout", f"the request {phase} did not arrive within "
                                               f"{timeout:g} seconds ({flag})", "request_timeout"))
        self.transport.close()


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` for an app built by :func:`deepseek_v41.server.app.build_app`.

    ``exit_code``: 0, or 1 once the engine failed (the process should exit with it).
    """

    exit_code = 0

    def engine_failed(self, exc: BaseException) -> None:
        """The engine loop's ``on_dead`` hook: log the cause, then shut down with exit code 1."""
        logger.error("the engine failed (%r): every running request got a 503 engine_dead; shutting down so that a "
                     "supervisor restarts the server", exc)
        self.exit_code = 1
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "server", None)
        if state is not None and not state.draining:
            state.draining = True
            logger.info("draining: %d requests running", state.engine.num_requests)
        await super().shutdown(sockets)


def make_server(app, host: str, port: int, drain_timeout_s: float, log_level: str = "info",
                limits: ConnectionLimits | None = None) -> DrainingServer:
    """A DrainingServer for ``app`` on ``host:port`` (port 0 = any free port, see ``bound_port``) with the
    connection ``limits`` (default: :class:`ConnectionLimits`' defaults)."""
    limits = limits or ConnectionLimits()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=max(1, round(drain_timeout_s)),
                            http=functools.partial(GuardedH11Protocol, limits=limits),
                            timeout_keep_alive=limits.timeout_keep_alive)  # type: ignore[arg-type]
    server = DrainingServer(config)
    state = getattr(getattr(app, "state", None), "server", None)
    if state is not None:
        state.engine.on_dead = server.engine_failed
    return server


def bound_port(server: uvicorn.Server) -> int:
    """The port a started server listens on."""
    return server.servers[0].sockets[0].getsockname()[1]
