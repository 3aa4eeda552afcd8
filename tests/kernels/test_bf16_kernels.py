"""bf16 takes the same kernels through ``upcast`` / ``cast`` at the boundary: where the torch
code computes in fp32 from the same upcast values and rounds once, the two are at most one bf16 ulp apart (most
elements identical); where the torch code rounds to bf16 between steps the kernel skips, a few ulps of the
output's scale.
"""


import pytest
import torch
from kernel_cases import (
    ATOL,
    ATTEND_TOL,
    EXPERT_BF16_TOL,
    RTOL,
    _attend_few,
    assert_bf16_close,
    assert_close_to_scale,
    assert_same_bits,
    attention_inputs,
    entries_context,
    kernel_and_torch,
    mhc_inputs,
    packed,
    router,
    small_moe,
    sparse_attention,
)

from deepseek_v41 import kernels
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast import install
from deepseek_v41.kernels.fast.block import collapse, expand, hc_mix
from deepseek_v41.kernels.fast.moe import swiglu
from deepseek_v41.model.indexer import IndexScorer
from deepseek_v41.model.moe import Expert
from deepseek_v41.model.norm import RMSNorm, rms_normalize, upcast


def peak(t: torch.Tensor) -> float:
    return t.float().abs().max().item()


@pytest.mark.parametrize("D", [64, 13])
def test_bf16_norms_and_mhc_take_the_kernels(calls, D):
    streams, fn, base, scale = mhc_inputs(2, 3, D=D, seed=90)
    sb = streams.bfloat16()
    g = torch.Generator().manual_seed(91)
    # rms_normalize: fp32 out (the torch code upcasts first); the weightless kernel from the same fp32 values.
    want = rms_normalize(sb.flatten(-2), 1e-6)
    with torch.inference_mode():
        got = kernels.rms_norm(upcast(sb.flatten(-2)), None, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # RMSNorm: a bf16 model's (bf16 x and weight) is bf16, one rounding of the same fp32 result apart; fp32 x
    # with a bf16 weight stays fp32.
    norm = RMSNorm(D, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    norm.bfloat16()
    assert install(norm).modules == {"RMSNorm": 1}
    got, want = kernel_and_torch(calls, "rms_norm", norm, sb[:, :, 0].contiguous())
    assert_bf16_close(got, want, peak(want), tol=ATOL)
    got, want = kernel_and_torch(calls, "rms_norm", norm, streams[:, :, 0].contiguous())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # hc_mix of bf16 streams and parameters: fp32 coefficients.
    args = (sb, fn.bfloat16(), base.bfloat16(), scale.bfloat16(), 4, 1e-6, 1e-6, 20)
    got, want = kernel_and_torch(calls, "hc_mix", hc_mix, *args)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    # collapse with its norm: bf16 out. The torch code rounds the collapse to bf16 before the norm (measured over
    # 100 inputs: at most 2 ulps apart, at least 64% identical).
    weights = torch.rand(2, 3, 4, generator=g)
    got, want = kernel_and_torch(calls, "hc_collapse", lambda s, w: collapse(s, w, norm=norm), sb, weights)
    assert_bf16_close(got, want, peak(want), ulps=2, tol=ATOL, share=0.5)
    # expand: bf16 out, with and without the upcast streams passed in.
    y = torch.randn(2, 3, D, generator=g).bfloat16()
    post, comb = torch.rand(2, 3, 4, generator=g) * 2, torch.rand(2, 3, 4, 4, generator=g)
    got, want = kernel_and_torch(calls, "hc_expand", expand, sb, y, post, comb)
    assert_bf16_close(got, want, peak(want), tol=ATOL)
    got, want = kernel_and_torch(calls, "hc_expand", lambda *a: expand(*a, wide=sb.float()), sb, y, post, comb)
    assert_bf16_close(got, want, peak(want), tol=ATOL)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("k", [None, 5])
@pytest.mark.parametrize("keys_dtype", [torch.bfloat16, torch.float32])
def test_bf16_attend_few_takes_the_kernel(calls, T, k, keys_dtype):
    """bf16 queries (and keys, sink and entries in bf16, or in fp32 as a bf16 model's cache reads give them):
    bf16 out, the same fp32 softmax from the same upcast values, rounded once."""
    q, q_pos, keys, key_pos, window, topk, gather, sink, scale = attention_inputs(T, k, seed=92 + T + (k or 0))

    def entries(idx):
        return gather(idx).to(keys_dtype)

    args = (q.bfloat16(), q_pos, keys.to(keys_dtype), key_pos, window, topk, None if k is None else entries,
            sink.to(keys_dtype), scale)
    got, want = kernel_and_torch(calls, "attend_few", sparse_attention, *args)
    assert_bf16_close(got, want, peak(want), tol=ATTEND_TOL, share=0.9)
    if k is None:  # row 1's queries see no key
        assert (got[1] == 0).all() and (want[1] == 0).all()


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attend_few_reads_bf16_queries_as_upcast_then_cast_would(calls, sink_dtype):
    """bf16 queries go into the kernel as they are and the output comes out in bf16: the same bits as widening
    them, attending in fp32 and rounding the result (what the caller did before); the sink (fp32 in a bf16 model's
    checkpoint, or bf16) reaches the kernel in fp32."""
    q, q_pos, keys, key_pos, window, topk, gather, sink, scale = attention_inputs(3, 5, seed=96)
    qb, sink = q.bfloat16(), sink.to(sink_dtype)
    with torch.inference_mode():
        selected = gather(topk).float().contiguous()
        want = kernels.attend_few(qb.float(), q_pos, keys, key_pos, window, selected, topk, sink.float(), scale)
        got = kernels.attend_few(qb, q_pos, keys, key_pos, window, selected, topk, sink.float(), scale)
        assert got.dtype == torch.bfloat16
        assert_same_bits(got, want.bfloat16())
        calls.clear()
        assert_same_bits(_attend_few(qb, q_pos, keys, key_pos, window, topk, gather, sink, scale), want.bfloat16())
        assert calls["attend_few"] == 1
        with pytest.raises(ValueError, match="sink beside"):
            kernels.attend_few(qb, q_pos, keys, key_pos, window, selected, topk, sink.double(), scale)


def test_bf16_router_and_swiglu_take_the_kernels(calls):
    gate = router(16, 4, True, seed=93).bfloat16()
    fast.install(gate)
    x = (torch.randn(5, 64, generator=torch.Generator().manual_seed(94)) * 3).bfloat16()
    (idx, w), (want_idx, want_w) = kernel_and_torch(calls, "gate", gate, x)
    assert torch.equal(idx, want_idx) and w.dtype == torch.float32
    torch.testing.assert_close(w, want_w, rtol=2e-6, atol=1e-7)
    g = torch.Generator().manual_seed(95)
    a, b = (torch.randn(6, 40, generator=g) * 8).bfloat16(), (torch.randn(6, 40, generator=g) * 8).bfloat16()
    for limit in (7.0, 0.0):
        got, want = kernel_and_torch(calls, "swiglu", swiglu, a, b, limit)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


def test_bf16_expert_takes_the_linear_and_swiglu_kernels(calls):
    g = torch.Generator().manual_seed(96)
    expert = Expert(64, 32, 7.0)
    with torch.no_grad():
        for p in expert.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    expert.bfloat16()
    fast.install(expert)
    x = (torch.randn(3, 64, generator=g) * 2).bfloat16()
    got, want = kernel_and_torch(calls, "linear", expert, x, times=3)
    assert calls["swiglu"] == 1 and got.dtype == torch.bfloat16
    assert_close_to_scale(got.float(), want.float(), EXPERT_BF16_TOL)


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 2, 64), (1, kernels.FEW_ROWS, 64), (1, kernels.FEW_ROWS + 1, 64)],
                         ids=str)
def test_bf16_moe_takes_moe_bf16_on_its_own_weights(calls, shape):
    moe = small_moe(97, exact=False).bfloat16()
    copies = packed(moe)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(98)) * 3).bfloat16()
    N = shape[0] * shape[1]
    few = N <= kernels.FEW_ROWS
    got, want = kernel_and_torch(calls, "moe_bf16", moe, x, times=int(few))
    assert calls["gate"] == 1
    # A few tokens: the shared expert runs inside moe_bf16; more: its three projections (and the routed experts',
    # where torch._grouped_mm does not take them).
    assert calls["linear"] == 0 if few else calls["linear"] >= 3
    assert got.dtype == torch.bfloat16 and got.shape == shape
    assert_close_to_scale(got.float(), want.float(), EXPERT_BF16_TOL)
    w13, w2 = copies.bf16  # no copies: the stacked parameters themselves
    assert w13.dtype == w2.dtype == torch.bfloat16
    first = moe.experts[0]
    assert w13.data_ptr() == first.w1.weight.data_ptr() and w2.data_ptr() == first.w2.weight.data_ptr()


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_index_scores_of_a_bf16_model_take_the_kernel(calls, q_dtype):
    """A bf16 model's context scores a few queries straight from the packed FP4 index keys; the result is in the
    queries' dtype and close to the torch code's scores of :meth:`index_keys` (an fp32 query: fp32 rounding
    apart; bf16: the torch code's bf16 matmuls round the dot products)."""
    cfg = tiny_config()
    cache = PagedKVCache(cfg, num_pages=8, block_size=8, num_slots=2)
    g = torch.Generator().manual_seed(99)
    T, Hi, di = 20, cfg.index_n_heads, cfg.index_head_dim
    for layer, m in ((2, 2), (4, 1)):
        G = T // m
        writer = entries_context(cache, T, [0, 0], torch.bfloat16)
        entries = torch.randn(2, G, cfg.head_dim, generator=g).bfloat16()
        writer.add_entries(layer, entries, torch.randn(2, G, di, generator=g).bfloat16(), torch.arange(G).expand(2, G))
        q = torch.randn(2, 3, Hi, di, generator=g).to(q_dtype)
        w = torch.rand(2, 3, Hi, generator=g).to(q_dtype)
        ctx = entries_context(cache, T, [0, 0], torch.bfloat16)
        calls.clear()
        with torch.inference_mode():
            got = ctx.index_scores(layer, q, w)
            with kernels.disabled():
                assert ctx.index_scores(layer, q, w) is None
        assert calls["index_scores"] == 1
        with torch.no_grad():
            assert ctx.index_scores(layer, q, w) is None
            with kernels.disabled():
                want = IndexScorer()(q, w, ctx.index_keys(layer))
        assert got.dtype == want.dtype == q_dtype and got.shape == (2, 3, G)
        assert (want > 0).float().mean() > 0.5  # ReLU leaves most heads' dots
        # Measured over 40 caches: at most 4.0e-7 (fp32) and 7.6e-3 (bf16) of the largest score.
        assert_close_to_scale(got.float(), want.float(), 2e-6 if q_dtype == torch.float32 else 2e-2)
