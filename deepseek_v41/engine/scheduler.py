"""Continuous batching with chunked prefill and preemption by recompute (SPEC.md §4.4; vLLM's scheduler).

Each step: every running sequence that is decoding gets one token (pages are found for it first, preempting the
most recently arrived running sequences when the pool is short); the rest of the token budget
``max_num_batched_tokens`` goes to prefill chunks — first of running sequences, then of waiting ones in arrival
order (FIFO: a waiting request that does not fit blocks the ones behind it). Preempted sequences free their
pages and slot and go back to the front of the queue; they later recompute prompt + output. A chunk never ends
inside an image span (:func:`image_safe_end`): a chunk that starts at (or, replaying, inside) a span takes all of
it, so a step may exceed ``max_num_batched_tokens`` by less than one span (``max_image_tokens``), after which it
schedules no more prefill; this way an image longer than the budget still runs and no span waits for room. The
scheduler
decides; it never computes. It owns the :class:`~deepseek_v41.cache.kv_cache_manager.KVCacheManager`: admission
takes a slot and looks the prefix up there (a hit moves ``num_computed`` past the cached pages), preemption and
finish free pages and slot there.

With speculative decoding (``num_lookahead_tokens`` = the most drafts a step verifies) a decoding sequence gets
pages for its anchor and that many drafts, up to its last possible position, and costs as many tokens of the
budget (vLLM's lookahead slots).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepseek_v41.cache.kv_cache_manager import KVCacheManager
from deepseek_v41.engine.sequence import Sequence, SequenceStatus


def image_safe_end(spans: list[tuple[int, int]], start: int, end: int, limit: int) -> int:
    """The end of a prefill chunk [start, end) moved so that no image span [s, e) of ``spans`` is split by it
    (VISION_DESIGN.md decision 2: the bidirectional keys of a span must be in the forward that computes it).

    An end strictly inside a span moves back to the span's start when that leaves a non-empty chunk; otherwise
    (the chunk starts at the span's start, or inside the span: a replay restart point after a prefix-cache hit)
    it moves on to the span's end, beyond the token budget if the span is longer: such a span runs whole in its
    own chunk. ``limit`` is the most positions the free pages allow: when the span's end lies beyond it, no
    chunk is possible now and ``start`` is returned (the sequence waits for pages)."""
    for s, e in spans:
        if s < end < e:
            if s > start:
                return s
            return e if e <= limit else start
    return end


@dataclass
class SchedulerOutput:
    """One step's work: prefill chunks ``(sequence, start, end)`` and sequences decoding one token."""

    prefills: list[tuple[Sequence, int, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Waiting queue, running list and the per-step plan (see the module docstring)."""

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_tokens: int = 0):
        self.kv_cache_manager = kv_cache_manager  # pages, slots and prefix lookup: the scheduler owns it
        self.blocks = kv_cache_manager.blocks
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = self._plan()
        # Running prefills can fill the pool between them with no one able to move: free the latest arrival.
        while out.empty and self.running:
            victim = self.running[-1]
            self.preempt(victim)
            again = self._plan()
            again.preempted = out.preempted + [victim]
            out = again
        return out

    def _plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Decodes first: a running sequence never waits behind new prompts.
        for seq in [s for s in self.running if not s.needs_prefill]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below while making room for an earlier sequence
            if not self._make_room(seq, self._decode_end(seq), out):
                continue
            out.decodes.append(seq)
            budget -= 1 + self.num_lookahead_tokens
        for seq in [s for s in self.running if s.needs_prefill]:
            if budget <= 0:
                break
            end = self._chunk_end(seq, budget)
            if end > seq.num_computed:
                out.prefills.append((seq, seq.num_computed, end))
                budget -= end - seq.num_computed
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and kv.has_free_slot:
            seq = self.waiting[0]
            end = self._chunk_end(seq, budget, grow=False)
            if end <= seq.num_computed:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            kv.admit(seq, self.prefill_end(seq))  # a slot; a prefix hit takes pages and moves num_computed
            self.running.append(seq)
            # The hit's pages may have been the last free ones: then no chunk this step (never an empty one).
            end = self._chunk_end(seq, budget)
            if end > seq.num_computed:
                out.prefills.append((seq, seq.num_computed, end))
                budget -= end - seq.num_computed
        return out

    def prefill_end(self, seq: Sequence) -> int:
        """Where ``seq``'s prefill stops: its last token, or with speculation the token before it when it has
        generated some (a preempted sequence coming back): the last token is then the anchor of a speculative
        step, as it was before the preemption, so the request's random draws and tokens do not depend on
        whether it was preempted."""
        if self.num_lookahead_tokens and seq.output_token_ids:
            return seq.num_tokens - 1
        return seq.num_tokens

    def _decode_end(self, seq: Sequence) -> int:
        """Positions a decode step of ``seq`` may write: its anchor and the lookahead, but never past the last
        position it can reach (prompt + max tokens), so speculation never needs more pages than the request."""
        end = seq.num_computed + 1 + self.num_lookahead_tokens
        limit = seq.detokenizer.max_tokens
        return end if limit is None else max(seq.num_computed + 1, min(end, len(seq.prompt_token_ids) + limit))

    def _chunk_end(self, seq: Sequence, budget: int, grow: bool = True) -> int:
        """End of the next prefill chunk of ``seq`` within ``budget`` tokens and the free pages (with ``grow``,
        its table is extended to cover it). An image span is never split (:func:`image_safe_end`): the end moves
        back to the span's start, or — when the chunk would start at or inside the span — on to its end, past
        the budget if need be."""
        end = min(self.prefill_end(seq), seq.num_computed + budget)
        free_tokens = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size
        end = min(end, free_tokens)
        if seq.mm_inputs is not None:
            end = image_safe_end(seq.image_spans, seq.num_computed, end, free_tokens)
        if grow and end > seq.num_computed:
            self.blocks.grow(seq.block_table, end)
        return end

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow ``seq``'s pages to ``num_tokens`` positions, preempting later arrivals if needed; False when
        ``seq`` itself had to be preempted."""
        while not self.blocks.can_grow(seq.block_table, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            out.decodes = [s for s in out.decodes if s is not victim]
            if victim is seq:
                return False
        self.blocks.grow(seq.block_table, num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and slot; it goes back to the front of the queue and will recompute."""
        self.running.remove(seq)
        self.kv_cache_manager.free(seq)
        seq.num_computed = seq.decoder_done = seq.write_from = 0
        seq.draft_backlog.clear()  # the re-prefill recomputes those rows; waiting, it would pin their steps' taps
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, snapshot: bool = False) -> None:
        """Release a finished (or aborted) sequence's pages and slot; ``snapshot``: it finished generating, and
        its window goes to the SWA pool first (:meth:`KVCacheManager.free`)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache_manager.free(seq, snapshot)
        seq.status = SequenceStatus.FINISHED
