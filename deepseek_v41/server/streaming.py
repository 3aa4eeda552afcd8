"""Server-sent events and client disconnects.

``SSEResponse`` streams an async iterator of JSON-able chunks as ``data: {...}\\n\\n`` lines, ends with
``data: [DONE]``, and watches the connection: when the client goes away the stream is cancelled and the iterator
closed, which aborts the engine request (``AsyncLLMEngine.generate`` aborts on close) and frees its pages at the
next step. A chunk generator that fails mid-stream (a bug) still ends its stream: an OpenAI-shaped error event
(500 ``internal_error``, the failure logged), then ``data: [DONE]``. ``until_disconnect`` cancels a non-streaming
handler whose client went away. Source: SPEC.md §4.6; the SSE format of the OpenAI streaming API; vLLM
``with_cancellation``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from deepseek_v41.server.errors import error_body

T = TypeVar("T")
logger = logging.getLogger("deepseek_v41.server")
DONE = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """A response streaming ``chunks`` (dicts) as SSE, then ``data: [DONE]``.

    The iterator is always closed when the response ends, normally or not; a client disconnect cancels it first.
    """

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[dict[str, Any]]):
        super().__init__(status_code=200)
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            try:
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": sse_event(chunk), "more_body": True})
            except (OSError, ClientDisconnected):
                raise
            except Exception as exc:  # a bug in a chunk generator: the client still gets an error and [DONE]
                logger.exception("a streamed response failed")
                error = error_body(f"internal error: {type(exc).__name__}", 500, None, "internal_error")
                await send({"type": "http.response.body", "body": sse_event(error), "more_body": True})
            await send({"type": "http.response.body", "body": DONE, "more_body": False})

        sender = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watcher, sender):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError, OSError, ClientDisconnected):
                    await task
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        error = None if sender.cancelled() else sender.exception()
        if error is not None and not isinstance(error, OSError | ClientDisconnected):
            raise error


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected
    return task.result()
