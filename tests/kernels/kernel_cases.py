"""Inputs, tolerances and comparisons shared by the kernel tests (moved from the one test file of the
kernels, unchanged).
"""


import numpy as np
import torch
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.paged_context import PagedContext
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast.moe import pack_copies
from deepseek_v41.model.attention import SparseAttention
from deepseek_v41.model.indexer import Indexer
from deepseek_v41.model.moe import Gate, MoE
from deepseek_v41.quant import (
    dequantize_fp4,
    quantize_fp4,
)

# The attention core and the selection rules with the fast backend installed (deepseek_v41/kernels/fast/attention.py):
# attend_few's kernel for a few queries, the top-k rules in C; outside inference mode the reference.
_CORE, _INDEXER = SparseAttention(), Indexer(16, 8, 16, 2, 32, False, 1e-6)
fast.install(_CORE)
fast.install(_INDEXER)
sparse_attention = _attend_few = _CORE
topk_entries = _INDEXER.topk_entries

F32 = np.float32


ENTRY_POINTS = ("fp8_quantize_values", "fp8_dequantize", "fp4_quantize", "fp4_dequantize", "fp4_gather",
                "fp4_scatter", "window_step", "rope", "rms_norm", "hc_mix", "hc_collapse", "hc_expand", "attend_few",
                "gate", "swiglu", "moe_bf16", "moe_fp4", "index_scores", "linear", "topk_set")


# RMSNorm / mHC: kernel vs ATen differ by the summation order only (measured: at most ~2.5 fp32 ulps, 2.5e-7
# absolute on values up to ~16).
RTOL, ATOL = 2e-6, 1e-6


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal dtype, shape and bits (-0 differs from +0); NaN equals NaN at the same positions, any payload."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if got.is_floating_point():
        nan = got.isnan()
        assert torch.equal(nan, want.isnan()), "NaN at different positions"
        ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[got.element_size()]
        got, want = got.masked_fill(nan, 0).view(ints), want.masked_fill(nan, 0).view(ints)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        raise AssertionError(f"{len(bad)} elements differ, first at {bad[0].tolist()}: "
                             f"{got[tuple(bad[0])].item()} vs {want[tuple(bad[0])].item()}")


def both_ways(fn, *args, **kwargs):
    """``fn`` with the kernels and inside ``kernels.disabled()``."""
    fast = fn(*args, **kwargs)
    with kernels.disabled():
        slow = fn(*args, **kwargs)
    return fast, slow


def assert_same_results(fast, slow) -> None:
    fast, slow = (fast,) if torch.is_tensor(fast) else fast, (slow,) if torch.is_tensor(slow) else slow
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow, strict=True):
        assert_same_bits(a, b)


def entries_context(cache: PagedKVCache, T: int, write_from: list[int],
                    model_dtype: torch.dtype = torch.float32) -> PagedContext:
    positions = torch.arange(T).expand(2, T).contiguous()
    return PagedContext(cache, [0, 1], [[1, 2, 3], [4, 5, 6]], positions, [T, T], model_dtype, write_from)


def mhc_inputs(B: int, T: int, hc: int = 4, D: int = 64, seed: int = 6):
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(B, T, hc, D, generator=g) * 2
    fn = torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.05
    base = torch.randn((2 + hc) * hc, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return streams, fn, base, scale


def close_in_inference_mode_and_exact_outside(calls, name: str, fn, *args) -> None:
    """``fn(*args)`` with the kernel under inference mode is close to the torch code; under no_grad (and
    outside any mode) the kernel does not run and the bits are the torch code's."""
    with kernels.disabled(), torch.no_grad():
        want = fn(*args)
    want = (want,) if torch.is_tensor(want) else want
    with torch.inference_mode():
        got = fn(*args)
    assert calls[name] == 1, name
    got = (got,) if torch.is_tensor(got) else got
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        plain = fn(*args)
    assert calls[name] == 1, f"{name} ran outside inference mode"
    assert_same_results(plain, want)


# These kernels run under torch.inference_mode only (fp32 CPU tensors) and agree with the torch code to fp32
# rounding (another summation order, expf instead of ATen's exp).
def attention_inputs(T: int, k: int | None, seed: int):
    """Two rows of T queries (H = 4, d = 64) at positions 40 .. 40 + T - 1 (row 0) and 2 .. 2 + T - 1 (row 1)
    over P = 12 earlier window rows and the T new rows, window 8. Row 0's earlier rows: empty (-1), older than
    the window, inside it, and past the queries (rejected drafts). Row 1's keys are all invisible to its
    queries: empty (position -1, which is inside their windows by position alone) or past them, so only the sink
    (and the entries) remain. ``k``: entries per query (None: no topk), some picks -1; ``gather`` reads them from
    a bank whose rows are not zero even where the pick is -1 (so a pick that is not masked shows)."""
    g = torch.Generator().manual_seed(seed)
    B, H, d, P, window = 2, 4, 64, 12, 8
    q_pos = torch.tensor([[40 + t for t in range(T)], [2 + t for t in range(T)]])
    earlier = torch.tensor([[-1, 20, 31, 32, 33, 35, 36, 38, 39, -1, 41 + T, 50],
                            [-1, -1, 2 + T, 3 + T, 30, -1, 5, 9, 55, 60, -1, 70]])
    new = q_pos.clone()
    new[1] = -1  # row 1: the new rows too are empty, so its queries see no key at all
    key_pos = torch.cat((earlier, new), 1).contiguous()
    keys = torch.randn(B, P + T, d, generator=g) * 2
    q = torch.randn(B, T, H, d, generator=g)
    sink = torch.randn(H, generator=g)
    topk = gather = None
    if k is not None:
        bank = torch.randn(B, 20, d, generator=g) * 2
        topk = torch.randint(0, 20, (B, T, k), generator=g)
        if k:
            topk[0, 0, 1] = topk[1, -1, 0] = topk[0, -1, -1] = -1

        def gather(idx):
            return bank[torch.arange(B)[:, None, None], idx.clamp(min=0)]  # [B, T, k, d]; -1 reads entry 0
    return (q, q_pos, keys, key_pos, window, topk, gather, sink, d ** -0.5)


def visible(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B, T, L]: key l is in query t's window (``p - window < key_pos <= p``, not empty)."""
    kp, qp = key_pos[:, None], q_pos[..., None]
    return (kp >= 0) & (kp <= qp) & (kp > qp - window)


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """``|got - want| <= tol * max|want|`` everywhere: a sum taken in another order is off by a few ulps of its
    largest terms, which is far more than a few ulps of an output that cancels to near 0."""
    assert got.dtype == want.dtype and got.shape == want.shape and want.isfinite().all()
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= tol * scale, f"off by {err:.3g} on outputs up to {scale:.3g} ({err / scale:.3g} of it)"


# Attention, kernel vs torch code: measured at most 8.5e-7 of the largest output (150 seeds of these inputs,
# outputs up to ~8; the torch code itself is as far from the float64 result).
ATTEND_TOL = 3e-6


def router(n_experts: int, topk: int, norm_topk: bool, seed: int, dim: int = 64) -> Gate:
    g = torch.Generator().manual_seed(seed)
    gate = Gate(dim, n_experts, topk, 2.5, norm_topk, with_bias_vl=False).eval()
    with torch.no_grad():
        gate.weight.copy_(torch.randn(n_experts, dim, generator=g) * 0.1)
        gate.bias.copy_(torch.randn(n_experts, generator=g) * 0.1)
    fast.install(gate)
    return gate


def fp4_exact(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to the checkpoint's FP4 format (E2M1, blocks of 32, UE8M0 scales): exact in bf16."""
    with kernels.disabled():
        return dequantize_fp4(*quantize_fp4(w, 32, "ue8m0"), 32, "ue8m0")


def small_moe(seed: int, exact: bool = True) -> MoE:
    """The routed experts FP4-exact (``exact``) or plain random fp32; the shared expert plain random fp32."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(dim=64, inter_dim=32, n_experts=8, topk=2, n_shared=1, swiglu_limit=7.0, route_scale=1.5,
              norm_topk=True, with_bias_vl=False).eval()
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if name == "gate.bias":
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                w = torch.randn(p.shape, generator=g) * 0.25
                p.copy_(fp4_exact(w) if exact and name.startswith("experts.") else w)
    return moe


def moe_calls(calls) -> int:
    """Calls of the MoE kernel, whichever format it read the routed experts in (FP4 or bf16 copies)."""
    return calls["moe_bf16"] + calls["moe_fp4"]



def packed(moe: MoE):
    """The copies the fast backend packs for ``moe``, installed (again) now and packed as a first decode step
    would."""
    fast.install(moe)
    return pack_copies(moe.__dict__["_fast_moe"])


def moe_both_ways(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE.forward under inference mode with the fast backend installed (again: the tests change weights, hooks
    and modules between calls, after which one installs again), and with the kernels off under no_grad."""
    fast.install(moe)
    with torch.inference_mode():
        got = moe(x)
    with kernels.disabled(), torch.no_grad():
        want = moe(x)
    return got, want


# MoE, kernel vs torch code: measured at most 3.8e-7 of the largest output (60 models x 3 token counts, outputs
# up to ~100).
MOE_TOL = 1.5e-6


class LoRA(nn.Module):
    """A LoRA-like wrapper: the base projection is a submodule, the wrapper has no ``weight`` of its own."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, 2, bias=False)
        self.up = nn.Linear(2, base.out_features, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def index_inputs(di: int, H: int, c: int, n: int, ratio: int, block_size: int, seed: int,
                 odd_scales: bool = False) -> tuple[torch.Tensor, ...]:
    """Codes, scales and block tables of B = 2 rows' index keys 0 .. n-1 (UE8M0 blocks of 32, per_page =
    block_size // ratio, each row's pages a random draw from n // per_page + 4), queries fp32 [2, c, H, di] and
    head weights [2, c, H]: kernels.index_scores' tensors. Scale bytes 118 .. 131; with odd_scales, about one in
    eight is 0 (2**-127), 1, 254 or 255 (NaN) instead."""
    g = torch.Generator().manual_seed(seed)
    per_page, B = block_size // ratio, 2
    pages = n // per_page + 4
    codes = torch.randint(0, 256, (pages, per_page, di // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 132, (pages, per_page, di // 32), generator=g, dtype=torch.uint8)
    if odd_scales:
        odd = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)[torch.randint(0, 4, scales.shape, generator=g)]
        scales = torch.where(torch.rand(scales.shape, generator=g) < 0.125, odd, scales)
    cols = -(-n * ratio // block_size)
    tables = torch.stack([torch.randperm(pages, generator=g)[:cols] for _ in range(B)])
    q, w = torch.randn(B, c, H, di, generator=g), torch.rand(B, c, H, generator=g)
    return codes, scales, tables, q, w


# fp32 sums, kernel vs ATen: measured at most 3.7e-8 of the sum of the terms' magnitudes (K = 1023).
LINEAR_TOL = 1e-6


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many steps between adjacent bf16 values lead from ``a`` to ``b`` (bf16, not NaN): -0 and +0 are one
    value, the infinities the two ends."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, scale, ulps: int = 1, tol: float = LINEAR_TOL,
                      share: float | None = 0.9) -> tuple[int, int]:
    """bf16 ``got`` and ``want``: NaN at the same places; every other element at most ``ulps`` bf16 values apart,
    or within ``tol * scale`` (``scale``: a number, or each element's sum of term magnitudes: a sum that cancels
    to near 0 is off by fp32 ulps of its terms, many bf16 ulps of itself); at least ``share`` of the elements
    identical (None: not checked). Returns (identical, compared) elements."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN at different positions"
    scale = torch.as_tensor(scale, dtype=torch.float64).expand(want.shape)[~nan]
    got, want = got[~nan], want[~nan]
    apart = bf16_ulps(got, want)
    far = (apart > ulps) & ~((got.double() - want.double()).abs() <= tol * scale)
    if far.any():
        raise AssertionError(f"{int(far.sum())} of {far.numel()} elements more than {ulps} ulp apart, e.g. "
                             f"{got[far][0].item()} vs {want[far][0].item()}")
    same = int((apart == 0).sum())
    if share is not None and want.numel():
        assert same >= share * want.numel(), f"only {same} of {want.numel()} elements identical"
    return same, want.numel()


# A bf16 model's few-token forwards take the fp32 kernels on upcast tensors and cast the result back. Where the
# torch code computes in fp32 from the same upcast values, the results are as close as in fp32, or one bf16
# rounding apart; where it rounds to bf16 between steps (a collapse before its norm, each projection of an
# expert), a few bf16 ulps of the output's scale.
def kernel_and_torch(calls, name: str, fn, *args, times: int = 1):
    """``fn(*args)`` under inference mode (the kernel ``name`` runs ``times``) and with the kernels off under
    no_grad; under no_grad with the kernels on, the kernel does not run and the bits are the torch code's."""
    calls.clear()
    with kernels.disabled(), torch.no_grad():
        want = fn(*args)
    with torch.inference_mode():
        got = fn(*args)
    assert calls[name] == times, (name, dict(calls))
    with torch.no_grad():
        assert_same_results(fn(*args), want)
    assert calls[name] == times, f"{name} ran outside inference mode"
    return got, want


# bf16 experts, kernels vs torch code. Expert: the same bf16 roundings both ways (measured: identical for 100
# seeds). MoE: moe_bf16 keeps the projections' outputs in fp32 where the torch code rounds them to bf16; measured at
# most 7.1e-3 of the largest output (30 models x 4 token counts).
EXPERT_BF16_TOL = 2e-2
