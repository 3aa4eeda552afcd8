"""Images of a chat request: the server's media policy, fetching URLs within it, and decoding off the event loop.

Policy (:class:`MediaConfig`, ``dsv41 serve`` flags named as vLLM's where vLLM has them):

- ``data:image/...;base64,...`` URLs are always taken (the image travels in the request body, whose size
  ``--max-body-mb`` bounds).
- ``http(s)://`` URLs are fetched only from the hosts of ``--allowed-media-domains`` (exact host names or IP
  literals, case-insensitive; ``*`` allows any host). **Fetching is off by default**, unlike vLLM (which fetches from
  anywhere unless the flag is given): a server that fetches any URL a client names can be steered at internal
  addresses (SSRF). A refused URL is a 400 saying which flag allows it.
- A fetch has ``--media-fetch-timeout`` seconds in all (connect, redirects and every byte; default
  ``$VLLM_IMAGE_FETCH_TIMEOUT``, else 5 as vLLM) and reads at most ``--max-image-bytes`` (streamed: it stops
  reading past the limit; a larger ``Content-Length`` is refused before the body is read). Redirects are followed
  (at most 5) only to allowed hosts, each hop checked again; ``VLLM_MEDIA_URL_ALLOW_REDIRECTS=0`` (vLLM's variable)
  refuses every redirect.
- ``file://`` URLs are read only below ``--allowed-local-media-path`` (vLLM's flag; the resolved path, so no
  ``..`` or symlink leads out of it), with the same byte limit.
- ``--limit-mm-per-prompt '{"image": N}'`` (vLLM's flag) caps the images of one request (default
  :data:`DEFAULT_LIMIT_IMAGES`); more is a 400 naming the limit.

Decoding (Pillow, at most ``max_image_pixels`` read from the header: :func:`deepseek_v41.engine.multimodal.
decode_image`) and preprocessing run on a pool of :data:`MEDIA_THREADS` worker threads of their own, never on the
event loop; a request loads and decodes its images one at a time, and the server holds at most
:data:`MEDIA_THREADS` full-size decoded images at once.
Every refusal is an :class:`~deepseek_v41.server.errors.APIError` 400 naming the content part.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from deepseek_v41.chat.images import ImageSource, data_url_bytes
from deepseek_v41.engine.multimodal import MAX_IMAGE_PIXELS, process_images
from deepseek_v41.server.errors import APIError

DEFAULT_LIMIT_IMAGES = 16  # images per request (vLLM: --limit-mm-per-prompt)
DEFAULT_FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT default
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # encoded bytes per image (OpenAI's limit per image is 20 MB)
MAX_REDIRECTS = 5
ANY_HOST = "*"
MEDIA_THREADS = 4
# Decoding and preprocessing run here, not in asyncio's default pool (which tokenizes text): a burst of image
# requests neither delays text requests' tokenization nor holds more than MEDIA_THREADS full-size decoded images.
_media_pool = ThreadPoolExecutor(max_workers=MEDIA_THREADS, thread_name_prefix="dsv41-media")


async def in_media_thread(fn, *args):
    """``fn(*args)`` on the media worker pool (:data:`MEDIA_THREADS` threads), awaited."""
    return await asyncio.get_running_loop().run_in_executor(_media_pool, functools.partial(fn, *args))


@dataclass
class MediaConfig:
    """How the server gets the images of a request (module docstring).

    ``allowed_media_domains``: hosts http(s) image URLs may name (``["*"]``: any); empty = fetching off.
    ``allowed_local_media_path``: directory ``file://`` URLs may read below; None = off.
    ``limit_images``: images per request at most. ``fetch_timeout_s``: seconds one fetch may take in all.
    ``max_image_bytes``: encoded bytes per image (fetched, read or in a data URL). ``max_image_pixels``: decoded
    pixels per image. ``allow_redirects``: follow redirects (to allowed hosts only).
    """

    allowed_media_domains: list[str] = field(default_factory=list)
    allowed_local_media_path: str | None = None
    limit_images: int = DEFAULT_LIMIT_IMAGES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    allow_redirects: bool = True

    def __post_init__(self) -> None:
        self.allowed_media_domains = [d.strip().lower() for d in self.allowed_media_domains if d.strip()]
        for name in ("limit_images", "max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < (0 if name == "limit_images" else 1):
                raise ValueError(f"{name} must be {'>= 0' if name == 'limit_images' else '> 0'}, got "
                                 f"{getattr(self, name)}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0 seconds, got {self.fetch_timeout_s}")

    def host_allowed(self, host: str) -> bool:
        return ANY_HOST in self.allowed_media_domains or host.lower() in self.allowed_media_domains


def describe(config: MediaConfig) -> str:
    """One log line of the media policy in force."""
    fetch = ("image URLs fetched from " + ", ".join(config.allowed_media_domains) +
             f" (within {config.fetch_timeout_s:g} s, redirects {'checked' if config.allow_redirects else 'refused'})"
             if config.allowed_media_domains else "image URL fetching off (--allowed-media-domains)")
    local = f"file:// URLs below {config.allowed_local_media_path}" if config.allowed_local_media_path else \
        "no file:// URLs"
    return (f"images: data URLs, {fetch}, {local}; at most {config.limit_images} images of "
            f"{config.max_image_bytes} bytes and {config.max_image_pixels} pixels each per request")


def env_fetch_timeout() -> float:
    """The fetch timeout default: ``$VLLM_IMAGE_FETCH_TIMEOUT`` (seconds, vLLM's variable) when set, else 5.
    Raises ValueError for a value that is not a positive number."""
    raw = os.environ.get("VLLM_IMAGE_FETCH_TIMEOUT")
    if raw is None or not raw.strip():
        return DEFAULT_FETCH_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"VLLM_IMAGE_FETCH_TIMEOUT must be a positive number of seconds, got {raw!r}")
    return value


def env_allow_redirects() -> bool:
    """``$VLLM_MEDIA_URL_ALLOW_REDIRECTS`` (vLLM's variable): redirects are followed unless it is ``0`` / ``false``."""
    return os.environ.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1").strip().lower() not in ("0", "false", "no", "off")


def parse_limit_mm_per_prompt(value: str) -> int:
    """``--limit-mm-per-prompt '{"image": N}'`` (vLLM's flag) -> N. Other modalities may be named only with 0 (this
    model takes images only). Raises ValueError saying what is allowed."""
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--limit-mm-per-prompt must be a JSON object such as '{{\"image\": 4}}': {exc}") from None
    if not isinstance(limits, dict):
        raise ValueError(f"--limit-mm-per-prompt must be a JSON object such as '{{\"image\": 4}}', got {value!r}")
    for modality, count in limits.items():
        if type(count) is not int or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality!r} must be an integer >= 0, got {count!r}")
        if modality != "image" and count:
            raise ValueError(f"--limit-mm-per-prompt: this model takes images only, so {modality!r} can only be 0")
    return limits.get("image", DEFAULT_LIMIT_IMAGES)


def check_image_count(count: int, config: MediaConfig, param: str = "messages") -> None:
    """400 naming the limit when a request has more than ``config.limit_images`` images."""
    if count > config.limit_images:
        raise APIError(f"this request has {count} images, but this server takes at most {config.limit_images} "
                       f"per prompt (--limit-mm-per-prompt '{{\"image\": {config.limit_images}}}')", param,
                       "too_many_images")


def _shown(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."


async def image_bytes(source: ImageSource, config: MediaConfig) -> bytes:
    """The encoded bytes of one image part under ``config``'s policy; APIError 400 naming the part otherwise.
    A data URL is decoded on the media pool; a fetch runs on the event loop (it awaits the network)."""
    scheme = source.scheme
    if scheme == "data":
        try:
            return await in_media_thread(data_url_bytes, source.url, config.max_image_bytes, source.where)
        except ValueError as exc:
            raise APIError(str(exc), source.where, "invalid_image") from None
    if scheme in ("http", "https"):
        return await _fetch(source, config)
    if scheme == "file":
        return await in_media_thread(_read_local, source, config)
    raise APIError(f"{source.where}: an image URL must be a data URL (data:image/png;base64,...), http(s):// or "
                   f"file://, got {_shown(source.url)!r}", source.where, "invalid_image")


def preprocess(data: bytes, config: MediaConfig, vision_config, where: str):
    """Encoded image bytes -> :class:`~deepseek_v41.model.image_processor.ProcessedImage` (decoded within
    ``config.max_image_pixels``, then resized, padded and patchified: :func:`deepseek_v41.engine.multimodal.
    process_images`); APIError 400 naming ``where``. Call it from a worker thread: the full-size decoded image
    lives only inside this call."""
    try:
        (processed,) = process_images([data], vision_config, max_pixels=config.max_image_pixels)
    except ValueError as exc:
        message = str(exc).removeprefix("image 0: ")
        raise APIError(f"{where}: {message}", where, "invalid_image") from None
    return processed


def _check_host(url: str, config: MediaConfig, where: str, hop: str = "") -> None:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise APIError(f"{where}: {hop}{_shown(url)!r} is not an http(s) URL with a host", where, "invalid_image")
    if not config.allowed_media_domains:
        raise APIError(f"{where}: this server does not fetch image URLs (fetching is off unless the server is "
                       f"started with --allowed-media-domains); send the image as a data URL "
                       f"(data:image/png;base64,...)", where, "image_url_not_allowed")
    if not config.host_allowed(host):
        raise APIError(f"{where}: {hop}host {host!r} is not in this server's --allowed-media-domains "
                       f"({', '.join(config.allowed_media_domains)}); send the image as a data URL or from an "
                       f"allowed host", where, "image_url_not_allowed")


async def _fetch(source: ImageSource, config: MediaConfig) -> bytes:
    where = source.where
    _check_host(source.url, config, where)
    try:
        return await asyncio.wait_for(_fetch_within(source.url, config, where), config.fetch_timeout_s)
    except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11
        raise APIError(f"{where}: fetching {_shown(source.url)!r} took longer than the {config.fetch_timeout_s:g} s "
                       f"allowed (--media-fetch-timeout)", where, "image_fetch_failed") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise APIError(f"{where}: fetching {_shown(source.url)!r} failed: {type(exc).__name__}: {exc}", where,
                       "image_fetch_failed") from None


async def _fetch_within(url: str, config: MediaConfig, where: str) -> bytes:
    """GET ``url`` following redirects by hand (each hop's host checked), streaming at most max_image_bytes."""
    limit = config.max_image_bytes
    # trust_env=False: no proxy from the environment sees (or routes) the URLs clients send.
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=config.fetch_timeout_s) as client:
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url) as response:
                if response.is_redirect:
                    target = response.headers.get("location", "")
                    if not config.allow_redirects:
                        raise APIError(f"{where}: {_shown(url)!r} redirects, and this server follows no redirects "
                                       f"(VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)", where, "image_fetch_failed")
                    url = urljoin(url, target)
                    _check_host(url, config, where, hop="a redirect to ")
                    continue
                if response.status_code != 200:
                    raise APIError(f"{where}: fetching {_shown(url)!r} answered HTTP {response.status_code}", where,
                                   "image_fetch_failed")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise _too_large(where, limit, int(declared))
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(where, limit)
                    chunks.append(chunk)
                return b"".join(chunks)
    raise APIError(f"{where}: more than {MAX_REDIRECTS} redirects", where, "image_fetch_failed")


def _too_large(where: str, limit: int, size: int | None = None) -> APIError:
    got = f" ({size} bytes)" if size is not None else ""
    return APIError(f"{where}: the image is larger than the {limit} bytes allowed per image{got} "
                    f"(--max-image-bytes)", where, "image_too_large")


def _read_local(source: ImageSource, config: MediaConfig) -> bytes:
    where = source.where
    if config.allowed_local_media_path is None:
        raise APIError(f"{where}: this server reads no local files (file:// URLs need --allowed-local-media-path); "
                       f"send the image as a data URL", where, "image_url_not_allowed")
    parts = urlsplit(source.url)
    if parts.netloc not in ("", "localhost"):
        raise APIError(f"{where}: a file:// URL names no host (file:///path), got {parts.netloc!r}", where,
                       "invalid_image")
    root = Path(config.allowed_local_media_path).resolve()
    path = Path(unquote(parts.path)).resolve()
    if not path.is_relative_to(root):
        raise APIError(f"{where}: {str(path)!r} is outside --allowed-local-media-path {str(root)!r}", where,
                       "image_url_not_allowed")
    try:
        with path.open("rb") as f:
            data = f.read(config.max_image_bytes + 1)
    except OSError as exc:
        raise APIError(f"{where}: cannot read {str(path)!r}: {exc.strerror or exc}", where, "invalid_image") from None
    if len(data) > config.max_image_bytes:
        raise _too_large(where, config.max_image_bytes)
    return data
