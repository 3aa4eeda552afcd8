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

import torch
import torch.distributed as dist

from deepseek_v41.distributed import protocol
from deepseek_v41.distributed.comm import ParallelState, init_distributed
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.executor import Executor, make_executor, worker_threads
from deepseek_v41.distributed.shard import shard_model
from deepseek_v41.engine.args import EngineArgs
from deepseek_v41.engine.engine import LLMEngine
from deepseek_v41.engine.sampling_params import SamplingParams
from deepseek_v41.engine.sequence import RequestOutput
from deepseek_v41.kernels import pool
from deepseek_v41.model.checkpoint import load_model

log = logging.getLogger(__name__)


def set_threads(threads: int) -> None:
    """This rank's fixed thread count: torch's intra-op threads and the kernels' pool."""
    torch.set_num_threads(threads)
    pool.set_threads(threads)


def engine_args_from_json(data: dict[str, Any]) -> EngineArgs:
    """EngineArgs from their JSON form (a cost table's dict keys come back as strings)."""
    data = dict(data)
    table = data.get("speculative_cost_table")
    if isinstance(table, dict):
        data["speculative_cost_table"] = {int(k): v for k, v in table.items()}
    return EngineArgs(**data)


def check_engine_args(args: dict[str, Any]) -> None:
    """ValueError for settings a parallel engine does not serve yet (Redis: its asynchronous writes could reach
    the ranks' lookups at different steps)."""
    if args.get("redis_url"):
        raise ValueError("redis_url is not served with several ranks yet (rank 0 is the only cache writer and "
                         "Redis writes are asynchronous); use cache_dir")


def join_and_shard(model: Any, config: ParallelConfig, rank: int, init_method: str | None, device: str
                   ) -> tuple[Any, ParallelState]:
    """Join the engine's process group as ``rank`` and shard ``model`` in place; returns (model, state)."""
    state = init_distributed(config, rank, init_method or "", device)
    return shard_model(model, state), state


class DriverEngine(LLMEngine):
    """Rank 0's engine: an :class:`LLMEngine` that also sends every event and step to the workers (see the module
    docstring). ``executor``: the started :class:`~deepseek_v41.distributed.executor.Executor`; ``state``: rank
    0's :class:`ParallelState`. Raises RuntimeError naming the rank when a worker failed (from :meth:`step`)."""

    def __init__(self, model, args: EngineArgs, tokenizer: Any, model_path: str | Path, executor: Executor,
                 state: ParallelState, threads: int):
        super().__init__(model, args, tokenizer, model_path=model_path)
        self.executor, self.parallel_state = executor, state
        self.lockstep_threads = threads
        self._events: list[dict[str, Any]] = []
        self._digest: str | None = None
        self._step_index = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, multi_modal_data: dict[str, Any] | None = None) -> None:
        """:meth:`LLMEngine.add_request`, then queued for the workers. ValueError also for images (not sent to
        the workers yet)."""
        if multi_modal_data:
            raise ValueError("images are not served with several ranks yet (tensor_parallel_size > 1); use one "
                             "process for image prompts")
        super().add_request(request_id, prompt_token_ids, params, prompt=prompt, arrival_time=arrival_time,
                            cache_salt=cache_salt)
        seq = self.requests[request_id][0]
        self._events.append(protocol.add_event(request_id, self._prompts[request_id][1], params, prompt,
                                               seq.arrival_time, cache_salt))

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
        self._events = []
        self.executor.send_step(protocol.encode(message))
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
    """Start the workers of ``config`` (:func:`make_executor`), load and shard rank 0's model beside them, and
    build rank 0's engine once every worker built its own. Raises ValueError for settings a parallel engine does
    not serve, RuntimeError naming a worker that failed; the workers are stopped on any failure."""
    check_engine_args(engine_args)
    executor = make_executor(config)
    threads = worker_threads(config)
    try:
        executor.start({"model": str(model_path), "dtype": str(dtype).removeprefix("torch."), "device": device,
                        "engine_args": engine_args}, (tokenizer.to_str().encode(),) if tokenizer is not None else ())
        set_threads(threads)
        model = load_model(model_path, dtype=dtype, device=device)
        executor.wait("loaded")
        model, state = join_and_shard(model, config, 0, executor.init_method, device)
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
