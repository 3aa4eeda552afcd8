"""The GEMV kernel (csrc/gemv.c: ``kernels.linear``, ``model.linear.Linear``,
``GroupedLinear``) against ``F.linear``, and its bf16 rounding bit for bit against ``Tensor.to(torch.bfloat16)``.
"""


import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_cases import LINEAR_TOL, assert_bf16_close, assert_close_to_scale, assert_same_bits
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast import install
from deepseek_v41.kernels.fast.dense import linear
from deepseek_v41.model.attention import GroupedLinear
from deepseek_v41.model.linear import Linear

# ---------------------------------------------------------------------------------- dense projections (GEMV)
# kernels.linear sums in fp32 in another order than ATen. A bf16 output is that sum rounded once to nearest even,
# as ATen rounds its own fp32 sums: the two are at most one bf16 ulp apart (measured: 1 to 2 elements in 5,000 differ
# at all) except where a sum cancels to near 0.
LINEAR_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                 (torch.float32, torch.bfloat16)]  # (x, weight)


def projection(shape: tuple[int, ...], K: int, O: int, dtypes: tuple[torch.dtype, torch.dtype], seed: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [*shape, K] and weight [O, K] of outputs ~N(0, 1), in dtypes (x, weight)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((*shape, K), generator=g).to(dtypes[0])
    weight = (torch.randn(O, K, generator=g) * max(K, 1) ** -0.5).to(dtypes[1])
    return x, weight


def aten_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` in x's dtype: ATen's bf16 GEMM for bf16 x bf16; otherwise fp32 on the upcast operands,
    rounded to x's dtype by ``Tensor.to`` (ATen takes no mixed operands)."""
    if x.dtype == weight.dtype:
        return F.linear(x, weight)
    return F.linear(x.float(), weight.float()).to(x.dtype)


def magnitudes(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Σ_k |x_k w_ok| [..., O] in float64: the size of a sum's rounding error (in any order)."""
    return x.double().abs() @ weight.double().abs().t()


def assert_linear_close(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, share: float | None = None
                        ) -> tuple[int, int]:
    """fp32: within LINEAR_TOL of the terms' magnitudes; bf16: as :func:`assert_bf16_close`."""
    if want.dtype == torch.bfloat16:
        return assert_bf16_close(got, want, scale, share=share)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    err = (got.double() - want.double()).abs()
    assert (err <= LINEAR_TOL * scale).all(), f"off by {(err / scale).max().item():.3g} of the terms"
    return int((got == want).sum()), want.numel()


@pytest.mark.parametrize("dtypes", LINEAR_DTYPES, ids=str)
@pytest.mark.parametrize("K,O", [(37, 7), (85, 1), (48, 2), (130, 33)])
def test_linear_kernel_equals_f_linear_to_rounding(dtypes, K, O):
    """N = 1 .. 9 tokens (the kernel takes blocks of 4 tokens and of weight rows, then the rest one by one), K not
    a multiple of the 8 / 16 vector lanes (37, 85, 130) or of 32 (48), O odd (a last row without a partner), and
    leading dimensions: [..., K] -> [..., O] in x's dtype; no token at all is refused."""
    same = total = 0
    for N in range(1, 10):
        x, w = projection((N,), K, O, dtypes, seed=1000 * N + K + O)
        got = kernels.linear(x, w)
        assert got.dtype == x.dtype and got.shape == (N, O)
        counts = assert_linear_close(got, aten_linear(x, w), magnitudes(x, w))
        same, total = same + counts[0], total + counts[1]
    for shape in ((2, 3), (3, 1, 2), ()):  # [B, T, K], more dims, one vector [K]
        x, w = projection(shape, K, O, dtypes, seed=len(shape) + K)
        got = kernels.linear(x, w)
        assert got.dtype == x.dtype and got.shape == (*shape, O)
        counts = assert_linear_close(got, aten_linear(x, w), magnitudes(x, w))
        same, total = same + counts[0], total + counts[1]
    for shape in ((0,), (2, 0, 3)):  # no token: refused (issue 22), F.linear's business
        empty, w = projection(shape, K, O, dtypes, seed=len(shape) + K)
        with pytest.raises(ValueError, match="linear kernel: empty input x"):
            kernels.linear(empty, w)
    if x.dtype == torch.bfloat16:  # all but a rare last bit identical to ATen's bf16 result
        assert same >= 0.97 * total, f"only {same} of {total} elements identical"


@pytest.mark.parametrize("dtypes", LINEAR_DTYPES, ids=str)
def test_linear_kernel_rounds_like_torch(dtypes):
    """One-hot tokens pick one weight column, so every fp32 sum is exactly that weight (the other terms are 0):
    the output is its conversion to x's dtype bit for bit, as ``Tensor.to`` does it (``c10::BFloat16``): ties to
    even, carries into the exponent, overflow to inf, subnormals, every NaN as 0x7FC0. Picked columns lie in the
    vector body and in the tail of the rows (K = 37). A NaN / inf weight spreads through 0 * w to the other
    tokens, as in ATen."""
    K, picks = 37, (0, 7, 15, 16, 31, 32, 36)
    rng = np.random.default_rng(70)
    tie_bits = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)  # below / at / above a tie
    high = rng.integers(0, 1 << 16, 200).astype(np.uint32)
    special = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7E8000, 0xFF7F8000, 0x00000001, 0x00008000, 0x00018000,
                        0x807FFFFF, 0x3F808000, 0x3F818000, 0x3F80C000], np.uint32)
    bits = np.concatenate([((high[:, None] << 16) | tie_bits).ravel(), special])
    values = torch.from_numpy(bits.view(np.float32).copy())
    values = values[values.isfinite() & (values.view(torch.int32) != -(1 << 31))]  # finite, not -0 (0 + -0 is +0)
    nonfinite = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
    sNaN = torch.tensor([0x7F800001, 0xFFC00001 - (1 << 32)], dtype=torch.int32).view(torch.float32)
    nonfinite = torch.cat((nonfinite, sNaN))
    g = torch.Generator().manual_seed(71)
    O = len(values) + len(nonfinite)
    w = torch.randn(O, K, generator=g)
    for j in picks:  # every picked column holds every value, in another order
        w[: len(values), j] = values[torch.randperm(len(values), generator=g)]
    for i, v in enumerate(nonfinite):  # rows with one NaN / inf each, in a picked column
        w[len(values) + i, picks[i % len(picks)]] = v
    x = torch.zeros(len(picks), K)
    x[torch.arange(len(picks)), torch.tensor(picks)] = 1.0
    x, w = x.to(dtypes[0]), w.to(dtypes[1])
    got = kernels.linear(x, w)
    want = F.linear(x.float(), w.float()).to(x.dtype)
    exact = w.float()[:, list(picks)].t()
    finite = torch.isfinite(w.float()).all(1)
    assert torch.equal(F.linear(x.float(), w.float())[:, finite], exact[:, finite])  # the sums are exact
    assert_same_bits(got, want)
    if x.dtype == torch.bfloat16:
        assert (got.view(torch.int16)[got.isnan()] == 0x7FC0).all() and got.isnan().sum() >= len(picks) * 4
        if w.dtype == torch.float32:  # the roundings the test is for really occur
            assert (got.isinf() & torch.isfinite(exact)).any()
            assert not torch.equal(got[:, finite].float(), exact[:, finite])


@pytest.mark.parametrize("dtypes", LINEAR_DTYPES, ids=str)
def test_linear_kernel_propagates_nan_and_inf(dtypes):
    """NaN and inf in x or the weight, in the vector body and the tail: NaN, +inf and -inf at the places ATen
    gives them (inf - inf is NaN), the finite rest close."""
    x, w = projection((6,), 37, 5, (torch.float32, torch.float32), seed=72)
    x[1, 3] = float("nan")
    x[4, 36] = float("inf")
    w[2, 20] = float("inf")
    w[3, 0], w[3, 33] = -float("inf"), float("inf")
    w[4, 10] = float("nan")
    x, w = x.to(dtypes[0]), w.to(dtypes[1])
    got, want = kernels.linear(x, w), aten_linear(x, w)
    assert torch.equal(got.isnan(), want.isnan())
    for inf in (float("inf"), -float("inf")):
        assert torch.equal(got == inf, want == inf)
    assert want.isnan().sum() >= 10 and (want == float("inf")).any() and (want == -float("inf")).any()
    ok = want.isfinite()
    assert ok.sum() >= 6
    assert_linear_close(got[ok], want[ok], magnitudes(x, w)[ok])


def fp32_dots_in_kernel_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, K] @ w [O, K]^T summed as csrc/gemv.c's dots_body sums fp32 weights, in fp32 torch steps (each
    product, then each sum, rounded on its own): lane j of a 16-lane accumulator adds the products i + j, 16 at a
    time in order; the lanes are added as a tree of halves (8, 4, 2, 1: sum16); then the last K % 16 products one
    by one."""
    N, K = x.shape
    body = K // 16 * 16
    acc = torch.zeros(N, w.shape[0], 16)
    for i in range(0, body, 16):
        acc = acc + x[:, None, i:i + 16] * w[None, :, i:i + 16]
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half:2 * half]
    out = acc[..., 0]
    for i in range(body, K):
        out = out + x[:, None, i] * w[None, :, i]
    return out


@pytest.mark.parametrize("K,O", [(256, 37), (48, 9), (133, 5), (16, 4)])
def test_fp32_linear_kernel_sums_in_its_documented_order(K, O):
    """The fp32 GEMV gives the bits of :func:`fp32_dots_in_kernel_order` for 1 .. 17 tokens (blocks of 4 tokens,
    whose 16 dots the AVX-512 build sums at once, sum16_by16, then 1 .. 3 tokens, summed one dot at a time; rows in
    blocks of 4 and a short last block; tails of K % 16 products): a token's outputs do not depend on the other
    tokens of its call, and the register-blocked kernel (issue 25) keeps the order of the sums (so a decode step's
    logits keep their bits)."""
    for N in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17):
        x, w = projection((N,), K, O, (torch.float32, torch.float32), seed=4000 + 10 * N + K)
        assert_same_bits(kernels.linear(x, w), fp32_dots_in_kernel_order(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,K,O", [(2, 37, 3), (3, 16, 1), (4, 21, 5), (2, 64, 2)])
def test_linear_kernel_by_groups_equals_f_linear_per_group(dtype, G, K, O):
    """``groups`` G: x [..., G * K], weight [G * O, K]; group g's outputs from group g's inputs only. Odd O puts
    a group's last row alone (a pair of rows never straddles two groups)."""
    same = total = 0
    for shape in ((1,), (3,), (4,), (5,), (9,), (2, 3)):
        x, w = projection(shape, G * K, G * O, (dtype, dtype), seed=G * 100 + K + len(shape) * 10 + shape[-1])
        w = w[:, :K].contiguous()
        got = kernels.linear(x, w, G)
        assert got.dtype == dtype and got.shape == (*shape, G * O)
        parts = [(x[..., g * K: (g + 1) * K].contiguous(), w[g * O: (g + 1) * O]) for g in range(G)]
        want = torch.cat([aten_linear(xg, wg) for xg, wg in parts], -1)
        counts = assert_linear_close(got, want, torch.cat([magnitudes(xg, wg) for xg, wg in parts], -1))
        same, total = same + counts[0], total + counts[1]
    if dtype == torch.bfloat16:
        assert same >= 0.97 * total, f"only {same} of {total} elements identical"


def bf16_linear(K: int, O: int, bias: bool = False, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(K, O, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(O, K, generator=g) * K ** -0.5)
        if bias:
            layer.bias.copy_(torch.randn(O, generator=g))
    return layer.to(dtype)


def test_linear_module_has_the_parameters_of_nn_linear():
    for bias in (False, True):
        plain, ours = nn.Linear(37, 5, bias=bias), Linear(37, 5, bias=bias)
        assert isinstance(ours, nn.Linear)
        assert ({k: v.shape for k, v in ours.state_dict().items()}
                == {k: v.shape for k, v in plain.state_dict().items()})
        ours.load_state_dict(plain.state_dict())  # checkpoints load unchanged
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters(), strict=True))


def test_linear_module_takes_the_kernel_for_few_bf16_tokens_in_inference_mode_only(calls):
    layer = bf16_linear(37, 7, seed=73)
    assert install(layer).modules == {"Linear": 1}  # then a hook added after install fires around it
    x = torch.randn(2, 3, 37, generator=torch.Generator().manual_seed(74)).bfloat16()
    seen = []
    handle = layer.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with torch.inference_mode():
            got = layer(x)
        assert calls["linear"] == 1 and len(seen) == 1 and seen[0] is got  # hooks still fire
    finally:
        handle.remove()
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 7)
    want = F.linear(x, layer.weight.detach())
    assert_bf16_close(got, want, magnitudes(x, layer.weight.detach()), share=0.95)
    with torch.inference_mode():  # the function as well
        assert_same_bits(linear(x, layer.weight), got)
    assert calls["linear"] == 2
    # Outside inference mode: F.linear, bit for bit, with no_grad and with autograd (the same gradients).
    with torch.no_grad():
        assert_same_bits(layer(x), want)
    xg = x.clone().requires_grad_()
    out = layer(xg)
    assert_same_bits(out.detach(), want)
    out.float().square().sum().backward()
    ref = nn.Linear(37, 7, bias=False).bfloat16()
    ref.load_state_dict(layer.state_dict())
    xr = x.clone().requires_grad_()
    ref(xr).float().square().sum().backward()
    assert_same_bits(layer.weight.grad, ref.weight.grad)
    assert_same_bits(xg.grad, xr.grad)
    assert calls["linear"] == 2
    # Under inference mode too: with a bias, in fp32, for a non-contiguous x.
    biased = bf16_linear(37, 7, bias=True, seed=75)
    fp32 = bf16_linear(37, 7, seed=73, dtype=torch.float32)
    assert install(biased).modules == {} and install(fp32).modules == {"Linear": 1}
    strided = torch.randn(37, 4, generator=torch.Generator().manual_seed(76)).bfloat16().t()
    assert not strided.is_contiguous()
    with torch.inference_mode():
        assert_same_bits(biased(x), F.linear(x, biased.weight, biased.bias))
        assert_same_bits(fp32(x.float()), F.linear(x.float(), fp32.weight))
        assert_same_bits(layer(strided), F.linear(strided, layer.weight))
    assert calls["linear"] == 2


def test_linear_of_many_tokens_and_more_than_gemv_macs_takes_f_linear(calls):
    """bf16: up to FEW_ROWS tokens take the kernel whatever the weight, more tokens only up to GEMV_MACS
    multiply-adds."""
    K, O = 64, 1024
    layer = bf16_linear(K, O, seed=77)
    install(layer)
    few = kernels.FEW_ROWS
    x = torch.randn(few + 1, K, generator=torch.Generator().manual_seed(78)).bfloat16()
    assert few * K * O > kernels.GEMV_MACS
    with torch.inference_mode():
        one = layer(x[:few])  # FEW_ROWS tokens, more than GEMV_MACS: the kernel
        assert calls["linear"] == 1
        two = layer(x)  # one more token: ATen
        assert calls["linear"] == 1
        small = bf16_linear(K, 8, seed=79)
        install(small)
        assert (few + 1) * K * 8 <= kernels.GEMV_MACS
        three = small(x)  # many tokens, few multiply-adds: the kernel
    assert calls["linear"] == 2
    weight = layer.weight.detach()
    assert_same_bits(two, F.linear(x, weight))
    assert_bf16_close(one, F.linear(x[:few], weight), magnitudes(x[:few], weight), share=0.95)
    assert_bf16_close(three, F.linear(x, small.weight.detach()), magnitudes(x, small.weight.detach()), share=0.95)


def test_linear_of_mismatched_or_empty_widths(calls):
    """Widths that do not fit the weight raise as ``F.linear`` does, under inference mode too (the kernel would
    read past the weight); the kernel refuses K = 0 (an empty input) rather than return unwritten memory."""
    layer = bf16_linear(40, 8, seed=79)
    install(layer)
    grouped = GroupedLinear(16, 2, 4).bfloat16()
    with torch.no_grad():
        grouped.weight.normal_(generator=torch.Generator().manual_seed(80))
    fast.install(grouped)
    with torch.inference_mode():
        with pytest.raises(RuntimeError):
            layer(torch.ones(1, 48, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError):
            grouped(torch.ones(1, 1, 2, 20, dtype=torch.bfloat16))
        # [B, T, G * K] is taken by the torch code (it reshapes): the same result under inference mode.
        flat = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(81)).bfloat16()
        got = grouped(flat)
    assert calls["linear"] == 0
    with torch.no_grad():
        assert_same_bits(got, grouped(flat))
    for dtype in (torch.float32, torch.bfloat16):  # K = 0: the kernel refuses the empty input (issue 22)
        with pytest.raises(ValueError, match="linear kernel: empty input x"):
            kernels.linear(torch.ones(64, 0, dtype=dtype), torch.ones(64, 0, dtype=dtype))


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (1, 5)], ids=str)
def test_grouped_linear_takes_the_kernel_for_few_bf16_tokens(calls, shape):
    g = torch.Generator().manual_seed(82 + sum(shape))
    layer = GroupedLinear(37, 3, 5)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(15, 37, generator=g) * 37 ** -0.5)
    layer.bfloat16()
    fast.install(layer)
    x = torch.randn((*shape, 3, 37), generator=g).bfloat16()
    with torch.inference_mode():
        got = layer(x)
    assert calls["linear"] == 1 and got.dtype == torch.bfloat16 and got.shape == (*shape, 15)
    with torch.no_grad():
        want = layer(x)  # ATen's batched bf16 matmul, group by group
    assert calls["linear"] == 1
    w = layer.weight.detach()
    scale = torch.cat([magnitudes(x[..., i, :], w[5 * i: 5 * i + 5]) for i in range(3)], -1)
    assert_bf16_close(got, want, scale, share=0.9)
    layer.float()  # fp32: the kernel too (its torch code is several ops), to fp32 rounding
    fast.install(layer)  # (after changing the weight's dtype)
    with torch.inference_mode():
        got32 = layer(x.float())
    assert calls["linear"] == 2 and got32.dtype == torch.float32
    with torch.no_grad():
        exact = layer(x.float())
    assert calls["linear"] == 2
    assert_close_to_scale(got32, exact, 1e-6)
