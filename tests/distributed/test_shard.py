"""Tensor / expert parallel sharding on 2 gloo processes (issue 28): the sharded exact forward equals one process.

Oracle: the unsharded model in this process (float64: the same sums in another order, so logits within 1e-10 and
the same greedy argmax). The two ranks must also hold bitwise identical logits (every rank computes the replicated
tensors alike, the collectives hand every rank the same result). Layouts: TP=2, EP=2 (``expert_parallel_size``)
and TP=2 + EP (``enable_expert_parallel``). The engine cases are in test_shard_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from shard_worker import LAYOUTS, prompt_ids, run_case, spawn, tiny_model

from deepseek_v41.config import QuantizationConfig
from deepseek_v41.distributed.comm import ParallelState
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.shard import check_shardable, shard_bytes, shard_model


@pytest.fixture(scope="module")
def oracle():
    """The one-process results of the forward cases."""
    out = {case: run_case(case, ParallelState.single()) for case in ("forward", "fast", "bf16")}
    exact = tiny_model(torch.float32)  # the bf16 model's weights, computed in fp32: what bf16 approximates
    exact.load_state_dict({k: v.to(torch.bfloat16).to(v.dtype) for k, v in exact.state_dict().items()})
    with torch.no_grad():
        out["bf16_exact"] = exact(torch.tensor([prompt_ids(37, 1)])).double().numpy().ravel()
    return out


def rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(a ** 2)))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_forward_equals_one_process(layout, oracle, tmp_path):
    tp = layout.startswith("tp")
    ranks = spawn(layout, ["forward", "fast", "bf16"] + (["forward_engram"] if tp else []), tmp_path)
    ref, ref_logits = oracle["forward"]
    ref_logits = ref_logits.double().numpy().ravel()
    for r, got in enumerate(ranks):
        data, logits = got["forward"]
        assert np.abs(logits - ref_logits).max() < 1e-10, (layout, r)
        assert data["argmax"] == ref["argmax"], (layout, r)
        # fp32 with the fast backend installed (few-token kernels in inference mode): within fp32 rounding.
        fast_ref = oracle["fast"][1].numpy().ravel()
        assert np.abs(got["fast"][1] - fast_ref).max() < 1e-4, (layout, r)
        # bf16: the sharded sums round other partials; as close to the fp32 result as one process is.
        exact, one = oracle["bf16_exact"], oracle["bf16"][1].double().numpy().ravel()
        assert rms(got["bf16"][1] - exact) < 1.5 * rms(one - exact), (layout, r)
        if tp:  # Engram tables split by rows: the same logits, half the table bytes (to a row)
            engram, engram_logits = got["forward_engram"]
            assert np.abs(engram_logits - ref_logits[:engram_logits.size]).max() < 1e-10
            assert engram["argmax"] == ref["argmax"]
            cfg = tiny_model(torch.float64, device="meta").config
            table = sum(cfg.engram_num_embeddings) * cfg.engram_head_dim * 8
            assert abs(ref["bytes"]["engram"] - engram["bytes"]["engram"] - table / 2) <= cfg.engram_head_dim * 8
    for case in ("forward", "fast", "bf16") + (("forward_engram",) if tp else ()):
        assert np.array_equal(ranks[0][case][1], ranks[1][case][1]), f"{layout} {case}: ranks differ"
    calls = ranks[0]["forward"][0]["comm_calls"]
    if layout.startswith("tp"):
        assert calls["all_reduce"] > 0 and calls["all_gather"] > 0
    if "ep" in layout:
        assert calls["all_to_all"] > 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shard_bytes_measured_equal_the_meta_plan(layout):
    """Sharding runs no collective, so each rank's shard is built here: the bytes it holds are what shard_model on
    ``meta`` plans, less than the whole model."""
    whole = shard_bytes(tiny_model(torch.float64))
    for rank in range(2):
        state = ParallelState.of(LAYOUTS[layout], rank)
        measured = shard_bytes(shard_model(tiny_model(torch.float64), state))
        assert measured == shard_bytes(shard_model(tiny_model(torch.float64, device="meta"), state)), rank
        assert measured["total"] < whole["total"]


def test_world_of_one_is_a_no_op():
    model = tiny_model(torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert shard_model(model, ParallelState.single()) is model
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_meta_plan_bytes_split_as_the_layout_says():
    """Per-rank bytes from arithmetic on the config (not from shard_bytes' own walk): TP halves attention's
    head-split weights, the vocab rows and the sliced experts; EP halves the routed experts only."""
    whole = shard_bytes(tiny_model(torch.float64, device="meta"))
    cfg = tiny_model(torch.float64, device="meta").config
    ranks = {}
    for name, pc in (("tp", ParallelConfig(tensor_parallel_size=2)), ("ep", ParallelConfig(expert_parallel_size=2)),
                     ("tpep", ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True))):
        ranks[name] = shard_bytes(shard_model(tiny_model(torch.float64, device="meta"), ParallelState.of(pc, 1)))
    D, V, H, d, qr = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    split = layers * 8 * (H * d * qr + H + H * d * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * D) // 2
    assert ranks["tp"]["attention"] == whole["attention"] - split
    assert ranks["tp"]["embed"] == ranks["tp"]["head"] == V * D * 8 // 2
    for name in ("tp", "ep", "tpep"):
        assert ranks[name]["experts"] == whole["experts"] // 2
        assert ranks[name]["engram"] == whole["engram"] and ranks[name]["other"] == whole["other"]
    assert ranks["tp"]["shared"] == whole["shared"] // 2 and ranks["tpep"]["shared"] == whole["shared"]
    assert ranks["ep"]["attention"] == whole["attention"] and ranks["ep"]["embed"] == whole["embed"]


def test_sizes_that_do_not_divide_are_named():
    cfg = tiny_model(torch.float64, device="meta").config
    with pytest.raises(ValueError, match=r"num_attention_heads = 4 does not split over tensor_parallel_size 8.*"
                                         r"allowed tensor_parallel_size values for it: 1, 2, 4"):
        check_shardable(cfg, 8, 1)
    with pytest.raises(ValueError, match=r"o_groups = 2 .*tensor_parallel_size values that fit every size: 1, 2\)"):
        check_shardable(cfg, 4, 1)
    with pytest.raises(ValueError, match=r"n_routed_experts = 8 does not split over expert parallel size 3"):
        check_shardable(cfg, 1, 3)
    fp4 = cfg.replace(moe_intermediate_size=96, quantization_config=QuantizationConfig(quant_method="fp8",
                                                                                        expert_dtype="fp4"))
    with pytest.raises(ValueError, match=r"FP4 experts: in 32-column blocks\) = 96 .* values for it: 1, 3"):
        check_shardable(fp4, 2, 1)
    check_shardable(fp4, 2, 2)  # with expert parallelism the experts stay whole
    state = ParallelState.of(ParallelConfig(tensor_parallel_size=2), 0)
    model = shard_model(tiny_model(torch.float64, device="meta"), state)
    with pytest.raises(ValueError, match="sharded already"):
        shard_model(model, state)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_expert_parallel_ranks(oracle, tmp_path):
    """EP=4 (2 experts a rank, 1 of the draft's 4): dispatch and combine over more than a pair of ranks, chunks of
    uneven length (37 rows over 4 ranks), a few-token fp32 forward that leaves a rank without rows."""
    ranks = spawn("ep4", ["forward", "fast"], tmp_path, timeout=240)
    ref_logits = oracle["forward"][1].double().numpy().ravel()
    for r, got in enumerate(ranks):
        assert np.abs(got["forward"][1] - ref_logits).max() < 1e-10, r
        assert got["forward"][0]["argmax"] == oracle["forward"][0]["argmax"], r
        assert np.abs(got["fast"][1] - oracle["fast"][1].numpy().ravel()).max() < 1e-4, r
        for case in ("forward", "fast"):
            assert np.array_equal(got[case][1], ranks[0][case][1]), (case, r)
