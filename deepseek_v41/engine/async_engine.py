"""``AsyncLLMEngine``: the engine behind an asyncio server (vLLM's ``AsyncLLM``).

One background task owns the engine: it starts a single worker thread (so the event loop stays responsive while
the model computes), which applies queued adds and aborts and runs ``LLMEngine.step`` after ``LLMEngine.step``
for as long as there is work, handing each step's outputs to the event loop in one callback (vLLM's output
handler: one hand-off per step, not per request), where they go to each request's ``asyncio.Queue``. The worker
does not wait for the event loop between steps: the next step computes while the loop streams the last one's
tokens (issue 25). Only the worker thread ever touches the ``LLMEngine``; the event loop only queues work (in
deques, which both threads may use), so no locks are needed. ``generate`` is an async iterator of
:class:`StepOutput`; closing it early (a client that went away, a cancelled task) aborts the request, which frees
its pages and slot at the next step.

Observers (``add_observer``) see every step's outputs and a stats snapshot; the server's metrics and the periodic
throughput log are observers. Source: SPEC.md §4.6; vLLM ``vllm/v1/engine/async_llm.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from deepseek_v41.engine.engine import LLMEngine
from deepseek_v41.engine.sampling_params import SamplingParams
from deepseek_v41.engine.sequence import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

ABORT = "abort"  # finish reason of a request stopped by abort (client gone, server shutting down)


class EngineDeadError(RuntimeError):
    """The engine loop failed; no request can be served any more (the server answers 503)."""


class EngineDrainingError(RuntimeError):
    """The engine is shutting down and takes no new requests (the server answers 503)."""


@dataclass
class StepOutput:
    """What one engine step did for one request.

    ``output``: the request's state after the step (full text and token ids per sample, ``finished``).
    ``delta_text[i]`` / ``delta_token_ids[i]``: what sample i streamed in this step (text already held back by
    the detokenizer for stop strings is not included; everything streamed concatenates to the final text).
    ``finish_reasons[i]``: "stop", "length" or "abort" in the step where sample i finished, else None.
    ``time``: seconds since the epoch when the step ended.
    """

    request_id: str
    output: RequestOutput
    delta_text: list[str]
    delta_token_ids: list[list[int]]
    finish_reasons: list[str | None]
    time: float

    @property
    def finished(self) -> bool:
        return self.output.finished


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


@dataclass
class _Progress:
    """Per-sample counters of what has been streamed, kept by the worker thread."""

    num_tokens: list[int]
    text: list[str]
    done: list[bool]


Observer = Callable[[list[StepOutput], dict[str, Any]], None]


class EngineThread(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` of exactly one thread ("dsv41-engine"): what :func:`engine_thread` returns and
    :class:`AsyncLLMEngine` takes (its steps run in order on that one thread)."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="dsv41-engine")


def engine_thread() -> EngineThread:
    """A single-thread executor ("dsv41-engine") for an engine's torch work: build the engine with
    ``engine_thread().submit(LLM, ...).result()`` and pass the same executor to :class:`AsyncLLMEngine`.

    Why one thread (issue 25, measured): each Python thread that runs a large torch op gets its own OpenMP thread
    team. With a model loaded on the main thread and stepped on a worker thread, two teams share the cores, and on
    a 2-core machine every parallel op of either thread then ran ~2.5x slower, also a plain matmul loop (likely
    libgomp's idle threads: with more of them than cores they sleep instead of spinning between ops). Loading and
    stepping on one thread keeps one team.
    """
    return EngineThread()


class AsyncLLMEngine:
    """Runs an :class:`LLMEngine` in the background and streams each request's outputs.

    Args:
        engine: the engine to drive; from now on only this object's worker thread may call it.
        idle_sleep_s: pause after a step that produced nothing while work is queued (e.g. every waiting request is
            blocked on free pages), so such a state does not spin a core.
        on_dead: called once on the event loop with the exception after the loop failed and every open request got
            :class:`EngineDeadError` (the server exits non-zero from it, so that a supervisor restarts it, as vLLM
            does); settable later as the ``on_dead`` attribute.
        executor: the single-thread executor whose thread runs the steps (None: a new one). Pass the
            :func:`engine_thread` that built the engine, so that one thread does all of its torch work; any other
            executor is a ValueError.

    ``stats`` is a snapshot of ``engine.stats`` taken after the latest step, plus ``num_running`` and
    ``num_waiting`` (safe to read from the event loop at any time).
    """

    def __init__(self, engine: LLMEngine, idle_sleep_s: float = 0.002,
                 on_dead: Callable[[BaseException], None] | None = None,
                 executor: EngineThread | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.idle_sleep_s = idle_sleep_s
        self.on_dead = on_dead
        if executor is not None and not isinstance(executor, EngineThread):
            raise ValueError(f"the engine's executor runs its steps in order on one thread: pass engine_thread() "
                             f"(an EngineThread), got {type(executor).__name__}")
        self._executor = executor if executor is not None else engine_thread()
        self._streams: dict[str, _Stream] = {}
        # Filled by the event loop, emptied by the worker thread (deque appends and pops are thread-safe).
        self._adds: deque[EngineRequest] = deque()
        self._aborts: deque[str] = deque()
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()  # run between steps
        self._stopping = False
        self._progress: dict[str, _Progress] = {}
        self._observers: list[Observer] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._draining = False
        self._watching = False
        self.stats: dict[str, Any] = self._snapshot()

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def num_requests(self) -> int:
        """Requests accepted and not yet finished (streams still open)."""
        return len(self._streams)

    def start(self) -> None:
        """Start the loop on the running event loop (idempotent)."""
        if self.is_running:
            return
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="dsv41-engine-loop")
        executor = getattr(self.engine, "executor", None)
        if executor is not None and not self._watching:  # a parallel engine: a worker may die between steps
            self._watching = True
            executor.watch(lambda exc: loop.call_soon_threadsafe(self._worker_failed, exc))

    def _worker_failed(self, exc: BaseException) -> None:
        """A worker rank of a parallel engine died or failed (its executor's watchdog, on the event loop): every
        request fails now, even while the engine is idle or a step waits on the dead rank."""
        if self._dead is None:
            logger.error("the engine is stopped: %s", exc)
            self._fail_all(exc)
            if self._wake is not None:
                self._wake.set()

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """Stop taking requests, let running ones finish for up to ``timeout_s`` seconds, abort the rest, stop."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self.is_running:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            self.abort(request_id)
        while self._streams and self.is_running:
            await asyncio.sleep(0.01)
        self._stopping = True  # the worker's loop returns after its current step
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)
        # Persistent pages reach the disk before exit.
        await asyncio.to_thread(self.engine.kv_cache_manager.flush)
        stop_workers = getattr(self.engine, "shutdown", None)  # a parallel engine (DriverEngine): its workers
        if stop_workers is not None:
            await asyncio.to_thread(stop_workers)

    def add_observer(self, observer: Observer) -> None:
        """Call ``observer(step_outputs, stats)`` on the event loop after every step that produced outputs."""
        self._observers.append(observer)

    # ------------------------------------------------------------------ requests
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, cache_salt: str | None = None,
                       arrival_time: float | None = None, multi_modal_data: dict | None = None
                       ) -> AsyncIterator[StepOutput]:
        """Add a request and yield a :class:`StepOutput` for every step that advanced it, the last one finished.

        ``cache_salt`` keeps its prefix-cache entries apart from other salts. ``multi_modal_data``: ``{"image":
        [...]}``, passed to ``LLMEngine.add_request`` as it is (one image per ``image_token_id`` placeholder of
        the prompt; preprocess them off the event loop first, the engine's thread only checks and expands). The
        request crosses to the engine's thread as one :class:`~deepseek_v41.engine.sequence.EngineRequest`. Raises
        ValueError (from ``LLMEngine.add_request``: empty prompt, ids outside the vocabulary, too long, duplicate id)
        at the first iteration, EngineDrainingError during shutdown and EngineDeadError after a failure of the loop.
        Leaving the iteration early aborts the request.
        """
        if self._dead is not None:
            raise self.dead_error()
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.start()
        stream = _Stream()
        self._streams[request_id] = stream
        self._adds.append(EngineRequest(request_id, prompt_token_ids, params, prompt=prompt, cache_salt=cache_salt,
                                        arrival_time=arrival_time, multi_modal_data=multi_modal_data))
        self._wake.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)
            else:
                self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step; its stream gets a last output with finish reason "abort"."""
        if request_id in self._streams and self._wake is not None:
            self._aborts.append(request_id)
            self._wake.set()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """:meth:`LLMEngine.reset_prefix_cache` on the engine's worker thread, between two steps (never during
        one): True when the cache was reset, False while requests hold KV pages (unless
        ``reset_running_requests``: they are preempted and recompute, their streams continue). Raises
        EngineDeadError after a failure of the loop, EngineDrainingError during shutdown."""
        if self._dead is not None:
            raise self.dead_error()
        if self._draining:
            raise EngineDrainingError("the server is shutting down")
        # The worker thread runs it between two steps (or, idle, when the loop wakes it for it).
        self.start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.append((lambda: self.engine.reset_prefix_cache(reset_running_requests), done))
        self._wake.set()
        return await asyncio.wrap_future(done)

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._adds or self._aborts or self._calls or self.stats["num_running"]
                    or self.stats["num_waiting"]):
                self._wake.clear()
                await self._wake.wait()
            if self._dead is not None:  # failed from outside the loop (a parallel engine's worker died)
                return
            try:
                # The worker steps until no work is left; each step's outputs reach _publish on this loop.
                await loop.run_in_executor(self._executor, self._run_steps, loop)
            except Exception as exc:  # the model or the engine failed: fail every request, loudly, once
                if self._dead is None:
                    logger.exception("engine step failed; the engine is stopped")
                    self._fail_all(exc)
                return

    def _run_steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """Worker thread: calls queued between steps, then the queued adds and aborts and one step, over and over
        while any work is left; each step's outputs, add errors and stats go to :meth:`_publish` on ``loop`` in
        one callback. Returns when idle (the event loop starts it again when work arrives) or stopping; raises
        what a step raised (after publishing the steps before it)."""
        while not self._stopping and self._dead is None:
            while self._calls:
                call, done = self._calls.popleft()
                if done.set_running_or_notify_cancel():
                    try:
                        done.set_result(call())
                    except Exception as exc:  # the caller gets it; the engine goes on
                        done.set_exception(exc)
            adds = [self._adds.popleft() for _ in range(len(self._adds))]
            aborts = [self._aborts.popleft() for _ in range(len(self._aborts))]
            if not (adds or aborts or self.engine.has_unfinished_requests()):
                return
            outputs, errors, stats = self._work(adds, aborts)
            try:
                loop.call_soon_threadsafe(self._publish, outputs, errors, stats)
            except RuntimeError:  # the event loop is closed: no one is listening any more
                return
            if not outputs and not adds and not aborts:
                time.sleep(self.idle_sleep_s)

    def _publish(self, outputs: list[StepOutput], errors: list[tuple[str, BaseException]],
                 stats: dict[str, Any]) -> None:
        """Event loop: one step's outputs to their streams, then the observers."""
        self.stats = stats
        for request_id, exc in errors:
            self._deliver(request_id, exc)
        for out in outputs:
            self._deliver(out.request_id, out)
        if outputs:
            for observer in self._observers:
                try:
                    observer(outputs, stats)
                except Exception:  # metrics must never take the engine down
                    logger.exception("stats observer %r failed", observer)

    def _deliver(self, request_id: str, item: StepOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream.queue.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)

    def dead_error(self) -> EngineDeadError:
        """The error every request gets once the loop failed (one message, naming the cause)."""
        return EngineDeadError(f"the engine loop failed: {self._dead!r}")

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        error = self.dead_error()
        for request_id in list(self._streams):
            self._deliver(request_id, error)
        if self.on_dead is not None:
            try:
                self.on_dead(exc)
            except Exception:  # the requests already have their error; the hook must not hide it
                logger.exception("on_dead hook %r failed", self.on_dead)

    # ------------------------------------------------------------------ worker thread
    def _work(self, adds: list[EngineRequest], aborts: list[str]
              ) -> tuple[list[StepOutput], list[tuple[str, BaseException]], dict[str, Any]]:
        """Runs on the worker thread: aborts, adds, one step; returns outputs, add errors and a stats snapshot."""
        engine = self.engine
        outputs: list[StepOutput] = []
        errors: list[tuple[str, BaseException]] = []
        for request in adds:
            request_id = request.request_id
            # Images only when there are some, so a text request takes the engine's text path unchanged.
            images = {"multi_modal_data": request.multi_modal_data} if request.multi_modal_data else {}
            try:
                engine.add_request(request_id, prompt_token_ids=request.prompt_token_ids, params=request.params,
                                   prompt=request.prompt, arrival_time=request.arrival_time,
                                   cache_salt=request.cache_salt, **images)
            except ValueError as exc:
                errors.append((request_id, exc))
                continue
            except Exception as exc:  # an engine bug on this input: fail this request, keep serving the others
                logger.exception("add_request(%r) failed", request_id)
                errors.append((request_id, RuntimeError(f"the engine could not take this request: {exc!r}")))
                continue
            n = request.params.n
            self._progress[request_id] = _Progress([0] * n, [""] * n, [False] * n)
        # After the adds: a request added and abandoned before its first step is still stopped.
        for request_id in dict.fromkeys(aborts):
            if request_id in self._progress:
                engine.abort_request(request_id)
                outputs.append(self._step_output(request_id, aborted=True))
        if engine.has_unfinished_requests():
            advanced = set(engine.step_request_ids())  # (_step_output builds each output once)
            outputs.extend(self._step_output(rid) for rid in advanced if rid in self._progress)
        return outputs, errors, self._snapshot()

    def _step_output(self, request_id: str, aborted: bool = False) -> StepOutput:
        """Diff the request's sequences against what was streamed; forget the request once it finished."""
        engine = self.engine
        output = engine.request_output(request_id)
        progress = self._progress[request_id]
        texts, ids, reasons = [], [], []
        for i, (seq, completion) in enumerate(zip(engine.requests[request_id], output.outputs, strict=True)):
            new_ids = completion.token_ids[progress.num_tokens[i]:]
            # What the detokenizer released in this step (stop-string hold-back applied).
            text = seq.new_text if new_ids and not aborted else ""
            reason = None
            if seq.finished and not progress.done[i]:
                progress.done[i] = True
                reason = ABORT if aborted else completion.finish_reason or ABORT
                if reason != ABORT and completion.text.startswith(progress.text[i]):
                    text = completion.text[len(progress.text[i]):]  # the final flush, as the engine ended it
            progress.num_tokens[i] += len(new_ids)
            progress.text[i] += text
            texts.append(text)
            ids.append(new_ids)
            reasons.append(reason)
        if aborted or output.finished:
            output.finished = True
            engine.release(request_id)
            del self._progress[request_id]
        return StepOutput(request_id, output, texts, ids, reasons, time.time())

    def _snapshot(self) -> dict[str, Any]:
        stats = dict(self.engine.stats)
        scheduler = self.engine.scheduler
        stats["num_running"] = len(scheduler.running)
        stats["num_waiting"] = len(scheduler.waiting)
        return stats
