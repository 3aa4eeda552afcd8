"""Byte layouts of the serving KV cache and their accounting (SPEC.md §4.1, MODEL_REFERENCE.md §4–§5).

Every number here is computed from the config and the element formats; nothing is typed in as a total.

- main compressed entry: ``head_dim`` FP4 E2M1 codes (4 bits) + one E4M3 scale byte per 16 channels;
- index key: ``index_head_dim`` FP4 E2M1 codes + one UE8M0 scale byte per 32 channels;
- window row: ``head_dim`` FP8 E4M3 bytes + one UE8M0 scale byte per 32 channels.

The byte order inside an entry is ``codes | scales`` (see :mod:`deepseek_v41.quant.layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from deepseek_v41.config import ModelConfig
from deepseek_v41.plan import build_layer_plan


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled element format: ``element_bits`` per element, one ``scale_bits`` scale per ``block``."""

    name: str
    element_bits: int
    block: int
    scale_bits: int

    def nbytes(self, elements: int) -> int:
        """Bytes of ``elements`` values in this format (codes then scales). Raises ValueError when
        ``elements`` is not a whole number of blocks or of bytes."""
        if elements % self.block or (elements * self.element_bits) % 8:
            raise ValueError(f"{elements} elements do not fill whole {self.name} blocks of {self.block}")
        return elements * self.element_bits // 8 + (elements // self.block) * self.scale_bits // 8


# MODEL_REFERENCE.md §4.
MAIN_KV_FORMAT = BlockFormat("FP4 E2M1 + E4M3 scale / 16", 4, 16, 8)
INDEX_KEY_FORMAT = BlockFormat("FP4 E2M1 + UE8M0 scale / 32", 4, 32, 8)
WINDOW_KV_FORMAT = BlockFormat("FP8 E4M3 + UE8M0 scale / 32", 8, 32, 8)


@dataclass(frozen=True)
class KVLayout:
    """Per-token and per-sequence KV bytes of a config.

    ``entries_per_token``: compressed entries stored per token over all kv-source layers (Σ 1/ratio).
    ``global_bytes_per_token``: (main entry + index key) bytes × entries per token — the paged, global KV.
    ``window_bytes_per_sequence``: backbone layers × ``sliding_window`` × window row bytes (logical; the
    engine's rings add slack rows, reported by the cache). DSpark draft rings are counted separately.
    """

    main_entry_bytes: int
    index_entry_bytes: int
    window_row_bytes: int
    entries_per_token: Fraction
    num_layers: int
    num_dspark_layers: int
    sliding_window: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> KVLayout:
        plan = build_layer_plan(cfg)
        entries = sum((Fraction(1, s.compress_ratio) for s in plan.layers if s.is_kv_source), Fraction(0))
        return cls(
            main_entry_bytes=MAIN_KV_FORMAT.nbytes(cfg.head_dim),
            index_entry_bytes=INDEX_KEY_FORMAT.nbytes(cfg.index_head_dim),
            window_row_bytes=WINDOW_KV_FORMAT.nbytes(cfg.head_dim),
            entries_per_token=entries,
            num_layers=cfg.num_hidden_layers,
            num_dspark_layers=cfg.num_nextn_predict_layers,
            sliding_window=cfg.sliding_window,
        )

    @property
    def global_bytes_per_token(self) -> float:
        return float(self.entries_per_token * (self.main_entry_bytes + self.index_entry_bytes))

    @property
    def window_bytes_per_sequence(self) -> int:
        return self.num_layers * self.sliding_window * self.window_row_bytes

    @property
    def dspark_window_bytes_per_sequence(self) -> int:
        return self.num_dspark_layers * self.sliding_window * self.window_row_bytes
