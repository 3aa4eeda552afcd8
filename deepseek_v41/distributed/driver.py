"""Rank 0 of a parallel engine (the driver) and what every rank does to build its engine (issue 28).

Execution model: lockstep SPMD. Every rank runs a full :class:`~deepseek_v41.engine.engine.LLMEngine` over its
shard of the model (scheduler, KV cache manager, runner, sampler); all make the same decisions because they see
the same events in the same order. :class:`DriverEngine` (rank 0) applies each ``add_request`` / ``abort_request``
/ ``reset_prefix_cache`` locally first (a bad request raises here and nothing is sent), queues it as an event, and
at each ``step`` sends the workers one message (the events, rank 0's DSpark step-time measurement of the previous
step, the digest of its previous outputs) before stepping itself. Workers (``worker.py``) apply the events, check
the digest against their own previous outputs and step; the forward's collectives keep the ranks together.

Every rank sees the same thread count (``lockstep_threads``) and rank 0's step-time measurements (DSpark's adaptive
policy), so replicated computations and policy decisions agree. Prefix cache: one ``cache_dir`` for all ranks,
written by rank 0 only (workers' persistent tier is read-only), and rank 0 flushes its page writer before any step
that may admit a waiting request, so every rank's lookup finds the same pages.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from deepseek_v41.distributed import executor as executors
from deepseek_v41.distributed import protocol
from deepseek_v41.distributed.comm import ParallelState
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.rank import (
    check_engine_args,
    join,
    load_rank,
    rank_device,
    set_threads,
    worker_threads,
)
from deepseek_v41.engine.args import EngineArgs
from deepseek_v41.engine.engine import LLMEngine
from deepseek_v41.engine.multimodal import process_images
from deepseek_v41.engine.sampling_params import SamplingParams
from deepseek_v41.engine.sequence import RequestOutput

log = logging.getLogger(__name__)


class DriverEngine(LLMEngine):
    """Rank 0's engine: an :class:`LLMEngine` that also sends every event and step to the workers (see the module
    docstring). ``executor``: the started :class:`~deepseek_v41.distributed.executor.Executor`; ``state``: rank
    0's :class:`ParallelState`. Raises RuntimeError naming the rank when a worker failed (from :meth:`step`)."""

    def __init__(self, model, args: EngineArgs, tokenizer: Any, model_path: str | Path, executor: executors.Executor,
                 state: ParallelState, threads: int):
        super().__init__(model, args, tokenizer, model_path=model_path)
        self.executor, self.parallel_state = executor, state
        self.lockstep_threads = threads
        self._events: list[dict[str, Any]] = []
        self._blobs: list[bytes] = []  # the step message's raw bytes (images' patches)
        self._digest: str | None = None
        self._step_index = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, multi_modal_data: dict[str, Any] | None = None) -> None:
        """:meth:`LLMEngine.add_request`, then queued for the workers: images are preprocessed here once and sent
        as their patches (every rank then expands the same placeholders and encodes the same pixels)."""
        images = None
        if multi_modal_data and isinstance(multi_modal_data, dict) and multi_modal_data.get("image") is not None \
                and self.config.vision_config is not None:
            given = multi_modal_data["image"]
            images = process_images(list(given) if isinstance(given, list | tuple) else [given],
                                    self.config.vision_config)
            multi_modal_data = {**multi_modal_data, "image": images}
        placeholders = prompt_token_ids if isinstance(prompt_token_ids, str | bytes) else list(prompt_token_ids)
        super().add_request(request_id, placeholders, params, prompt=prompt, arrival_time=arrival_time,
                            cache_salt=cache_salt, multi_modal_data=multi_modal_data)
        seq = self.requests[request_id][0]
        event = protocol.add_event(request_id, placeholders, params, prompt, seq.arrival_time, cache_salt)
        if images:
            event["images"] = protocol.image_entries(images, self._blobs)
        self._events.append(event)

    def abort_request(self, request_id: str) -> None:
        super().abort_request(request_id)
        self._events.append(protocol.abort_event(request_id))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        done = super().reset_prefix_cache(reset_running_requests)
        self._events.append(protocol.reset_event(reset_running_requests))
        return done

    def step(self) -> list[RequestOutput]:
        self.executor.check()
        if self.prefix_cache is not None and self.scheduler.waiting:
            self.prefix_cache.flush()  # pages rank 0 queued are on disk before any rank looks them up
        message = {"type": "step", "step": self._step_index, "events": self._events,
                   "observation": self.last_observation, "digest": self._digest}
        data = protocol.encode(message, self._blobs)
        self._events, self._blobs = [], []
        self.executor.send_step(data)
        self.pending_observation = self.last_observation
        try:
            outputs = super().step()
        except Exception as exc:  # a collective failed: name the worker behind it when the watchdog sees one
            failure = self.executor.wait_failure(2.0) or RuntimeError(
                f"step {self._step_index} failed on rank 0: {exc}; {self.executor.describe_workers()}")
            self.executor.fail(failure)  # the ranks are out of step now: every later step refuses
            raise failure from exc
        except BaseException:  # Ctrl-C inside a step: the workers finish it, rank 0 did not
            self.executor.fail(RuntimeError(f"step {self._step_index} was interrupted on rank 0; the ranks are out "
                                            "of step (build a new LLM)"))
            raise
        self._digest = protocol.outputs_digest(outputs)
        self._step_index += 1
        return outputs

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        self.executor.shutdown()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def build_driver_engine(model_path: str | Path, config: ParallelConfig, dtype: Any, device: str,
                        engine_args: dict[str, Any], tokenizer: Any) -> DriverEngine:
    """Start the workers of ``config`` (:func:`make_executor`), load rank 0's shard beside them, and
    build rank 0's engine once every worker built its own. Raises ValueError for settings a parallel engine does
    not serve, RuntimeError naming a worker that failed; the workers are stopped on any failure."""
    check_engine_args(engine_args)
    executor = executors.make_executor(config)
    threads = worker_threads(config)
    try:
        executor.start({"model": str(model_path), "dtype": str(dtype).removeprefix("torch."), "device": device,
                        "engine_args": engine_args}, (tokenizer.to_str().encode(),) if tokenizer is not None else ())
        set_threads(threads)
        device = rank_device(device, 0, config)
        model, state = load_rank(model_path, config, 0, dtype, device)
        executor.wait("loaded")
        join(state, config, executor.init_method, device)
        engine = DriverEngine(model, EngineArgs(**engine_args), tokenizer, model_path, executor, state, threads)
        executor.wait("ready")
        executor.start_watchdog()
    except BaseException:
        executor.shutdown()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        raise
    log.info("parallel engine: %d ranks (tensor parallel %d, expert parallel %d) on the %r backend, %d threads "
             "per rank", config.world_size, config.tensor_parallel_size, config.ep_size, executor.name, threads)
    return engine
