"""The vision tower in ``dsv41 report``: parameters and FLOPs per image, from the real modules on ``meta``
(issue 27; MODEL_REFERENCE.md §3.18, §6).

Parameters are read off a :class:`~deepseek_v41.model.vision.VisionModel` built on PyTorch's ``meta`` device
(``vision.*``, ``aligner.*``, ``image_start`` / ``image_newline`` / ``image_end``), by part. FLOPs per image are
counted by ``torch.utils.flop_counter.FlopCounterMode`` while that model encodes one image of a given patch grid
(meta patches: no memory, no values), split by module: the patch embedding, each ViT block's ``wqkv``, attention
core (scores q k^T and values p v over all the image's patches, both heads-summed: 4 N^2 width), ``wo`` and MLP
(``w1``, ``w2``), and the aligner (``w1`` over the 3x3-merged rows, ``w2``). Matmul FLOPs only (2 per
multiply-add), as :mod:`deepseek_v41.analysis.flops` counts; norms, RoPE and activations are not counted. The
release keeps the vision weights in BF16 (MODEL_REFERENCE.md §4), so these FLOPs are BF16 FLOPs (weight 1).

The grids the report shows are the processor's own (:func:`~deepseek_v41.model.image_processor.plan_image_grid`):
a square image at ``min_pixels`` and a square image large enough to hit the ``max_image_tokens`` budget.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from deepseek_v41.config import ModelConfig
from deepseek_v41.model.image_processor import ImageGrid, ProcessedImage, plan_image_grid
from deepseek_v41.model.vision import VisionModel

_PARTS = {  # own FLOPs of a counter module name -> report part
    "patch_embed": re.compile(r"^VisionTower\.patch_embed(\.proj)?$"),
    "qkv": re.compile(r"^VisionTower\.blocks\.\d+\.attn\.wqkv$"),
    "attention_core": re.compile(r"^VisionTower\.blocks\.\d+\.attn$"),
    "wo": re.compile(r"^VisionTower\.blocks\.\d+\.attn\.wo$"),
    "mlp": re.compile(r"^VisionTower\.blocks\.\d+\.mlp(\.w[12])?$"),
    "aligner": re.compile(r"^Aligner(\.w[12])?$"),
}
LARGE_SIDE = 1 << 16  # pixels: a square image this large always meets the max_image_tokens cap


def build_vision_on_meta(cfg: ModelConfig) -> VisionModel:
    """The vision path of ``cfg`` with every parameter on ``meta``. Raises ValueError without a vision_config."""
    with torch.device("meta"):
        return VisionModel(cfg)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def vision_params(model: VisionModel) -> dict[str, int]:
    """Parameters of ``model`` (any device) by part: ``patch_embed``, ``blocks`` (all ViT blocks), ``per_block``,
    ``norm`` (the ViT's final norm), ``aligner``, ``delimiters`` (the three learned vectors) and ``total``."""
    tower = model.vision
    out = {
        "patch_embed": _numel(tower.patch_embed),
        "blocks": _numel(tower.blocks),
        "per_block": _numel(tower.blocks[0]) if len(tower.blocks) else 0,
        "norm": _numel(tower.norm),
        "aligner": _numel(model.aligner),
        "delimiters": sum(getattr(model, n).numel() for n in ("image_start", "image_newline", "image_end")),
    }
    out["total"] = _numel(model)
    return out


def vision_flops(model: VisionModel, n_vit_h: int, n_vit_w: int) -> dict[str, int]:
    """Matmul FLOPs of encoding one image of ``n_vit_h x n_vit_w`` patches with ``model`` (built on meta, see
    :func:`build_vision_on_meta`; a real model also works but then computes): by part (module docstring) and
    ``total``. Raises ValueError for a grid side below 1."""
    if n_vit_h < 1 or n_vit_w < 1:
        raise ValueError(f"a patch grid needs at least 1x1 patches, got {n_vit_h}x{n_vit_w}")
    tower = model.vision
    p, r = tower.patch_size, model.aligner.ratio
    weight = tower.patch_embed.proj.weight
    grid = ImageGrid(n_vit_h * p, n_vit_w * p, n_vit_h, n_vit_w, math.ceil(n_vit_h / r), math.ceil(n_vit_w / r))
    patches = torch.empty(n_vit_h * n_vit_w, weight.shape[1], device=weight.device, dtype=weight.dtype)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.encode([ProcessedImage(patches, grid)])
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    total = counts.pop("Global", 0)
    own = dict(counts)  # each module's own FLOPs: its count minus its counted children's
    for name, flops in counts.items():
        cut = name.rfind(".")
        while cut > 0 and name[:cut] not in counts:
            cut = name.rfind(".", 0, cut)
        if cut > 0:
            own[name[:cut]] -= flops
    out = dict.fromkeys(_PARTS, 0)
    for name, flops in own.items():
        part = next((k for k, pattern in _PARTS.items() if pattern.match(name)), None)
        if part is None and flops:
            raise RuntimeError(f"vision FLOPs of module {name!r} fit no report part")  # a new module: extend _PARTS
        if part is not None:
            out[part] += flops
    if sum(out.values()) != total:
        raise RuntimeError(f"vision FLOPs outside the counted modules: {total - sum(out.values())}")
    out["total"] = total
    return out


def report_grids(cfg: ModelConfig) -> dict[str, ImageGrid]:
    """The grids the report counts, as the processor plans them: ``min_pixels`` (a square image of that area) and
    ``max_image_tokens`` (a square image large enough to be capped by the budget)."""
    vc = cfg.vision_config
    side = math.isqrt(vc.min_pixels)
    return {"min_pixels": plan_image_grid(side, side, vc),
            "max_image_tokens": plan_image_grid(LARGE_SIDE, LARGE_SIDE, vc)}


def vision_section(cfg: ModelConfig, flops: bool = True) -> dict | None:
    """The ``vision`` block of ``dsv41 report``: ``params`` (:func:`vision_params`) and, with ``flops``,
    ``flops_per_image`` by grid name (:func:`report_grids`), each with its grid (ViT patches, LLM tokens, span
    length) and :func:`vision_flops`. None for a config without a vision tower."""
    if cfg.vision_config is None:
        return None
    model = build_vision_on_meta(cfg)
    out: dict = {"params": vision_params(model)}
    if flops:
        out["flops_per_image"] = {
            name: {"vit_grid": [g.n_vit_h, g.n_vit_w], "llm_grid": [g.n_llm_h, g.n_llm_w],
                   "span_tokens": g.span_length, "flops": vision_flops(model, g.n_vit_h, g.n_vit_w)}
            for name, g in report_grids(cfg).items()}
    return out
