"""The layer plan: what every layer does, derived from the config (MODEL_REFERENCE.md §3.3, §3.11, §3.16).

Roles are never hard-coded: the official 40-layer model and small configs go through the same rules.

- ratio 0: **window-only** (sliding-window attention, base RoPE theta, no YaRN).
- ratio > 0 and a kv source: **Full** (own compressor, own index keys, own top-k).
- ratio > 0, an index source but not a kv source: **Reindex** (own indexer query and top-k over the entries
  and index keys of its kv source; inside the candidate pool when the candidate source comes before it and
  reads the same entries).
- otherwise **Reuse** (entries of the latest kv source, top-k of the latest index source, same ratio).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from deepseek_v41.config import ModelConfig, latest_source


class LayerRole(str, enum.Enum):
    """CSA2 mode of a layer (the paper's terms)."""

    WINDOW = "window-only"
    FULL = "Full"
    REINDEX = "Reindex"
    REUSE = "Reuse"


class Stack(str, enum.Enum):
    """CED half a layer belongs to."""

    ENCODER = "encoder"
    DECODER = "decoder"


@dataclass(frozen=True)
class LayerSpec:
    """One layer's plan.

    ``kv_source``: layer whose compressed entries and index keys this layer reads (None for window-only).
    ``index_source``: layer whose top-k this layer uses (itself for Full and Reindex).
    ``candidate_source``: for a Reindex layer scoring only inside the candidate pool, the layer that builds the
    pool; else None. ``rope_theta`` / ``yarn``: this layer's RoPE table. ``stack``: encoder / decoder under
    CED, None when the config has no CED layout.
    """

    layer_id: int
    compress_ratio: int
    role: LayerRole
    kv_source: int | None
    index_source: int | None
    candidate_source: int | None
    is_candidate_source: bool
    rope_theta: float
    yarn: bool
    engram: bool
    stack: Stack | None

    @property
    def is_kv_source(self) -> bool:
        return self.role is LayerRole.FULL

    @property
    def is_index_source(self) -> bool:
        return self.role in (LayerRole.FULL, LayerRole.REINDEX)


@dataclass(frozen=True)
class LayerPlan:
    """The plan of the backbone layers, the DSpark draft layers and the CED split.

    ``ced``: True when the config passes the layout checks of MODEL_REFERENCE.md §3.16; then
    ``encoder_layers`` = [0, n/2) and ``decoder_layers`` = [n/2, n). ``ced_reason`` says why not otherwise.
    ``sliding_window``: window keys per query (the config's), which fixes where the CED decoder starts.
    """

    layers: tuple[LayerSpec, ...]
    dspark_layers: tuple[LayerSpec, ...]
    ced: bool
    ced_reason: str
    sliding_window: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def encoder_layers(self) -> range:
        return range(0, self.num_layers // 2) if self.ced else range(0)

    @property
    def decoder_layers(self) -> range:
        return range(self.num_layers // 2, self.num_layers) if self.ced else range(0)

    def decoder_start(self, num_prompt_tokens: int) -> int:
        """First position the CED decoder runs over for a prompt of ``num_prompt_tokens`` tokens:
        ``max(0, N - sliding_window)`` (MODEL_REFERENCE.md §3.16: the decoder runs over the trailing
        ``min(N, sliding_window)`` prompt tokens, its windows starting there; every later token runs all layers).

        The one home of that rule: the engine fixes it per sequence at arrival (so a preempted sequence recomputes
        what it had), the prefix cache plans hits around it, the runner, the FLOP
        counts and the CED evaluation read it from here. Without the CED layout every layer runs over every token
        and the decoder starts at 0. Raises ValueError for a negative token count.
        """
        if num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
        return max(0, num_prompt_tokens - self.sliding_window) if self.ced else 0

    @property
    def kv_source_layers(self) -> list[int]:
        return [s.layer_id for s in self.layers if s.is_kv_source]

    def table(self) -> list[dict]:
        """Rows for printing: one dict per layer."""
        rows = []
        for s in (*self.layers, *self.dspark_layers):
            rows.append({
                "layer": s.layer_id if s in self.layers else f"dspark.{s.layer_id}",
                "ratio": s.compress_ratio, "role": s.role.value,
                "kv_source": s.kv_source, "index_source": s.index_source,
                "candidate_source": s.candidate_source, "candidate_pool_builder": s.is_candidate_source,
                "rope_theta": s.rope_theta, "yarn": s.yarn, "engram": s.engram,
                "stack": s.stack.value if s.stack else None,
            })
        return rows


def ced_layout_problems(cfg: ModelConfig) -> list[str]:
    """Why the config cannot run CED (MODEL_REFERENCE.md §3.16); empty when it can.

    Checks: even layer count, window > 0, the first decoder layer is a kv source and an index source with ratio 1,
    every later decoder layer has ratio 1 and is not a kv source, every Engram layer is in the encoder.
    """
    n = cfg.num_hidden_layers
    ratios = cfg.layer_ratios
    problems = []
    if n % 2:
        problems.append(f"num_hidden_layers ({n}) is odd")
        return problems
    half = n // 2
    if cfg.sliding_window <= 0:
        problems.append("sliding_window is not positive")
    if half not in cfg.kv_source_layer_ids or half not in cfg.index_source_layer_ids or ratios[half] != 1:
        problems.append(f"layer {half} (the first decoder layer) must be a kv source and an index source with "
                        f"compress ratio 1")
    later = [j for j in range(half + 1, n) if ratios[j] != 1 or j in cfg.kv_source_layer_ids]
    if later:
        problems.append(f"decoder layers {later} must have compress ratio 1 and not be kv sources")
    outside = [j for j in cfg.engram_layer_ids if j >= half]
    if outside:
        problems.append(f"Engram layers {outside} are not in the encoder")
    return problems


def build_layer_plan(cfg: ModelConfig) -> LayerPlan:
    """Derive every layer's role, sources, RoPE table, Engram flag and CED stack from ``cfg``."""
    n = cfg.num_hidden_layers
    ratios = cfg.layer_ratios
    ced_problems = ced_layout_problems(cfg)
    ced = not ced_problems
    cand = cfg.candidate_source_layer_id
    cand_kv = latest_source(cand, cfg.kv_source_layer_ids, ratios) if cand >= 0 else None
    yarn = cfg.rope_scaling is not None
    layers = []
    for j in range(n):
        ratio = ratios[j]
        stack = (Stack.ENCODER if j < n // 2 else Stack.DECODER) if ced else None
        if ratio == 0:
            layers.append(LayerSpec(j, 0, LayerRole.WINDOW, None, None, None, False, cfg.rope_theta, False,
                                    j in cfg.engram_layer_ids, stack))
            continue
        kv = latest_source(j, cfg.kv_source_layer_ids, ratios)
        index = latest_source(j, cfg.index_source_layer_ids, ratios)
        if j in cfg.kv_source_layer_ids:
            role = LayerRole.FULL
        elif j in cfg.index_source_layer_ids:
            role = LayerRole.REINDEX
        else:
            role = LayerRole.REUSE
        pool = cand if role is LayerRole.REINDEX and 0 <= cand < j and cand_kv == kv else None
        layers.append(LayerSpec(j, ratio, role, kv, index, pool, j == cand, cfg.compress_rope_theta, yarn,
                                j in cfg.engram_layer_ids, stack))
    dspark = tuple(
        LayerSpec(k, 0, LayerRole.WINDOW, None, None, None, False, cfg.rope_theta, False, False, None)
        for k in range(cfg.num_nextn_predict_layers)
    )
    reason = "CED layout supported" if ced else "no CED: " + "; ".join(ced_problems)
    return LayerPlan(tuple(layers), dspark, ced, reason, cfg.sliding_window)
