"""The engine's KV storage: paged global KV pools, FP8 window rings, pending pairs, Engram history (SPEC.md §4.1).

- **Global KV** (paged): for each kv-source layer, main entries as packed FP4 codes + E4M3 scales and index keys
  as packed FP4 codes + UE8M0 scales, ``[num_pages, block_size / ratio, ...]`` uint8 — no dequantized copy.
  Entry g of a ratio-m layer lives in the page holding token g*m, at slot ``g mod (block_size / m)``.
- **Window rings**, per sequence slot and layer: ``sliding_window + window_slack_rows`` rows of FP8 codes + UE8M0
  scales, and the position each row holds (-1 = empty). Row of position p: ``p mod rows``. A forward reads the
  rows of earlier positions first, then writes its own; rows of tokens that are later rejected (speculative
  decoding) hold positions beyond the committed length, so no query ever reads them, and the slack guarantees
  they only overwrite rows no query still needs.
- **Pending pairs** of ratio-2 kv sources (kv and score of the open pair's first token, fp32) and the **Engram
  history** (the last ``max_ngram - 1`` compressed ids), per slot.
- **DSpark draft rings** (speculative decoding only), per slot: each draft layer's ``sliding_window`` committed
  context rows and their positions (DSPARK.md §3.1, §7); only accepted rows are ever written, so no slack.

Allocated bytes are measured from the tensors (:meth:`PagedKVCache.allocated_bytes_per_token`), so the 890 B of
the official config is a reading of real pool tensors (built on ``meta`` for the official sizes).
"""

from __future__ import annotations

import torch

from deepseek_v41.cache.block_manager import BlockManager
from deepseek_v41.cache.layout import INDEX_KEY_FORMAT, MAIN_KV_FORMAT, WINDOW_KV_FORMAT
from deepseek_v41.config import ModelConfig
from deepseek_v41.plan import build_layer_plan


class PagedKVCache:
    """All KV tensors of an engine: ``num_pages`` pages of ``block_size`` tokens and ``num_slots`` sequence slots.

    ``state_dtype``: dtype of the pending pairs (fp32 as in the reference; float64 for a float64 model).
    ``residual_dtype``: when given, every slot also keeps a ring of the encoder's final residual streams (the CED
    decoder's inputs) of its last ``window_rows`` positions, for SWA snapshots (SPEC.md §4.3).
    ``draft_layers``: DSpark draft layers whose rings each slot keeps (0 = none): ``draft_keys`` [draft_layers,
    num_slots, sliding_window, head_dim] (``state_dtype``) and ``draft_pos`` [num_slots, sliding_window] long.
    Raises ValueError when ``block_size`` is not a multiple of every compress ratio or the slack is negative.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, block_size: int, num_slots: int,
                 window_slack_rows: int = 16, device: torch.device | str = "cpu",
                 state_dtype: torch.dtype = torch.float32, residual_dtype: torch.dtype | None = None,
                 draft_layers: int = 0):
        plan = build_layer_plan(cfg)
        ratios = sorted({s.compress_ratio for s in plan.layers if s.is_kv_source})
        if block_size <= 0 or any(block_size % m for m in ratios):
            raise ValueError(f"block_size must be a positive multiple of every compress ratio {ratios}, "
                             f"got {block_size}")
        if window_slack_rows < 0:
            raise ValueError(f"window_slack_rows must be >= 0, got {window_slack_rows}")
        self.config, self.plan = cfg, plan
        self.block_size, self.num_pages, self.num_slots = block_size, num_pages, num_slots
        self.device = torch.device(device)
        self.blocks = BlockManager(num_pages, block_size)
        d, di = cfg.head_dim, cfg.index_head_dim
        u8 = dict(dtype=torch.uint8, device=device)
        self.ratio = {s.layer_id: s.compress_ratio for s in plan.layers if s.is_kv_source}
        # Global KV pools, per kv-source layer: (main codes, main scales, index codes, index scales).
        self.pools: dict[int, tuple[torch.Tensor, ...]] = {}
        for layer, m in self.ratio.items():
            e = block_size // m
            self.pools[layer] = (
                torch.zeros(num_pages, e, d // 2, **u8), torch.zeros(num_pages, e, d // MAIN_KV_FORMAT.block, **u8),
                torch.zeros(num_pages, e, di // 2, **u8), torch.zeros(num_pages, e, di // INDEX_KEY_FORMAT.block, **u8))
        # Window rings of every backbone layer.
        self.window_rows = cfg.sliding_window + window_slack_rows
        L, R = cfg.num_hidden_layers, self.window_rows
        self.window_codes = torch.zeros(num_slots, L, R, d, **u8)
        self.window_scales = torch.zeros(num_slots, L, R, d // WINDOW_KV_FORMAT.block, **u8)
        self.window_pos = torch.full((num_slots, L, R), -1, dtype=torch.int32, device=device)
        # Ratio-2 pending pairs and Engram history.
        self.pending_layers = [layer for layer, m in self.ratio.items() if m == 2]
        self.pending = torch.zeros(num_slots, max(1, len(self.pending_layers)), 2, d, dtype=state_dtype,
                                   device=device)
        depth = max(1, cfg.engram_max_ngram_size - 1) if cfg.engram_layer_ids else 1
        self.engram_history = torch.full((num_slots, depth), -1, dtype=torch.int64, device=device)
        self.residuals = residual_dtype is not None
        if self.residuals:
            hc, D = cfg.hc_mult, cfg.hidden_size
            self.residual_streams = torch.zeros(num_slots, R, hc, D, dtype=residual_dtype, device=device)
            self.residual_pre = torch.zeros(num_slots, R, hc, dtype=state_dtype, device=device)
            self.residual_pos = torch.full((num_slots, R), -1, dtype=torch.int32, device=device)
        self.draft_layers = draft_layers
        if draft_layers:
            W = cfg.sliding_window
            self.draft_keys = torch.zeros(draft_layers, num_slots, W, d, dtype=state_dtype, device=device)
            self.draft_pos = torch.full((num_slots, W), -1, dtype=torch.long, device=device)
        self.free_slots = list(range(num_slots))

    # ------------------------------------------------------------------ accounting (SPEC.md §4.1)
    def global_tensors(self) -> list[torch.Tensor]:
        return [t for pool in self.pools.values() for t in pool]

    @property
    def global_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.global_tensors())

    @property
    def allocated_bytes_per_token(self) -> float:
        """Σ nbytes of the global-KV pool tensors ÷ (pages × page size)."""
        return self.global_bytes / (self.num_pages * self.block_size)

    @property
    def window_bytes_per_slot_allocated(self) -> int:
        """Window ring bytes of one sequence slot as allocated (rows incl. slack, scales, row positions)."""
        tensors = (self.window_codes, self.window_scales, self.window_pos)
        return sum(t.numel() * t.element_size() for t in tensors) // self.num_slots

    @property
    def window_bytes_per_slot_logical(self) -> int:
        """Window bytes a sequence needs: layers × ``sliding_window`` × row bytes."""
        cfg = self.config
        return cfg.num_hidden_layers * cfg.sliding_window * WINDOW_KV_FORMAT.nbytes(cfg.head_dim)

    # ------------------------------------------------------------------ slots
    def acquire_slot(self) -> int:
        """A free sequence slot, reset (empty window and draft rings, no pending pair, fresh Engram history).

        Raises RuntimeError when every slot is taken (the scheduler never asks for more than ``num_slots``).
        """
        if not self.free_slots:
            raise RuntimeError("no free sequence slot")
        slot = self.free_slots.pop(0)
        self.window_pos[slot] = -1
        self.pending[slot] = 0
        self.engram_history[slot] = -1
        if self.residuals:
            self.residual_pos[slot] = -1
        if self.draft_layers:
            self.draft_pos[slot] = -1
        return slot

    # ------------------------------------------------------------------ residual ring (CED decoder inputs)
    def write_residual_rows(self, slots: list[int], starts: list[int], streams: torch.Tensor,
                            pre: torch.Tensor) -> None:
        """Keep the encoder's final streams [B, T, hc, D] and ``pre`` [B, T, hc] of rows b = slots ``slots[b]``,
        positions ``starts[b] .. starts[b] + T - 1`` (each row's last ``window_rows`` positions only), in one
        indexed write for all rows (a decode step's rows: one write, not one per sequence; issue 25)."""
        R = self.window_rows
        T = streams.shape[1]
        keep = min(T, R)
        pos = torch.tensor(starts, device=self.device)[:, None] + (T - keep) + torch.arange(keep, device=self.device)
        slot = torch.tensor(slots, device=self.device)[:, None]
        self.residual_streams[slot, pos % R] = streams[:, T - keep:].to(self.residual_streams.dtype)
        self.residual_pre[slot, pos % R] = pre[:, T - keep:].to(self.residual_pre.dtype)
        self.residual_pos[slot, pos % R] = pos.to(torch.int32)

    def read_residuals(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept streams [end - start, hc, D] and ``pre`` of positions [start, end). Raises RuntimeError when
        a position is not in the ring."""
        pos = torch.arange(start, end, device=self.device)
        rows = pos % self.window_rows
        if not torch.equal(self.residual_pos[slot, rows].long(), pos):
            raise RuntimeError(f"residuals of positions [{start}, {end}) are not in slot {slot}'s ring")
        return self.residual_streams[slot, rows], self.residual_pre[slot, rows]

    # ------------------------------------------------------------------ SWA snapshots (SPEC.md §4.3)
    def snapshot(self, slot: int, boundary: int, layers: list[int]) -> dict[str, torch.Tensor] | None:
        """Window rows of ``layers`` (and, with residuals, the decoder inputs) for positions
        [max(0, boundary - sliding_window), boundary), copied out of slot ``slot``; None when the rings no longer
        hold them all."""
        start = max(0, boundary - self.config.sliding_window)
        pos = torch.arange(start, boundary, device=self.device)
        rows = pos % self.window_rows
        held = self.window_pos[slot][layers][:, rows].long()
        if not torch.equal(held, pos.expand_as(held)):
            return None
        out = {"positions": pos.to(torch.int32).cpu(),
               "window_codes": self.window_codes[slot][layers][:, rows].cpu(),
               "window_scales": self.window_scales[slot][layers][:, rows].cpu()}
        if self.residuals:
            try:
                streams, pre = self.read_residuals(slot, start, boundary)
            except RuntimeError:
                return None
            out["residual_streams"], out["residual_pre"] = streams.cpu(), pre.cpu()
        return out

    def restore(self, slot: int, snapshot: dict[str, torch.Tensor], layers: list[int]) -> None:
        """Write a snapshot's rows back into slot ``slot``'s rings (positions as recorded)."""
        pos = snapshot["positions"].to(self.device).long()
        rows = pos % self.window_rows
        for i, layer in enumerate(layers):
            self.window_codes[slot, layer, rows] = snapshot["window_codes"][i].to(self.device)
            self.window_scales[slot, layer, rows] = snapshot["window_scales"][i].to(self.device)
            self.window_pos[slot, layer, rows] = pos.to(torch.int32)
        if self.residuals and "residual_streams" in snapshot:
            self.residual_streams[slot, rows] = snapshot["residual_streams"].to(self.device,
                                                                                self.residual_streams.dtype)
            self.residual_pre[slot, rows] = snapshot["residual_pre"].to(self.device, self.residual_pre.dtype)
            self.residual_pos[slot, rows] = pos.to(torch.int32)

    # ------------------------------------------------------------------ pages as bytes (persistent tier)
    def page_layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Names, shapes and dtypes of one page's tensors (every kv-source layer's codes and scales)."""
        parts = ("main_codes", "main_scales", "index_codes", "index_scales")
        return {f"{layer}.{part}": (tuple(t.shape[1:]), "uint8")
                for layer, pool in self.pools.items() for part, t in zip(parts, pool, strict=True)}

    def read_page(self, page: int) -> dict[str, torch.Tensor]:
        parts = ("main_codes", "main_scales", "index_codes", "index_scales")
        return {f"{layer}.{part}": t[page].cpu().clone()
                for layer, pool in self.pools.items() for part, t in zip(parts, pool, strict=True)}

    def write_page(self, page: int, tensors: dict[str, torch.Tensor]) -> None:
        parts = ("main_codes", "main_scales", "index_codes", "index_scales")
        for layer, pool in self.pools.items():
            for part, t in zip(parts, pool, strict=True):
                t[page] = tensors[f"{layer}.{part}"].to(t.device)

    def release_slot(self, slot: int) -> None:
        self.free_slots.append(slot)
        self.free_slots.sort()
