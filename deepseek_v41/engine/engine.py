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
from deepseek_v41.engine.model_runner import ModelRunner, PrefillMode, few_token_kernels, step_threads
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
from deepseek_v41.kernels import fast

DEFAULT_KV_POOL_BYTES = 1 << 30  # the default KV pool's cap, unless one sequence of max_model_len needs more


@dataclass
class EngineArgs:
    """Engine settings (vLLM's names where they exist).

    ``block_size``: tokens per KV page. ``num_kv_pages`` or ``kv_cache_memory_bytes`` size the global KV pool
    (default: room for ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most 1 GiB but never less than
    one such sequence).
    ``window_slack_rows``: extra rows per window ring (SPEC.md §4.1). ``prefill_mode``: "ced" (default when the
    layout allows) or "exact".

    Prefix caching (SPEC.md §4.3): ``enable_prefix_caching`` shares the pages of common prefixes between requests
    (device tier); ``swa_pool_bytes`` sizes the in-memory SWA snapshot pool (default 10% of RAM; 0 disables
    snapshots); ``cache_dir`` keeps global KV pages on disk across restarts (``cache_max_bytes`` budget, 72 h TTL;
    default None: no persistence); ``replay`` is "bounded" (default) or "exact" for hits without a snapshot;
    ``redis_url`` shares the SWA snapshots and the global KV pages between engine processes (any ``cache_dir``).

    Speculative decoding (SPEC.md §4.4, DSPARK.md): ``speculative="dspark"`` (default None: off) drafts with the
    checkpoint's DSpark draft and verifies at most ``speculative_max_len`` drafts per step (default and maximum:
    the checkpoint's ``dspark_block_size``; needs ``window_slack_rows >= speculative_max_len``).
    ``speculative_cost_table``: relative cost of a target forward verifying ℓ drafts per sequence, as a list
    indexed by ℓ or a dict ℓ -> cost over 0..speculative_max_len; None (default) measures it at engine start;
    ``"fixed"`` verifies ``speculative_max_len`` drafts every step.
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
    enable_prefix_caching: bool = True
    cache_dir: str | None = None
    cache_max_bytes: int = 16 * 1024**3
    swa_pool_bytes: int | None = None
    replay: str = "bounded"
    redis_url: str | None = None
    speculative: str | None = None
    speculative_max_len: int | None = None
    speculative_cost_table: dict[int, float] | list[float] | str | None = None


class LLMEngine:
    """Owns the model, the cache, the scheduler, the runner and the sampler.

    Raises ValueError for settings that cannot work (prefill mode, sizes, a pool too small for one sequence,
    speculative settings the checkpoint or the window slack cannot support).
    """

    def __init__(self, model, args: EngineArgs, tokenizer: Any | None = None, model_path: str | Path | None = None):
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
        num_pages = self._num_pages(args)
        state_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        swa_bytes = self._swa_pool_bytes(args)
        # The CED decoder's inputs go into SWA snapshots whenever there is a snapshot pool (in memory, or in Redis
        # with --redis-url); swa_pool_bytes=0 means no snapshots in either (_prefix_cache), so no residual ring.
        snapshots = args.enable_prefix_caching and bool(swa_bytes)
        residuals = weight.dtype if snapshots and self.prefill_mode is PrefillMode.CED else None
        spec_len = self._speculative_len(args)
        self.cache = PagedKVCache(cfg, num_pages, args.block_size, args.max_num_seqs, args.window_slack_rows, device,
                                  state_dtype, residuals, len(model.mtp) if spec_len else 0)
        self.prefix_cache = self._prefix_cache(args, swa_bytes, model_path) if args.enable_prefix_caching else None
        self.scheduler = Scheduler(self.cache, args.max_num_seqs, args.max_num_batched_tokens,
                                   on_admit=self._admit if self.prefix_cache is not None else None,
                                   num_lookahead_tokens=spec_len)
        self.runner = ModelRunner(model, self.cache, self.prefill_mode)
        self.sampler = Sampler()
        self.speculator = self._speculator(args, spec_len) if spec_len else None
        self.device = device
        self._seq_ids = itertools.count()
        self._seed = args.seed
        self.requests: dict[str, list[Sequence]] = {}
        # Per request: its prompt text and token ids as every RequestOutput gives them (one list per request, not
        # a copy per step: at 16K tokens that copy cost ~50 µs of each decode step).
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}
        self.num_steps = 0

    def _speculative_len(self, args: EngineArgs) -> int:
        """Drafts verified per step at most (0 = no speculation); checks the speculative settings."""
        from deepseek_v41.engine.speculative import SPECULATIVE_METHODS

        if args.speculative is None:
            given = [name for name in ("speculative_max_len", "speculative_cost_table")
                     if getattr(args, name) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} needs speculative='dspark' (speculative is None: no "
                                 f"speculative decoding)")
            return 0
        if args.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS} or None, got {args.speculative!r}")
        if self.model.mtp is None:
            raise ValueError("speculative='dspark' needs a DSpark draft, but this checkpoint has none "
                             "(num_nextn_predict_layers = 0)")
        block = self.config.dspark_block_size
        length = block if args.speculative_max_len is None else args.speculative_max_len
        if not 1 <= length <= block:
            raise ValueError(f"speculative_max_len ({length}) must be in [1, dspark_block_size ({block})]: the "
                             f"draft proposes dspark_block_size tokens per step")
        if args.window_slack_rows < length:
            raise ValueError(f"speculative_max_len ({length}) needs window_slack_rows >= {length} (got "
                             f"{args.window_slack_rows}): rows of rejected drafts must land in the ring's slack")
        return length

    def _speculator(self, args: EngineArgs, length: int):
        from deepseek_v41.engine.speculative import FIXED, DSparkSpeculator, parse_cost_table

        table = args.speculative_cost_table
        if isinstance(table, str) and table != FIXED:
            raise ValueError(f"speculative_cost_table must be a list, a dict, {FIXED!r} or None, got {table!r}")
        cost = parse_cost_table(table, length) if table is not None and table != FIXED else None
        speculator = DSparkSpeculator(self.model, self.cache, self.runner, self.sampler, length, cost)
        if table is None:
            speculator.cost = speculator.measure_cost(self.prefill_mode)
        return speculator

    @staticmethod
    def _swa_pool_bytes(args: EngineArgs) -> int:
        from deepseek_v41.cache.swa_pool import default_swa_pool_bytes

        if args.swa_pool_bytes is not None and args.swa_pool_bytes < 0:
            raise ValueError(f"swa_pool_bytes must be >= 0 (0 disables the SWA pool), got {args.swa_pool_bytes}")
        return default_swa_pool_bytes() if args.swa_pool_bytes is None else args.swa_pool_bytes

    def _prefix_cache(self, args: EngineArgs, swa_bytes: int, model_path: str | Path | None):
        from deepseek_v41.cache.fingerprint import model_fingerprint
        from deepseek_v41.cache.prefix_cache import PrefixCache

        if args.replay not in ("bounded", "exact"):
            raise ValueError(f"replay must be 'bounded' or 'exact', got {args.replay!r}")
        if swa_bytes and args.window_slack_rows < args.block_size - 1:
            raise ValueError(f"SWA snapshots need window_slack_rows >= block_size - 1 ({args.block_size - 1}), got "
                             f"{args.window_slack_rows}: the rings must still hold the window before the last page "
                             f"boundary (or set swa_pool_bytes=0)")
        fingerprint = model_fingerprint(self.model, model_path)
        page_store = swa_pool = remote_pages = None
        if args.cache_dir is not None:
            from deepseek_v41.cache.store import PageStore

            page_store = PageStore(Path(args.cache_dir).expanduser() / fingerprint[:16], fingerprint,
                                   self.cache.page_layout(), args.cache_max_bytes)
        if args.redis_url is not None:
            # Redis shares the pages (any cache_dir, or none) and, unless swa_pool_bytes=0, the SWA snapshots.
            from deepseek_v41.cache.redis_store import RedisPages, RedisStore
            from deepseek_v41.cache.store import PageCodec

            redis_store = RedisStore(args.redis_url, namespace=fingerprint[:32])
            remote_pages = RedisPages(redis_store, PageCodec(fingerprint, self.cache.page_layout()))
            swa_pool = redis_store if swa_bytes else None
        elif swa_bytes:
            from deepseek_v41.cache.swa_pool import SwaPool

            swa_pool = SwaPool(swa_bytes)
        return PrefixCache(self.cache, fingerprint, self.prefill_mode is PrefillMode.EXACT, args.replay, page_store,
                           swa_pool, remote_pages)

    def _admit(self, seq: Sequence) -> None:
        """Prefix-cache lookup for a sequence that just got its slot: take the cached pages, restore or plan the
        window state, and start computing at the hit's start (SPEC.md §4.3)."""
        from deepseek_v41.cache.prefix_cache import chain_hashes

        pc = self.prefix_cache
        tokens = seq.token_at(0, self.scheduler.prefill_end(seq))
        seq.block_hashes = chain_hashes(pc.root(seq.cache_salt), tokens, self.cache.block_size, seq.block_hashes)
        # A preempted sequence comes back with its output: it resumes where its decoder can be rebuilt exactly.
        hit = pc.match(tokens, seq.block_hashes, seq.decoder_start, len(seq.prompt_token_ids),
                       resumed=bool(seq.output_token_ids))
        if hit.cached == 0:
            return
        seq.block_table[:] = hit.pages
        seq.registered_pages = len(hit.pages)
        seq.num_computed, seq.write_from = hit.start, hit.cached
        if seq.num_cached_tokens == 0:  # a preempted sequence keeps what its first admission reported
            seq.num_cached_tokens, seq.num_replayed_tokens = hit.cached, hit.replayed
        pc.counters["cached_tokens"] += hit.cached
        pc.counters["replayed_tokens"] += hit.replayed
        pc.restore(seq.slot, hit)
        hasher = self.model.hasher
        if hasher is not None:  # Engram history from the real tokens before the restart point
            depth = hasher.depth
            before = torch.tensor([tokens[max(0, hit.start - depth): hit.start]], dtype=torch.long, device=self.device)
            history = hasher.next_history(before, None, hasher.start_history(1, self.device))
            self.cache.engram_history[seq.slot, :depth] = history[0]

    def _after_forward(self, seq: Sequence, prompt_done: bool) -> None:
        """Register the sequence's newly completed pages; snapshot the window at the prompt's last page boundary."""
        pc = self.prefix_cache
        if pc is None:
            return
        from deepseek_v41.cache.prefix_cache import chain_hashes

        P = self.cache.block_size
        full = seq.num_computed // P
        if full > seq.registered_pages:
            seq.block_hashes = chain_hashes(pc.root(seq.cache_salt), seq.token_at(0, full * P), P, seq.block_hashes)
            pc.register(seq.block_table, seq.block_hashes, seq.registered_pages, full)
            seq.registered_pages = full
        if prompt_done and not seq.prompt_snapshot_taken:
            seq.prompt_snapshot_taken = True
            pc.take_snapshot(seq.slot, P * (len(seq.prompt_token_ids) // P), seq.block_hashes)

    def _num_pages(self, args: EngineArgs) -> int:
        """Pages of the global KV pool, the reserved null page included.

        Raises ValueError when an explicitly sized pool (``num_kv_pages`` or ``kv_cache_memory_bytes``) cannot
        hold one sequence of ``max_model_len`` tokens: such a pool would cut every long output short (vLLM
        refuses it at start too). The default pool holds ``max_num_seqs`` such sequences, capped at
        ``DEFAULT_KV_POOL_BYTES`` (1 GiB) but never below one sequence.
        """
        P = args.block_size
        needed = -(-self.max_model_len // P)  # pages of one sequence of max_model_len tokens
        page_bytes = max(1, PagedKVCache(self.config, 2, P, 1, 0, "meta").global_bytes // 2)
        wanted = args.max_num_seqs * needed
        if args.num_kv_pages is not None:
            pages, given = args.num_kv_pages, f"num_kv_pages={args.num_kv_pages}"
        elif args.kv_cache_memory_bytes is not None:
            pages = max(0, min(wanted, args.kv_cache_memory_bytes // page_bytes))
            given = f"kv_cache_memory_bytes={args.kv_cache_memory_bytes}: {pages} pages of {page_bytes} bytes"
        else:
            # At most DEFAULT_KV_POOL_BYTES, but never less than one sequence of max_model_len tokens.
            return max(needed, min(wanted, DEFAULT_KV_POOL_BYTES // page_bytes)) + 1  # + the reserved null page
        if pages < needed:
            tokens = max(0, pages) * P
            smaller = f" or set max_model_len <= {tokens}" if tokens >= 2 else ""
            raise ValueError(f"the KV pool ({given}, {tokens} tokens) cannot hold one sequence of "
                             f"max_model_len={self.max_model_len} tokens: that needs {needed} pages of {P} tokens "
                             f"(num_kv_pages >= {needed} or kv_cache_memory_bytes >= {needed * page_bytes}); "
                             f"raise the pool{smaller}")
        return pages + 1  # + the reserved null page

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> None:
        """Queue a request (``params.n`` sequences). Raises ValueError, with nothing queued, for an empty prompt,
        token ids outside ``[0, vocab_size)``, ``params.logprobs`` above ``vocab_size``, a ``cache_salt`` that is
        not None or a non-empty string, a prompt longer than ``max_model_len`` or than the KV pool can ever hold,
        a duplicate id."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.config.vocab_size
        bad = next((i for i, t in enumerate(prompt_token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be in [0, {vocab}) (the vocabulary), got "
                             f"{prompt_token_ids[bad]} at position {bad}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs must be in [0, {vocab}] (the vocabulary size) or None, got {params.logprobs}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be None or a non-empty string, got {cache_salt!r}")
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
                           decoder_start=max(0, n - self.config.sliding_window), arrival_time=arrival,
                           cache_salt=cache_salt)
            seqs.append(seq)
        # Queue only once every sample was built: a failure above leaves nothing half-added.
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self._prompts[request_id] = (prompt, list(prompt_token_ids))

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
        """Run one scheduler step; returns the outputs of the requests that advanced.

        The step runs under ``torch.inference_mode`` (no autograd bookkeeping: a few µs less per op, and an
        engine step is thousands of small ops) on the cores other processes leave free (``step_threads``); nothing
        it returns holds a tensor."""
        with torch.inference_mode(), step_threads(self.runner.device):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        fast.still_valid(self.model)  # a global module hook registered since install: back to the reference
        plan = self.scheduler.schedule()
        if plan.prefills:
            return self._run(plan)
        # Decodes only: the whole step (sampling too) under the few-token settings, so no torch op in it wakes
        # torch's thread pool, whose threads then spin for milliseconds beside the kernels' (model_runner.py).
        with few_token_kernels(self.runner.dtype, self.runner.device):
            return self._run(plan)

    def _run(self, plan) -> list[RequestOutput]:
        now = time.time()
        sampled: list[tuple[Sequence, torch.Tensor]] = []
        spec = self.speculator
        for seq, start, end in plan.prefills:
            seq.first_scheduled_time = seq.first_scheduled_time or now
            taps = spec.prefill_taps() if spec is not None else None
            logits = self.runner.prefill(seq, start, end, taps)
            if spec is not None:
                spec.add_context(seq, taps, end)
            seq.num_computed = end
            self._after_forward(seq, prompt_done=end >= len(seq.prompt_token_ids))
            if logits is not None:
                sampled.append((seq, logits))
        verdicts = []
        if plan.decodes and spec is not None:
            verdicts = list(zip(plan.decodes, spec.step(plan.decodes), strict=True))
        elif plan.decodes:
            logits = self.runner.decode(plan.decodes)
            for row, seq in enumerate(plan.decodes):
                seq.num_computed += 1
                self._after_forward(seq, prompt_done=True)
                sampled.append((seq, logits[row]))
        touched = {seq.request_id for seq, _ in sampled} | {seq.request_id for seq, _ in verdicts}
        if sampled:
            out = self.sampler.sample(torch.stack([l for _, l in sampled]), [s.sampling for s, _ in sampled])
            tokens = out.token_ids.tolist()
            for row, (seq, _) in enumerate(sampled):
                entries = None
                if out.logprobs is not None and seq.params.logprobs is not None:
                    entries = [out.logprobs.to_dict(row, seq.params.logprobs)]
                self._append(seq, [tokens[row]], entries)
        for seq, verdict in verdicts:
            self._append(seq, verdict.tokens, verdict.logprobs, speculative=True)
        self.num_steps += 1
        return [self.request_output(rid) for rid in touched]

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list | None, speculative: bool = False) -> None:
        """Add one step's tokens (one, or the accepted drafts + one under speculation) with their logprobs
        entries. A speculative step computed the accepted drafts already: its committed length is cut back to
        the tokens kept (a stop inside the block) before the new full pages are registered."""
        now = time.time()
        seq.first_token_time = seq.first_token_time or now
        update = seq.detokenizer.append(tokens)
        seq.new_text = update.new_text
        seq.new_token_ids = tokens[: update.kept]
        if logprobs is not None and seq.params.logprobs is not None:
            for token, entry in zip(seq.new_token_ids, logprobs, strict=False):
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry[token].logprob
        if speculative:
            seq.num_computed = min(seq.num_computed, seq.num_tokens)
            self._after_forward(seq, prompt_done=True)
        if update.finished:
            if self.prefix_cache is not None:  # the full sequence's last page boundary (SPEC.md §4.3 policy)
                P = self.cache.block_size
                self.prefix_cache.take_snapshot(seq.slot, P * (seq.num_computed // P), seq.block_hashes)
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
        prompt, prompt_token_ids = self._prompts[request_id]
        return RequestOutput(request_id, prompt, prompt_token_ids, outputs,
                             finished, first.num_cached_tokens, metrics, first.num_replayed_tokens,
                             sum(s.spec_accepted_tokens for s in seqs), sum(s.spec_verify_steps for s in seqs))

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self.requests.pop(request_id, None)
        self._prompts.pop(request_id, None)

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> dict[str, Any]:
        """Engine counters: per-layer processed tokens, the largest decode batch, preemptions, KV bytes; with
        speculation the ``spec_decode_*`` counters (:class:`~deepseek_v41.engine.speculative.SpecDecodeStats`)
        and the cost table in use."""
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
            "entries_written": dict(self.runner.entries_written),
            **({"prefix_cache": self._prefix_stats()} if self.prefix_cache is not None else {}),
            **(self._spec_stats() if self.speculator is not None else {}),
        }

    def _spec_stats(self) -> dict[str, Any]:
        spec = self.speculator
        return {**spec.stats.as_dict(), "spec_decode_max_len": spec.max_len, "spec_decode_cost_table": spec.cost}

    def _prefix_stats(self) -> dict[str, Any]:
        pc = self.prefix_cache
        out: dict[str, Any] = {**pc.counters, **pc.read_stats()}
        if pc.swa_pool is not None:
            out["swa_pool_occupancy_bytes"] = pc.swa_pool.occupancy_bytes
            out["swa_pool"] = dict(pc.swa_pool.stats)
        if pc.page_store is not None:
            out["disk"] = dict(pc.page_store.stats)
        if pc.remote_pages is not None:
            out["remote"] = dict(pc.remote_pages.stats)
        return out


def load_tokenizer(path: str | Path):
    """The model directory's ``tokenizer.json`` (or ``tokenizer/tokenizer.json``) as a ``tokenizers.Tokenizer``,
    or None when the directory has none (token-id prompts only)."""
    from tokenizers import Tokenizer

    path = Path(path)
    for candidate in (path / "tokenizer.json", path / "tokenizer" / "tokenizer.json"):
        if candidate.is_file():
            return Tokenizer.from_file(str(candidate))
    return None
