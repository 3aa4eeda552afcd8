"""The engine loop: requests in, scheduler -> model runner -> sampler -> outputs (vLLM's ``LLMEngine``).

Data flows one way: :meth:`LLMEngine.add_request` queues sequences; :meth:`LLMEngine.step` asks the scheduler for
one step of work (the scheduler admits sequences through its KV cache manager, which looks their prefixes up),
runs it (the model runner), reports the computed positions to the KV cache manager (page registration, SWA
snapshots), samples, detokenizes, frees finished sequences and returns the outputs that changed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from deepseek_v41.cache.kv_cache_manager import KVCacheManager, build_kv_cache_manager
from deepseek_v41.cache.swa_pool import SwaPool
from deepseek_v41.engine.args import EngineArgs
from deepseek_v41.engine.detokenizer import IncrementalDetokenizer
from deepseek_v41.engine.encoder_cache import build_vision_encoder
from deepseek_v41.engine.model_runner import ModelRunner, PrefillMode, few_token_kernels, step_threads
from deepseek_v41.engine.multimodal import MultiModalInputs, build_multimodal_prompt, process_images
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
from deepseek_v41.engine.speculative import build_speculator, speculative_max_len
from deepseek_v41.kernels import fast
from deepseek_v41.structured import CompiledGrammar, StructuredOutputManager, StructuredOutputsConfig

log = logging.getLogger(__name__)


class LLMEngine:
    """Owns the model, the scheduler (which owns the KV cache manager), the runner and the sampler.

    Raises ValueError for settings that cannot work (prefill mode, sizes, a pool too small for one sequence,
    speculative settings the checkpoint or the window slack cannot support, a bad ``structured_outputs_config``).
    """

    # The most prefill chunks run as one batched forward (ModelRunner.prefill_batch); 1 runs each alone.
    max_prefill_batch = 64

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
        self.kv_transfer = args.kv_transfer_config
        if self.kv_transfer is not None:
            check_kv_transfer(model, args, self.prefill_mode)
        spec_len = speculative_max_len(model, args.speculative, args.speculative_max_len,
                                       args.speculative_cost_table, args.window_slack_rows)
        kv = build_kv_cache_manager(model, args.cache_config(self.max_model_len),
                                    self.prefill_mode is PrefillMode.EXACT,
                                    len(model.mtp) if spec_len else 0, model_path)
        self.cache, self.prefix_cache = kv.cache, kv.prefix_cache
        self.scheduler = Scheduler(kv, args.max_num_seqs, args.max_num_batched_tokens, num_lookahead_tokens=spec_len)
        self.runner = ModelRunner(model, self.cache, self.prefill_mode)
        self.vision = build_vision_encoder(model, args.encoder_cache_size, args.ec_transfer_config, model_path)
        self.runner.vision = self.vision
        self.sampler = Sampler()
        self.speculator = (build_speculator(model, self.cache, self.runner, self.sampler, spec_len,
                                            args.speculative_cost_table) if spec_len else None)
        self.device = self.cache.device
        self._seq_ids = itertools.count()
        self._seed = args.seed
        self.requests: dict[str, list[Sequence]] = {}
        # Per request: its prompt text and token ids as every RequestOutput gives them (one list per request, not
        # a copy per step: at 16K tokens that copy cost ~50 µs of each decode step).
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}
        self.num_steps = 0
        # Structured outputs: built at the first constrained request (it reads the whole vocabulary and imports
        # the grammar engines; an engine that never gets one pays nothing).
        self.structured_outputs_config = StructuredOutputsConfig.of(args.structured_outputs_config)
        self._structured: StructuredOutputManager | None = None
        # Lockstep (issue 28: several ranks, each running this engine over its shard, must make the same decisions):
        # a fixed thread count instead of the cores found free per step, and DSpark's policy fed rank 0's step-time
        # measurement one step late (``pending_observation``, set before each step) instead of this process's own
        # (``last_observation``: this step's, for rank 0 to send). distributed/driver.py and worker.py set them.
        self.lockstep_threads: int | None = None
        self.pending_observation: list | None = None
        self.last_observation: list | None = None

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """The engine's :class:`~deepseek_v41.structured.StructuredOutputManager` (built on first use). Raises
        ValueError when the engine has no tokenizer or the tokenizer is not byte-level BPE."""
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer (tokenizer.json); this engine has "
                                 "none (token-id prompts only)")
            self._structured = StructuredOutputManager(self.tokenizer, self.config.vocab_size,
                                                       self.config.eos_token_id, self.structured_outputs_config)
        return self._structured

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        """Pages, slots and the prefix cache: the scheduler's; the step loop reports computed work to it."""
        return self.scheduler.kv_cache_manager

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, multi_modal_data: dict[str, Any] | None = None) -> None:
        """Queue a request (``params.n`` sequences). Raises ValueError, with nothing queued, for an empty prompt,
        token ids outside ``[0, vocab_size)``, ``params.logprobs`` above ``vocab_size``, a ``cache_salt`` that is
        not None or a non-empty string, a prompt longer than ``max_model_len`` or than the KV pool can ever hold,
        a duplicate id, ``params.structured_outputs`` that no backend compiles (a bad schema, regex or grammar) or
        on an engine without a tokenizer.

        Images (vLLM's ``multi_modal_data``): ``{"image": [PIL.Image | ProcessedImage | bytes, ...]}`` (or one
        image), with one ``image_token_id`` placeholder per image in ``prompt_token_ids``, not expanded: each is
        preprocessed and its placeholder expanded to its span here (engine/multimodal.py), and the length limits
        apply to the expanded prompt, whose ids the request's outputs then carry. ValueError, with nothing
        queued, for images given to a model without a vision tower, a key other than ``"image"``, placeholders
        that do not match the images, more image tokens than ``max_image_tokens`` allows, or an unreadable
        image; a vision model's prompt holding placeholders without images is refused too."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:  # ints, numpy or 0-d torch integers; not text (vLLM's engine also takes text, ours token ids only)
            if isinstance(prompt_token_ids, str | bytes):
                raise TypeError
            prompt_token_ids = [operator.index(t) for t in prompt_token_ids]
        except TypeError:
            raise TypeError("LLMEngine.add_request takes the prompt as token ids (a list of ints); for text, use "
                            "LLM.generate or encode it with the engine's tokenizer first "
                            "(engine.tokenizer.encode(text).ids)") from None
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
        prompt_token_ids, mm_inputs = self._multimodal_prompt(prompt_token_ids, multi_modal_data)
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} (the prompt "
                             f"plus at least one generated token must fit)")
        capacity = self.kv_cache_manager.capacity_tokens
        if n + 1 > capacity:
            raise ValueError(f"the prompt needs {n + 1} token positions but the KV pool holds {capacity}; "
                             f"raise num_kv_pages or kv_cache_memory_bytes")
        prefill_only = self._prefill_only(params)
        grammar: CompiledGrammar | None = None
        if params.structured_outputs is not None and not prefill_only:
            grammar = self.structured_output_manager.compile(params.structured_outputs)
        arrival = arrival_time or time.time()
        # A prefill-only sequence never runs the CED decoder: its pages hold the encoder's KV, all the decode side
        # reads (MODEL_REFERENCE.md §3.16).
        decoder_start = n if prefill_only else self.model.plan.decoder_start(n)
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
                           decoder_start=decoder_start, arrival_time=arrival,
                           cache_salt=cache_salt)
            if grammar is not None:
                seq.grammar = self._structured.matcher(grammar)
            seq.mm_inputs = mm_inputs
            seq.prefill_only = prefill_only
            seqs.append(seq)
        # Queue only once every sample was built: a failure above leaves nothing half-added.
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        self._prompts[request_id] = (prompt, list(prompt_token_ids))

    def _prefill_only(self, params: SamplingParams) -> bool:
        """Whether a request with ``params`` is prefill-only: every request of a kv_producer, and on a kv_both
        engine one whose ``extra_args["kv_transfer_params"]`` says ``{"do_remote_decode": true}`` (vLLM's words).
        Raises ValueError for kv_transfer_params that are not a JSON object, or that ask for a remote decode of an
        engine that writes no KV connector."""
        extra = params.extra_args or {}
        if not isinstance(extra, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(extra).__name__}")
        transfer = extra.get("kv_transfer_params")
        if transfer is not None and not isinstance(transfer, dict):
            raise ValueError(f"kv_transfer_params must be a JSON object or null, got {transfer!r}")
        for key in ("do_remote_decode", "do_remote_prefill"):
            if transfer and not isinstance(transfer.get(key, False), bool):
                raise ValueError(f"kv_transfer_params {key} must be true or false, got {transfer[key]!r}")
        remote_decode = bool((transfer or {}).get("do_remote_decode", False))
        config = self.kv_transfer
        connector = self.prefix_cache.connector if config is not None else None
        if transfer and config is not None and config.is_consumer and "remote_host" in transfer and hasattr(
                connector, "add_peer"):  # NixlConnector: pull from the producer that prefilled this prompt
            connector.add_peer(transfer["remote_host"], transfer.get("remote_port"))
        if remote_decode and (config is None or not config.is_producer):
            role = "no --kv-transfer-config" if config is None else f"kv_role {config.kv_role}"
            raise ValueError(f"kv_transfer_params asks for a remote decode (do_remote_decode), but this engine has "
                             f"{role}: only a kv_producer or kv_both engine prefills for another server")
        return config is not None and (config.prefill_only or remote_decode)

    def _multimodal_prompt(self, prompt_token_ids: list[int], multi_modal_data: dict[str, Any] | None
                           ) -> tuple[list[int], MultiModalInputs | None]:
        """The prompt with each image placeholder expanded to its span, and its images (None for a text prompt);
        ValueError as :meth:`add_request` says."""
        cfg = self.config
        images: list = []
        if multi_modal_data is not None:
            if not isinstance(multi_modal_data, dict):
                raise ValueError(f"multi_modal_data must be a dict such as {{'image': [image, ...]}}, got "
                                 f"{type(multi_modal_data).__name__}")
            unknown = sorted(set(multi_modal_data) - {"image"})
            if unknown:
                raise ValueError(f"multi_modal_data takes only the key 'image' (a list of images), got {unknown}")
            given = multi_modal_data.get("image")
            images = [] if given is None else list(given) if isinstance(given, list | tuple) else [given]
        if images and (cfg.vision_config is None or self.vision is None):
            raise ValueError("this model has no vision tower (its config has no vision_config): it takes text "
                             "prompts only, without images")
        if not images:
            if (cfg.vision_config is not None and cfg.image_token_id is not None
                    and cfg.image_token_id in prompt_token_ids):
                count = prompt_token_ids.count(cfg.image_token_id)
                raise ValueError(f"the prompt has {count} image placeholder(s) (id {cfg.image_token_id}) but no "
                                 f"image was given; pass one image per placeholder in multi_modal_data['image']")
            return prompt_token_ids, None
        processed = process_images(images, cfg.vision_config)
        ids, mm_inputs = build_multimodal_prompt(prompt_token_ids, processed, cfg, max_model_len=self.max_model_len)
        return list(ids), mm_inputs

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its pages and slots return to the pool."""
        for seq in self.requests.get(request_id, []):
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.finished_time = time.time()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the cached prefixes of this process (vLLM's ``LLMEngine.reset_prefix_cache``): the device tier's
        index (every page is free then and keeps no prefix hash) and the snapshots of the in-memory SWA pool, so
        that no later request reuses KV computed before. For a model whose weights were changed in place: change
        them, reinstall the CPU fast paths (``deepseek_v41.kernels.fast.install(engine.model)``, which read the
        weights captured at install time), then reset.

        Returns True when the cache was reset (or there is no prefix cache), False, changing nothing, while
        requests hold device pages (running, or added but not finished): finish or abort them first, or pass
        ``reset_running_requests=True`` (vLLM's keyword): the running requests are preempted first (their pages
        freed; they go back to the front of the queue and recompute their prompt and output so far, with no
        prefix hit, then continue; preemption never changes their tokens). Call it between steps (the async
        engine runs it on its worker thread). The encoder cache (the images' aligner rows, computed by the same
        weights) is emptied with it.

        The persistent tiers are kept: disk pages under ``cache_dir`` and Redis entries are keyed by the
        fingerprint of the checkpoint taken when the engine was built, so after changing the weights in place an
        engine with ``cache_dir`` or ``redis_url`` would read them again; use a new engine (and a new
        ``cache_dir`` / Redis database) for changed weights (logged as a warning when those tiers exist)."""
        if self.prefix_cache is None:
            if self.vision is not None:
                self.vision.cache.clear()
            return True  # nothing cached: no request is preempted for nothing
        if reset_running_requests:
            for seq in reversed(list(self.scheduler.running)):
                self.scheduler.preempt(seq)
        if not self.kv_cache_manager.reset_prefix_cache():
            log.warning("reset_prefix_cache: not reset, %d requests hold KV pages (finish or abort them first, or "
                        "pass reset_running_requests=True)", len(self.scheduler.running))
            return False
        if self.vision is not None:  # the images' rows were computed by the old weights too
            self.vision.cache.clear()
        pc = self.prefix_cache
        if pc is not None and (pc.page_store is not None or pc.remote_pages is not None
                               or (pc.swa_pool is not None and not isinstance(pc.swa_pool, SwaPool))):
            log.warning("reset_prefix_cache: the device tier and the in-memory SWA pool were reset; the persistent "
                        "tiers (cache_dir, Redis) are kept and keyed by the checkpoint's fingerprint taken at load: "
                        "after changing the weights in place, use a new engine with a new cache_dir / Redis database")
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of the requests that advanced.

        The step runs under ``torch.inference_mode`` (no autograd bookkeeping: a few µs less per op, and an
        engine step is thousands of small ops) on the cores other processes leave free (``step_threads``); nothing
        it returns holds a tensor."""
        return [self.request_output(rid) for rid in self._step_ids()]

    def step_request_ids(self) -> list[str]:
        """:meth:`step` without building its outputs: the ids of the requests that advanced. For callers that want
        only some outputs (``LLM.generate`` the finished ones, the async engine its own per-request diffs), which
        they get from :meth:`request_output`: building every advanced request's output costs ~10 µs per sequence
        per step, more as its output grows (issue 25). An engine that extends :meth:`step` (a parallel driver,
        whose step hands the outputs' digest to its workers), or whose ``step`` was replaced on the instance or the
        class (a fault injection, a wrapper), runs that :meth:`step`."""
        if type(self).step is not _PLAIN_STEP or "step" in self.__dict__:
            return [out.request_id for out in self.step()]
        return self._step_ids()

    def request_finished(self, request_id: str) -> bool:
        """Whether every sequence of the request finished (its :meth:`request_output` is final). KeyError for a
        request the engine does not hold."""
        return all(s.status is SequenceStatus.FINISHED for s in self.requests[request_id])

    def _step_ids(self) -> list[str]:
        threads = step_threads(self.runner.device) if self.lockstep_threads is None else contextlib.nullcontext()
        with torch.inference_mode(), threads:
            return self._step()

    def _step(self) -> list[str]:
        started = time.perf_counter()
        if self.lockstep_threads is not None:
            observed, self.pending_observation, self.last_observation = self.pending_observation, None, None
            if observed is not None and self.speculator is not None:
                self.speculator.observe_measurement(observed)
        fast.still_valid(self.model)  # a global module hook registered since install: back to the reference
        plan = self.scheduler.schedule()
        if plan.prefills:
            return self._run(plan)
        # Decodes only: the whole step (sampling too) under the few-token settings, so no torch op in it wakes
        # torch's thread pool, whose threads then spin for milliseconds beside the kernels' (model_runner.py).
        with few_token_kernels(self.runner.dtype, self.runner.device):
            outputs = self._run(plan)
        if self.speculator is not None and plan.decodes:  # the speculation policy's measurement of this step
            if self.lockstep_threads is None:
                self.speculator.observe_step(time.perf_counter() - started)
            else:
                self.last_observation = self.speculator.measurement(time.perf_counter() - started)
        return outputs

    def _run(self, plan) -> list[str]:
        if self.vision is None or not plan.prefills:
            return self._run_plan(plan)
        # The encode stage: every image the step's chunks hold, the cached ones from the encoder cache and the
        # others encoded now in one batch, before any chunk runs; their rows are held for this step only.
        try:
            for seq, start, end in plan.prefills:
                self.vision.request(seq.images_in(start, end))
            self.vision.run()
            return self._run_plan(plan)
        finally:
            self.vision.release()

    def _run_plan(self, plan) -> list[str]:
        """Run a scheduled step; the ids of the requests that advanced (sampled, verified or prefilled)."""
        now = time.time()
        kv = self.kv_cache_manager
        sampled: list[tuple[Sequence, torch.Tensor]] = []
        spec = self.speculator
        prefilled: list[Sequence] = []  # prefill-only sequences whose prompt is done
        for seq, _, end, logits in self._prefill(plan.prefills):
            seq.first_scheduled_time = seq.first_scheduled_time or now
            seq.num_computed = end
            kv.on_computed(seq, prompt_done=end >= len(seq.prompt_token_ids))
            if seq.prefill_only and end >= len(seq.prompt_token_ids):
                prefilled.append(seq)
            elif logits is not None:
                sampled.append((seq, logits))
        if prefilled:
            # The response of a prefill-only request leaves only once its pages are in the KV connector, where the
            # decode server will look for them: wait for the page writer (a producer's steps are prefills only).
            kv.flush()
            for seq in prefilled:
                seq.kv_transfer = self._pages_in_connector(seq)
                seq.detokenizer.end("length")
                self.scheduler.finish(seq)
                seq.finished_time = time.time()
        verdicts = []
        decoded = None  # the decode logits [B, V], when they are all the step samples (no copy into a stack then)
        if plan.decodes and spec is not None and spec.speculate(plan.decodes):
            verdicts = list(zip(plan.decodes, spec.step(plan.decodes), strict=True))
        elif plan.decodes:
            if spec is None:
                logits = self.runner.decode(plan.decodes)
            else:  # a plain step of a speculative engine: the draft's context rows wait in a backlog
                taps = spec.decode_taps(plan.decodes)
                logits = self.runner.decode(plan.decodes, taps)
                spec.record_plain(plan.decodes)
                spec.defer_context(plan.decodes, taps)
            decoded = logits if not sampled else None
            for row, seq in enumerate(plan.decodes):
                seq.num_computed += 1
                kv.on_computed(seq, prompt_done=True)
                sampled.append((seq, logits[row]))
        touched = ({seq.request_id for seq, _ in sampled} | {seq.request_id for seq, _ in verdicts}
                   | {seq.request_id for seq in prefilled})
        if sampled:
            logits = decoded if decoded is not None else torch.stack([l for _, l in sampled])
            if any(seq.grammar is not None for seq, _ in sampled):
                self._structured.mask_logits(logits, [seq.grammar for seq, _ in sampled])
            out = self.sampler.sample(logits, [s.sampling for s, _ in sampled])
            tokens = out.token_ids.tolist()
            for row, (seq, _) in enumerate(sampled):
                entries = None
                if out.logprobs is not None and seq.params.logprobs is not None:
                    entries = [out.logprobs.to_dict(row, seq.params.logprobs)]
                self._append(seq, [tokens[row]], entries)
        for seq, verdict in verdicts:
            self._append(seq, verdict.tokens, verdict.logprobs, speculative=True, matched=verdict.accepted)
        self.num_steps += 1
        return list(touched)

    def _prefill(self, chunks: list[tuple[Sequence, int, int]]
                 ) -> list[tuple[Sequence, int, int, torch.Tensor | None]]:
        """Run a step's prefill chunks; ``(seq, start, end, logits)`` per chunk, in the plan's order.

        Chunks that share a :meth:`ModelRunner.batch_key` (equal lengths, text only: e.g. many short prompts
        arriving together) run as one batched forward of at most ``max_prefill_batch`` rows, the others alone
        (issue 25). With a speculator each chunk's draft context rows are committed from its row of the taps."""
        spec = self.speculator
        groups: list[list[int]] = []
        open_groups: dict[Any, list[int]] = {}  # per batch key, the group still taking rows
        for i, chunk in enumerate(chunks):
            key = self.runner.batch_key(*chunk) if self.max_prefill_batch > 1 else None
            group = open_groups.get(key) if key is not None else None
            if group is None or len(group) >= self.max_prefill_batch:
                group = []
                groups.append(group)
                if key is not None:
                    open_groups[key] = group
            group.append(i)
        results: list[torch.Tensor | None] = [None] * len(chunks)
        for members in groups:
            taps = spec.prefill_taps() if spec is not None else None
            if len(members) == 1:
                seq, start, end = chunks[members[0]]
                results[members[0]] = self.runner.prefill(seq, start, end, taps)
                if spec is not None:
                    spec.add_context(seq, taps, end)
                continue
            batch = [chunks[i] for i in members]
            for i, logits in zip(members, self.runner.prefill_batch(batch, taps), strict=True):
                results[i] = logits
            if spec is not None:
                for row, (seq, _, end) in enumerate(batch):
                    spec.add_context(seq, {j: t[row:row + 1] for j, t in taps.items()}, end)
        return [(*chunk, logits) for chunk, logits in zip(chunks, results, strict=True)]

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list | None, speculative: bool = False,
                matched: int = 0) -> None:
        """Add one step's tokens (one, or the accepted drafts + one under speculation) with their logprobs
        entries. A speculative step computed the accepted drafts already: its committed length is cut back to
        the tokens kept (a stop inside the block) before the new full pages are registered.

        Structured outputs: the sequence's matcher accepts the kept tokens (the first ``matched`` of them are in
        it already: the speculator walked the accepted drafts); a matcher that terminated (its EOS ends the
        output in the detokenizer already, even with ``ignore_eos``) or refused a token finishes it ("stop")."""
        now = time.time()
        seq.first_token_time = seq.first_token_time or now
        update = seq.detokenizer.append(tokens)
        new_text, finished = update.new_text, update.finished
        if seq.grammar is not None and not finished and not self._advance_grammar(seq, tokens[matched: update.kept]):
            new_text += seq.detokenizer.stop()
            finished = True
        seq.new_text = new_text
        seq.new_token_ids = tokens[: update.kept]
        if logprobs is not None and seq.params.logprobs is not None:
            for token, entry in zip(seq.new_token_ids, logprobs, strict=False):
                seq.logprobs.append(entry)
                seq.cumulative_logprob += entry[token].logprob
        if speculative:
            seq.num_computed = min(seq.num_computed, seq.num_tokens)
            self.kv_cache_manager.on_computed(seq, prompt_done=True)
        if finished:  # its window at its last page boundary goes to the SWA pool (SPEC.md §4.3 policy)
            self.scheduler.finish(seq, snapshot=True)
            seq.finished_time = now

    @staticmethod
    def _advance_grammar(seq: Sequence, tokens: list[int]) -> bool:
        """Feed ``tokens`` to ``seq.grammar``; False when the sequence must stop: the grammar is complete (its stop
        token accepted) or refused a token (only when every token was masked, e.g. ``min_tokens`` hiding the EOS
        a complete grammar needs: logged)."""
        grammar = seq.grammar
        for token in tokens:
            if not grammar.accept_token(token):
                log.warning("request %s: token %d is outside its structured output's grammar (every token was "
                            "masked: is min_tokens longer than the grammar allows?); the output stops here",
                            seq.request_id, token)
                return False
        return not grammar.is_terminated()

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
                             sum(s.spec_accepted_tokens for s in seqs), sum(s.spec_verify_steps for s in seqs),
                             self._kv_transfer_params(first) if finished else None)

    def _kv_transfer_params(self, seq: Sequence) -> dict | None:
        """The ``kv_transfer_params`` of a finished request (:class:`RequestOutput`), None without a transfer."""
        if self.kv_transfer is None:
            return None
        pages, nbytes, seconds = seq.kv_transfer
        if seq.prefill_only:
            P = self.kv_cache_manager.block_size
            return {"do_remote_prefill": True, "num_prompt_tokens": len(seq.prompt_token_ids), "num_pages": pages,
                    "num_pages_expected": len(seq.prompt_token_ids) // P, "block_size": P, "transfer_bytes": nbytes,
                    # where a pulling connector (Nixl) reads them: remote_host, remote_port, remote_engine_id
                    **getattr(self.prefix_cache.connector, "kv_transfer_params", {})}
        if not self.kv_transfer.is_consumer:
            return None
        return {"cached_tokens": seq.num_cached_tokens, "replayed_tokens": seq.num_replayed_tokens,
                "transfer_pages": pages, "transfer_bytes": nbytes, "transfer_seconds": seconds}

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self.requests.pop(request_id, None)
        self._prompts.pop(request_id, None)

    def _pages_in_connector(self, seq: Sequence) -> tuple[int, int, float]:
        """(pages, KV bytes, 0.0) of a finished prefill-only sequence's prompt that the connector holds now, its
        leading full pages: only those are promised to the decode side (with Redis down, none; it then computes
        them)."""
        pc, P = self.prefix_cache, self.kv_cache_manager.block_size
        pages = 0
        for block_hash in seq.block_hashes[: len(seq.prompt_token_ids) // P]:
            if not pc.connector.contains(block_hash):
                break
            pages += 1
        return pages, pages * pc.page_payload_bytes, 0.0

    # ------------------------------------------------------------------ stats
    def kv_transfer_stats(self) -> dict[str, Any]:
        """What moved through the KV connector, by direction ("sent": pages this producer wrote, "received": pages
        prefix lookups read): ``pages``, ``bytes`` (KV payload), ``tokens`` (pages x block size: the prompt
        tokens those pages hold, so bytes / tokens is the KV bytes per token) and ``seconds`` (writes: put calls
        on the page writer; reads: get calls)."""
        pc = self.prefix_cache
        counters, payload, P = pc.counters, pc.page_payload_bytes, pc.block_size
        out = {}
        for direction, pages, seconds in (("sent", "connector_pages_written", "connector_write_seconds"),
                                          ("received", "connector_pages_read", "connector_read_seconds")):
            n = counters[pages]
            out[direction] = {"pages": n, "bytes": n * payload, "tokens": n * P, "seconds": counters[seconds]}
        return out

    @property
    def stats(self) -> dict[str, Any]:
        """Engine counters: per-layer processed tokens, the largest decode batch, preemptions, KV bytes and the
        ``prefix_cache`` counters (:meth:`KVCacheManager.stats`); for a model with a vision tower the
        ``encoder_cache`` counters (hits, misses, evictions, encoded images, size, encode calls and seconds:
        :meth:`~deepseek_v41.engine.encoder_cache.VisionEncoder.stats`); with speculation the ``spec_decode_*``
        counters (:class:`~deepseek_v41.engine.speculative.SpecDecodeStats`), the user's cost table (None: adaptive
        or fixed) and, with the adaptive policy, the measured step costs per batch size
        (``spec_decode_step_costs``: ms of a plain step and of a speculative step per verification length)."""
        spec = self.speculator
        return {
            "layer_tokens": list(self.runner.layer_tokens),
            "max_decode_batch": self.runner.max_decode_batch,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "prefill_mode": self.prefill_mode.value,
            "entries_written": dict(self.runner.entries_written),
            **self.kv_cache_manager.stats(),
            **({"encoder_cache": self.vision.stats()} if self.vision is not None else {}),
            **({"kv_transfer": self.kv_transfer_stats()} if self.kv_transfer is not None else {}),
            **({**spec.stats.as_dict(), "spec_decode_max_len": spec.max_len, "spec_decode_cost_table": spec.cost,
                "spec_decode_step_costs": spec.policy.costs.summary(spec.max_len) if spec.policy is not None else None}
               if spec is not None else {}),
        }


def check_kv_transfer(model, args: EngineArgs, prefill_mode: PrefillMode) -> None:
    """Refuse a disaggregated engine that cannot move a prompt's KV as pages (issue 29): the decode side rebuilds the
    window state by replaying the encoder (CED prefill, prefix caching on); a producer samples nothing, so it drafts
    nothing either. ValueError naming the setting otherwise."""
    config = args.kv_transfer_config
    if prefill_mode is not PrefillMode.CED:
        raise ValueError(f"--kv-transfer-config needs the CED prefill (prefill_mode 'ced'; this engine prefills "
                         f"{prefill_mode.value!r}{'' if model.plan.ced else ': ' + model.plan.ced_reason}): only "
                         f"then can the decode side rebuild the window state from the global KV pages")
    if not args.enable_prefix_caching:
        raise ValueError("--kv-transfer-config needs prefix caching (the pages move through the prefix cache's "
                         "tiers); drop --no-enable-prefix-caching")
    if config.prefill_only and args.speculative is not None:
        raise ValueError("a kv_producer samples nothing, so speculative decoding has nothing to draft; drop "
                         "--speculative on the prefill server")
    if getattr(model, "encoder_only", False) and not config.prefill_only:
        raise ValueError(f"an encoder-only model (loaded for a kv_producer) cannot serve a {config.kv_role}: load "
                         f"the whole model")


def load_tokenizer(path: str | Path):
    """The model directory's ``tokenizer.json`` (or ``tokenizer/tokenizer.json``) as a ``tokenizers.Tokenizer``,
    or None when the directory has none (token-id prompts only)."""

    path = Path(path)
    for candidate in (path / "tokenizer.json", path / "tokenizer" / "tokenizer.json"):
        if candidate.is_file():
            return Tokenizer.from_file(str(candidate))
    return None


_PLAIN_STEP = LLMEngine.step  # (step_request_ids: a step replaced since is run as it is)
