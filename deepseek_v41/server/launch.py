"""Running the app under uvicorn with a drain on shutdown.

:class:`DrainingServer` marks the app as draining as soon as shutdown begins (SIGTERM, SIGINT or
``should_exit``): ``/health`` and new requests answer 503 while uvicorn lets running responses finish for up to
``timeout_graceful_shutdown`` seconds; the lifespan then aborts what is left and stops the engine loop.

A failure of the engine loop is permanent for this process, so (as vLLM does) the server logs the cause and shuts
down by itself: every request in flight has already been answered with the 503 ``engine_dead``, and ``exit_code``
turns 1 so that ``dsv41 serve`` exits non-zero and a supervisor (systemd, Kubernetes) restarts it.
"""

from __future__ import annotations

import logging

import uvicorn

logger = logging.getLogger("deepseek_v41.server")


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


def make_server(app, host: str, port: int, drain_timeout_s: float, log_level: str = "info") -> DrainingServer:
    """A DrainingServer for ``app`` on ``host:port`` (port 0 = any free port, see ``bound_port``)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=max(1, round(drain_timeout_s)))
    server = DrainingServer(config)
    state = getattr(getattr(app, "state", None), "server", None)
    if state is not None:
        state.engine.on_dead = server.engine_failed
    return server


def bound_port(server: uvicorn.Server) -> int:
    """The port a started server listens on."""
    return server.servers[0].sockets[0].getsockname()[1]
