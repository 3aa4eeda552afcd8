"""The engine loop: requests in, scheduler -> model runner -> sampler -> outputs (vLLM's ``LLMEngine``).

Data flows one way: :meth:`LLMEngine.add_request` queues sequences; :meth:`LLMEngine.step` asks the scheduler for
one step of work, runs it, samples, detokenizes, frees finished sequences and returns the outputs that changed.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.engine.detokenizer import IncrementalDetokenizer
from deepseek_v41.engine.model_runner import ModelRunner, PrefillMode
from deepseek_v41.engine.sampler import Sampler, SamplingState
from deepseek_v41.engine.sampling_params import SamplingParams
from deepseek_v41.engine.scheduler import Scheduler
from deepseek_v41.engine.sequence import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    Sequence,
    SequenceStatus,
)


@dataclass
class EngineArgs:
    """Engine settings (vLLM's names where they exist).

    ``block_size``: tokens per KV page. ``num_kv_pages`` or ``kv_cache_memory_bytes`` size the global KV pool
    (default: room for ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most 1 GiB).
    ``window_slack_rows``: extra rows per window ring (SPEC.md §4.1). ``prefill_mode``: "ced" (default when the
    layout allows) or "exact".
    """

    prefill_mode: str | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    num_kv_pages: int | None = None
    kv_cache_memory_bytes: int | None = None
    window_slack_rows: int = 16
    seed: int = 0


class LLMEngine:
    """Owns the model, the cache, the scheduler, the runner and the sampler.

    Raises ValueError for settings that cannot work (prefill mode, sizes, a pool too small for one sequence).
    """

    def __init__(self, model, args: EngineArgs, tokenizer: Any | None = None):
        cfg = model.config
        self.model, self.config, self.args, self.tokenizer = model, cfg, args, tokenizer
        mode = args.prefill_mode or ("ced" if model.plan.ced else "exact")
        if mode not in ("ced", "exact"):
            raise ValueError(f"prefill_mode must be 'ced' or 'exact', got {mode!r}")
        if mode == "ced" and not model.plan.ced:
            raise ValueError(f"prefill_mode='ced' needs the CED layout; this config has {model.plan.ced_reason}")
        self.prefill_mode = PrefillMode(mode)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(args, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(args, name)}")
        self.max_model_len = args.max_model_len or min(cfg.max_position_embeddings, 32768)
        if not 0 < self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [1, {cfg.max_position_embeddings}] "
                             f"(max_position_embeddings), got {args.max_model_len}")
        weight = next(model.parameters())
        device = weight.device
        num_pages = self._num_pages(args, device)
        state_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.cache = PagedKVCache(cfg, num_pages, args.block_size, args.max_num_seqs, args.window_slack_rows, device,
                                  state_dtype)
        self.scheduler = Scheduler(self.cache, args.max_num_seqs, args.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, self.prefill_mode)
        self.sampler = Sampler()
        self.device = device
        self._seq_ids = itertools.count()
        self._seed = args.seed
        self.requests: dict[str, list[Sequence]] = {}
        self._prompts: dict[str, str | None] = {}
        self.num_steps = 0

    def _num_pages(self, args: EngineArgs, device: torch.device) -> int:
        if args.num_kv_pages is not None:
            return args.num_kv_pages + 1  # + the reserved null page
        probe = PagedKVCache(self.config, 2, args.block_size, 1, 0, "meta")
        page_bytes = probe.global_bytes // 2
        wanted = args.max_num_seqs * -(-self.max_model_len // args.block_size)
        budget = args.kv_cache_memory_bytes if args.kv_cache_memory_bytes is not None else 1 << 30
        return max(2, min(wanted, budget // max(1, page_bytes)) + 1)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request (``params.n`` sequences). Raises ValueError for an empty prompt, token ids outside the
        vocabulary, a prompt longer than ``max_model_len`` or than the KV pool can ever hold, a duplicate id."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} (the prompt "
                             f"plus at least one generated token must fit)")
        capacity = (self.cache.num_pages - 1) * self.cache.block_size
        if n + 1 > capacity:
            raise ValueError(f"the prompt needs {n + 1} token positions but the KV pool holds {capacity}; "
                             f"raise num_kv_pages or kv_cache_memory_bytes")
        arrival = arrival_time or time.time()
        seqs = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else self._seed + next(self._seq_ids) * 7919
            sampling = SamplingState(params, prompt_token_ids, self.config.eos_token_id, device=self.device,
                                     generator=torch.Generator(device=self.device).manual_seed(seed))
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params,
                                           eos_token_id=self.config.eos_token_id,
                                           max_tokens=min(self.max_model_len, capacity) - n)
            sampling.output_token_ids = detok.output_token_ids
            seq = Sequence(next(self._seq_ids), request_id, i, list(prompt_token_ids), params, sampling, detok,
                           decoder_start=max(0, n - self.config.sliding_window), arrival_time=arrival)
            seqs.append(seq)
        # Queue only once every sample was built: a failure above leaves nothing half-added.
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self._prompts[request_id] = prompt

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its pages and slots return to the pool."""
        for seq in self.requests.get(request_id, []):
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.finished_time = time.time()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of the requests that advanced."""
        plan = self.scheduler.schedule()
        now = time.time()
        sampled: list[tuple[Sequence, torch.Tensor]] = []
        for seq, start, end in plan.prefills:
            seq.first_scheduled_time = seq.first_scheduled_time or now
            logits = self.runner.prefill(seq, start, end)
            seq.num_computed = end
            if logits is not None:
                sampled.append((seq, logits))
        if plan.decodes:
            logits = self.runner.decode(plan.decodes)
            for row, seq in enumerate(plan.decodes):
                seq.num_computed += 1
                sampled.append((seq, logits[row]))
        for seq, _ in sampled:
            seq.new_text, seq.new_token_ids = "", []
        touched = {seq.request_id for seq, _ in sampled}
        if sampled:
            out = self.sampler.sample(torch.stack([l for _, l in sampled]), [s.sampling for s, _ in sampled])
            tokens = out.token_ids.tolist()
            for row, (seq, _) in enumerate(sampled):
                self._append(seq, tokens[row], out.logprobs, row)
        self.num_steps += 1
        return [self.request_output(rid) for rid in touched]

    def _append(self, seq: Sequence, token: int, logprobs, row: int) -> None:
        now = time.time()
        seq.first_token_time = seq.first_token_time or now
        update = seq.detokenizer.append([token])
        seq.new_text = update.new_text
        seq.new_token_ids = [token][: update.kept]
        if logprobs is not None and seq.params.logprobs is not None and update.kept:
            entry = logprobs.to_dict(row, seq.params.logprobs)
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[token].logprob
        if update.finished:
            self.scheduler.finish(seq)
            seq.finished_time = now

    def request_output(self, request_id: str) -> RequestOutput:
        seqs = self.requests[request_id]
        first = seqs[0]
        outputs = [CompletionOutput(
            index=s.index, text=s.detokenizer.output_text, token_ids=list(s.output_token_ids),
            cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
            logprobs=s.logprobs if s.params.logprobs is not None else None,
            finish_reason=s.detokenizer.finish_reason if s.finished else None,
            stop_reason=s.detokenizer.stop_reason, new_text=s.new_text, new_token_ids=list(s.new_token_ids))
            for s in seqs]
        finished = all(s.status is SequenceStatus.FINISHED for s in seqs)
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time,
                                 min((s.first_token_time for s in seqs if s.first_token_time), default=None),
                                 max((s.finished_time or 0 for s in seqs), default=None) if finished else None)
        return RequestOutput(request_id, self._prompts[request_id], list(first.prompt_token_ids), outputs,
                             finished, first.num_cached_tokens, metrics)

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self.requests.pop(request_id, None)
        self._prompts.pop(request_id, None)

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> dict[str, Any]:
        """Engine counters: per-layer processed tokens, the largest decode batch, preemptions, KV bytes."""
        cache = self.cache
        return {
            "layer_tokens": list(self.runner.layer_tokens),
            "max_decode_batch": self.runner.max_decode_batch,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "kv_pages_total": cache.num_pages - 1,
            "kv_pages_used": cache.blocks.num_used,
            "kv_allocated_bytes_per_token": cache.allocated_bytes_per_token,
            "kv_global_bytes": cache.global_bytes,
            "window_bytes_per_sequence_logical": cache.window_bytes_per_slot_logical,
            "window_bytes_per_sequence_allocated": cache.window_bytes_per_slot_allocated,
            "prefill_mode": self.prefill_mode.value,
        }


def load_tokenizer(path: str | Path):
    """The model directory's ``tokenizer.json`` (or ``tokenizer/tokenizer.json``) as a ``tokenizers.Tokenizer``,
    or None when the directory has none (token-id prompts only)."""
    from tokenizers import Tokenizer

    path = Path(path)
    for candidate in (path / "tokenizer.json", path / "tokenizer" / "tokenizer.json"):
        if candidate.is_file():
            return Tokenizer.from_file(str(candidate))
    return None
