"""The MoE kernel reading the routed experts in FP4 (``kernels.moe_fp4``) must give its bf16
path's bits on the same weight values (also when built without AVX-512), and agree with float64 arithmetic on
weights decoded by ml_dtypes; the FP4 expert copies follow weight changes.
"""

import collections
import os
import platform
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_cases import (
    EXPERT_BF16_TOL,
    MOE_TOL,
    LoRA,
    assert_close_to_scale,
    assert_same_bits,
    fp4_exact,
    index_inputs,
    kernel_and_torch,
    moe_both_ways,
    moe_calls,
    packed,
    small_moe,
)
from optional_deps import require
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.kernels import loader
from deepseek_v41.model.moe import Expert, MoE


# ------------------------------------------------------------------------------------------ routed experts in FP4
@pytest.fixture
def pool_of_one_after():
    """The kernels' pool back at one thread after the test, whatever it set or raised."""
    yield
    assert kernels.set_threads(1) == 1


def fp4_oracle_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [..., n] of FP4 ``codes`` uint8 [..., n / 2] (element 2i in the low nibble) with UE8M0 ``scales``
    uint8 [..., n / 32], decoded by ml_dtypes (the oracle)."""
    ml = require("ml_dtypes")
    c = codes.numpy()
    nibbles = np.stack((c & 15, c >> 4), -1).reshape(*c.shape[:-1], -1)
    scale = np.repeat(scales.numpy().view(ml.float8_e8m0fnu).astype(np.float64), 32, -1)
    return torch.from_numpy(nibbles.view(ml.float4_e2m1fn).astype(np.float64) * scale)


def fp4_moe_inputs(N: int, D: int, inter: int, x_dtype: torch.dtype, shared_dtype: torch.dtype | None, seed: int):
    """``kernels.moe_fp4`` inputs for N tokens ``(x, indices, weights, (codes13, scales13, codes2, scales2), limit,
    shared)``, and ``(w13, w2)``: the same weights in bf16 (decoded by ``kernels.fp4_dequantize``, checked exact).
    6 routed experts, k = 3 (token 0 picks expert 4 twice); random codes (every nibble) with UE8M0 scales from
    2^-27 to 2^13 (bytes 100 .. 140) laid out so that every block counts: a w1 / w3 block's scale follows the block
    of x it meets (x's block is divided by about that scale) and a w2 block's its output row (as do the shared
    expert's, when ``shared_dtype``): the terms of each dot are of one size, whatever their scale."""
    g = torch.Generator().manual_seed(seed)
    E, k, s_inter, limit = 6, 3, 48, 7.0

    def byte(lo: int, hi: int, *shape: int) -> torch.Tensor:
        return torch.randint(lo, hi + 1, shape, generator=g).to(torch.uint8)

    col = torch.linspace(100, 137, D // 32).round().to(torch.uint8)  # per block of x's columns
    row = byte(100, 137, D)  # per output row
    fp4 = (byte(0, 255, E, 2 * inter, D // 2), col + byte(0, 3, E, 2 * inter, D // 32),
           byte(0, 255, E, D, inter // 2), row[:, None] + byte(0, 3, E, D, inter // 32))
    bf16 = []
    for codes, scales in (fp4[:2], fp4[2:]):
        values = kernels.fp4_dequantize(codes, scales, 32, "ue8m0")
        assert torch.equal(values.bfloat16().float(), values)  # E2M1 value x power of two: exact in bf16
        bf16.append(values.bfloat16())
    col_scale = torch.pow(2.0, col.double() - 127).repeat_interleave(32).float()
    row_scale = torch.pow(2.0, row.double() - 127).float()
    x = (torch.randn(N, D, generator=g) * 0.04 / col_scale).to(x_dtype)
    indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    indices[0] = torch.tensor([4, 1, 4])
    weights = torch.rand(N, k, generator=g)
    shared = None
    if shared_dtype is not None:
        shared = ((torch.randn(s_inter, D, generator=g) * 8 * col_scale).to(shared_dtype),
                  (torch.randn(s_inter, D, generator=g) * 8 * col_scale).to(shared_dtype),
                  (torch.randn(D, s_inter, generator=g) * 25 * row_scale[:, None]).to(shared_dtype))
    return (x, indices, weights, fp4, limit, shared), tuple(bf16)


def float64_moe(x, indices, weights, w13, w2, limit, shared) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle in float64: ``(out, size)`` [N, D], out = Σ_j weights[n, j] · expert_{indices[n, j]}(x_n) +
    shared(x_n), an expert being ``w2 (silu(min(w1 x, limit)) * clamp(w3 x, ±limit))`` (model/moe.py Expert) of
    float64 weights w13 [E, 2 * inter, D], w2 [E, D, inter]. ``size`` is what fp32 rounding errors are relative to:
    Σ over an output's terms of gain · |w2| (|hidden| + 1.1 limit (|w1| |x| + |w3| |x|)), a hidden value moving by
    at most the SwiGLU's slope (1.1 limit) times its gate and up dots' errors."""
    inter = w2.shape[2]
    out, size = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(x.shape, dtype=torch.float64)
    for n, xn in enumerate(x.double()):
        experts = [(gain, w13[e, :inter], w13[e, inter:], w2[e])
                   for e, gain in zip(indices[n].tolist(), weights[n].tolist(), strict=True)]
        if shared is not None:
            experts.append((1.0, *(w.double() for w in shared)))
        for gain, w1, w3, w2e in experts:
            hidden = F.silu((w1 @ xn).clamp(max=limit)) * (w3 @ xn).clamp(-limit, limit)
            out[n] += gain * (w2e @ hidden)
            size[n] += gain * (w2e.abs() @ (hidden.abs() + 1.1 * limit * (w1.abs() + w3.abs()) @ xn.abs()))
    return out, size


# moe_fp4 against float64, relative to float64_moe's size (a few hundred times the output): measured at most 3.6e-9
# (5 seeds of the 12 cases below, 16 tokens). A wrong code or scale in a row moves its outputs by ~1e-5 of the size.
FP4_MOE_TOL = 2e-8


@pytest.mark.parametrize("D, inter", [(64, 96), (96, 64)], ids=str)
@pytest.mark.parametrize("shared_dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_fp4_is_moe_bf16_bit_for_bit_on_the_same_weights(pool_of_one_after, x_dtype, shared_dtype, D, inter):
    """N = 1, 3, 8, 16 tokens at 1 and 2 threads, D and inter multiples of 32 but not of 64: moe_fp4 gives
    moe_bf16's bits on the bf16 weights holding the same values, the same bits on either pool, and agrees with
    float64 arithmetic on weights decoded by ml_dtypes to fp32 rounding."""
    (x, indices, weights, fp4, limit, shared), (w13, w2) = fp4_moe_inputs(kernels.FEW_ROWS, D, inter, x_dtype,
                                                                           shared_dtype, seed=D + inter)
    codes13, scales13, codes2, scales2 = fp4
    assert torch.cat((codes13.flatten() & 15, codes2.flatten() >> 4)).unique().numel() == 16
    scales = torch.cat((scales13.flatten(), scales2.flatten()))
    assert scales.min() == 100 and scales.max() == 140
    exact13, exact2 = fp4_oracle_values(codes13, scales13), fp4_oracle_values(codes2, scales2)
    assert torch.equal(w13.double(), exact13) and torch.equal(w2.double(), exact2)
    gate_up = torch.einsum("eod,nd->neo", exact13, x.double())
    assert 0.05 < (gate_up.abs() > limit).double().mean() < 0.5  # the clamps are exercised, not everywhere
    want, size = float64_moe(x, indices, weights, exact13, exact2, limit, shared)
    first = {}
    for threads in (1, 2):
        assert kernels.set_threads(threads) == threads
        for n in (1, 3, 8, kernels.FEW_ROWS):
            head = (x[:n], indices[:n], weights[:n])
            got = kernels.moe_fp4(*head, *fp4, limit, shared=shared)
            assert_same_bits(got, kernels.moe_bf16(*head, w13, w2, limit, shared=shared))
            assert_same_bits(got, first.setdefault(n, got))
            err = (got.double() - want[:n]).abs()
            assert (err <= FP4_MOE_TOL * size[:n]).all(), f"off by {(err / size[:n]).max().item():.3g} of the size"


def index_scores_of(case: tuple[int, ...], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """kernels.index_scores for case (di, H, c, n, ratio, block_size) on its index_inputs."""
    _, _, _, n, ratio, block_size = case
    codes, scales, tables, q, w = inputs
    return kernels.index_scores(codes, scales, 32, "ue8m0", tables, ratio, block_size, q, w, n)


# Index scores the generic build must give the default build's bits for: di, H, c, n, ratio, block_size. The even /
# odd path (c * H * di / 32 <= 64) scores 16 keys at a time in vector lanes with AVX-512, then the rest of each
# chunk of 256 one or two at a time; the generic build scores every key on its own. (32, 4, 1): the bench's decode
# shape, two chunks, 16 + 2 lane groups and 12 keys after them; c > 1; di 64 and 128 (two and four blocks of 32);
# H not a multiple of 4; n not a multiple of 16; 16 keys spanning two pages (8 per page: ratio 2 or 1), four (4 per
# page: ratio 2 or 1) or, not page-aligned, three or six (ratio 3: 5 or 2 per page). (64, 32, 2): the widening path.
GENERIC_INDEX_CASES = [(32, 4, 1, 300, 2, 16), (32, 4, 3, 100, 2, 16), (64, 4, 2, 100, 2, 8), (64, 5, 3, 77, 1, 4),
                       (128, 3, 2, 90, 1, 8), (32, 7, 2, 61, 3, 16), (32, 6, 1, 45, 3, 8), (64, 32, 2, 100, 2, 8)]


@pytest.mark.slow  # (two kernel-library builds, 13 s: with the slow tests, to keep make test under 5 minutes)
@pytest.mark.parametrize("generic", ["-mno-avx512f", "-march=x86-64"])
def test_moe_fp4_of_the_generic_code_gives_the_same_bits(tmp_path, monkeypatch, generic):
    """The C code without AVX-512 (weight_pairs', x_pairs' and sum16's generic forms, the index scores' even / odd
    path key by key where AVX-512 puts 16 keys in vector lanes) or without any AVX (sum8's too), built into a
    second library with the loader's flags, gives the default build's bits for moe_fp4, moe_bf16, fp32 and bf16
    projections (the fp32 GEMV's register-blocked AVX-512 form, issue 25), few-query attention (its scores of 4 keys
    x 4 heads at once), mHC mixing (two tokens at once), index scores
    (GENERIC_INDEX_CASES, NaN scales included) and the FP8 decode of every E4M3 code (its table lookups, where
    AVX-512 builds most values' bits). Skips without a compiler, except under CI=true."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        message = f"no C compiler {cc!r} to build the generic code with"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = [*kernels.CFLAGS, *([generic] if x86 else [])]  # elsewhere the default build is generic too
    macros = subprocess.run([cc, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True)
    assert macros.returncode == 0 and "__AVX512F__" not in macros.stdout, macros.stderr
    if x86 and generic == "-march=x86-64":
        assert "__AVX__" not in macros.stdout
    cases = [fp4_moe_inputs(kernels.FEW_ROWS, 96, 64, torch.bfloat16, torch.float32, seed=90),
             fp4_moe_inputs(kernels.FEW_ROWS, 64, 96, torch.float32, None, seed=91)]

    def fp4_and_bf16(case) -> tuple[torch.Tensor, torch.Tensor]:
        (x, indices, weights, fp4, limit, shared), (w13, w2) = case
        return (kernels.moe_fp4(x, indices, weights, *fp4, limit, shared=shared),
                kernels.moe_bf16(x, indices, weights, w13, w2, limit, shared=shared))

    index_cases = [index_inputs(*case, seed=92 + i, odd_scales=True) for i, case in enumerate(GENERIC_INDEX_CASES)]
    want_scores = [index_scores_of(*case) for case in zip(GENERIC_INDEX_CASES, index_cases, strict=True)]
    assert all(scores.isnan().any() and (scores > 0).float().mean() > 0.3 for scores in want_scores)
    # A Reindex layer's picks among 20 blocks of 8 entries of 38, some past a query's visible count.
    codes, scales, tables, q, w = index_inputs(32, 4, 2, 300, 2, 16, seed=99)
    blocks = torch.rand(2, 2, 38, generator=torch.Generator().manual_seed(99)) < 0.5
    visible = torch.tensor([[300, 123], [77, 250]])
    select = (codes, scales, 32, "ue8m0", tables, 2, 16, q, w, 300, blocks, 8, 20, visible, 32)
    want_picks = kernels.pool_select(*select)
    assert (want_picks == -1).any() and (want_picks >= 0).sum() > 64
    want = [fp4_and_bf16(case) for case in cases]
    # fp32 and bf16 projections of 1 .. 9 tokens: AVX-512 holds the fp32 weights in registers and sums 4 tokens' 16
    # dots at once (sum16_by16); the generic code sums each with sum16.
    g = torch.Generator().manual_seed(97)
    projections = [(torch.randn(n, k, generator=g).to(dt), torch.randn(o, k, generator=g).to(dt))
                   for n in (1, 3, 4, 5, 8, 9) for k, o in ((256, 37), (133, 6))
                   for dt in (torch.float32, torch.bfloat16)]
    want_linear = [kernels.linear(x, w) for x, w in projections]
    # Few-query attention: AVX-512 scores 4 keys x 4 heads at once (H a multiple of 4, d of 16), the generic code
    # one dot at a time; 4 heads, 12 heads (three groups of 4), 3 heads (one at a time); window keys and picks.
    attends = []
    for B, H, d, L, k in ((3, 4, 64, 37, 9), (2, 12, 32, 18, 5), (2, 3, 64, 21, 3)):
        attends.append((torch.randn(B, 1, H, d, generator=g), torch.randint(20, 40, (B, 1), generator=g),
                        torch.randn(B, L, d, generator=g), torch.randint(-1, 40, (B, L), generator=g), 16,
                        torch.randn(B, 1, k, d, generator=g), torch.randint(-1, 30, (B, 1, k), generator=g),
                        torch.randn(H, generator=g), d ** -0.5))
    want_attend = [kernels.attend_few(*case) for case in attends]
    # mHC mixing: AVX-512 takes two tokens at once (hc * D a multiple of 32), the generic code one at a time; hc 3
    # leaves 3 of its 15 rows past a multiple of 4; 5 tokens leave the last one alone; bf16 streams.
    mixes = []
    for T, hc, D, dt in ((5, 4, 64, torch.float32), (3, 3, 32, torch.float32), (4, 4, 64, torch.bfloat16)):
        m = (2 + hc) * hc
        mixes.append((torch.randn(1, T, hc, D, generator=g).to(dt), torch.randn(m, hc * D, generator=g) * 0.05,
                       torch.randn(m, generator=g), torch.rand(3, generator=g), hc, 1e-6, 1e-6, 20))
    want_mix = [kernels.hc_mix(*case) for case in mixes]
    # FP8 rows: every code (twice, the second time shuffled) under scale bytes 0, 1, 127, 254 and 255 (NaN), then
    # each block its own scale byte. Bits compared as int32, NaN signs too, but for code 0xFF (-NaN) times a NaN
    # scale: x86 returns one of the two NaNs by operand order, which the compiler picks (a -march=x86-64 build's
    # multiply gives -NaN, -march=native builds +NaN, with or without the AVX-512 path).
    every = torch.arange(256, dtype=torch.uint8)
    shuffled = every[torch.randperm(256, generator=torch.Generator().manual_seed(98))]
    fp8_codes = torch.cat((every, shuffled)).expand(6, 512).contiguous()
    fp8_scales = torch.tensor([0, 1, 127, 254, 255, 0], dtype=torch.uint8)[:, None].repeat(1, 16)
    fp8_scales[5] = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(98), dtype=torch.uint8)
    want_fp8 = kernels.fp8_dequantize(fp8_codes, fp8_scales)
    assert want_fp8.isnan().sum() > 512 and (want_fp8 == 0).sum() > 8 and want_fp8.view(torch.int32).lt(0).any()
    monkeypatch.setattr(loader, "CFLAGS", flags)
    monkeypatch.setenv("DSV41_KERNEL_CACHE", str(tmp_path))
    generic = kernels._load()
    assert generic is not None
    monkeypatch.setitem(kernels._state, "lib", generic)
    assert kernels.library() is generic
    for case, (fp4_want, bf16_want) in zip(cases, want, strict=True):
        assert_same_bits(fp4_want, bf16_want)
        fp4_got, bf16_got = fp4_and_bf16(case)
        assert_same_bits(fp4_got, fp4_want)
        assert_same_bits(bf16_got, bf16_want)
    for (x, w), expected in zip(projections, want_linear, strict=True):
        assert_same_bits(kernels.linear(x, w), expected)
    for case, expected in zip(attends, want_attend, strict=True):
        assert_same_bits(kernels.attend_few(*case), expected)
    for case, expected in zip(mixes, want_mix, strict=True):
        for got_part, want_part in zip(kernels.hc_mix(*case), expected, strict=True):
            assert_same_bits(got_part, want_part)
    for case, inputs, expected in zip(GENERIC_INDEX_CASES, index_cases, want_scores, strict=True):
        assert_same_bits(index_scores_of(case, inputs), expected)
    assert torch.equal(kernels.pool_select(*select), want_picks)
    both_nan = (fp8_codes == 0xFF) & (fp8_scales == 255).repeat_interleave(32, 1)
    got_fp8 = kernels.fp8_dequantize(fp8_codes, fp8_scales)
    assert got_fp8[both_nan].isnan().all() and both_nan.sum() >= 2
    assert torch.equal(got_fp8.masked_fill(both_nan, 0).view(torch.int32), want_fp8.masked_fill(both_nan, 0)
                       .view(torch.int32))


def round_experts_to_bf16(moe: MoE) -> MoE:
    """The routed experts' weights rounded to bf16 (kept fp32): exact in bf16, random ones not FP4 values."""
    with torch.no_grad():
        for p in moe.experts.parameters():
            p.copy_(p.bfloat16().float())
    return moe


def test_bf16_copies_of_fp32_experts_and_none_for_a_bf16_model():
    moe = round_experts_to_bf16(small_moe(71, exact=False))
    copies = packed(moe)
    assert copies.fp4 is None and copies.bf16_all
    w13, w2 = copies.bf16
    for e in (2, 5):
        expert = moe.experts[e]
        assert torch.equal(w13[e].float(), torch.cat((expert.w1.weight, expert.w3.weight)))
        assert torch.equal(w2[e].float(), expert.w2.weight)
    moe.bfloat16()  # no copies of the bf16 weights: the kernel reads the stacked parameters
    w13, _ = packed(moe).bf16
    assert w13.data_ptr() == moe.experts[0].w1.weight.data_ptr()


def test_moe_takes_moe_fp4_for_fp4_values_and_moe_bf16_for_other_bf16_values(calls):
    """Routed experts whose weights are FP4 values take moe_fp4, on copies that decode (by ml_dtypes) to the
    weights and give the bf16 copies' bits; weights exact in bf16 but not FP4 values take moe_bf16; weights exact
    in neither, the torch code. Each agrees with the torch code."""
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(81)) * 3
    fp4_moe, bf16_moe, plain = small_moe(80), round_experts_to_bf16(small_moe(80, exact=False)), small_moe(80, False)
    for moe, fp4, bf16 in ((fp4_moe, 1, 0), (bf16_moe, 0, 1), (plain, 0, 0)):
        calls.clear()
        got, want = moe_both_ways(moe, x)
        assert (calls["moe_fp4"], calls["moe_bf16"], calls["gate"]) == (fp4, bf16, 1)
        assert_close_to_scale(got, want, MOE_TOL)
        assert (packed(moe).fp4 is not None) == bool(fp4)
        assert packed(moe).fp4_all == bool(fp4) and packed(moe).bf16_all == bool(bf16)
    codes13, scales13, codes2, scales2 = packed(fp4_moe).fp4
    for e, expert in enumerate(fp4_moe.experts):
        w13 = torch.cat((expert.w1.weight, expert.w3.weight))
        assert torch.equal(fp4_oracle_values(codes13[e], scales13[e]), w13.double())
        assert torch.equal(fp4_oracle_values(codes2[e], scales2[e]), expert.w2.weight.double())
    flat = x.reshape(5, 64)
    with torch.no_grad():
        indices, weights = fp4_moe.gate(flat)
    bf16 = (torch.stack([torch.cat((e.w1.weight, e.w3.weight)) for e in fp4_moe.experts]).bfloat16(),
            torch.stack([e.w2.weight for e in fp4_moe.experts]).bfloat16())
    assert_same_bits(kernels.moe_fp4(flat, indices, weights, *packed(fp4_moe).fp4, 7.0),
                     kernels.moe_bf16(flat, indices, weights, *bf16, 7.0))


def test_moe_fp4_copies_follow_weight_changes(calls):
    """Installing again after expert 3's weights change in place (inside or outside inference mode), through
    ``.data`` or are replaced remakes its FP4 copy; weights that stop being FP4 values send the step to moe_bf16
    (exact in bf16) or the torch code (not), and only while a token picks that expert."""
    moe = small_moe(84)
    with torch.no_grad():
        moe.gate.bias[3] = 100.0  # every token picks expert 3
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(85)) * 3
    expert = moe.experts[3]
    w1 = expert.w1.weight
    fp4_values = w1.detach().clone()
    results = []

    def step(fp4: int, bf16: int) -> None:
        """A forward: the kernels' calls so far, the torch code's result, and a result unlike the last one."""
        got, want = moe_both_ways(moe, x)
        assert (calls["moe_fp4"], calls["moe_bf16"]) == (fp4, bf16)
        assert_close_to_scale(got, want, MOE_TOL)
        if results:
            assert (got - results[-1]).abs().max() > 0.1  # a stale copy would have given the last result
        results.append(got)

    step(1, 0)
    with torch.no_grad():
        expert.w2.weight.mul_(2)  # other FP4 values
    step(2, 0)
    with torch.inference_mode():
        w1.mul_(-0.5)
    step(3, 0)
    with torch.no_grad():
        w1.mul_(1.25)  # exact in bf16 (3 significant bits), not FP4 values
    copies = packed(moe)
    assert not copies.fp4_ok[3] and copies.fp4_ok[5] and copies.bf16_ok[3]
    step(3, 1)
    with torch.no_grad():
        w1.neg_().add_(1e-3)  # not exact in bf16 either
    assert not packed(moe).bf16_ok[3]
    step(3, 1)
    with torch.no_grad():
        moe.gate.bias[3], moe.gate.bias[5] = 0.0, 100.0  # now expert 5 (FP4 values) is picked instead
    step(4, 1)
    with torch.no_grad():
        moe.gate.bias[3], moe.gate.bias[5] = 100.0, 0.0
        w1.copy_(fp4_values)  # back to FP4 values
    step(5, 1)
    expert.w3.weight = nn.Parameter(expert.w3.weight.detach() * 4, requires_grad=False)
    step(6, 1)
    with torch.no_grad():
        w1.data.mul_(-2)  # not seen by the version counter: seen by installing again
    step(7, 1)
    assert packed(moe).fp4_ok[3]


def _fp4_exact_linear(linear: nn.Linear, seed: int, bias: bool = False) -> nn.Linear:
    """A new Linear of ``linear``'s shape with other FP4-exact weights (and a bias)."""
    out = nn.Linear(linear.in_features, linear.out_features, bias=bias)
    with torch.no_grad():
        out.weight.copy_(fp4_exact(torch.randn(out.weight.shape, generator=torch.Generator().manual_seed(seed))))
    return out


@pytest.mark.parametrize("change", ["hook on w1", "pre-hook on the expert", "backward hook on w2", "bias on w2",
                                    "w3 replaced", "expert replaced", "w1 wrapped", "global hook",
                                    "a hooked expert on the same projections", "hook dicts replaced"])
@pytest.mark.parametrize("copies", ["fp4", "bf16"])
def test_a_change_after_the_experts_were_checked_is_seen(calls, change, copies):
    """After forwards that took the kernel for expert 3, each kind of change to it is seen once the fast backend
    is installed again (as documented), for the FP4 copies (FP4-exact experts) and the bf16 ones (bf16-exact):
    hooks run, a bias or a wrapper sends the step to the torch code, new weights are used; the result is the
    torch code's and differs from before where the weights changed."""
    moe = small_moe(88) if copies == "fp4" else round_experts_to_bf16(small_moe(88, exact=False))
    kernel_name = f"moe_{copies}"
    with torch.no_grad():
        moe.gate.bias[3] = 100.0  # every token picks expert 3
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(89)) * 3
    for _ in range(2):
        before, want = moe_both_ways(moe, x)
    assert calls[kernel_name] == 2 and getattr(packed(moe), f"{copies}_ok")[3]
    expert, seen = moe.experts[3], []
    handles = []
    kernel = 0  # further moe_fp4 calls expected
    if change == "hook on w1":
        handles.append(expert.w1.register_forward_hook(lambda module, args, out: seen.append(1)))
    elif change == "pre-hook on the expert":
        handles.append(expert.register_forward_pre_hook(lambda module, args: seen.append(1)))
    elif change == "backward hook on w2":
        handles.append(expert.w2.register_full_backward_hook(lambda module, gin, gout: None))
    elif change == "bias on w2":
        expert.w2.bias = nn.Parameter(torch.full((64,), 0.5))
    elif change == "w3 replaced":
        expert.w3 = _fp4_exact_linear(expert.w3, 90)
        kernel = 1
    elif change == "expert replaced":
        moe.experts[3] = Expert(64, 32, 7.0)
        moe.experts[3].w1, moe.experts[3].w3, moe.experts[3].w2 = (_fp4_exact_linear(expert.w1, 91),
                                                                    _fp4_exact_linear(expert.w3, 92),
                                                                    _fp4_exact_linear(expert.w2, 93))
        kernel = 1
    elif change == "w1 wrapped":
        expert.w1 = LoRA(expert.w1)
        with torch.no_grad():
            expert.w1.up.weight.fill_(0.1)
    elif change == "a hooked expert on the same projections":
        moe.experts[3] = Expert(64, 32, 7.0)
        moe.experts[3].w1, moe.experts[3].w3, moe.experts[3].w2 = expert.w1, expert.w3, expert.w2
        handles.append(moe.experts[3].register_forward_pre_hook(lambda module, args: seen.append(1)))
    elif change == "hook dicts replaced":  # a "clear every hook" idiom, then a new hook
        for m in (expert, expert.w1, expert.w3, expert.w2):
            m._forward_hooks = collections.OrderedDict()
        handles.append(expert.w1.register_forward_hook(lambda module, args, out: seen.append(1)))
    elif change == "global hook":
        from torch.nn.modules.module import register_module_forward_hook
        handles.append(register_module_forward_hook(lambda module, args, out: seen.append(1)))
    try:
        got, want = moe_both_ways(moe, x)
        assert calls[kernel_name] == 2 + kernel and moe_calls(calls) == 2 + kernel
        assert_close_to_scale(got, want, MOE_TOL)
        hooks = ("hook on w1", "pre-hook on the expert", "global hook", "a hooked expert on the same projections",
                 "hook dicts replaced")
        if change in hooks:
            assert seen, "the hook did not run"
        if change not in (*hooks, "backward hook on w2"):
            assert (got - before).abs().max() > 0.1  # the change changed the output: no stale copy or check
    finally:
        for h in handles:
            h.remove()


def test_expert_copies_are_made_for_every_plain_expert_at_once(monkeypatch):
    """Installing makes every plain expert's FP4 copies at once, skipping a wrapped one (whose tokens take the
    torch code); no bf16 copies when every plain expert is FP4; installing again after an in-place change remakes
    the copies from the weights as they are then."""
    moe = small_moe(88)
    wrapped = moe.experts[6]
    moe.experts[6] = nn.Sequential()  # a wrapper without weights
    made = []
    quantize = kernels.fp4_quantize
    monkeypatch.setattr(kernels, "fp4_quantize", lambda *a, **k: (made.append(1), quantize(*a, **k))[1])
    copies = packed(moe)
    assert len(made) == 3 * 7  # w1, w3, w2 of the 7 plain experts
    assert copies.fp4_ok == [e != 6 for e in range(8)] and not copies.fp4_all and copies.bf16 is None
    with torch.no_grad():
        moe.experts[5].w2.weight.mul_(2)
    codes13, scales13, codes2, scales2 = packed(moe).fp4
    assert len(made) == 2 * 3 * 7
    assert torch.equal(fp4_oracle_values(codes2[5], scales2[5]), moe.experts[5].w2.weight.double())
    assert wrapped is not moe.experts[6]


@pytest.mark.parametrize("tokens", [1, 3, kernels.FEW_ROWS])
def test_bf16_moe_of_fp4_values_takes_moe_fp4(calls, tokens):
    """A bf16 model's FP4 values (the checkpoint's experts) take moe_fp4: close to the torch code's bf16 steps,
    and the bits moe_bf16 gives on the stacked bf16 weights themselves."""
    moe = small_moe(86).bfloat16()  # FP4 values are exact in bf16
    copies = packed(moe)
    x = (torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(87)) * 3).bfloat16()
    got, want = kernel_and_torch(calls, "moe_fp4", moe, x)
    assert calls["moe_bf16"] == 0 and got.dtype == torch.bfloat16 and got.shape == x.shape
    assert_close_to_scale(got.float(), want.float(), EXPERT_BF16_TOL)
    flat = x.reshape(tokens, 64)
    with torch.no_grad():
        indices, weights = moe.gate(flat)
    shared = tuple(getattr(moe.shared_experts, name).weight for name in ("w1", "w3", "w2"))
    assert_same_bits(kernels.moe_fp4(flat, indices, weights, *copies.fp4, 7.0, shared=shared),
                     kernels.moe_bf16(flat, indices, weights, *copies.stacked, 7.0, shared=shared))


def e2m1_experts(dim: int, inter: int, seed: int) -> MoE:
    """A small MoE whose routed experts' weights are E2M1 values / 8: FP4 values in blocks of 32 along any axis (one
    power-of-two scale), exact in bf16, whatever dim and inter are; the rest plain random fp32."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(dim=dim, inter_dim=inter, n_experts=8, topk=2, n_shared=1, swiglu_limit=7.0, route_scale=1.5,
              norm_topk=True, with_bias_vl=False).eval()
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name.startswith("experts."):
                p.copy_(e2m1[torch.randint(0, 16, p.shape, generator=g)] / 8)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if name == "gate.bias" else 0.25))
    return moe


@pytest.mark.parametrize("dim, inter, fp4", [(64, 32, True), (48, 32, False), (64, 48, False)], ids=str)
def test_moe_fp4_needs_dim_and_inter_in_blocks_of_32(calls, dim, inter, fp4):
    """The same kind of weights take moe_fp4 when D and inter are multiples of 32 and moe_bf16 otherwise
    (fp4_experts is None): the torch code's result either way."""
    moe = e2m1_experts(dim, inter, seed=88)
    copies = packed(moe)
    assert (copies.fp4 is not None) == fp4 and (copies.fp4_all or copies.bf16_all)
    x = torch.randn(1, 4, dim, generator=torch.Generator().manual_seed(89)) * 3
    got, want = moe_both_ways(moe, x)
    assert (calls["moe_fp4"], calls["moe_bf16"]) == (int(fp4), int(not fp4))
    assert_close_to_scale(got, want, MOE_TOL)


