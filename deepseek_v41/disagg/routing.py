"""Where ``dsv41 router`` sends a request: the backends of each role, their health and load, and prefix affinity
(issue 29). No I/O here (:mod:`deepseek_v41.disagg.router` does the HTTP); the policy is SGLang's cache-aware
load balancing, simplified.

**Prefix affinity**: a request's prompt material is cut into chunks (chat: the canonical JSON of each message in
order; completions: the prompt in ``affinity_chunk_chars`` characters, or ``affinity_chunk_chars // 4`` token ids)
and chain-hashed from a root of the route, model, ``cache_salt``, tools, ``chat_template_kwargs`` and the
``Authorization`` value (the servers salt their prefix caches per API key). A bounded LRU map per role sends a
request to the healthy server that served the longest matching chain (its device tier holds those pages) unless
that server has ``affinity_max_imbalance`` more requests in flight than the least loaded one; otherwise the least
loaded (fewest in flight, then fewest sent so far) is chosen.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

from deepseek_v41.chat.images import IMAGE_PART_TYPES

Role = Literal["encode", "prefill", "decode"]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# Fields the prefill request drops: it samples one token it does not return, as one sequence.
_PREFILL_DROPPED = ("stream_options", "n", "best_of", "min_tokens")


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
    """Settings of :func:`deepseek_v41.disagg.router.build_router_app` (the ``dsv41 router`` flags).

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
        for name in ("health_interval_s", "request_timeout_s", "health_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                what = f"--{name.replace('_', '-')}" if name in ("health_interval_s", "request_timeout_s") else name
                raise ValueError(f"{what} must be > 0 seconds, got {getattr(self, name)}")
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


class BackendPool:
    """The backends of every role (from a :class:`RouterConfig`) and the prefix-affinity maps of prefill and decode.

    ``backends[role]``: the :class:`Backend` list in the order given; ``choose`` picks one, ``record`` notes which
    server now holds a request's prefix.
    """

    def __init__(self, config: RouterConfig):
        self.max_imbalance = config.affinity_max_imbalance
        self.backends: dict[Role, list[Backend]] = {role: [Backend(role, url) for url in getattr(config, role)]
                                                    for role in ("encode", "prefill", "decode")}
        self.affinity = {role: PrefixAffinity(config.affinity_max_entries) for role in ("prefill", "decode")}

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
                if best.outstanding - least.outstanding <= self.max_imbalance:
                    return best, True
        return least, False

    def record(self, role: Role, hashes: list[bytes], backend: Backend) -> None:
        """``backend`` served a request of prefix ``hashes``: later requests sharing it go there."""
        if role in self.affinity and hashes:
            self.affinity[role].record(hashes, backend.url)
