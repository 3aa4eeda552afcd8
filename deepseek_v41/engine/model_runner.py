"""Turns scheduled work into forwards over the paged cache, and keeps per-layer token counters (SPEC.md §4.2).

Prefill modes:

- ``exact``: every layer over every prompt token (what the reference ``generate.py`` does).
- ``ced`` (default when the layout allows, MODEL_REFERENCE.md §3.16): the encoder over every token, the first
  decoder layer's compressor and index keys over every token (the decoder's only global KV), and the decoder
  layers only over positions >= ``decoder_start`` = max(0, N - sliding_window), their windows starting there.

Both run in chunks of any size: each chunk is a forward over positions [start, end) of one sequence whose
earlier state (window rings, pending pair, pages, Engram history) is in the cache. Decode runs one token of
every decoding sequence in one batched forward of all layers.
"""

from __future__ import annotations

import enum

import torch

from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.paged_context import PagedContext
from deepseek_v41.engine.sequence import Sequence


class PrefillMode(str, enum.Enum):
    EXACT = "exact"
    CED = "ced"


class ModelRunner:
    """Runs the model over the cache. ``layer_tokens[j]`` counts the tokens layer j has processed."""

    def __init__(self, model, cache: PagedKVCache, prefill_mode: PrefillMode):
        self.model = model
        self.cache = cache
        self.prefill_mode = prefill_mode
        self.plan = model.plan
        self.device = cache.device
        self.dtype = next(model.parameters()).dtype
        self.layer_tokens = [0] * len(model.layers)
        self.entries_written: dict[int, int] = {}  # compressed entries written per kv-source layer
        self.max_decode_batch = 0

    # ------------------------------------------------------------------ helpers
    def _context(self, seqs: list[Sequence], positions: torch.Tensor, ends: list[int]) -> PagedContext:
        return PagedContext(self.cache, [s.slot for s in seqs], [s.block_table for s in seqs], positions, ends,
                            self.dtype, [s.write_from for s in seqs])

    def _count_entries(self, ctx: PagedContext) -> None:
        for layer, n in ctx.entries_written.items():
            self.entries_written[layer] = self.entries_written.get(layer, 0) + n

    def _engram(self, seqs: list[Sequence], ids: torch.Tensor):
        """Engram rows of this forward and the histories after it (from the cache slots)."""
        hasher = self.model.hasher
        if hasher is None:
            return None, None
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        history = self.cache.engram_history[slots][:, : hasher.depth]
        rows = hasher(ids, None, history)
        return rows, (slots, hasher.next_history(ids, None, history))

    def _commit_engram(self, update) -> None:
        if update is not None:
            slots, history = update
            self.cache.engram_history[slots, : history.shape[1]] = history

    def _count(self, layers, tokens: int) -> None:
        for j in layers:
            self.layer_tokens[j] += tokens

    # ------------------------------------------------------------------ forwards
    @torch.no_grad()
    def prefill(self, seq: Sequence, start: int, end: int) -> torch.Tensor | None:
        """Forward positions [start, end) of ``seq``; fp32 logits [V] of the last position when it is the last
        token of the sequence, else None."""
        model, plan = self.model, self.plan
        ids = torch.tensor([seq.token_at(start, end)], dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device)[None]
        ctx = self._context([seq], positions, [end])
        rows, engram = self._engram([seq], ids)
        streams, pre = model.embed_streams(ids)
        want_logits = end == seq.num_tokens
        if self.prefill_mode is PrefillMode.CED and plan.ced:
            streams, pre = model.run_layers(plan.encoder_layers, streams, pre, ctx, None, rows)
            self._count(plan.encoder_layers, end - start)
            if self.cache.residuals:
                self.cache.write_residuals(seq.slot, range(start, end), streams[0], pre[0])
            boundary = model.layers[plan.decoder_layers[0]]
            boundary.attn.compress(boundary.attention_input(streams, pre), ctx)
            first = max(seq.decoder_start, seq.decoder_done)
            logits = None
            if first < end:
                if first < start:
                    # Resumed from an SWA snapshot: the decoder's inputs before this chunk are the snapshot's.
                    old_streams, old_pre = self.cache.read_residuals(seq.slot, first, start)
                    streams = torch.cat((old_streams[None].to(streams.dtype), streams), 1)
                    pre = torch.cat((old_pre[None].to(pre.dtype), pre), 1)
                else:
                    streams, pre = streams[:, first - start:], pre[:, first - start:]
                tail = self._context([seq], torch.arange(first, end, device=self.device)[None], [end])
                streams, pre = model.run_layers(plan.decoder_layers, streams, pre, tail, None, rows,
                                                skip_compress={boundary.layer_id})
                self._count(plan.decoder_layers, end - first)
                seq.decoder_done = end
                if want_logits:
                    logits = model.logits(streams[:, -1:], pre[:, -1:])[0, -1]
        else:
            layers = range(len(model.layers))
            streams, pre = model.run_layers(layers, streams, pre, ctx, None, rows)
            self._count(layers, end - start)
            logits = model.logits(streams[:, -1:], pre[:, -1:])[0, -1] if want_logits else None
        self._commit_engram(engram)
        self._count_entries(ctx)
        return logits

    @torch.no_grad()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token of every sequence in ``seqs`` (its last token, at position ``num_computed``), all layers.
        Returns fp32 logits [B, V]."""
        ids = torch.tensor([seq.token_at(seq.num_computed, seq.num_computed + 1) for seq in seqs],
                           dtype=torch.long, device=self.device)
        positions = torch.tensor([[seq.num_computed] for seq in seqs], device=self.device)
        ctx = self._context(seqs, positions, [seq.num_computed + 1 for seq in seqs])
        rows, engram = self._engram(seqs, ids)
        streams, pre = self.model.embed_streams(ids)
        plan = self.plan
        if self.cache.residuals and plan.ced:  # keep the decoder inputs for SWA snapshots
            streams, pre = self.model.run_layers(plan.encoder_layers, streams, pre, ctx, None, rows)
            for row, seq in enumerate(seqs):
                self.cache.write_residuals(seq.slot, range(seq.num_computed, seq.num_computed + 1), streams[row],
                                           pre[row])
            streams, pre = self.model.run_layers(plan.decoder_layers, streams, pre, ctx, None, rows)
        else:
            streams, pre = self.model.run_layers(range(len(self.model.layers)), streams, pre, ctx, None, rows)
        self._count(range(len(self.model.layers)), len(seqs))
        for seq in seqs:
            seq.decoder_done = seq.num_computed + 1
        self.max_decode_batch = max(self.max_decode_batch, len(seqs))
        self._commit_engram(engram)
        self._count_entries(ctx)
        return self.model.logits(streams, pre)[:, -1]
