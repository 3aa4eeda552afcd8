"""The mHC mixing, collapse and expand (csrc/hyper.c) against the torch code: another order of
additions, so they agree to fp32 rounding and only run under ``torch.inference_mode``; bf16 streams are read and
written as upcast then cast would.
"""


import pytest
import torch
from kernel_cases import ATOL, RTOL, assert_same_bits, close_in_inference_mode_and_exact_outside, mhc_inputs

from deepseek_v41 import kernels
from deepseek_v41.kernels.fast import install
from deepseek_v41.kernels.fast.block import collapse, expand, hc_mix
from deepseek_v41.model.norm import RMSNorm


@pytest.mark.parametrize("iters,D", [(3, 64), (20, 64), (20, 13)])  # 3: far from converged, every Sinkhorn
def test_hc_mix_is_close_in_inference_mode_only(calls, iters, D):  # step shows; 13: hc * D not a multiple of 8
    streams, fn, base, scale = mhc_inputs(2, 3, D=D)
    close_in_inference_mode_and_exact_outside(calls, "hc_mix", hc_mix, streams, fn, base, scale, 4, 1e-6, 1e-6,
                                              iters)
    # Sinkhorn really ran: the kernel's comb is doubly stochastic (columns normalised last).
    with torch.inference_mode():
        comb = hc_mix(streams, fn, base, scale, 4, 1e-6, 1e-6, iters)[2]
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 3, 4), rtol=0, atol=1e-5)
    # Prefill-sized inputs take the kernel too (tokens over the pool, Sinkhorn 16 tokens at a time).
    calls.clear()
    many = mhc_inputs(1, 257)
    with torch.inference_mode():
        got = hc_mix(*many, 4, 1e-6, 1e-6, 20)
    with torch.no_grad(), kernels.disabled():
        want = hc_mix(*many, 4, 1e-6, 1e-6, 20)
    assert calls["hc_mix"] == 1
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_hc_mix_of_rows_wider_than_its_stack_uses_the_callers_scratch(calls):
    """hc * D > ROW_ON_STACK: each token's normalized row goes through the scratch the wrapper allocates; fp32 and
    bf16 streams both close to the torch code."""
    D = kernels.ROW_ON_STACK // 4 + 3
    streams, fn, base, scale = mhc_inputs(2, 2, D=D, seed=15)
    for s in (streams, streams.bfloat16()):
        calls.clear()
        with torch.inference_mode():
            got = hc_mix(s, fn, base, scale, 4, 1e-6, 1e-6, 20)
        with torch.no_grad(), kernels.disabled():
            want = hc_mix(s.float(), fn, base, scale, 4, 1e-6, 1e-6, 20)
        assert calls["hc_mix"] == 1
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_hc_mix_of_a_token_does_not_depend_on_the_others():
    """Sinkhorn runs on 16 tokens at once, one per vector lane: each token's coefficients are still its own,
    bit for bit, whatever its lane and whichever tokens share its group (here a token alone, and tokens 0, 15,
    16 and 256 of 257: first and last lanes of full groups, and a lone token in the last group)."""
    streams, fn, base, scale = mhc_inputs(1, 257, seed=12)
    with torch.inference_mode():
        together = hc_mix(streams, fn, base, scale, 4, 1e-6, 1e-6, 20)
        for t in (0, 15, 16, 100, 256):
            alone = hc_mix(streams[:, t:t + 1].contiguous(), fn, base, scale, 4, 1e-6, 1e-6, 20)
            for a, b in zip(alone, together, strict=True):
                assert_same_bits(a[:, 0], b[:, t])


@pytest.mark.parametrize("D", [64, 13])
def test_collapse_with_norm_and_expand_are_close_in_inference_mode_only(calls, D):
    streams, _, _, _ = mhc_inputs(2, 3, D=D, seed=8)
    g = torch.Generator().manual_seed(9)
    weights = torch.rand(2, 3, 4, generator=g)
    norm = RMSNorm(D, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    close_in_inference_mode_and_exact_outside(calls, "hc_collapse",
                                              lambda s, w: collapse(s, w, norm=norm), streams, weights)
    y = torch.randn(2, 3, D, generator=g)
    post = torch.rand(2, 3, 4, generator=g) * 2
    comb = torch.rand(2, 3, 4, 4, generator=g)
    close_in_inference_mode_and_exact_outside(calls, "hc_expand", expand, streams, y, post, comb)


@pytest.mark.parametrize("D", [64, 13])
def test_mhc_kernels_read_and_write_bf16_as_upcast_then_cast_would(calls, D):
    """bf16 streams (and a bf16 norm weight / sub-layer output) go into the mHC kernels as they are: the same
    bits as widening them first, running the kernels in fp32 and rounding the result to bf16 (what the callers
    did before); no conversion op runs outside the kernels."""
    streams, fn, base, scale = mhc_inputs(2, 3, D=D, seed=13)
    g = torch.Generator().manual_seed(14)
    sb = streams.bfloat16()
    weights, post = torch.rand(2, 3, 4, generator=g), torch.rand(2, 3, 4, generator=g) * 2
    comb = torch.rand(2, 3, 4, 4, generator=g)
    y = torch.randn(2, 3, D, generator=g).bfloat16()
    norm = RMSNorm(D, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    norm = norm.bfloat16()
    wide = sb.float()
    with torch.inference_mode():
        for got, want in zip(kernels.hc_mix(sb, fn, base, scale, 4, 1e-6, 1e-6, 20),
                             kernels.hc_mix(wide, fn, base, scale, 4, 1e-6, 1e-6, 20), strict=True):
            assert_same_bits(got, want)
        want = kernels.hc_collapse(wide, weights, norm.weight.float(), norm.eps).bfloat16()
        assert_same_bits(kernels.hc_collapse(sb, weights, norm.weight, norm.eps), want)
        calls.clear()
        assert_same_bits(collapse(sb, weights, norm=norm), want)
        assert calls["hc_collapse"] == 1
        want = kernels.hc_expand(wide, y.float(), post, comb).bfloat16()
        assert_same_bits(kernels.hc_expand(sb, y, post, comb), want)
        assert_same_bits(expand(sb, y, post, comb), want)
        with pytest.raises(ValueError, match="both fp32 or both bf16"):
            kernels.hc_expand(sb, y.float(), post, comb)
        with pytest.raises(ValueError, match="both fp32 or both bf16"):
            kernels.hc_collapse(sb, weights, norm.weight.float(), norm.eps)
        with pytest.raises(ValueError, match="bf16 rows of up to"):
            kernels.hc_expand(torch.zeros(1, 1, 4, kernels.ROW_ON_STACK + 1, dtype=torch.bfloat16),
                              torch.zeros(1, 1, kernels.ROW_ON_STACK + 1, dtype=torch.bfloat16), post[:1, :1],
                              comb[:1, :1])


def test_kernels_refuse_dtypes_they_would_misread():
    """fp16 / float64 where a kernel reads fp32 or bf16 (an fp16 hc_collapse wrote 4-byte floats into a 2-byte
    output before the check), and a non-fp32 tensor where it reads fp32: ValueError, nothing written."""
    streams, fn, base, scale = mhc_inputs(1, 2, D=64, seed=16)
    w, post, comb = torch.rand(1, 2, 4), torch.rand(1, 2, 4), torch.rand(1, 2, 4, 4)
    y, norm = torch.randn(1, 2, 64), torch.ones(64)
    for dtype in (torch.float16, torch.float64):
        with pytest.raises(ValueError, match="fp32 or bf16"):
            kernels.hc_collapse(streams.to(dtype), w, norm.to(dtype), 1e-6)
        with pytest.raises(ValueError, match="fp32 or bf16"):
            kernels.hc_expand(streams.to(dtype), y.to(dtype), post, comb)
        with pytest.raises(ValueError, match="fp32 or bf16"):
            kernels.hc_mix(streams.to(dtype), fn, base, scale, 4, 1e-6, 1e-6, 20)
        with pytest.raises(ValueError, match="fp32 or bf16"):
            kernels.gate(torch.randn(2, 64, dtype=dtype), torch.randn(8, 64), torch.zeros(8), 2, True, 1.0)
    with pytest.raises(ValueError, match="fp32 tensors"):
        kernels.hc_mix(streams, fn.bfloat16(), base, scale, 4, 1e-6, 1e-6, 20)
    with pytest.raises(ValueError, match="fp32 tensors"):
        kernels.hc_expand(streams, y, post.double(), comb)
    with pytest.raises(ValueError, match="fp32 tensors"):
        kernels.gate(torch.randn(2, 64), torch.randn(8, 64), torch.zeros(8).bfloat16(), 2, True, 1.0)


def test_a_hooked_norm_passed_to_collapse_is_still_called(calls):
    streams, _, _, _ = mhc_inputs(2, 3, seed=10)
    weights = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(11))
    norm = RMSNorm(64, 1e-6)
    install(norm)  # (before the hook: a hooked module gets no fast version)
    seen = []
    handle = norm.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with torch.inference_mode():
            got = collapse(streams, weights, norm=norm)
        assert len(seen) == 1 and seen[0] is got
        assert calls["hc_collapse"] == 0 and calls["rms_norm"] == 1  # the module ran (its own kernel inside)
        with torch.no_grad(), kernels.disabled():
            want = collapse(streams, weights, norm=norm)
        assert len(seen) == 2
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    finally:
        handle.remove()
