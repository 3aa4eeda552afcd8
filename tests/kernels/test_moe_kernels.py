"""The MoE router, the clamped SwiGLU and the experts' kernel (csrc/moe.c, ``kernels.moe_bf16``)
against the torch code, and when the MoE takes them (hooks, wrapped experts, weight changes).
"""


import ctypes
import ctypes.util
import platform

import numpy as np
import pytest
import torch
from kernel_cases import (
    EXPERT_BF16_TOL,
    MOE_TOL,
    LoRA,
    assert_close_to_scale,
    assert_same_bits,
    assert_same_results,
    fp4_exact,
    moe_both_ways,
    moe_calls,
    packed,
    router,
    small_moe,
)
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast.moe import swiglu
from deepseek_v41.model.moe import MoE


@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("N", [1, 5])
def test_gate_picks_the_same_experts_in_order_with_close_weights(calls, norm_topk, N):
    gate = router(16, 4, norm_topk, seed=40 + N)
    x = torch.randn(N, 64, generator=torch.Generator().manual_seed(41)) * 3
    with kernels.disabled(), torch.no_grad():
        want_idx, want_w = gate(x)
    with torch.inference_mode():
        idx, w = gate(x)
    assert calls["gate"] == 1
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == w.shape == (N, 4)
    assert torch.equal(idx, want_idx)  # the same experts, in the same (descending) order
    torch.testing.assert_close(w, want_w, rtol=2e-6, atol=1e-7)
    if norm_topk:
        torch.testing.assert_close(w.sum(-1), torch.full((N,), 2.5), rtol=2e-6, atol=0)
    # The torch code runs (bit for bit) with an image mask, in training mode and outside inference mode.
    mask = torch.zeros(N, dtype=torch.bool)
    mask[0] = True
    with kernels.disabled(), torch.no_grad():
        masked = gate(x, mask)
    with torch.inference_mode():
        assert_same_results(gate(x, mask), masked)
    with torch.no_grad():
        assert_same_results(gate(x), (want_idx, want_w))
    gate.train()
    with torch.inference_mode():
        assert_same_results(gate(x), (want_idx, want_w))
    assert gate.expert_load.sum() == N * 4
    assert calls["gate"] == 1


def test_gate_reads_bf16_tokens_and_weight_as_upcast_would(calls):
    """A bf16 model's router: bf16 tokens and weight go into the kernel as they are, with the same result, bit for
    bit, as widening both first (what the caller did before)."""
    gate = router(16, 4, True, seed=44)
    gate.weight.data = gate.weight.data.bfloat16()
    fast.install(gate)  # new weights: install again
    x = (torch.randn(5, 64, generator=torch.Generator().manual_seed(45)) * 3).bfloat16()
    with torch.inference_mode():
        got = gate(x)
        assert calls["gate"] == 1
        want = kernels.gate(x.float(), gate.weight.float(), gate.bias, 4, True, gate.route_scale)
        for mixed in ((x, gate.weight.float()), (x.float(), gate.weight)):
            assert_same_results(kernels.gate(*mixed, gate.bias, 4, True, gate.route_scale), want)
    assert_same_results(got, want)
    with pytest.raises(ValueError, match="bf16 rows of up to"):
        kernels.gate(torch.zeros(1, kernels.ROW_ON_STACK + 1, dtype=torch.bfloat16),
                     torch.zeros(4, kernels.ROW_ON_STACK + 1), torch.zeros(4), 2, True, 1.0)


def test_gate_of_more_than_small_rows_takes_the_torch_code(calls):
    gate = router(8, 2, True, seed=42)
    x = torch.randn(kernels.SMALL_ROWS + 1, 64, generator=torch.Generator().manual_seed(43))
    with torch.inference_mode():
        got = gate(x)
    with kernels.disabled(), torch.no_grad():
        want = gate(x)
    assert calls["gate"] == 0
    assert_same_results(got, want)


SWIGLU_SPECIALS = [0.0, -0.0, 6.99, 7.0, 7.01, 30.0, -30.0, 100.0, -100.0, 1e30, -1e30, float("inf"), -float("inf")]


@pytest.mark.parametrize("limit", [7.0, 0.0, -1.0])
def test_clamped_swiglu_is_close_with_and_without_a_limit(calls, limit):
    g = torch.Generator().manual_seed(50)
    gate, up = torch.randn(6, 40, generator=g) * 8, torch.randn(6, 40, generator=g) * 8  # many beyond the limit
    specials = torch.tensor(SWIGLU_SPECIALS)
    n = len(specials)
    gate[0, :n], up[1, :n] = specials, specials  # one special at a time, with a random partner
    gate[2, :n], up[2, :n] = specials, specials.roll(3)
    assert (gate.abs() > 7).float().mean() > 0.2 and (up.abs() > 7).float().mean() > 0.2
    with kernels.disabled(), torch.no_grad():
        want = swiglu(gate, up, limit)
    with torch.inference_mode():
        got = swiglu(gate, up, limit)
    assert calls["swiglu"] == 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30, equal_nan=True)
    if limit > 0:  # only silu(-inf) = -inf * 0 is not finite (the gate is clamped from above only)
        assert torch.equal(~got.isfinite(), (gate == -float("inf")) | gate.isnan() | up.isnan())
        assert got.nan_to_num().abs().max() <= limit * limit
    else:  # no clamping: infinities pass through, inf * 0 is NaN
        assert got.isinf().any() and got.isnan().any()
    with torch.no_grad():
        assert_same_bits(swiglu(gate, up, limit), want)
    assert calls["swiglu"] == 1


@pytest.mark.parametrize("limit", [7.0, 0.0])
def test_clamped_swiglu_propagates_nan_like_the_torch_code(calls, limit):
    g = torch.Generator().manual_seed(51)
    gate, up = torch.randn(3, 16, generator=g) * 10, torch.randn(3, 16, generator=g) * 10
    nan = float("nan")
    gate[0, :4] = nan  # NaN gate (clamped from above only: NaN survives min())
    up[1, 2:6] = nan  # NaN up (clamp on both sides)
    gate[2, 0], up[2, 0] = nan, 100.0
    gate[2, 1], up[2, 1] = 100.0, nan
    gate[2, 2], up[2, 2] = -float("inf"), 1.0  # silu(-inf) = -inf * 0: NaN
    with kernels.disabled(), torch.no_grad():
        want = swiglu(gate, up, limit)
    with torch.inference_mode():
        got = swiglu(gate, up, limit)
    assert calls["swiglu"] == 1
    assert want.isnan().sum() >= 10
    assert torch.equal(got.isnan(), want.isnan()), (got.isnan() != want.isnan()).nonzero().tolist()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30, equal_nan=True)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or platform.machine() != "x86_64",
                    reason="the kernels' vector expf reproduces glibc's x86-64 expf")
@pytest.mark.parametrize("limit", [0.0, 7.0])
def test_clamped_swiglu_is_libm_expf_step_by_step(limit):
    """gate / (1 + expf(-gate)) * up in fp32 steps with the C library's own expf, bit for bit: the kernel's 16-wide
    exponential (expf16, issue 25) is glibc's expf (checked over all 2^32 floats when written). Gates from random
    bit patterns (every exponent: subnormals, |x| >= 88 where it hands over to expf, inf, NaN) and N(0, 3);
    odd widths leave a tail of single values."""
    expf = ctypes.CDLL(ctypes.util.find_library("m")).expf
    expf.argtypes, expf.restype = [ctypes.c_float], ctypes.c_float
    g = torch.Generator().manual_seed(52)
    bits = torch.randint(-(1 << 31), 1 << 31, (40, 101), generator=g, dtype=torch.int64).to(torch.int32)
    gate = torch.cat((bits.view(torch.float32), torch.randn(40, 101, generator=g) * 3), 1).contiguous()
    up = (torch.randn(40, 202, generator=g) * 3).contiguous()
    got = kernels.swiglu(gate, up, limit)
    gc, uc = gate.numpy().copy(), up.numpy().copy()
    if limit > 0:  # min(gate, limit), clamp(up, -limit, limit); NaN stays
        lim = np.float32(limit)
        gc = np.where(gc > lim, lim, gc).astype(np.float32)
        uc = np.where(uc < -lim, -lim, np.where(uc > lim, lim, uc)).astype(np.float32)
    e = np.array([expf(float(-v)) for v in gc.ravel()], dtype=np.float32).reshape(gc.shape)
    with np.errstate(all="ignore"):
        want = torch.from_numpy((gc / (np.float32(1) + e) * uc).astype(np.float32))
    assert_same_bits(got, want)
    assert want.isnan().any() and (want == 0).any() and (gate.abs() >= 88).any()


@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 2, 64), (1, kernels.FEW_ROWS, 64), (1, kernels.FEW_ROWS + 1, 64)],
                         ids=str)
def test_moe_of_fp4_exact_experts_takes_moe_bf16_for_few_tokens(calls, shape):
    moe = small_moe(60)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(61)) * 3  # some w1 / w3 outputs beyond 7
    got, want = moe_both_ways(moe, x)
    N = shape[0] * shape[1]
    assert moe_calls(calls) == (1 if N <= kernels.FEW_ROWS else 0) and calls["gate"] == 1
    assert packed(moe).fp4_all
    assert_close_to_scale(got, want, MOE_TOL)
    if N >= kernels.FEW_ROWS:
        with kernels.disabled(), torch.no_grad():
            routed = moe.gate(x.reshape(N, 64))[0]
        assert routed.unique().numel() >= 6  # many experts, several tokens each
    with torch.no_grad():  # outside inference mode: no kernel, the torch code's bits
        assert_same_bits(moe(x), want)
    assert moe_calls(calls) == (1 if N <= kernels.FEW_ROWS else 0) and calls["gate"] == 1


def test_moe_of_plain_fp32_experts_does_not_take_moe_bf16(calls):
    moe = small_moe(62, exact=False)
    assert packed(moe).fp4 is None and packed(moe).bf16 is None
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(63))
    got, want = moe_both_ways(moe, x)
    assert moe_calls(calls) == 0 and calls["gate"] == 1
    assert_close_to_scale(got, want, MOE_TOL)


def test_moe_bf16_copies_follow_an_in_place_weight_change(calls):
    moe = small_moe(64)
    with torch.no_grad():
        moe.gate.bias[3] = 100.0  # every token routes to expert 3
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(65))
    before, _ = moe_both_ways(moe, x)
    with torch.no_grad():
        assert (moe.gate(x.reshape(4, 64))[0] == 3).any(-1).all()
        moe.experts[3].w2.weight.mul_(2)  # still FP4-exact
    assert packed(moe).fp4_all
    got, want = moe_both_ways(moe, x)
    assert moe_calls(calls) == 2
    assert_close_to_scale(got, want, MOE_TOL)
    assert (got - before).abs().max() > 0.1  # a stale copy would have given the old result
    # The same for a change made inside inference mode (the engine's forwards).
    with torch.inference_mode():
        moe.experts[3].w1.weight.mul_(-0.5)
    again, want = moe_both_ways(moe, x)
    assert moe_calls(calls) == 3
    assert_close_to_scale(again, want, MOE_TOL)
    assert (again - got).abs().max() > 0.1


def test_moe_kernel_takes_the_shared_expert_unless_it_is_hooked(calls):
    g = torch.Generator().manual_seed(70)
    moe = MoE(dim=64, inter_dim=32, n_experts=8, topk=2, n_shared=2, swiglu_limit=7.0, route_scale=1.5,
              norm_topk=True, with_bias_vl=False).eval()  # a shared expert twice as wide as the routed ones
    with torch.no_grad():
        for name, p in moe.named_parameters():
            w = torch.randn(p.shape, generator=g) * 0.25
            p.copy_(fp4_exact(w) if name.startswith("experts.") else w)
    x = torch.randn(1, 3, 64, generator=g) * 3
    got, want = moe_both_ways(moe, x)
    assert moe_calls(calls) == 1 and calls["swiglu"] == 0  # the shared expert ran inside the kernel
    assert_close_to_scale(got, want, MOE_TOL)
    with torch.no_grad():
        without_shared = moe.dispatch(x.reshape(3, 64), *moe.gate(x.reshape(3, 64)))
    assert (want.reshape(3, 64) - without_shared).abs().max() > 0.1  # the shared expert matters here
    seen = []
    handle = moe.shared_experts.w2.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    fast.install(moe)  # a hook registered after install: install again
    try:
        with torch.inference_mode():
            hooked = moe(x)
        assert seen == [(3, 64)] and moe_calls(calls) == 2  # routed experts fused, the shared one called
        assert_close_to_scale(hooked, want, MOE_TOL)
    finally:
        handle.remove()


def test_moe_calls_a_hooked_expert(calls):
    moe = small_moe(66)
    with torch.no_grad():
        moe.gate.bias[3] = 100.0
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(67))
    seen = []
    handle = moe.experts[3].w1.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    try:
        got, want = moe_both_ways(moe, x)
        assert seen == [(4, 32), (4, 32)]  # under inference mode and with the kernels off
        assert moe_calls(calls) == 0
        assert_close_to_scale(got, want, MOE_TOL)
    finally:
        handle.remove()
    fast.install(moe)
    with torch.inference_mode():
        assert_close_to_scale(moe(x), want, MOE_TOL)
    assert moe_calls(calls) == 1 and len(seen) == 2  # the hook is gone: the kernel is back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_kernel_runs_beside_a_wrapped_expert_it_does_not_pick(calls, dtype):
    """A wrapper on an expert the step does not pick (here expert 0, whose weights once gave the dtype and shapes:
    a KeyError) does not break the MoE: fp32 experts still take the kernel (only the picked ones need be plain);
    bf16 ones, read from the stack of every expert's weights, take the torch code."""
    moe = small_moe(68, exact=dtype == torch.float32).to(dtype)
    with torch.no_grad():
        moe.gate.bias[3] = moe.gate.bias[5] = 100.0  # every token routes to experts 3 and 5
    moe.experts[0].w1 = LoRA(moe.experts[0].w1).to(dtype)
    x = (torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(69)) * 3).to(dtype)
    fused = int(dtype == torch.float32)
    got, want = moe_both_ways(moe, x)
    assert moe_calls(calls) == fused
    assert_close_to_scale(got.float(), want.float(), MOE_TOL if dtype == torch.float32 else EXPERT_BF16_TOL)
    with torch.no_grad():
        moe.gate.bias[0] = 200.0  # now expert 0 is picked: the torch code calls its wrapper
    got, want = moe_both_ways(moe, x)
    assert moe_calls(calls) == fused
    assert_close_to_scale(got.float(), want.float(), MOE_TOL if dtype == torch.float32 else EXPERT_BF16_TOL)


class WholeExpertWrapper(nn.Module):
    """A module standing for a whole expert that is no Expert (no ``plain``, no ``w1``)."""

    def __init__(self, expert: nn.Module):
        super().__init__()
        self.inner = expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 0.5


def test_moe_kernel_beside_an_expert_replaced_by_another_module(calls):
    """An expert replaced by a module of another class: unpicked, the kernel runs; picked, the torch code calls
    it (before, the kernel's checks raised AttributeError on it)."""
    moe = small_moe(74)
    with torch.no_grad():
        moe.gate.bias[3] = moe.gate.bias[5] = 100.0
    moe.experts[0] = WholeExpertWrapper(moe.experts[0])
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(75)) * 3
    got, want = moe_both_ways(moe, x)
    assert moe_calls(calls) == 1
    assert_close_to_scale(got, want, MOE_TOL)
    with torch.no_grad():
        moe.gate.bias[0] = 200.0
    got, want = moe_both_ways(moe, x)
    assert moe_calls(calls) == 1
    assert_close_to_scale(got, want, MOE_TOL)


def test_bf16_moe_kernel_runs_beside_a_hooked_expert_it_does_not_pick(calls):
    """A hook on an unpicked expert's projection does not stop bf16 experts from being stacked and fused."""
    moe = small_moe(72, exact=False).bfloat16()
    with torch.no_grad():
        moe.gate.bias[3] = moe.gate.bias[5] = 100.0
    seen = []
    moe.experts[0].w1.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    x = (torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(73)) * 3).bfloat16()
    got, want = moe_both_ways(moe, x)
    assert moe_calls(calls) == 1 and seen == []
    assert_close_to_scale(got.float(), want.float(), EXPERT_BF16_TOL)
