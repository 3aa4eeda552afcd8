"""FLOPs counted on meta (issue 4): checked against arithmetic from the config."""

import pytest

from deepseek_v41.analysis.flops import decode_flops, flops_section, prefill_flops
from deepseek_v41.analysis.params import build_on_meta, count_params
from deepseek_v41.config import flash_config, tiny_config
from deepseek_v41.plan import LayerRole, build_layer_plan


def scoring_growth(cfg, short: int, long: int) -> int:
    """Extra indexer-scoring FLOPs of one decode step at ``long`` over ``short`` context, from the config:
    Full layers score every visible entry, Reindex layers their candidate pool (at most blocks x block_size
    entries); per entry 2 * heads * dim (dots) + 2 * heads (head weights)."""
    per_entry = 2 * cfg.index_n_heads * cfg.index_head_dim + 2 * cfg.index_n_heads
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    extra = 0
    for spec in build_layer_plan(cfg).layers:
        entries = {n: (n + 1) // spec.compress_ratio for n in (short, long)} if spec.compress_ratio else {}
        if spec.role is LayerRole.FULL:
            extra += entries[long] - entries[short]
        elif spec.role is LayerRole.REINDEX:
            extra += min(entries[long], pool) - min(entries[short], pool)
    return per_entry * extra


def test_tiny_decode_growth_is_the_indexers_scoring():
    cfg = tiny_config()
    model = build_on_meta(cfg)
    short, long = decode_flops(model, 1000), decode_flops(model, 4000)
    assert long.total - short.total == scoring_growth(cfg, 1000, 4000)
    assert sum(short.by_format.values()) == short.total


def test_tiny_decode_covers_every_active_parameter():
    cfg = tiny_config()
    model = build_on_meta(cfg)
    count = decode_flops(model, 100)
    # Every active weight is one multiply-add; attention core, indexer and mHC come on top.
    assert count.total > 2 * count_params(model)["active_decode"]
    assert count.total < 4 * count_params(model)["active_decode"]


def test_tiny_ced_prefill_skips_the_decoder():
    model = build_on_meta(tiny_config())
    exact, ced = prefill_flops(model, 2048, "exact"), prefill_flops(model, 2048, "ced")
    assert ced.total < exact.total


@pytest.mark.slow
def test_official_flops():
    cfg = flash_config()
    flops = flops_section(build_on_meta(cfg))
    unweighted = flops["decode_per_token_unweighted"]
    assert unweighted["1M"] - unweighted["4K"] == scoring_growth(cfg, 4096, 1048576)
    assert 0 < flops["decode_growth_4k_to_1m"] < 0.5  # the paper: about a quarter; README explains ours
    assert 0.4 < flops["prefill_per_token"]["ced"] / flops["prefill_per_token"]["exact"] < 0.6  # CED halves
    # About 2 FLOPs per active parameter at 4K (16.1B active -> ~32 GFLOPs, plus attention and indexers).
    assert 2 * 16.1e9 < unweighted["4K"] < 2.5 * 16.1e9


def test_progress_hears_each_meta_run_and_the_end():
    from deepseek_v41.analysis.report import build_report

    model = build_on_meta(tiny_config())
    calls = []
    flops_section(model, {"64": 64}, prefill_prompt=32,
                  progress=lambda done, total, what="": calls.append((done, total, what)))
    assert calls == [(0, 3, "decode at 64"), (1, 3, "prefill exact"), (2, 3, "prefill ced"), (3, 3, "")]
    calls.clear()
    build_report(tiny_config(), "tiny", flops=False, progress=lambda *args: calls.append(args))
    assert calls == [(0, 1, "building the model on meta"), (1, 1, "counting parameters and KV bytes"),
                     (1, 1, "")]
