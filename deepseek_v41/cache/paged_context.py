"""The engine's KV context: attention reads and writes the packed paged cache (SPEC.md §4.1).

Implements the context protocol of :mod:`deepseek_v41.model.context` over :class:`~deepseek_v41.cache.kv_cache.
PagedKVCache`: window rows and compressed entries are quantized to their byte layouts when written and
dequantized right before attention — for compressed entries, only the ones the indexer selected. The values
attention sees are exactly the reference fake-quant values (dequantize(quantize(x))).
"""

from __future__ import annotations

from typing import Any

import torch

from deepseek_v41 import kernels
from deepseek_v41.cache.block_manager import BlockManager
from deepseek_v41.cache.block_table import BlockTable
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.kernels.fast import KERNEL_DTYPES, fused
from deepseek_v41.model.context import pick_rows
from deepseek_v41.model.norm import cast, upcast
from deepseek_v41.quant import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8_values

_MAIN, _INDEX = 0, 2  # where each FP4 kind starts in a pool tuple (codes, scales)
_FP4_FORMATS = {_MAIN: (16, "e4m3"), _INDEX: (32, "ue8m0")}  # block size and scale format (MODEL_REFERENCE.md §4)


class PagedContext:
    """KV context of one forward over rows ``slots`` (sequence slots) with block tables ``tables``.

    ``positions`` [B, T]: absolute positions of the new tokens (each row consecutive); ``ends``: per row, the
    position after its last new token (Python ints, so shapes never depend on tensor values: the forward also
    runs on ``meta``); ``dtype``: the model's dtype (stored rows decode to fp32, or float64 for a float64 model:
    what attention, the indexer and the mixing compute in); ``write_from``: per row, the first position
    whose compressed entries this forward may write (earlier ones live in shared prefix-cache pages);
    ``key_limit`` [B, T] long or None: the window keys each query sees (:mod:`deepseek_v41.model.context`; None =
    causal; the engine passes :func:`deepseek_v41.model.vision.window_key_limit` of a chunk holding image spans;
    ValueError when its shape is not that of ``positions``).

    The block tables are padded with the null page up to ``max(ends)``: a speculative verify forward pads short
    rows with positions past their pages, whose entries then go to the null page (DSPARK.md §7).
    """

    # The fast decode plan (kernels/fast/decode.py) reads and writes this context's cache tensors itself: it takes
    # contexts of exactly this class (a subclass could change what they hold).
    PAGED = True

    def __init__(self, cache: PagedKVCache, slots: list[int], tables: list[list[int]], positions: torch.Tensor,
                 ends: list[int], dtype: torch.dtype, write_from: list[int] | None = None,
                 key_limit: torch.Tensor | None = None):
        self.cache = cache
        self.positions = positions
        if key_limit is not None and key_limit.shape != positions.shape:
            raise ValueError(f"key_limit must have the shape of positions {list(positions.shape)}, got "
                             f"{list(key_limit.shape)}")
        self.key_limit = key_limit
        self.fake_quant = True  # the indexer query is quantized as in the reference
        self.banded_window = True  # the new window rows are the new tokens, at consecutive positions
        self.indexer_losses = None  # training: a deepseek_v41.train.indexer_loss.IndexerLosses
        self.dense_indexer = False  # training warm-up: every visible entry is selected
        self.shared: dict[Any, torch.Tensor] = {}
        # Attention, the indexer and the mixing compute in fp32 (float64 for a float64 model), so stored rows decode
        # straight to that: FP8 / FP4 values times power-of-two scales are exact in bf16 too, so decoding to a bf16
        # model's dtype first would only add two conversions.
        self.dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.ends = ends
        device = cache.device
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        # Reading one row's rings through a slice is a view; several rows need a gather (a copy).
        self._rows = slice(slots[0], slots[0] + 1) if len(slots) == 1 else self.slots
        width = max(1, max(len(t) for t in tables), -(-max(ends) // cache.block_size))
        if all(isinstance(t, BlockTable) for t in tables):  # the tensors they keep: no list conversion per step
            self.tables = torch.stack([t.padded(width, device) for t in tables])
        else:
            padded = [t + [BlockManager.NULL_PAGE] * (width - len(t)) for t in tables]
            self.tables = torch.tensor(padded, dtype=torch.long, device=device)
        # Entries of positions below write_from are already in (shared) prefix-cache pages: replay never
        # rewrites them (SPEC.md §4.3).
        self.write_from = torch.tensor(write_from or [0] * len(slots), device=device)[:, None]
        self.entries_written: dict[int, int] = {}
        self._decoded: dict[int, torch.Tensor] = {}  # a layer's main entries decoded + a zero row (prefill)

    # ------------------------------------------------------------------ window rings
    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache
        if (kv.dim() == 3 and kv.shape[0] == self.slots.shape[0] and kv.shape[2] == cache.window_codes.shape[-1]
                and kv.shape[1] == self.positions.shape[1] and self._fused(kv)
                and kernels.usable(cache.window_codes, cache.window_scales, cache.window_pos)):
            return kernels.window_step(cache.window_codes, cache.window_scales, cache.window_pos, layer, self.slots,
                                       self.positions, cast(kv, torch.float32).contiguous())
        R = cache.window_rows
        B, T, _ = kv.shape
        codes = cache.window_codes[self._rows, layer]
        scales = cache.window_scales[self._rows, layer]
        row_pos = cache.window_pos[self._rows, layer].long()
        prev = dequantize_fp8(codes, scales, 32, "ue8m0", dtype=self.dtype)
        start = self.positions[:, :1]
        prev_pos = torch.where((row_pos >= 0) & (row_pos < start), row_pos, -1)
        new_codes, new_scales, new = quantize_fp8_values(kv, 32, "ue8m0")
        # Write after reading: a long chunk may wrap the ring over rows its own first queries read above.
        tail = min(T, R)
        pos = self.positions[:, T - tail:]
        rows = pos % R
        slot = self.slots[:, None]
        cache.window_codes[slot, layer, rows] = new_codes[:, T - tail:]
        cache.window_scales[slot, layer, rows] = new_scales[:, T - tail:]
        cache.window_pos[slot, layer, rows] = pos.to(torch.int32)
        return torch.cat((prev, cast(new, self.dtype)), 1), torch.cat((prev_pos, self.positions), 1)

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the fused CPU kernels serve this forward's cache reads and writes of ``x`` (fp32 or bf16,
        whose FP8 / FP4 values are exact in both; a float64 model keeps the torch code). They give the same
        values as the torch code below, bit for bit."""
        return (self.dtype == torch.float32 and x.dtype in KERNEL_DTYPES
                and self.positions.dtype == torch.int64 and kernels.usable(x, self.positions))

    # ------------------------------------------------------------------ ratio-2 pending pairs
    def pending(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if layer not in self.cache.pending_layers:
            return None  # ratio 1: no open pair
        k = self.cache.pending_layers.index(layer)
        state = self.cache.pending[self.slots, k]
        return state[:, 0], state[:, 1]

    def set_pending(self, layer: int, state: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if state is None or layer not in self.cache.pending_layers:
            return
        k = self.cache.pending_layers.index(layer)
        self.cache.pending[self.slots, k] = torch.stack(state, 1).to(self.cache.pending.dtype)

    # ------------------------------------------------------------------ compressed entries and index keys
    def _locate(self, layer: int, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot-in-page) of entries ``group`` [B, ...] (-1 -> the reserved null page)."""
        m = self.cache.ratio[layer]
        per_page = self.cache.block_size // m
        g = group.clamp(min=0)
        col = (g * m) // self.cache.block_size
        page = self.tables.gather(1, col.reshape(col.shape[0], -1)).view(col.shape)
        page = torch.where(group >= 0, page, BlockManager.NULL_PAGE)
        return page, g % per_page

    def add_entries(self, layer: int, entries: torch.Tensor, index_keys: torch.Tensor, group: torch.Tensor) -> None:
        self._decoded.pop(layer, None)
        pools = self.cache.pools[layer]
        if self._fused(entries) and group.dtype == torch.int64 and kernels.usable(group, *pools):
            for pool, values in ((_MAIN, entries), (_INDEX, index_keys)):  # both write the same entries
                written = kernels.fp4_scatter(pools[pool], pools[pool + 1], *_FP4_FORMATS[pool], self.tables,
                                              self.cache.ratio[layer], self.cache.block_size, group, self.write_from,
                                              cast(values, torch.float32).contiguous())
            if written:
                self.entries_written[layer] = self.entries_written.get(layer, 0) + written
            return
        group = torch.where(group * self.cache.ratio[layer] >= self.write_from, group, -1)
        if group.device.type != "meta":
            written = int((group >= 0).sum())
            if written == 0:  # e.g. a ratio-2 decode step that only opens a pair: nothing to store
                return
            self.entries_written[layer] = self.entries_written.get(layer, 0) + written
        page, slot = self._locate(layer, group)
        for pool, values in ((_MAIN, entries), (_INDEX, index_keys)):
            codes, scales = quantize_fp4(values, *_FP4_FORMATS[pool])
            pools[pool][page, slot] = codes
            pools[pool + 1][page, slot] = scales

    def completes_entries(self, layer: int) -> bool:
        """Whether some row's new tokens complete a compressed entry of kv source ``layer`` (from the rows' ends,
        Python ints: no host sync). Entries of earlier forwards stay in the cache, so a forward completing none
        need not call :meth:`add_entries`."""
        m, T = self.cache.ratio[layer], self.positions.shape[1]
        return any(end // m > (end - T) // m for end in self.ends)

    def num_entries(self, layer: int) -> int:
        """Entries of kv source ``layer`` visible at the end of this forward, over the batch (max)."""
        return max(self.ends) // self.cache.ratio[layer]

    def index_keys(self, layer: int) -> torch.Tensor:
        return self._decode_first(layer, _INDEX, self.num_entries(layer))

    def num_index_keys(self, layer: int) -> int:
        """Index keys of kv source ``layer`` that :meth:`index_keys` returns (the max over the batch)."""
        return self.num_entries(layer)

    def index_scores(self, layer: int, q: torch.Tensor, w: torch.Tensor,
                     visible: torch.Tensor | None = None) -> torch.Tensor | None:
        """Indexer scores [B, c, N] in q's dtype of a few fp32 / bf16 queries q [B, c, Hi, di] (head weights w
        [B, c, Hi]) against all N index keys, straight from the packed FP4 keys by the fused kernel (inference
        mode, the CPU; summed in fp32); with ``visible`` [B, c] (each query's visible count), -inf from it on
        (:func:`~deepseek_v41.model.indexer.mask_invisible`, done by the kernel). None when the kernel does not
        apply (the caller then scores :meth:`index_keys` and masks them). Equal to that to rounding."""
        codes, scales = self.cache.pools[layer][_INDEX: _INDEX + 2]
        if (self.dtype != torch.float32 or q.shape[0] * q.shape[1] > kernels.FEW_ROWS
                or not fused(q, w) or not kernels.usable(codes, scales)):
            return None
        if visible is not None and not (visible.dtype == torch.int64 and visible.shape == q.shape[:2]
                                        and kernels.usable(visible)):
            return None
        scores = kernels.index_scores(codes, scales, *_FP4_FORMATS[_INDEX], self.tables, self.cache.ratio[layer],
                                      self.cache.block_size, upcast(q), upcast(w), self.num_entries(layer), visible)
        return cast(scores, q.dtype)

    def pool_topk(self, layer: int, q: torch.Tensor, w: torch.Tensor, blocks: torch.Tensor, block: int, keep: int,
                  visible: torch.Tensor, k: int) -> torch.Tensor | None:
        """A Reindex layer's top-k entries [B, c, k] (-1 = none) inside the candidate pool ``blocks`` bool [B, c,
        nblocks] (:func:`~deepseek_v41.model.indexer.candidate_blocks`: at most ``keep`` blocks of ``block``
        entries) of a few fp32 / bf16 queries q [B, c, Hi, di] with head weights w [B, c, Hi] and visible counts
        ``visible`` int64 [B, c], in one fused kernel call (:func:`kernels.pool_select`: scores straight from the
        packed FP4 keys, summed in fp32, then the top-k rule). None when the kernel does not apply (the caller
        then scores :meth:`index_keys_at` of :func:`~deepseek_v41.model.indexer.pool_entries`). The same picks as
        that, up to the scores' rounding."""
        codes, scales = self.cache.pools[layer][_INDEX: _INDEX + 2]
        B, c = q.shape[:2]
        if (self.dtype != torch.float32 or B * c > kernels.FEW_ROWS or not fused(q, w)
                or blocks.dtype != torch.bool or blocks.shape[:2] != (B, c) or visible.dtype != torch.int64
                or visible.shape != (B, c) or not kernels.usable(codes, scales, blocks, visible)):
            return None
        return kernels.pool_select(codes, scales, *_FP4_FORMATS[_INDEX], self.tables, self.cache.ratio[layer],
                                   self.cache.block_size, upcast(q), upcast(w), self.num_entries(layer), blocks, block,
                                   keep, visible, k)

    def index_keys_at(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Index keys of entries ``ids`` [B, c, n] (valid ids) [B, c, n, di]: only these are decoded."""
        return self._decode_at(layer, _INDEX, ids)

    def _decode_at(self, layer: int, pool: int, idx: torch.Tensor, zero_missing: bool = False) -> torch.Tensor:
        """Entries ``idx`` [B, ...] of ``pools[layer][pool:pool + 2]`` (``_MAIN`` or ``_INDEX``) decoded to
        ``dtype`` [B, ..., width]: only these are read. An index -1 reads the null page: zeros from the fused
        kernel; from the torch code whatever the null page holds, unless ``zero_missing`` (then zeros too)."""
        codes, scales = self.cache.pools[layer][pool: pool + 2]
        if self.dtype == torch.float32 and idx.dtype == torch.int64 and kernels.usable(codes, scales, idx):
            return kernels.fp4_gather(codes, scales, *_FP4_FORMATS[pool], self.tables, self.cache.ratio[layer],
                                      self.cache.block_size, idx)
        page, slot = self._locate(layer, idx)
        values = dequantize_fp4(codes[page, slot], scales[page, slot], *_FP4_FORMATS[pool], dtype=self.dtype)
        return values.masked_fill((idx < 0)[..., None], 0.0) if zero_missing else values

    def _decode_first(self, layer: int, pool: int, n: int) -> torch.Tensor:
        """Entries 0 .. n-1 of every row, as :meth:`_decode_at`, read page by page through the block tables."""
        codes, scales = self.cache.pools[layer][pool: pool + 2]
        if self.dtype == torch.float32 and kernels.usable(codes, scales):
            ids = torch.arange(n, device=codes.device).expand(self.tables.shape[0], n).contiguous()
            return self._decode_at(layer, pool, ids)
        per_page = self.cache.block_size // self.cache.ratio[layer]
        pages = self.tables[:, : -(-n // per_page)] if n else self.tables[:, :0]
        B = pages.shape[0]
        return dequantize_fp4(codes[pages].reshape(B, -1, codes.shape[-1])[:, :n],
                              scales[pages].reshape(B, -1, scales.shape[-1])[:, :n], *_FP4_FORMATS[pool],
                              dtype=self.dtype)

    def gather_entries(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """Entries ``idx`` [B, c, k] (-1 = none) as [B, c, k, d] in ``dtype``. Few picks (decode) decode just
        the picked entries; when the picks outnumber the stored entries (a prefill chunk: every query picks
        top-k of the same few thousand entries), every entry is decoded once per forward and picked from."""
        n = self.num_entries(layer)
        B = idx.shape[0]
        if n > 0 and 2 * B * n < idx.numel():
            entries = self._decoded.get(layer)
            if entries is None:  # with a zero row n after each row's entries: what an index -1 reads
                first = self._decode_first(layer, _MAIN, n)
                zero = first.new_zeros(first.shape[0], 1, first.shape[-1])
                entries = self._decoded[layer] = torch.cat((first, zero), 1)
            return pick_rows(entries, torch.where(idx < 0, n, idx))
        return self._decode_at(layer, _MAIN, idx, zero_missing=True)
