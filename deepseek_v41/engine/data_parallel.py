"""Data parallelism (issue 28): several engine replicas behind one server (vLLM's ``--data-parallel-size``).

:class:`DataParallelEngine` has the interface the server uses of :class:`AsyncLLMEngine` and owns one
``AsyncLLMEngine`` per replica; each replica has its own ``LLMEngine`` (weights, KV pool, scheduler) stepping on
its own thread, and all share the persistent prefix cache directory (``cache_dir``: the page store is made for
several writers, pages are written to a temp file and renamed; a page one replica wrote is a disk hit for another).

Routing (SGLang's cache-aware router, simplified): a request whose prompt starts with the same full KV pages
(``block_size`` tokens each, with the same ``cache_salt``) as a recent request goes to that request's replica,
whose device tier and SWA pool hold them (the deepest of the first :data:`AFFINITY_PAGES` pages that matches
wins) — unless that replica has ``balance_threshold`` or more open requests than the least loaded one; every other
request goes to the replica with the fewest open requests (ties in turn). Requests with images are routed by load
only (their placeholder tokens do not say which image they hold).

A failure of any replica's engine loop fails the server as one engine's does: ``on_dead`` is called once, the
server exits non-zero, and the front refuses new requests (``errored``); open requests of the other replicas may
finish while the server drains. Source: issue 28; vLLM ``vllm/v1/engine/core_client.py`` (DPLBAsyncMPClient),
SGLang ``sgl-router`` cache-aware policy.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from deepseek_v41.engine.async_engine import AsyncLLMEngine, EngineDrainingError, Observer, StepOutput
from deepseek_v41.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

AFFINITY_PAGES = 4  # leading full pages of a prompt remembered for routing
AFFINITY_ENTRIES = 65536  # page keys remembered at most (least recently routed forgotten first)
BALANCE_THRESHOLD = 32  # SGLang's balance_abs_threshold: open requests above the least loaded replica's
ROUTE_REASONS = ("prefix_affinity", "least_loaded")
_MAX_KEYS = frozenset({"max_decode_batch"})  # stats merged by max instead of sum


def merge_stats(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' stats snapshots as one: numbers summed (``max_decode_batch``: the largest), dicts merged key by
    key, lists of numbers summed elementwise (``layer_tokens``), anything else (strings, None, cost tables) taken
    from the first replica. Raises ValueError for no snapshot."""
    if not snapshots:
        raise ValueError("merge_stats needs at least one stats snapshot")
    out: dict[str, Any] = {}
    for key, first in snapshots[0].items():
        values = [s.get(key) for s in snapshots]
        out[key] = _merge(key, first, values)
    return out


def _merge(key: str, first: Any, values: list[Any]) -> Any:
    if isinstance(first, bool) or first is None:
        return first
    if isinstance(first, int | float):
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        return max(numbers) if key in _MAX_KEYS else sum(numbers)
    if isinstance(first, dict):
        return merge_stats([v for v in values if isinstance(v, dict)])
    if isinstance(first, list) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in first):
        lists = [v for v in values if isinstance(v, list)]
        width = max(len(v) for v in lists)
        return [sum(v[i] for v in lists if i < len(v)) for i in range(width)]
    return first


class DataParallelEngine:
    """``len(replicas)`` :class:`AsyncLLMEngine` replicas behind one server (see the module docstring).

    Args:
        replicas: the replicas' async engines (at least one; their engines built alike: same model, block size,
            ``max_model_len``); from now on this object drives them.
        balance_threshold: open requests by which a replica may exceed the least loaded one and still take a
            request for prefix affinity (default: :data:`BALANCE_THRESHOLD`, at most the replicas'
            ``max_num_seqs``); >= 1.
        on_dead: called once with the exception when any replica's engine loop failed (settable later).

    The server-facing surface is :class:`AsyncLLMEngine`'s: ``engine`` (the first replica's ``LLMEngine``, for
    its config and args), ``tokenizer``, ``max_model_len``, ``stats`` (merged, :func:`merge_stats`),
    ``num_requests``, ``errored``, ``dead_error()``, ``start()``, ``shutdown()``, ``add_observer()`` (observers get
    each replica's steps, with ``stats["engine"]`` = the replica's index), ``generate()``, ``abort()``,
    ``reset_prefix_cache()``. ``routed[index][reason]``: requests routed to each replica, by
    :data:`ROUTE_REASONS`. Raises ValueError for no replica, replicas of different block sizes or context
    lengths, or a threshold < 1.
    """

    def __init__(self, replicas: list[AsyncLLMEngine], balance_threshold: int | None = None,
                 on_dead: Callable[[BaseException], None] | None = None):
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        first = replicas[0].engine
        for index, replica in enumerate(replicas):
            other = replica.engine
            if (other.args.block_size, other.max_model_len) != (first.args.block_size, first.max_model_len):
                raise ValueError(f"replica {index} has block_size {other.args.block_size} and max_model_len "
                                 f"{other.max_model_len}, replica 0 {first.args.block_size} and "
                                 f"{first.max_model_len}: replicas must be built alike")
        if balance_threshold is None:
            balance_threshold = min(BALANCE_THRESHOLD, first.args.max_num_seqs)
        if balance_threshold < 1:
            raise ValueError(f"balance_threshold must be >= 1, got {balance_threshold}")
        self.replicas = list(replicas)
        self.engine = first
        self.tokenizer = replicas[0].tokenizer
        self.max_model_len = replicas[0].max_model_len
        self.block_size = first.args.block_size
        self.balance_threshold = balance_threshold
        self.on_dead = on_dead
        self.routed = [dict.fromkeys(ROUTE_REASONS, 0) for _ in replicas]
        self._affinity: OrderedDict[int, int] = OrderedDict()  # page key -> replica index
        self._open = [0] * len(replicas)  # requests routed to each replica and not finished
        self._owner: dict[str, int] = {}  # open request id -> replica index
        self._turn = 0  # where the next tie between equally loaded replicas starts
        self._dead: tuple[int, BaseException] | None = None
        self._draining = False
        for index, replica in enumerate(replicas):
            replica.on_dead = lambda exc, index=index: self._replica_dead(index, exc)

    # ------------------------------------------------------------------ state
    @property
    def data_parallel_size(self) -> int:
        return len(self.replicas)

    @property
    def is_running(self) -> bool:
        return any(r.is_running for r in self.replicas)

    @property
    def errored(self) -> bool:
        return self._dead is not None or any(r.errored for r in self.replicas)

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished, all replicas."""
        return sum(r.num_requests for r in self.replicas)

    @property
    def stats(self) -> dict[str, Any]:
        """The replicas' latest stats snapshots merged (:func:`merge_stats`)."""
        return merge_stats([r.stats for r in self.replicas])

    def dead_error(self):
        """The error of the first replica that failed, naming it."""
        index = self._dead[0] if self._dead is not None else next(
            (i for i, r in enumerate(self.replicas) if r.errored), 0)
        error = self.replicas[index].dead_error()
        return type(error)(f"data-parallel replica {index}: {error}")

    def _replica_dead(self, index: int, exc: BaseException) -> None:
        if self._dead is not None:
            return
        self._dead = (index, exc)
        logger.error("data-parallel replica %d failed: %r", index, exc)
        if self.on_dead is not None:
            self.on_dead(exc)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start every replica's loop on the running event loop (idempotent)."""
        for replica in self.replicas:
            replica.start()

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """:meth:`AsyncLLMEngine.shutdown` of every replica at once (drain up to ``timeout_s``, abort the rest, stop;
        a parallel replica's workers too)."""
        self._draining = True
        results = await asyncio.gather(*(r.shutdown(timeout_s) for r in self.replicas), return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                logger.error("shutting down data-parallel replica %d failed: %r", index, result)

    def add_observer(self, observer: Observer) -> None:
        """``observer(step_outputs, stats)`` after every step of every replica that produced outputs; ``stats``
        is every replica's latest snapshot merged (:attr:`stats`, so gauges such as running requests count all
        replicas) plus ``"engine"``: the index of the replica that stepped."""
        for index, replica in enumerate(self.replicas):
            replica.add_observer(lambda outputs, _, index=index: observer(outputs, {**self.stats, "engine": index}))

    # ------------------------------------------------------------------ requests
    def route(self, prompt_token_ids: list[int], cache_salt: str | None = None, has_images: bool = False
              ) -> tuple[int, str]:
        """``(replica index, reason)`` for a new request (the module docstring's rule), and remembers the
        prompt's leading pages for that replica. ``reason``: one of :data:`ROUTE_REASONS`."""
        keys = [] if has_images else self._page_keys(prompt_token_ids, cache_salt)
        least = self._least_loaded()
        index, reason = least, "least_loaded"
        for key in reversed(keys):
            owner = self._affinity.get(key)
            if owner is not None:
                if self._open[owner] - self._open[least] < self.balance_threshold:
                    index, reason = owner, "prefix_affinity"
                break
        for key in keys:
            self._affinity[key] = index
            self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        if index == least:
            self._turn = (index + 1) % len(self.replicas)
        return index, reason

    def _least_loaded(self) -> int:
        n = len(self.replicas)
        order = [(self._turn + i) % n for i in range(n)]
        return min(order, key=lambda i: self._open[i])

    def _page_keys(self, prompt_token_ids: list[int], cache_salt: str | None) -> list[int]:
        """Chained keys of the prompt's first full pages (at most :data:`AFFINITY_PAGES`), as the prefix cache
        chains its block hashes (a page's key covers every token before it and the salt)."""
        keys, key = [], hash(("dsv41-dp", cache_salt))
        size = self.block_size
        for page in range(min(AFFINITY_PAGES, len(prompt_token_ids) // size)):
            key = hash((key, tuple(prompt_token_ids[page * size:(page + 1) * size])))
            keys.append(key)
        return keys

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, cache_salt: str | None = None,
                       arrival_time: float | None = None, multi_modal_data: dict | None = None
                       ) -> AsyncIterator[StepOutput]:
        """:meth:`AsyncLLMEngine.generate` on the replica :meth:`route` picks (same arguments, outputs and errors;
        EngineDeadError naming the replica once any replica failed)."""
        if self.errored:
            raise self.dead_error()
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        index, reason = self.route(prompt_token_ids, cache_salt, bool(multi_modal_data))
        self.routed[index][reason] += 1
        self._owner[request_id] = index
        self._open[index] += 1
        try:
            async for out in self.replicas[index].generate(request_id, prompt_token_ids, params, prompt=prompt,
                                                           cache_salt=cache_salt, arrival_time=arrival_time,
                                                           multi_modal_data=multi_modal_data):
                yield out
        finally:
            self._open[index] -= 1
            self._owner.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request at its replica's next step (nothing for an unknown or finished id)."""
        index = self._owner.get(request_id)
        if index is not None:
            self.replicas[index].abort(request_id)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """:meth:`AsyncLLMEngine.reset_prefix_cache` on every replica; True when all were reset (a replica whose
        requests hold pages stays as it is and makes it False). The shared disk tier is kept, as with one
        engine. Forgets the routing table (the replicas' device tiers are empty now)."""
        if self.errored:
            raise self.dead_error()
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        done = await asyncio.gather(*(r.reset_prefix_cache(reset_running_requests) for r in self.replicas))
        self._affinity.clear()
        return all(done)
