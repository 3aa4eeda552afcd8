"""``NixlConnector``: global KV pages moved DRAM to DRAM by NVIDIA NIXL (UCX backend), the optional ``nixl`` extra.

Issue 29 (EPD disaggregation); the page-tier interface of ``/work/wt/DISAGG_DESIGN.md`` (``get`` / ``put`` /
``flush`` / ``stats``, ``read_tier``); pages are the bytes of :class:`~deepseek_v41.cache.store.PageCodec`
(SPEC.md §4.3: header + sha256), so a torn, partial or stale transfer fails the checksum and is a miss.

A **producer** (``kv_producer`` / ``kv_both``) keeps the encoded pages in one host buffer registered with its NIXL
agent (DRAM_SEG), cut into equal slots (``buffer_bytes`` of them, LRU) and serves, on a small TCP side channel
(``side_channel_host`` / ``side_channel_port``), its agent metadata and an index ``block_hash -> (offset,
length)``. A **consumer** (``kv_consumer`` / ``kv_both``) knows producers from ``peers`` ``["host:port", ...]`` or
from the ``kv_transfer_params`` of a prefill response (:meth:`NixlPages.add_peer`), fetches their metadata once,
looks a page up, NIXL-READs its bytes into its own registered buffer (one-sided for the producer's Python: on
RDMA hardware no producer CPU is involved; on a host without it, as here, UCX emulates the read over TCP in the
producer's UCX progress thread) and decodes them. As vLLM's NixlConnector: the side channel carries only
metadata, the KV bytes go through NIXL; unlike it, whole checksummed pages move, not raw KV blocks, so the decode
side never trusts them unverified.

Side channel: one JSON object per line, UTF-8, never pickle; a connection may carry many requests::

    -> {"op": "metadata"}
    <- {"agent_name", "agent_metadata" (hex), "buffer_addr", "buffer_bytes", "fingerprint", "format_version"}
    -> {"op": "lookup", "block_hashes": [h, ...]}            (at most MAX_LOOKUP hashes)
    <- {"agent_name", "pages": {h: [offset, length], ...}}   (only the hashes held)
    <- {"error": "..."}                                       (a request it does not understand)

Security: whoever reaches the side channel and the UCX endpoint can read the registered page buffer (KV of other
users' prompts). The side channel binds to 127.0.0.1 unless told otherwise; across hosts, run it on a trusted
network only. NIXL logs at WARNING unless ``NIXL_LOG_LEVEL`` says otherwise (its INFO lines go to stdout).

Source: NIXL's python API (``nixl._api``: ``nixl_agent``, ``register_memory``, ``get_agent_metadata``,
``add_remote_agent``, ``initialize_xfer("READ", ...)``); vLLM ``kv_connector/v1/nixl_connector.py`` (side channel,
``remote_host`` / ``remote_port`` / ``remote_engine_id`` in ``kv_transfer_params``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import socketserver
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from deepseek_v41.disagg.config import KV_ROLES

try:
    from nixl import _bindings as _nixl_bindings
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as _exc:  # the optional extra; NixlPages says how to install it
    _NIXL_IMPORT_ERROR: ImportError | None = _exc
    _NIXL_ERRORS: tuple[type[Exception], ...] = ()
else:
    _NIXL_IMPORT_ERROR = None
    _NIXL_ERRORS = tuple(getattr(_nixl_bindings, n) for n in dir(_nixl_bindings)
                         if n.startswith("nixl") and n.endswith("Error"))
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)

log = logging.getLogger(__name__)

DEFAULT_SIDE_CHANNEL_HOST = "127.0.0.1"
DEFAULT_SIDE_CHANNEL_PORT = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default; 0 picks a free port
DEFAULT_BUFFER_BYTES = 256 << 20
DEFAULT_BACKENDS = ("UCX",)
MAX_LOOKUP = 4096  # hashes per lookup request
MAX_LINE = 8 << 20  # bytes of one side-channel line (metadata is a few KB; a full lookup answer ~0.4 MB)
SIDE_CHANNEL_TIMEOUT = 2.0  # seconds for connecting to a peer and for each answer
# Peers named by requests (kv_transfer_params) are kept at most this many, and forgotten at their first failure: a
# request cannot leave a dead or silent address behind for every later lookup to wait on.
MAX_REQUEST_PEERS = 16
TRANSFER_TIMEOUT = 10.0  # seconds for one NIXL READ before the peer counts as down
RETRY_SECONDS = 1.0  # a peer that failed is skipped this long, then tried again (a restarted producer rejoins)
_MAX_HASH_CHARS = 128
_HASH = re.compile(rf"[0-9a-f]{{1,{_MAX_HASH_CHARS}}}")
_EXTRA_KEYS = {"encoder_only", "side_channel_host", "side_channel_port", "peers", "buffer_bytes", "backends"}


class _PeerError(Exception):
    """A peer that cannot be used now (side channel down, bad answer, failed transfer)."""


def parse_peer(peer: Any) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:5600"`` for IPv6) -> (host, port). Raises ValueError saying what is allowed."""
    if not isinstance(peer, str) or ":" not in peer:
        raise ValueError(f"NixlConnector peer {peer!r} must be a string 'host:port', e.g. '10.0.0.2:5600'")
    host, _, port = peer.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"NixlConnector peer {peer!r} must be 'host:port' with a port in 1..65535")
    return host, int(port)


class _Peer:
    """A producer this consumer reads from: its side-channel connection and NIXL agent, once handshaken."""

    def __init__(self, host: str, port: int, configured: bool = True):
        self.host, self.port, self.configured = host, port, configured
        self.sock: socket.socket | None = None
        self.reader: Any = None
        self.agent_name = ""
        self.buffer_addr = self.buffer_bytes = 0
        self.down_until = 0.0

    def request(self, message: dict) -> dict:
        """Send one JSON line, read one. Raises _PeerError."""
        try:
            self.sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")
            line = self.reader.readline(MAX_LINE + 1)
        except OSError as exc:
            raise _PeerError(f"side channel {self.host}:{self.port}: {exc}") from exc
        if not line.endswith(b"\n"):
            raise _PeerError(f"side channel {self.host}:{self.port} closed or sent an over-long line")
        try:
            answer = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _PeerError(f"side channel {self.host}:{self.port} sent bad JSON") from exc
        if not isinstance(answer, dict) or "error" in answer:
            raise _PeerError(f"side channel {self.host}:{self.port} answered {str(answer)[:200]}")
        return answer

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = self.reader = None


class NixlPages:
    """The ``NixlConnector`` page tier (module docstring): one NIXL agent per process, UCX over host memory.

    Args:
        codec: the :class:`~deepseek_v41.cache.store.PageCodec` of the model and page layout (pages are its bytes).
        extra: ``kv_connector_extra_config``: ``side_channel_host`` (str, default 127.0.0.1; the producer binds
            it and advertises it, its host name when it is 0.0.0.0), ``side_channel_port`` (int, default 5600,
            0 = a free port: see :attr:`side_channel_port`), ``peers`` (list of "host:port" producers a consumer
            reads from), ``buffer_bytes`` (int, the producer's registered page buffer, default 256 MiB; it holds
            ``buffer_bytes // slot_bytes`` pages, LRU), ``backends`` (NIXL backends, default ["UCX"]),
            ``encoder_only`` (the engine's, ignored here).
        role: ``kv_producer`` (serves pages), ``kv_consumer`` (reads them) or ``kv_both``.

    Raises ValueError for a bad role or extra config (saying what is allowed), ImportError when nixl is not
    installed (``pip install -e '.[nixl]'``), ValueError when a backend is not available in this nixl, OSError
    when the side-channel port is taken.
    """

    read_tier = "remote"

    def __init__(self, codec: Any, extra: dict, role: str):
        if role not in KV_ROLES:
            raise ValueError(f"NixlConnector role {role!r} is not one of {', '.join(KV_ROLES)}")
        if not isinstance(extra, dict) or set(extra) - _EXTRA_KEYS:
            raise ValueError(f"NixlConnector extra config must be a dict with keys among {sorted(_EXTRA_KEYS)}, "
                             f"got {extra!r}")
        host = extra.get("side_channel_host", DEFAULT_SIDE_CHANNEL_HOST)
        port = extra.get("side_channel_port", DEFAULT_SIDE_CHANNEL_PORT)
        buffer_bytes = extra.get("buffer_bytes", DEFAULT_BUFFER_BYTES)
        backends = extra.get("backends", list(DEFAULT_BACKENDS))
        peers = extra.get("peers", [])
        if not isinstance(host, str) or not host:
            raise ValueError(f"NixlConnector side_channel_host must be a host name or address, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"NixlConnector side_channel_port must be an int in 0..65535 (0 = free), got {port!r}")
        if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes <= 0:
            raise ValueError(f"NixlConnector buffer_bytes must be a positive int, got {buffer_bytes!r}")
        if not isinstance(backends, list) or not backends or not all(isinstance(b, str) and b for b in backends):
            raise ValueError(f"NixlConnector backends must be a non-empty list of NIXL backend names such as "
                             f"['UCX'], got {backends!r}")
        if not isinstance(peers, list):
            raise ValueError(f"NixlConnector peers must be a list of 'host:port' strings, got {peers!r}")
        self.codec, self.role = codec, role
        self.serves = role in ("kv_producer", "kv_both")
        self.reads = role in ("kv_consumer", "kv_both")
        self.slot_bytes = codec.size("0" * _MAX_HASH_CHARS)  # the largest page of this layout
        slots = buffer_bytes // self.slot_bytes
        if self.serves and slots == 0:
            raise ValueError(f"NixlConnector buffer_bytes={buffer_bytes} holds no page: one page of this layout "
                             f"takes {self.slot_bytes} bytes")
        self._peers = [_Peer(*parse_peer(p)) for p in peers]
        if _NIXL_IMPORT_ERROR is not None:
            raise ImportError(f"NixlConnector needs the optional nixl package: pip install -e '.[nixl]' "
                              f"({_NIXL_IMPORT_ERROR})") from _NIXL_IMPORT_ERROR
        self.agent_name = f"dsv41-{role}-{uuid.uuid4().hex[:12]}"
        self._agent = nixl_agent(self.agent_name, nixl_agent_config(backends=backends))
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise ValueError(f"NixlConnector backends {missing} are not available in this nixl; it has "
                             f"{self._agent.get_plugin_list()}")
        self._lock = threading.Lock()  # the index, the page buffer and the counters
        self._read_lock = threading.Lock()  # the receive buffer and the peers (one READ at a time)
        self._registered = []
        self._buffer = torch.zeros(slots * self.slot_bytes if self.serves else 0, dtype=torch.uint8)
        self._recv = torch.zeros(self.slot_bytes if self.reads else 0, dtype=torch.uint8)
        for buf in (self._buffer, self._recv):
            if buf.numel():
                self._registered.append(self._agent.register_memory(buf))
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()  # block_hash -> (offset, length), LRU
        self._free = list(range(slots - 1, -1, -1)) if self.serves else []
        self._warned: set[str] = set()
        self._stats = {"read_bytes": 0, "read_seconds": 0.0, "pages_read": 0, "pages_written": 0,
                       "written_bytes": 0, "bytes_used": 0, "evictions": 0, "rejected": 0, "misses": 0,
                       "local_hits": 0, "peer_errors": 0}
        self._metadata = self._agent.get_agent_metadata()  # after the registrations: it describes the buffers
        self._server: socketserver.ThreadingTCPServer | None = None
        self.host = host
        self.side_channel_port = 0
        if self.serves:
            self._start_side_channel(host, port)

    # ---- the page-tier interface ----

    def put(self, block_hash: str, page: dict[str, torch.Tensor]) -> bool:
        """Encode ``page`` into a slot of the registered buffer (evicting the least recently used page when full)
        and publish it in the index; False when this role does not serve pages or the hash is not hex. A page
        already held is only marked used. Raises ValueError for a page that does not match the layout."""
        if not self.serves or not _HASH.fullmatch(block_hash):
            return False
        self.codec.check_page(page)
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
        data = np.frombuffer(self.codec.encode(block_hash, page), dtype=np.uint8)
        with self._lock:
            if block_hash in self._index:  # another thread wrote it meanwhile
                return True
            if self._free:
                offset = self._free.pop() * self.slot_bytes
            else:
                # Unpublished before it is overwritten; a consumer READing it right now gets bytes that fail
                # the checksum or name another hash: a miss.
                _, (offset, length) = self._index.popitem(last=False)
                self._stats["evictions"] += 1
                self._stats["bytes_used"] -= length
            self._buffer.numpy()[offset : offset + data.size] = data
            self._index[block_hash] = (offset, data.size)
            self._stats["pages_written"] += 1
            self._stats["written_bytes"] += data.size
            self._stats["bytes_used"] += data.size
        return True

    def contains(self, block_hash: str) -> bool:
        """Whether this (serving) connector's buffer holds ``block_hash`` now (what a prefill response may promise)."""
        with self._lock:
            return block_hash in self._index

    def get(self, block_hash: str) -> dict[str, torch.Tensor] | None:
        """The page under ``block_hash`` (fresh CPU tensors of the layout), or None on a miss.

        A serving role looks in its own buffer first (``local_hits``; not counted in ``read_bytes``); a reading
        role then asks its peers, most recently useful first, and NIXL-READs the page from the first that holds
        it. A page that fails ``codec.decode`` (torn by an eviction, corrupt, another model or hash) is a miss
        and counted in ``rejected``; a peer that fails is skipped for RETRY_SECONDS (``peer_errors``).
        """
        if not _HASH.fullmatch(block_hash):
            return None
        if self.serves:
            page = self._get_local(block_hash)
            if page is not None:
                return page
        if self.reads:
            with self._read_lock:
                for peer in list(self._peers):
                    page = self._get_remote(peer, block_hash)
                    if page is not None:
                        self._peers.remove(peer)
                        self._peers.insert(0, peer)
                        return page
        with self._lock:
            self._stats["misses"] += 1
        return None

    def flush(self, timeout: float = 10.0) -> bool:
        """True: ``put`` copies into the registered buffer before it returns, so nothing is ever queued."""
        return True

    @property
    def stats(self) -> dict:
        """Counters: read_bytes / read_seconds / pages_read (pages NIXL-READ from peers and decoded; seconds from
        the lookup to the decoded page), pages_written / written_bytes (pages put into the buffer), bytes_used
        (page bytes held now), evictions, rejected (transfers or local pages that failed the checksum), misses,
        local_hits (pages a serving role found in its own buffer), peer_errors, peers (known producers)."""
        with self._lock:
            return {**self._stats, "peers": len(self._peers)}

    # ---- peers (consumer) ----

    @property
    def kv_transfer_params(self) -> dict:
        """What a producer's prefill response adds to its ``kv_transfer_params`` so that the decode server can
        pull (vLLM's names): ``remote_host``, ``remote_port``, ``remote_engine_id`` (this agent's name)."""
        host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
        return {"remote_host": host, "remote_port": self.side_channel_port, "remote_engine_id": self.agent_name}

    def add_peer(self, host: str, port: int) -> None:
        """Read from the producer at ``host:port`` too, first (a decode request's ``kv_transfer_params``
        ``remote_host`` / ``remote_port``). Such a peer is forgotten at its first failure (a configured ``peers``
        entry is retried after RETRY_SECONDS) and at most MAX_REQUEST_PEERS of them are kept (the least recently
        useful go first). Raises ValueError for a host that is not a string or a port that is not an integer in
        1..65535."""
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
            raise ValueError(f"kv_transfer_params remote_host must be a string and remote_port an integer, got "
                             f"{host!r} and {port!r}")
        host, port = parse_peer(f"{host}:{port}")
        with self._read_lock:
            for peer in self._peers:
                if (peer.host, peer.port) == (host, port):
                    self._peers.remove(peer)
                    break
            else:
                peer = _Peer(host, port, configured=False)
            self._peers.insert(0, peer)
            named = [p for p in self._peers if not p.configured]
            for old in named[MAX_REQUEST_PEERS:]:
                self._peers.remove(old)
                old.close()

    def _get_remote(self, peer: _Peer, block_hash: str) -> dict[str, torch.Tensor] | None:
        if peer.down_until > time.monotonic():
            return None
        try:
            if peer.sock is None:
                self._handshake(peer)
            start = time.perf_counter()  # after the one-time handshake: read_bytes / read_seconds is a bandwidth
            answer = peer.request({"op": "lookup", "block_hashes": [block_hash]})
            if answer.get("agent_name") != peer.agent_name:
                raise _PeerError(f"{peer.host}:{peer.port} restarted (now agent {answer.get('agent_name')!r})")
            entry = answer.get("pages", {}).get(block_hash) if isinstance(answer.get("pages"), dict) else None
            if entry is None:
                return None
            offset, length = self._check_entry(peer, entry)
            self._read(peer, offset, length)
        except _PeerError as exc:
            self._drop(peer, exc)
            return None
        data = self._recv.numpy()[:length].tobytes()
        page, kind = self.codec.decode(block_hash, data)
        with self._lock:
            if page is None:
                self._reject(block_hash, kind, f"{peer.host}:{peer.port}")
                return None
            self._stats["read_bytes"] += length
            self._stats["read_seconds"] += time.perf_counter() - start
            self._stats["pages_read"] += 1
        return page

    def _handshake(self, peer: _Peer) -> None:
        try:
            peer.sock = socket.create_connection((peer.host, peer.port), timeout=SIDE_CHANNEL_TIMEOUT)
        except OSError as exc:
            raise _PeerError(f"side channel {peer.host}:{peer.port}: {exc}") from exc
        peer.reader = peer.sock.makefile("rb")
        meta = peer.request({"op": "metadata"})
        if meta.get("fingerprint") != self.codec.fingerprint or meta.get("format_version") != self.codec.format_version:
            raise _PeerError(f"{peer.host}:{peer.port} serves another model or page format "
                             f"(fingerprint {str(meta.get('fingerprint'))[:16]})")
        try:
            peer.buffer_addr, peer.buffer_bytes = int(meta["buffer_addr"]), int(meta["buffer_bytes"])
            name = self._agent.add_remote_agent(bytes.fromhex(meta["agent_metadata"]))
            peer.agent_name = name.decode() if isinstance(name, bytes) else name
        except (KeyError, TypeError, ValueError, *_NIXL_ERRORS) as exc:
            raise _PeerError(f"{peer.host}:{peer.port} sent unusable metadata: {exc!r}") from exc
        if peer.agent_name != meta.get("agent_name"):
            raise _PeerError(f"{peer.host}:{peer.port} metadata names agent {peer.agent_name!r}, "
                             f"not {meta.get('agent_name')!r}")

    def _check_entry(self, peer: _Peer, entry: Any) -> tuple[int, int]:
        if (not isinstance(entry, list) or len(entry) != 2 or not all(type(v) is int for v in entry)
                or entry[0] < 0 or not 0 < entry[1] <= self.slot_bytes or entry[0] + entry[1] > peer.buffer_bytes):
            raise _PeerError(f"{peer.host}:{peer.port} sent a bad index entry {str(entry)[:80]}")
        return entry[0], entry[1]

    def _read(self, peer: _Peer, offset: int, length: int) -> None:
        """NIXL READ of ``length`` bytes at ``offset`` of the peer's buffer into the receive buffer."""
        handle = None
        try:
            local = self._agent.get_xfer_descs([(self._recv.data_ptr(), length, 0)], "DRAM")
            remote = self._agent.get_xfer_descs([(peer.buffer_addr + offset, length, 0)], "DRAM")
            handle = self._agent.initialize_xfer("READ", local, remote, peer.agent_name)
            state, deadline = self._agent.transfer(handle), time.monotonic() + TRANSFER_TIMEOUT
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.0002)  # the UCX progress thread moves the bytes; do not spin on a 2-core machine
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise _PeerError(f"NIXL READ from {peer.host}:{peer.port} ended {state} "
                                 f"({'timed out' if state == 'PROC' else 'error'})")
        except _NIXL_ERRORS as exc:
            raise _PeerError(f"NIXL READ from {peer.host}:{peer.port}: {exc!r}") from exc
        finally:
            if handle is not None:
                try:
                    self._agent.release_xfer_handle(handle)
                except _NIXL_ERRORS as exc:  # an unfinished transfer nixl could not cancel: it keeps it
                    log.warning("NixlConnector: could not release a transfer from %s:%d: %r", peer.host, peer.port,
                                exc)

    def _drop(self, peer: _Peer, exc: Exception) -> None:
        """Forget the peer's connection and agent; skip it for RETRY_SECONDS, then handshake again."""
        peer.close()
        if peer.agent_name:
            with contextlib.suppress(*_NIXL_ERRORS):  # never loaded or already gone
                self._agent.remove_remote_agent(peer.agent_name)
            peer.agent_name = ""
        peer.down_until = time.monotonic() + RETRY_SECONDS
        with self._lock:
            self._stats["peer_errors"] += 1
        if not peer.configured:  # named by a request: forgotten (the next request that names it adds it again)
            with contextlib.suppress(ValueError):
                self._peers.remove(peer)
            log.warning("NixlConnector: peer %s:%d (named by a request) forgotten: %s", peer.host, peer.port, exc)
            return
        log.warning("NixlConnector: peer %s:%d skipped for %.0f s: %s", peer.host, peer.port, RETRY_SECONDS, exc)

    # ---- the buffer and the side channel (producer) ----

    def _get_local(self, block_hash: str) -> dict[str, torch.Tensor] | None:
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None:
                return None
            self._index.move_to_end(block_hash)
            data = self._buffer.numpy()[entry[0] : entry[0] + entry[1]].tobytes()
        page, kind = self.codec.decode(block_hash, data)
        with self._lock:
            if page is None:
                if self._index.get(block_hash) == entry:
                    del self._index[block_hash]
                    self._free.append(entry[0] // self.slot_bytes)
                    self._stats["bytes_used"] -= entry[1]
                self._reject(block_hash, kind, "the local buffer")
            else:
                self._stats["local_hits"] += 1
        return page

    def _reject(self, block_hash: str, kind: str, where: str) -> None:
        """Count a page that failed validation; warn once per kind. Call with ``_lock`` held."""
        self._stats["rejected"] += 1
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("NixlConnector: rejected page %s from %s (%s); further rejections of this kind are only "
                        "counted", block_hash, where, kind)

    def _lookup(self, hashes: list[str]) -> dict[str, list[int]]:
        with self._lock:
            found = {}
            for h in hashes:
                if h in self._index:
                    self._index.move_to_end(h)  # a page a consumer is about to read stays
                    found[h] = list(self._index[h])
            return found

    def _answer(self, request: Any) -> dict:
        if isinstance(request, dict) and request.get("op") == "metadata":
            return {"agent_name": self.agent_name, "agent_metadata": self._metadata.hex(),
                    "buffer_addr": self._buffer.data_ptr(), "buffer_bytes": self._buffer.numel(),
                    "fingerprint": self.codec.fingerprint, "format_version": self.codec.format_version}
        if isinstance(request, dict) and request.get("op") == "lookup":
            hashes = request.get("block_hashes")
            if (isinstance(hashes, list) and len(hashes) <= MAX_LOOKUP
                    and all(isinstance(h, str) and _HASH.fullmatch(h) for h in hashes)):
                return {"agent_name": self.agent_name, "pages": self._lookup(hashes)}
            return {"error": f"lookup takes block_hashes: a list of at most {MAX_LOOKUP} hex strings"}
        return {"error": "op must be 'metadata' or 'lookup'"}

    def _start_side_channel(self, host: str, port: int) -> None:
        pages, connections = self, set()

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                connections.add(self.connection)
                try:
                    while line := self.rfile.readline(MAX_LINE + 1):
                        try:
                            answer = (pages._answer(json.loads(line)) if line.endswith(b"\n")
                                      else {"error": f"line longer than {MAX_LINE} bytes"})
                        except (UnicodeDecodeError, json.JSONDecodeError):
                            answer = {"error": "each line must be one JSON object"}
                        self.wfile.write(json.dumps(answer, separators=(",", ":")).encode() + b"\n")
                        if "error" in answer and not line.endswith(b"\n"):
                            return
                except OSError:
                    return  # the consumer went away, or close() shut the connection
                finally:
                    connections.discard(self.connection)

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True  # a restarted producer takes its port back at once
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._server = Server((host, port), Handler)
        self._connections = connections
        self.side_channel_port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="nixl-side-channel", daemon=True).start()

    # ---- lifetime ----

    def close(self) -> None:
        """Stop the side channel, close the peer connections and deregister the buffers. Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            for conn in list(self._connections):
                with contextlib.suppress(OSError):  # already closed by the consumer
                    conn.shutdown(socket.SHUT_RDWR)
            self._server = None
        with self._read_lock:
            for peer in self._peers:
                peer.close()
        for reg in self._registered:
            self._agent.deregister_memory(reg)
        self._registered = []

    def __enter__(self) -> NixlPages:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
