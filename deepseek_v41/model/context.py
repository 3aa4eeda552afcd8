"""What attention reads and writes besides its input: the KV context (SPEC.md §3, §4.1).

One attention implementation serves training, the exact forward and the cached engine; they differ only in
the context object they pass. A context provides, for the tokens of one forward (``positions`` [B, T]):

- ``window(layer, kv)``: store the new window rows [B, T, d] (post-RoPE; FP8 round trip) and return the keys
  visible to this forward, ``(keys [B, P + T, d], key_pos [B, P + T])``, whose last T rows are the new rows in
  order and whose first P rows are earlier rows (position -1 where empty);
- ``pending(layer)`` / ``set_pending(layer, state)``: the open ratio-2 pair of a kv source;
- ``add_entries(layer, entries, index_keys, group)``: store compressed entries [B, G, d] (post-RoPE; FP4 with
  E4M3 scales) and index keys [B, G, di] (FP4 with UE8M0 scales) for groups ``group`` [B, G] (-1 = none);
- ``index_keys(layer)``: all stored index keys [B, N, di] of a kv source, entry n at row n;
  ``num_index_keys(layer)``: that N; ``index_keys_at(layer, ids)``: the keys of entries ``ids`` [B, c, n]
  (each valid) as [B, c, n, di] (a Reindex layer's candidate pool: the engine decodes only those);
  ``index_scores(layer, q, w, visible)``: the indexer scores [B, c, N] of queries q [B, c, Hi, di] with head
  weights w [B, c, Hi] against all N keys, -inf from each query's visible count ``visible`` [B, c] on, when the
  context computes them itself (the engine's fused FP4 kernel), else None (the layer then scores ``index_keys``
  with its ``IndexScorer``); ``pool_topk(layer, q, w, blocks, block, keep, visible, k)``: likewise a Reindex
  layer's top-k inside its candidate pool, or None (the layer then scores ``index_keys_at`` of the pool);
- ``gather_entries(layer, idx)``: the entries picked by ``idx`` [B, c, k] as [B, c, k, d] (zeros where -1);
- ``shared``: per-forward results handed between layers (top-k of index sources, candidate pools);
- ``indexer_losses`` / ``dense_indexer``: training only (:mod:`deepseek_v41.train.trainer`): an object whose
  ``add`` each index-source layer calls with what its KL loss needs (:mod:`deepseek_v41.train.indexer_loss`),
  and the dense warm-up in which every visible entry is selected;
- ``key_limit``: None (every window is causal: ``p - window < key_pos <= p``), or [B, T] long, the exclusive upper
  bound of the window-key positions each query sees — ``p + 1`` for text, ``min(e, p + window)`` inside an image
  span [s, e) (bidirectional inside the span; :func:`deepseek_v41.model.vision.window_key_limit`, VISION_DESIGN.md
  decision 1); compressed entries and the indexer stay causal either way;
- ``banded_window``: True when the last T window rows are the new tokens at consecutive positions (each query
  then reads only its band of them); False makes attention mask every row by position alone.
- ``completes_entries(layer)``: False when no row of this forward completes a compressed entry of kv source
  ``layer`` and the context keeps earlier entries (the engine's paged cache): the layer then skips its entry
  RoPE, its index keys and ``add_entries``;

:class:`DenseContext` is the exact-forward / training context: everything stays a tensor, the KV quantization
is the reference fake-quant (switchable off), and a forward starts at position 0.
"""

from __future__ import annotations

from typing import Any

import torch

from deepseek_v41.quant import fake_quant_fp4, fake_quant_fp8


def pick_rows(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``rows[b, idx[b, ...]]``: rows [B, N, d], idx [B, ...] long in [0, N) -> [B, ..., d]. One ``index_select``
    of whole rows (a gather with an index expanded over d reads an int64 per element: several times slower)."""
    B, N = rows.shape[:2]
    flat = idx.reshape(B, -1)
    if B > 1:
        flat = flat + torch.arange(B, device=idx.device)[:, None] * N
    return rows.reshape(B * N, -1).index_select(0, flat.reshape(-1)).view(*idx.shape, -1)


class DenseContext:
    """Context of one exact forward over whole sequences [B, T] starting at position 0. ``key_limit`` [B, T] long
    or None: the window keys each query sees (module docstring; the exact forward builds it from the prompt's
    image spans). Raises ValueError for a ``key_limit`` of another shape."""

    def __init__(self, batch: int, length: int, device: torch.device | str, fake_quant: bool = True,
                 key_limit: torch.Tensor | None = None):
        self.positions = torch.arange(length, device=device).expand(batch, length)
        if key_limit is not None and tuple(key_limit.shape) != (batch, length):
            raise ValueError(f"key_limit must be [batch, length] = [{batch}, {length}], got {list(key_limit.shape)}")
        self.key_limit = key_limit
        self.fake_quant = fake_quant
        self.shared: dict[Any, torch.Tensor] = {}
        self.banded_window = True  # the new window rows are the new tokens, at consecutive positions
        self.indexer_losses = None  # training: a deepseek_v41.train.indexer_loss.IndexerLosses
        self.dense_indexer = False  # training warm-up: every visible entry is selected
        self._entries: dict[int, torch.Tensor] = {}
        self._index_keys: dict[int, torch.Tensor] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def window(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys = fake_quant_fp8(kv, 32) if self.fake_quant else kv
        return keys, self.positions

    def pending(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._pending.get(layer)

    def set_pending(self, layer: int, state: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self._pending[layer] = state

    def add_entries(self, layer: int, entries: torch.Tensor, index_keys: torch.Tensor, group: torch.Tensor) -> None:
        # All rows start at 0 and have the same length, so every row completes the same groups 0..G-1.
        if self.fake_quant:
            entries = fake_quant_fp4(entries, 16, "e4m3")
            index_keys = fake_quant_fp4(index_keys, 32, "ue8m0")
        self._entries[layer] = entries
        self._index_keys[layer] = index_keys

    def index_keys(self, layer: int) -> torch.Tensor:
        return self._index_keys[layer]

    def all_entries(self, layer: int) -> torch.Tensor:
        """Every stored entry of kv source ``layer`` [B, N, d] (training's dense warm-up)."""
        return self._entries[layer]

    def completes_entries(self, layer: int) -> bool:
        """Always True: this context stores each kv source's entries once per forward, even none."""
        return True

    def num_index_keys(self, layer: int) -> int:
        """N of :meth:`index_keys`."""
        return self.index_keys(layer).shape[1]

    def index_keys_at(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Index keys of entries ``ids`` [B, c, n] (valid ids) as [B, c, n, di]."""
        return pick_rows(self.index_keys(layer), ids)

    def index_scores(self, layer: int, q: torch.Tensor, w: torch.Tensor, visible: torch.Tensor | None = None) -> None:
        """None: the layer scores :meth:`index_keys` itself (module docstring)."""
        return None

    def pool_topk(self, layer: int, q: torch.Tensor, w: torch.Tensor, blocks: torch.Tensor, block: int, keep: int,
                  visible: torch.Tensor, k: int) -> None:
        """None: the layer scores its candidate pool's :meth:`index_keys_at` itself (module docstring)."""
        return None

    def gather_entries(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        picked = pick_rows(self._entries[layer], idx.clamp(min=0))
        return picked.masked_fill((idx < 0)[..., None], 0.0)
