"""The encode server (``--ec-transfer-config`` with ``"ec_role": "ec_producer"``; issue 29, DISAGG_DESIGN.md).

An encode server holds the vision tower and aligner only (:func:`deepseek_v41.disagg.vision_only.load_vision_only`)
and answers the chat bodies the OpenAI server takes by encoding every image of the request and writing its
aligner rows to the EC connector (:mod:`deepseek_v41.disagg.ec_connector`), where the prefill server (an
``ec_consumer``) reads them instead of encoding the image itself. Text parts are ignored; the images are taken under
the same media policy (:mod:`deepseek_v41.server.media`: data URLs, allowed hosts, byte / pixel / count limits),
rendered in the same order (:func:`deepseek_v41.chat.encoding.render_messages`) and processed by the same rules, so
the content hashes are the ones the prefill server computes.

Routes: ``POST /v1/chat/completions`` -> 200 ``{"id", "object": "ec_transfer", "created", "model",
"ec_transfer_params": {"image_hashes": [...] (prompt order, one per image part), "num_image_tokens": prompt
positions of the image spans, "transfer_bytes": bytes of the distinct images' files in the connector (what a
consumer reads, headers included), "encoded": distinct images encoded now, "cached": distinct images already in
the encoder cache}}``, sent once every file is in the connector; a request without images is a 400
(``no_images``), rows that cannot be written a 503 (``ec_transfer_failed``). ``POST /v1/completions``: a 400 (a
completions body carries no images). ``GET /version``, ``GET /health`` (503 once the connector's directory is not
writable), ``GET /metrics`` (``dsv41:ec_transfer_bytes{direction}``, ``dsv41:ec_transfer_images{direction}``,
``dsv41:ec_transfer_seconds{direction}``, ``dsv41:ec_transfer_hits`` / ``_misses``,
``dsv41:encoder_cache_hits`` / ``_misses``, ``dsv41:ec_requests{status}``), ``GET /v1/models``.

Images are loaded and preprocessed on the media threads; the encoding and the writes run on one thread of their own
(the vision encode stage is not shared between threads), never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from pydantic import ValidationError

from deepseek_v41 import __version__
from deepseek_v41.chat.encoding import render_messages
from deepseek_v41.chat.errors import ChatFormatError
from deepseek_v41.disagg.config import ECTransferConfig
from deepseek_v41.disagg.vision_only import load_vision_only
from deepseek_v41.engine.encoder_cache import VisionEncoder, build_vision_encoder
from deepseek_v41.engine.multimodal import ImageItem, image_hash
from deepseek_v41.server.app import _Guard
from deepseek_v41.server.chat import resolve_thinking
from deepseek_v41.server.errors import APIError, install_error_handlers, validation_error
from deepseek_v41.server.media import (
    MediaConfig,
    check_image_count,
    image_bytes,
    in_media_thread,
    preprocess,
)
from deepseek_v41.server.metrics import ec_metric_families
from deepseek_v41.server.protocol import ChatCompletionRequest

logger = logging.getLogger("deepseek_v41.server")


class EncodeServer:
    """The encode server's state: the vision encode stage (with its EC connector), the media policy, the thread
    that encodes and the request counters. ``encode(images)`` is what a request runs (module docstring)."""

    def __init__(self, encoder: VisionEncoder, served_model_names: list[str], media: MediaConfig,
                 model_path: str | None = None, vision_config=None, model_aliases: list[str] | None = None):
        self.encoder, self.media, self.model_path = encoder, media, model_path
        self.served_model_names, self.vision_config = served_model_names, vision_config
        self.model_aliases = list(model_aliases or [])
        self.connector = encoder.ec_connector
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv41-encode")
        self.requests = {"ok": 0, "error": 0}
        self.created = int(time.time())

    def encode(self, items: list[ImageItem]) -> dict[str, Any]:
        """Encode (or take from the encoder cache) every image of ``items`` and make sure each distinct one is in
        the connector; the ``ec_transfer_params`` of the response. Runs on :attr:`pool`. Raises APIError 503 when
        rows could not be written (the directory is not writable, or an image's file exceeds the budget)."""
        encoder, unique = self.encoder, {item.hash: item for item in items}
        with torch.no_grad():
            encoder.request(unique.values())
            queued = set(encoder.queue)
            try:
                encoded = encoder.run()
                rows = {h: encoder.ready[h] for h in unique}
            finally:
                encoder.queue.clear()  # a failed encode leaves nothing queued for the next request
                encoder.release()
        failed = [h for h in unique if h not in queued and not self.connector.put(h, rows[h])]
        # The encoded ones were written by the stage; their files must be there too.
        failed += [h for h in queued if not self.connector.contains(h)]
        if failed:
            raise APIError(f"the aligner rows of {len(failed)} image(s) could not be written to the EC connector "
                           f"at {self.connector.directory} (not writable, or larger than its max_bytes)", None,
                           "ec_transfer_failed", 503)
        return {"image_hashes": [item.hash for item in items],
                "num_image_tokens": sum(item.length for item in items),
                "transfer_bytes": sum(self.connector.file_bytes(h, r.shape[0]) for h, r in rows.items()),
                "encoded": encoded, "cached": len(unique) - encoded}


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", None, "invalid_type")
    return body


async def _images(server: EncodeServer, body: dict[str, Any]) -> list[ImageItem]:
    """The request's images as :class:`ImageItem` (hash, span length; ``offset`` 0), prompt order. APIError 400 for
    a body the OpenAI server would refuse in its messages, and for a request without images."""
    known = {k: v for k, v in body.items() if k in ChatCompletionRequest.model_fields}  # sampling fields pass
    try:
        req = ChatCompletionRequest.model_validate(known)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    if req.model and req.model not in server.served_model_names and req.model not in server.model_aliases:
        raise APIError(f"The model '{req.model}' does not exist", "model", "model_not_found", 404)
    thinking, effort, drop = resolve_thinking(req)
    try:
        _, sources = render_messages(req.messages, tools=req.tools if req.tool_choice != "none" else None,
                                     thinking=thinking, reasoning_effort=effort, drop_thinking=drop)
    except ChatFormatError as exc:
        raise APIError(str(exc), exc.where, "invalid_value") from exc
    if not sources:
        raise APIError("this request has no images: an encode server (ec_producer) encodes the image parts of chat "
                       "messages (image_url, input_image, image); send text-only requests to the prefill server",
                       "messages", "no_images")
    check_image_count(len(sources), server.media)
    items = []
    for source in sources:
        data = await image_bytes(source, server.media)
        processed = await in_media_thread(preprocess, data, server.media, server.vision_config, source.where)
        del data
        items.append(ImageItem(processed, await in_media_thread(image_hash, processed), 0,
                               processed.grid.span_length))
    return items


def _collector(server: EncodeServer, name: str):
    class _Collector:
        def collect(self):
            stats = server.encoder.stats()
            yield from ec_metric_families(name, stats.get("ec_transfer"))
            for key, doc in (("hits", "Images whose aligner rows came from the encoder cache (not encoded again)."),
                             ("misses", "Images the encoder cache did not hold, encoded by the vision tower.")):
                family = CounterMetricFamily(f"dsv41:encoder_cache_{key}", doc, labels=["model_name"])
                family.add_metric([name], stats.get(key, 0))
                yield family
            seconds = CounterMetricFamily("dsv41:ec_encode_seconds", "Seconds the vision tower spent encoding.",
                                          labels=["model_name"])
            seconds.add_metric([name], stats["encode_seconds"])
            yield seconds
            requests = CounterMetricFamily("dsv41:ec_requests", "Encode requests answered, by outcome.",
                                           labels=["model_name", "status"])
            for status, count in server.requests.items():
                requests.add_metric([name, status], count)
            yield requests

    return _Collector()


def build_encode_app(model_dir: str | Path, ec_config: ECTransferConfig | dict | str, dtype: torch.dtype | str = "auto",
                     device: torch.device | str = "cpu", *, served_model_names: list[str] | None = None,
                     model_aliases: list[str] | None = None, media: MediaConfig | None = None,
                     encoder_cache_size: int | None = None, api_keys: list[str] | None = None,
                     max_body_bytes: int = 32 * 1024 * 1024) -> FastAPI:
    """The encode server's FastAPI app (module docstring) for the model directory ``model_dir``: its vision tower
    and aligner loaded alone in ``dtype`` on ``device``, an encoder cache of ``encoder_cache_size`` rows (as
    ``EngineArgs``), the EC connector of ``ec_config`` (``--ec-transfer-config``; role ``ec_producer`` or
    ``ec_both``). ``served_model_names`` (default ``[str(model_dir)]``), ``model_aliases``, ``media`` (default
    :class:`~deepseek_v41.server.media.MediaConfig`), ``api_keys`` and ``max_body_bytes`` as the OpenAI server's
    :class:`~deepseek_v41.server.common.ServerConfig`.
    Raises ValueError for a consumer-only role or a bad config, and what :func:`load_vision_only` raises."""
    cfg = ec_config if isinstance(ec_config, ECTransferConfig) else ECTransferConfig.from_cli(ec_config)
    if not cfg.is_producer:
        raise ValueError(f"an encode server writes aligner rows: its ec_role must be ec_producer (or ec_both), got "
                         f"{cfg.ec_role}")
    model = load_vision_only(model_dir, dtype, device)
    encoder = build_vision_encoder(model, encoder_cache_size, cfg, model_dir)
    names = list(served_model_names or [str(model_dir)])
    server = EncodeServer(encoder, names, media or MediaConfig(), str(model_dir), model.config.vision_config,
                          model_aliases)
    registry = CollectorRegistry()
    registry.register(_collector(server, names[0]))
    logger.info("encode server: %s, writing aligner rows to %s", cfg.ec_role, encoder.ec_connector.directory)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            server.pool.shutdown(wait=True)

    app = FastAPI(title="deepseek_v41 encode server (ec_producer)", version=__version__, lifespan=lifespan)
    app.state.encode_server = server
    install_error_handlers(app)
    app.add_middleware(_Guard, keys=list(api_keys or []), max_body_bytes=max_body_bytes)

    @app.post("/v1/chat/completions")
    async def encode_chat(request: Request):
        try:
            items = await _images(server, await _json_body(request))
            params = await asyncio.get_running_loop().run_in_executor(server.pool, server.encode, items)
        except APIError:
            server.requests["error"] += 1
            raise
        server.requests["ok"] += 1
        return {"id": f"ec-{uuid.uuid4().hex}", "object": "ec_transfer", "created": int(time.time()),
                "model": names[0], "ec_transfer_params": params}

    @app.post("/v1/completions")
    async def encode_completion(request: Request):
        await _json_body(request)
        server.requests["error"] += 1
        raise APIError("a completions request carries no images: an encode server (ec_producer) encodes the image "
                       "parts of chat requests (/v1/chat/completions); send completions to the prefill server",
                       "prompt", "no_images")

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": server.created,
                                            "owned_by": "dsv41", "root": server.model_path, "parent": None}
                                           for name in names]}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        if server.connector.stats["disabled"]:
            raise APIError(f"the EC connector's directory {server.connector.directory} is not writable", None,
                           "ec_transfer_failed", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
