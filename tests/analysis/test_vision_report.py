"""``dsv41 report``'s vision block: parameters and FLOPs per image of the real modules (issue 27; MODEL_REFERENCE.md
§3.18, §6).

Oracles: parameter arithmetic from the config's shapes written out here, the numel of a real (CPU) model's
tensors, and FLOPs by hand (2 per multiply-add) from the shapes of each matmul of §3.18.
"""

import dataclasses
import io
import math

import pytest
import torch
from rich.console import Console

from deepseek_v41.analysis import report as report_module
from deepseek_v41.analysis.vision import (
    build_vision_on_meta,
    report_grids,
    vision_flops,
    vision_params,
    vision_section,
)
from deepseek_v41.config import VisionConfig, flash_config, tiny_config
from deepseek_v41.model.vision import VisionModel

SMALL = VisionConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=12, patch_size=2,
                     rope_theta=100.0, downsample_ratio=3, max_image_tokens=64, min_pixels=16)


def small_cfg():
    return dataclasses.replace(tiny_config(), vision_config=SMALL, image_token_id=509)


def params_by_hand(vc: VisionConfig, llm_width: int) -> dict[str, int]:
    C, I, p, r, D = vc.hidden_size, vc.intermediate_size, vc.patch_size, vc.downsample_ratio, llm_width
    block = (C                      # norm1
             + 3 * C * C + 3 * C    # wqkv + bias
             + C * C + C            # wo + bias
             + C                    # norm2
             + 2 * I * C + C * I)   # w1 (gate | up), w2
    parts = {"patch_embed": 3 * p * p * C + C, "blocks": vc.num_hidden_layers * block, "per_block": block,
             "norm": C, "aligner": r * r * C * D + D + D * D + D, "delimiters": 3 * D}
    parts["total"] = sum(v for k, v in parts.items() if k != "per_block")
    return parts


def flops_by_hand(vc: VisionConfig, llm_width: int, n_h: int, n_w: int) -> dict[str, int]:
    C, I, p, r, D, L = (vc.hidden_size, vc.intermediate_size, vc.patch_size, vc.downsample_ratio, llm_width,
                        vc.num_hidden_layers)
    N = n_h * n_w
    M = math.ceil(n_h / r) * math.ceil(n_w / r)  # aligner rows after zero-padding the grid to multiples of r
    out = {"patch_embed": 2 * N * (3 * p * p) * C,
           "qkv": L * 2 * N * C * 3 * C,
           "attention_core": L * (2 * N * N * C + 2 * N * N * C),  # q k^T and p v, summed over the heads
           "wo": L * 2 * N * C * C,
           "mlp": L * (2 * N * C * 2 * I + 2 * N * I * C),
           "aligner": 2 * M * (r * r * C) * D + 2 * M * D * D}
    out["total"] = sum(out.values())
    return out


def test_params_of_the_official_tower():
    cfg = flash_config()
    counted = vision_params(build_vision_on_meta(cfg))
    assert counted == params_by_hand(cfg.vision_config, cfg.hidden_size)
    # The released shards' vision tensors: 970,536,960 bf16 bytes (model/vision.py's docstring).
    assert counted["total"] == 485_268_480 == 970_536_960 // 2


def test_params_equal_the_real_tensors():
    cfg = small_cfg()
    real = VisionModel(cfg)
    counted = vision_params(real)
    assert counted == vision_params(build_vision_on_meta(cfg)) == params_by_hand(SMALL, cfg.hidden_size)
    assert counted["total"] == sum(t.numel() for t in real.state_dict().values())


@pytest.mark.parametrize("grid", [(4, 5), (1, 1), (3, 7)])
def test_flops_per_image_by_hand(grid):
    cfg = small_cfg()
    assert vision_flops(build_vision_on_meta(cfg), *grid) == flops_by_hand(SMALL, cfg.hidden_size, *grid)


def test_official_flops_at_the_report_grids():
    cfg = flash_config()
    grids = report_grids(cfg)
    big, small = grids["max_image_tokens"], grids["min_pixels"]
    assert big.span_length <= cfg.vision_config.max_image_tokens < image_span_after_growing(big)
    assert small.height * small.width >= cfg.vision_config.min_pixels
    section = vision_section(cfg)
    for name, grid in grids.items():
        entry = section["flops_per_image"][name]
        assert entry["vit_grid"] == [grid.n_vit_h, grid.n_vit_w] and entry["span_tokens"] == grid.span_length
        assert entry["flops"] == flops_by_hand(cfg.vision_config, cfg.hidden_size, grid.n_vit_h, grid.n_vit_w)
    # Attention over all patches grows with the square of the patches: at the budget it is the largest part.
    top = section["flops_per_image"]["max_image_tokens"]["flops"]
    assert top["attention_core"] == max(v for k, v in top.items() if k != "total")


def image_span_after_growing(grid):
    """The span one more token row and column would take: beyond the budget when the grid is capped."""
    return (grid.n_llm_h + 1) * (grid.n_llm_w + 2) + 2


def test_report_carries_and_prints_the_vision_block(monkeypatch):
    cfg = small_cfg()
    data = report_module.build_report(cfg, "tiny-vl", flops=False)
    assert data["vision"] == {"params": params_by_hand(SMALL, cfg.hidden_size)}
    assert "vision" not in report_module.build_report(tiny_config(), "tiny", flops=False)
    data["vision"] = vision_section(cfg)
    buffer = io.StringIO()
    monkeypatch.setattr("rich.console.Console", lambda *a, **k: Console(file=buffer, width=200))
    report_module.print_report(data)
    text = buffer.getvalue()
    assert "Vision tower parameters" in text and "Vision FLOPs per image" in text
    assert f"{data['vision']['params']['total']:,}" in text and "max_image_tokens" in text


def test_flops_reject_an_empty_grid():
    with pytest.raises(ValueError, match="1x1"):
        vision_flops(build_vision_on_meta(small_cfg()), 0, 3)
    assert torch.device("meta") == next(build_vision_on_meta(small_cfg()).parameters()).device
