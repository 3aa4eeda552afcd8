"""KV bytes per token by model generation, computed from small layout records (MODEL_REFERENCE.md §5).

Each older generation is described by what its cache stores per layer (layers, compression ratio, and the
fields of one entry as element count x bits); V4.1-Flash's record is built from the layer plan of the official
config (tests check it against :class:`~deepseek_v41.cache.layout.KVLayout`). Totals are sums over these
records, never typed-in numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from deepseek_v41.cache.layout import INDEX_KEY_FORMAT, MAIN_KV_FORMAT, BlockFormat
from deepseek_v41.config import ModelConfig, flash_config
from deepseek_v41.plan import build_layer_plan


@dataclass(frozen=True)
class Field:
    """``elements`` values of ``bits`` bits each (e.g. 512 FP8 values, 4 fp32 scales)."""

    elements: int
    bits: int

    @property
    def bits_total(self) -> int:
        return self.elements * self.bits


@dataclass(frozen=True)
class Component:
    """A kind of cache entry: stored by ``layers`` layers, one entry per ``ratio`` tokens."""

    label: str
    layers: int
    ratio: int
    fields: tuple[Field, ...]

    @property
    def entry_bytes(self) -> Fraction:
        return Fraction(sum(f.bits_total for f in self.fields), 8)

    @property
    def bytes_per_token(self) -> Fraction:
        return self.layers * self.entry_bytes / self.ratio


BF16, FP8, FP4, FP32, UE8M0 = 16, 8, 4, 32, 8


def _v4_flash_components() -> list[Component]:
    """V4-Flash: CSA layers (ratio 4: main entry + FP4 index key) and HCA layers (ratio 128: main entry).

    Main entry (FlashMLA "MODEL1" layout): 448 FP8 position-free dims + 7 UE8M0 scales per 64 + 1 pad byte +
    64 BF16 RoPE dims. Layer ratios from V4-Flash's ``compress_ratios`` (MTP layer excluded).
    """
    ratios = [0, 0] + [4, 128] * 20 + [4]
    main = (Field(448, FP8), Field(448 // 64 + 1, UE8M0), Field(64, BF16))
    index = (Field(128, FP4), Field(128 // 32, UE8M0))
    return [
        Component("CSA main entry", ratios.count(4), 4, main),
        Component("CSA index key", ratios.count(4), 4, index),
        Component("HCA main entry", ratios.count(128), 128, main),
    ]


def _fields(fmt: BlockFormat, elements: int) -> tuple[Field, Field]:
    """The codes and scales of ``elements`` values in a block-scaled format."""
    return Field(elements, fmt.element_bits), Field(elements // fmt.block, fmt.scale_bits)


def _v41_components(cfg: ModelConfig) -> list[Component]:
    """One main-entry and one index-key component per kv-source layer of ``cfg``."""
    out = []
    for s in build_layer_plan(cfg).layers:
        if s.is_kv_source:
            out.append(Component(f"layer {s.layer_id} main entry", 1, s.compress_ratio,
                                 _fields(MAIN_KV_FORMAT, cfg.head_dim)))
            out.append(Component(f"layer {s.layer_id} index key", 1, s.compress_ratio,
                                 _fields(INDEX_KEY_FORMAT, cfg.index_head_dim)))
    return out


def generation_records(cfg: ModelConfig | None = None) -> dict[str, list[Component]]:
    """Layout records of the four generations; V4.1-Flash from ``cfg`` (default: the official config)."""
    return {
        "deepseek-llm-67b": [Component("K and V, 8 KV heads x 128, BF16", 95, 1,
                                       (Field(8 * 128, BF16), Field(8 * 128, BF16)))],
        "deepseek-v3.2": [
            Component("MLA entry (512 FP8 + 4 fp32 scales + 64 BF16 RoPE)", 61, 1,
                      (Field(512, FP8), Field(4, FP32), Field(64, BF16))),
            Component("indexer key (128 FP8 + fp32 scale)", 61, 1, (Field(128, FP8), Field(1, FP32))),
        ],
        "deepseek-v4-flash": _v4_flash_components(),
        "deepseek-v4.1-flash": _v41_components(cfg or flash_config()),
    }


def generations_bytes_per_token(cfg: ModelConfig | None = None) -> dict[str, float]:
    """Global KV bytes per token of each generation."""
    return {name: float(sum(c.bytes_per_token for c in comps))
            for name, comps in generation_records(cfg).items()}
