"""The fused CPU kernels (deepseek_v41/kernels) against the torch code they stand in for.

The FP8 / FP4 codecs, RoPE and the paged KV cache reads and writes must give the torch code's bits exactly (each
test runs the same call with the kernels and inside ``kernels.disabled()``); E4M3 / E2M1 codes are also checked
against ml_dtypes. RMSNorm and the mHC mixing add in another order, so they agree to fp32 rounding, and only run
under ``torch.inference_mode``: outside it the result is the torch code's, bit for bit. The tests also check that
the kernel was really called (a spy on the module's entry points). Without a C compiler these tests skip, except
under CI=true, where a missing library fails. The end of the file pins inputs outside a kernel's limits (odd FP4
blocks, hc > 16, broadcast RoPE positions): they must take the torch code, run in a child process because a
kernel reading past a buffer could crash.

bf16 takes the same kernels through ``upcast`` / ``cast`` at the boundary (the tests near the end): where the
torch code computes in fp32 from the same upcast values and rounds once, the two are at most one bf16 ulp apart
(most elements identical); where the torch code rounds to bf16 between steps the kernel skips, a few ulps of the
output's scale. The GEMV kernel (``kernels.linear``, an installed ``model.linear.Linear``, ``GroupedLinear``) is
checked against ``F.linear``, and its bf16 rounding bit for bit against ``Tensor.to(torch.bfloat16)``. The MoE kernel
reading the routed experts in FP4 (``kernels.moe_fp4``) must give its bf16 path's bits on the same weight values
(also when built without AVX-512), and agree with float64 arithmetic on weights decoded by ml_dtypes.
"""

import collections
import ctypes
import os
import platform
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_oracles import count_calls
from optional_deps import require
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.cache.block_manager import BlockManager
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.paged_context import PagedContext
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast import install
from deepseek_v41.kernels.fast.attention import _topk_set as topk_set
from deepseek_v41.kernels.fast.block import collapse, expand, hc_mix
from deepseek_v41.kernels.fast.dense import linear
from deepseek_v41.kernels.fast.moe import swiglu
from deepseek_v41.model.attention import GroupedLinear, SparseAttention
from deepseek_v41.model.indexer import Indexer, IndexScorer
from deepseek_v41.model.linear import Linear
from deepseek_v41.model.moe import Expert, Gate, MoE
from deepseek_v41.model.norm import RMSNorm, rms_normalize, upcast
from deepseek_v41.model.rope import RotaryEmbedding
from deepseek_v41.quant import (
    dequantize_fp4,
    dequantize_fp8,
    fake_quant_fp4,
    fake_quant_fp8,
    quantize_fp4,
    quantize_fp8,
    quantize_fp8_values,
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


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of every kernel entry point (the callers look them up on the module at each call)."""
    return count_calls(monkeypatch, *ENTRY_POINTS)


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


# ---------------------------------------------------------------------------------------------- the library
def test_the_library_builds_and_loads(library, tmp_path, monkeypatch):
    assert library.dsv41_init() == 256
    assert kernels.usable(torch.zeros(4)) and not kernels.usable(torch.zeros(4, 4).t())
    with torch.enable_grad():
        assert not kernels.usable(torch.zeros(4, requires_grad=True))
    # A fresh build from the source into an empty cache folder loads and runs too.
    monkeypatch.setenv("DSV41_KERNEL_CACHE", str(tmp_path / "cache"))
    built = kernels._build()
    assert built.parent == tmp_path / "cache" and built.is_file()
    assert ctypes.CDLL(str(built)).dsv41_init() == 256
    mtime = built.stat().st_mtime_ns
    assert kernels._build() == built and built.stat().st_mtime_ns == mtime  # cached: not rebuilt
    # A cache folder others may write to is refused (a library there could have been planted).
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    monkeypatch.setenv("DSV41_KERNEL_CACHE", str(tmp_path / "open"))
    with pytest.raises(RuntimeError, match="writable by others"):
        kernels.cache_dir()
    assert stat.S_IMODE(os.stat(built.parent).st_mode) & (stat.S_IWGRP | stat.S_IWOTH) == 0


def test_disabled_restores_the_previous_state_after_an_exception(library):
    x = torch.randn(2, 64)
    with pytest.raises(ZeroDivisionError), kernels.disabled():
        assert kernels.library() is None and not kernels.usable(x)
        with kernels.disabled():
            pass
        assert kernels.library() is None  # the inner block restored "off", not "on"
        _ = 1 / 0
    assert kernels.library() is library and kernels.usable(x)
    with pytest.raises(ValueError), kernels.disabled(), kernels.disabled():
        raise ValueError
    assert kernels.library() is library


# ------------------------------------------------------------------------------------------------ E4M3 codes
def e4m3_grid() -> np.ndarray:
    """Every finite non-negative E4M3FN value, ascending (fp32): codes 0x00 .. 0x7E."""
    return np.arange(0x7F, dtype=np.uint8).view(require("ml_dtypes").float8_e4m3fn).astype(F32)


def near_grid(grid: np.ndarray, rng: np.random.Generator, hi: float) -> np.ndarray:
    """Grid points, the midpoints between neighbours (ties), the midpoints +- 1 ulp, subnormal-range and random
    values in [0, hi], both signs."""
    mid = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(F32)  # exact: one more mantissa bit
    assert np.array_equal(mid.astype(np.float64), (grid[:-1].astype(np.float64) + grid[1:]) / 2)
    up, down = np.nextafter(mid, F32(np.inf)), np.nextafter(mid, F32(0))
    tiny = rng.uniform(0, grid[grid > 0].min() * 8, 300).astype(F32)  # the subnormal codes' range
    spread = (2.0 ** rng.uniform(-12, np.log2(hi), 1500)).astype(F32)
    uniform = rng.uniform(0, hi, 500).astype(F32)
    values = np.concatenate([grid, mid, up, down, tiny, spread, uniform]).clip(0, F32(hi))
    return np.concatenate([values, -values])


def exact_blocks(values: np.ndarray, block: int, amax: float, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Rows of blocks whose largest magnitude is exactly ``amax * 2**k`` (k per block), so the block's scale is
    exactly ``2**k`` and ``x / scale`` is the value itself; returns (x fp32 [rows, 4 * block], k [rows, 4])."""
    others = block - 1
    values = rng.permutation(values)
    values = np.concatenate([values, np.zeros(-len(values) % (4 * others), F32)]).reshape(-1, others)
    blocks = np.concatenate([np.where(rng.random((len(values), 1)) < 0.5, -amax, amax).astype(F32), values], 1)
    blocks = np.take_along_axis(blocks, rng.permuted(np.tile(np.arange(block), (len(blocks), 1)), axis=1), 1)
    k = rng.integers(-20, 21, len(blocks))
    x = (blocks.astype(np.float64) * 2.0 ** k[:, None]).astype(F32)
    assert np.array_equal(x.astype(np.float64) / 2.0 ** k[:, None], blocks.astype(np.float64))  # exact
    return x.reshape(-1, 4 * block), k.reshape(-1, 4)


def test_e4m3_rounding_of_every_grid_point_tie_and_neighbour(calls):
    ml = require("ml_dtypes")
    rng = np.random.default_rng(0)
    x, k = exact_blocks(near_grid(e4m3_grid(), rng, 448.0), 32, 448.0, rng)
    xt = torch.from_numpy(x)
    assert kernels.usable(xt)
    fast, slow = both_ways(quantize_fp8_values, xt)
    assert calls["fp8_quantize_values"] == 1
    assert_same_results(fast, slow)
    codes, scales, values = fast
    np.testing.assert_array_equal(scales.numpy(), 127 + k)
    y = x.reshape(-1, 32) / (2.0 ** k.reshape(-1, 1)).astype(F32)  # the exact quotients
    raw = y.astype(ml.float8_e4m3fn).view(np.uint8).reshape(x.shape)
    want = np.where(raw == 0x80, 0, raw)  # the package stores -0 as +0
    np.testing.assert_array_equal(codes.numpy(), want)
    decoded = want.view(ml.float8_e4m3fn).astype(F32).reshape(-1, 32) * (2.0 ** k.reshape(-1, 1)).astype(F32)
    np.testing.assert_array_equal(values.numpy(), decoded.reshape(x.shape))
    assert_same_results(*both_ways(quantize_fp8, xt))
    assert_same_results(*both_ways(dequantize_fp8, codes, scales))
    # Ties really occur: each went to the even code, some up and some down.
    grid = e4m3_grid().astype(np.float64)
    ties = np.isin(np.abs(y), ((grid[:-1] + grid[1:]) / 2).astype(F32)).reshape(x.shape)
    tie_codes = codes.numpy()[ties]
    up = np.abs(values.numpy()[ties]) > np.abs(x[ties])
    assert ties.sum() > 200 and (tie_codes & 1 == 0).all() and 0 < up.sum() < ties.sum()


def test_e4m3_block_scales_of_fp4_round_like_ml_dtypes(calls):
    """FP4 "e4m3" blocks: the scale byte is E4M3(clamp(amax / 6, 2**-9, 448)), so amaxes near 6 * every grid
    point, tie and neighbour (and beyond the clamp) exercise the kernel's E4M3 rounding of the scale."""
    ml = require("ml_dtypes")
    rng = np.random.default_rng(1)
    s = np.abs(near_grid(e4m3_grid(), rng, 470.0))
    amax = np.concatenate([s * F32(6), (s * F32(6)).astype(np.float64).astype(F32) * F32(0.25),
                           np.array([0, 1e-30, 6 * 2.0**-10, 3e38, np.inf], F32)]).astype(F32)
    rest = rng.uniform(-1, 1, (len(amax), 15)).astype(F32) * amax[:, None]
    x = np.concatenate([amax[:, None] * np.where(rng.random((len(amax), 1)) < 0.5, -1, 1).astype(F32), rest], 1)
    xt = torch.from_numpy(x.reshape(-1, 16))
    fast, slow = both_ways(quantize_fp4, xt, 16, "e4m3")
    assert calls["fp4_quantize"] == 1
    assert_same_results(fast, slow)
    with np.errstate(invalid="ignore"):
        want = np.clip(amax / F32(6), F32(2**-9), F32(448)).astype(ml.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(fast[1].numpy()[:, 0], want)
    assert_same_results(*both_ways(fake_quant_fp4, xt, 16, "e4m3"))


def test_e2m1_rounding_of_every_grid_point_tie_and_neighbour(calls):
    ml = require("ml_dtypes")
    rng = np.random.default_rng(2)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)
    values = np.concatenate([near_grid(grid, rng, 6.0), rng.uniform(0, 0.26, 200).astype(F32)])
    x, k = exact_blocks(values, 32, 6.0, rng)
    xt = torch.from_numpy(x)
    fast, slow = both_ways(quantize_fp4, xt, 32, "ue8m0")
    assert calls["fp4_quantize"] == 1
    assert_same_results(fast, slow)
    codes, scales = fast
    np.testing.assert_array_equal(scales.numpy(), 127 + k)
    y = x.reshape(-1, 32) / (2.0 ** k.reshape(-1, 1)).astype(F32)
    raw = y.astype(ml.float4_e2m1fn).view(np.uint8).reshape(x.shape) & 0x0F
    raw = np.where(raw == 8, 0, raw)  # -0 stored as +0
    np.testing.assert_array_equal(codes.numpy(), (raw[:, 0::2] | (raw[:, 1::2] << 4)).astype(np.uint8))
    assert_same_results(*both_ways(fake_quant_fp4, xt, 32, "ue8m0"))
    assert_same_results(*both_ways(dequantize_fp4, codes, scales, 32, "ue8m0"))


# --------------------------------------------------------------------------------- codecs on random data
SPECIALS = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-45, 3e38, -1e30, 1e-30])
SHAPES = [(32,), (5, 64), (2, 3, 96), (0, 64), (4, 0)]
FP4_SHAPES = SHAPES  # (0, 64) pins the torch code's decode of zero elements (a view as [0, -1] used to fail)


def special_data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values of very different magnitudes per row, with the special values mixed in (about 1 in 60)
    and, when there are enough rows, a row of zeros and a row of specials only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10.0 ** (torch.rand((*shape[:-1], 1), generator=g) * 12 - 6)
    pick = torch.randint(0, len(SPECIALS), shape, generator=g)
    x = torch.where(torch.rand(shape, generator=g) < 1 / 60, SPECIALS[pick], x)
    if shape[-1] and x.numel() >= 3 * shape[-1]:
        rows = x.view(-1, shape[-1])
        rows[0] = 0.0
        rows[1] = SPECIALS[pick.view(-1, shape[-1])[1]]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_codec_equals_the_torch_code(calls, shape, dtype):
    x = special_data(shape, dtype, seed=len(shape) * 100 + shape[-1])
    assert kernels.usable(x)
    assert_same_results(*both_ways(quantize_fp8, x))
    assert_same_results(*both_ways(quantize_fp8_values, x))
    assert_same_results(*both_ways(fake_quant_fp8, x))
    codes, scales = quantize_fp8(x)
    for out in (torch.float32, torch.bfloat16):
        assert_same_results(*both_ways(dequantize_fp8, codes, scales, dtype=out))
    kernel_runs = 1 if x.numel() else 0  # an empty tensor takes the torch code (the kernels refuse it)
    assert calls["fp8_quantize_values"] == 4 * kernel_runs and calls["fp8_dequantize"] == 2 * kernel_runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", FP4_SHAPES, ids=str)
@pytest.mark.parametrize("block,fmt", [(16, "e4m3"), (32, "ue8m0")])
def test_fp4_codec_equals_the_torch_code(calls, shape, dtype, block, fmt):
    x = special_data(shape, dtype, seed=len(shape) * 100 + shape[-1] + block)
    assert_same_results(*both_ways(quantize_fp4, x, block, fmt))
    assert_same_results(*both_ways(fake_quant_fp4, x, block, fmt))
    codes, scales = quantize_fp4(x, block, fmt)
    for out in (torch.float32, torch.bfloat16):
        assert_same_results(*both_ways(dequantize_fp4, codes, scales, block, fmt, dtype=out))
    kernel_runs = 1 if x.numel() else 0  # an empty tensor takes the torch code (the kernels refuse it)
    assert calls["fp4_quantize"] == 3 * kernel_runs and calls["fp4_dequantize"] == 2 * kernel_runs


def test_dequantize_every_code_and_scale_byte(calls):
    every = torch.arange(256, dtype=torch.uint8)
    # FP8: row r holds all 256 codes, with scale byte r on each of its blocks (255 = NaN), then shuffled codes.
    codes = torch.cat((every.expand(256, 256), every[torch.randperm(256, generator=torch.Generator().manual_seed(3))]
                       .expand(256, 256)), 1).contiguous()
    scales = every[:, None].expand(256, 16).contiguous()
    for out in (torch.float32, torch.bfloat16):
        assert_same_results(*both_ways(dequantize_fp8, codes, scales, dtype=out))
    # Each block its own scale byte (the kernel decodes 32 values, a block, at a time with AVX-512).
    g = torch.Generator().manual_seed(4)
    assert_same_results(*both_ways(dequantize_fp8, codes, torch.randint(0, 256, (256, 16), generator=g,
                                                                        dtype=torch.uint8)))
    # FP4: every packed byte under every scale byte, E4M3 (0x7F / 0xFF are NaN) and UE8M0; then each block's scale
    # its own (the kernel decodes 32 values at a time: two blocks of 16 side by side) and a row length that
    # leaves a last block of 16 alone.
    for block, fmt in ((16, "e4m3"), (32, "ue8m0")):
        fp4_scales = every[:, None].expand(256, 512 // block).contiguous()
        assert_same_results(*both_ways(dequantize_fp4, every.expand(256, 256).contiguous(), fp4_scales, block, fmt))
        mixed = torch.randint(0, 256, (256, 512 // block), generator=g, dtype=torch.uint8)
        assert_same_results(*both_ways(dequantize_fp4, every.expand(256, 256).contiguous(), mixed, block, fmt))
    short = torch.randint(0, 256, (5, 24), generator=g, dtype=torch.uint8)
    assert_same_results(*both_ways(dequantize_fp4, short, torch.randint(100, 140, (5, 3), generator=g,
                                                                        dtype=torch.uint8), 16, "e4m3"))
    assert calls["fp8_dequantize"] == 3 and calls["fp4_dequantize"] == 5
    # The E4M3 NaN codes decode to NaN in the kernel too (the table is not all zeros or all finite).
    values = dequantize_fp8(codes[127:128, :256], scales[127:128, :8])
    assert values.isnan().sum() == 2 and values[0, 0x38].item() == 1.0


# ------------------------------------------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("heads", [None, 4])
@pytest.mark.parametrize("d,r,yarn", [(32, 16, True), (16, 16, False), (64, 8, True)])
def test_rope_equals_the_torch_code(calls, dtype, inverse, heads, d, r, yarn):
    cfg = tiny_config()
    rope = RotaryEmbedding(r, 10000.0 if yarn else 160000.0, cfg.yarn if yarn else None)
    assert install(rope).modules == {"RotaryEmbedding": 1}
    g = torch.Generator().manual_seed(d + r)
    B, T = 3, 7
    x = (torch.randn((B, T, d) if heads is None else (B, T, heads, d), generator=g) * 4).to(dtype)
    positions = torch.randint(0, 200_000, (B, T), generator=g)
    assert kernels.usable(x, *rope.phases(positions))
    fast, slow = both_ways(rope, x, positions, inverse=inverse)
    assert calls["rope"] == 1
    assert_same_bits(fast, slow)
    assert not torch.equal(fast[..., -r:], x[..., -r:]) and torch.equal(fast[..., :-r], x[..., :-r])


# ------------------------------------------------------------------------------------------- paged KV cache
def window_call(cache: PagedKVCache, slots: list[int], layer: int, starts: list[int], kv: torch.Tensor,
                dtype: torch.dtype = torch.float32):
    T = kv.shape[1]
    positions = (torch.tensor(starts)[:, None] + torch.arange(T)).contiguous()
    ctx = PagedContext(cache, slots, [[1]] * len(slots), positions, [s + T for s in starts], dtype)
    return ctx.window(layer, kv)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_window_step_equals_the_torch_code(calls, model_dtype):
    cfg = tiny_config()
    fast_cache, slow_cache = (PagedKVCache(cfg, num_pages=2, block_size=8, num_slots=3) for _ in range(2))
    R, d = fast_cache.window_rows, cfg.head_dim
    g = torch.Generator().manual_seed(4)

    def kv(B, T, dtype=torch.float32, scale=1.0):
        return (torch.randn(B, T, d, generator=g) * scale).to(dtype)

    big = kv(1, 20, torch.bfloat16, 1e5)
    big[0, 3, 5] = float("inf")  # a NaN-scaled block
    steps = [  # (slots, layer, first positions, new rows)
        ([0, 2], 0, [0, 5], kv(2, R + 8)),  # longer than the ring: it wraps over rows read first
        ([0, 2], 0, [R + 8, R + 13], kv(2, 3, torch.bfloat16)),
        ([1], 3, [0], torch.zeros(1, 1, d)),  # one row (a view of the rings in the torch code); amax floor
        ([1], 3, [1], big),
        ([2, 0], 0, [R + 16, R + 11], kv(2, 1, scale=1e-6)),  # decode, rows in another order
        ([1, 0, 2], 3, [21, 0, 100], kv(3, R + 1, torch.bfloat16)),
        ([1, 0, 2], 3, [R + 22, R + 1, 101 + R], kv(3, 1)),
        ([0], 0, [R + 9], kv(1, 2)),  # positions already in the ring (rejected drafts): they must read -1
    ]
    for step, (slots, layer, starts, new) in enumerate(steps):
        held = fast_cache.window_pos[slots[0], layer].long()
        keys, key_pos = window_call(fast_cache, slots, layer, starts, new, model_dtype)
        assert calls["window_step"] == step + 1
        with kernels.disabled():
            want_keys, want_pos = window_call(slow_cache, slots, layer, starts, new, model_dtype)
        assert keys.dtype == torch.float32  # a bf16 model's rows decode to fp32 too (what attention computes in)
        assert_same_bits(keys, want_keys)
        assert torch.equal(key_pos, want_pos), step
        for name in ("window_codes", "window_scales", "window_pos"):
            assert torch.equal(getattr(fast_cache, name), getattr(slow_cache, name)), (step, name)
    # The last step: earlier rows came back, rows held at or past its first position read -1.
    assert (held >= 0).sum() > 10 and (held >= R + 9).sum() >= 2
    assert torch.equal(key_pos[0, :R], torch.where((held >= 0) & (held < R + 9), held, -1))


def entries_context(cache: PagedKVCache, T: int, write_from: list[int],
                    model_dtype: torch.dtype = torch.float32) -> PagedContext:
    positions = torch.arange(T).expand(2, T).contiguous()
    return PagedContext(cache, [0, 1], [[1, 2, 3], [4, 5, 6]], positions, [T, T], model_dtype, write_from)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_entries_equal_the_torch_code(calls, dtype, model_dtype):
    cfg = tiny_config()
    fast_cache, slow_cache = (PagedKVCache(cfg, num_pages=8, block_size=8, num_slots=2) for _ in range(2))
    g = torch.Generator().manual_seed(5)
    T, write_from = 20, [0, 8]
    fast_ctx, slow_ctx = (entries_context(c, T, write_from, model_dtype) for c in (fast_cache, slow_cache))
    for layer, m in ((2, 2), (4, 1)):
        G = T // m
        group = torch.arange(G).expand(2, G).clone()
        group[0, -1] = group[1, 2] = -1  # an open pair / nothing to store
        entries = (torch.randn(2, G, cfg.head_dim, generator=g) * 3).to(dtype)
        entries[0, 1] = 0.0
        entries[1, 5, 7] = float("nan")
        keys = torch.randn(2, G, cfg.index_head_dim, generator=g).to(dtype)
        fast_ctx.add_entries(layer, entries, keys, group)
        with kernels.disabled():
            slow_ctx.add_entries(layer, entries, keys, group)
        # Nothing to store: no count, no bytes.
        none = torch.full((2, 1), -1)
        fast_ctx.add_entries(layer, entries[:, :1], keys[:, :1], none)
        with kernels.disabled():
            slow_ctx.add_entries(layer, entries[:, :1], keys[:, :1], none)
        expected = int(((group >= 0) & (group * m >= torch.tensor(write_from)[:, None])).sum())
        assert fast_ctx.entries_written[layer] == slow_ctx.entries_written[layer] == expected
        # The torch code sends skipped entries to the null page; every other page holds the same bytes.
        real = slice(BlockManager.NULL_PAGE + 1, None)
        for fast_pool, slow_pool in zip(fast_cache.pools[layer], slow_cache.pools[layer], strict=True):
            assert torch.equal(fast_pool[real], slow_pool[real]), layer
        # write_from: row 1's first page (positions 0..7) was not written; its second page was.
        codes = fast_cache.pools[layer][0]
        assert (codes[4] == 0).all() and (codes[5] != 0).any() and (codes[1] != 0).any()
    assert calls["fp4_scatter"] == 4

    # Reads, from the same cache both ways.
    for layer, m in ((2, 2), (4, 1)):
        G = T // m
        reader = entries_context(fast_cache, T, write_from, model_dtype)
        with kernels.disabled():
            want_keys = entries_context(fast_cache, T, write_from, model_dtype).index_keys(layer)
        assert want_keys.dtype == torch.float32
        assert_same_bits(reader.index_keys(layer), want_keys)
        ids = torch.randint(0, G, (2, 3, 5), generator=g)
        assert_same_results(*both_ways(reader.index_keys_at, layer, ids))
        few = torch.randint(-1, G, (2, 3, 4), generator=g)  # decode: only the picked entries are decoded
        many = torch.randint(-1, G, (2, 30, 8), generator=g)  # prefill: every entry decoded once, then picked
        for idx in (few, many):
            fast = entries_context(fast_cache, T, write_from, model_dtype).gather_entries(layer, idx)
            with kernels.disabled():
                slow = entries_context(fast_cache, T, write_from, model_dtype).gather_entries(layer, idx)
            assert_same_bits(fast, slow)
            assert (fast[idx < 0] == 0).all() and (fast[idx >= 0] != 0).any()
    assert calls["fp4_gather"] >= 8


def test_entry_indices_past_the_block_table_raise_index_error():
    cfg = tiny_config()
    cache = PagedKVCache(cfg, num_pages=4, block_size=8, num_slots=1)
    codes, scales = cache.pools[4][:2]  # ratio 1: 8 entries per page
    table = torch.tensor([[1, 2]])[:, :1]  # one column, followed in memory by a valid page
    assert table.is_contiguous() and table.shape == (1, 1)
    ok = kernels.fp4_gather(codes, scales, 16, "e4m3", table, 1, 8, torch.tensor([[0, 7, -1]]))
    assert ok.shape == (1, 3, cfg.head_dim)
    with pytest.raises(IndexError):
        kernels.fp4_gather(codes, scales, 16, "e4m3", table, 1, 8, torch.tensor([[0, 8]]))
    with pytest.raises(IndexError):  # a page number past the pool
        kernels.fp4_gather(codes, scales, 16, "e4m3", torch.tensor([[4]]), 1, 8, torch.tensor([[0]]))
    x = torch.randn(1, 2, cfg.head_dim)
    assert kernels.fp4_scatter(codes, scales, 16, "e4m3", table, 1, 8, torch.tensor([[0, 7]]), torch.zeros(1,
                               dtype=torch.long), x) == 2
    with pytest.raises(IndexError):
        kernels.fp4_scatter(codes, scales, 16, "e4m3", table, 1, 8, torch.tensor([[7, 9]]),
                            torch.zeros(1, dtype=torch.long), x)


# ------------------------------------------------------------------------------------- RMSNorm and mHC
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


def test_rms_norm_is_close_in_inference_mode_only(calls):
    g = torch.Generator().manual_seed(7)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    assert install(norm).modules == {"RMSNorm": 1}
    x = torch.randn(2, 5, 64, generator=g) * 3
    close_in_inference_mode_and_exact_outside(calls, "rms_norm", norm, x)
    calls.clear()
    # The weightless kernel (no weight: the normalisation hc_mix's kernel does per row) against rms_normalize.
    odd = torch.randn(3, 37, generator=g)  # a width that is not a multiple of the kernel's 8 lanes
    for rows, eps in ((x * 1e-8, 1e-20), (odd, 1e-6)):
        with torch.inference_mode():
            got = kernels.rms_norm(rows, None, eps)
        torch.testing.assert_close(got, rms_normalize(rows, eps), rtol=RTOL, atol=ATOL)
    calls.clear()
    wide = RMSNorm(64, 1e-6).double()
    assert install(wide).modules == {}  # a float64 weight: nothing installed
    with torch.inference_mode():  # float64 stays on the torch code, also through an fp32 norm
        wide(x.double())
        norm(x.double())
    assert calls["rms_norm"] == 0
    xb = x.bfloat16()
    with torch.inference_mode():  # bf16: the kernel on the upcast input, the result in bf16
        got = norm(xb)
    assert calls["rms_norm"] == 1 and got.dtype == torch.bfloat16
    with torch.no_grad():
        want = norm(xb)
    assert calls["rms_norm"] == 1
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)  # one bf16 rounding apart at most


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


# --------------------------------------------------------------------------------------------- the engine
def test_engine_generates_the_same_greedy_tokens_with_and_without_the_kernels(calls):
    from deepseek_v41.engine import LLM, SamplingParams
    from deepseek_v41.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(tiny_config().replace(max_position_embeddings=8192)).eval().float()
    g = torch.Generator().manual_seed(12)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (40, 37)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run():
        outs = [o.outputs[0] for o in LLM(model, max_model_len=256).generate(prompts, params)]
        logprobs = [[step[t].logprob for t, step in zip(o.token_ids, o.logprobs, strict=True)] for o in outs]
        return [o.token_ids for o in outs], torch.tensor(logprobs)

    tokens, logprobs = run()
    used = dict(calls)
    with kernels.disabled():
        want_tokens, want_logprobs = run()
    assert dict(calls) == used  # nothing more ran with the kernels off
    for name in ("window_step", "fp4_scatter", "fp4_gather", "rope", "rms_norm", "hc_mix", "hc_collapse",
                 "hc_expand", "fp4_quantize"):
        assert used.get(name, 0) > 0, name
    assert used.get("linear", 0) > 0  # GroupedLinear (wo_a); plain fp32 projections stay on ATen
    assert tokens == want_tokens and all(len(t) == 12 for t in tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-4)


# ------------------------------------------------------------------------ inputs outside the kernels' limits
def test_fp4_odd_block_sizes_equal_the_torch_code(calls):
    # Six values in blocks of 3: the torch code accepts them (even n). The row is a prefix of a wider buffer so
    # the kernel's read past its end stays inside our memory.
    x = torch.tensor([[1.0, 2.0, 100.0, 0.5, 0.25, 3.0, 7.0, 7.0]])[:, :6]
    assert x.is_contiguous()
    assert_same_results(*both_ways(quantize_fp4, x, 3, "ue8m0"))


ISOLATED = {
    # The mHC kernel keeps the mixing logits in float[16 * 18]: more than 16 streams must take the torch code.
    "hc_mult above 16": """
import torch
from deepseek_v41 import kernels
from deepseek_v41.kernels.fast.block import hc_mix
hc, D = 24, 8
g = torch.Generator().manual_seed(0)
args = (torch.randn(1, 1, hc, D, generator=g), torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.05,
        torch.zeros((2 + hc) * hc), torch.ones(3), hc, 1e-6, 1e-6, 20)
with torch.inference_mode():
    fast = hc_mix(*args)
    with kernels.disabled():
        slow = hc_mix(*args)
for a, b in zip(fast, slow):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
""",
    # The RoPE kernel reads cos / sin as [B * T, r]; phases of positions [1, T] broadcast in the torch code only.
    "rope positions [1, T] for x [B, T]": """
import torch
from deepseek_v41 import kernels
from deepseek_v41.model.rope import RotaryEmbedding
from deepseek_v41.kernels.fast import install
rope = RotaryEmbedding(16, 10000.0, None)
assert install(rope).modules == {"RotaryEmbedding": 1}
x, positions = torch.randn(3, 5, 4, 32), torch.arange(5)[None]
fast = rope(x, positions)
with kernels.disabled():
    slow = rope(x, positions)
assert torch.equal(fast, slow), (fast - slow).abs().max()
""",
    # moe_bf16 reads the router weights as fp32 [N, k], the shared expert's three weights in one dtype and every
    # row as wide as the experts; the router kernel reads x rows as wide as its weight. Inputs that break these
    # must take the torch code (which raises where the dtypes or widths do not match).
    "MoE inputs the moe_bf16 and router kernels cannot read": """
import torch
from deepseek_v41 import kernels
from deepseek_v41.kernels.fast import install
from deepseek_v41.model.moe import MoE

def small_moe(dtype=torch.float32):
    m = MoE(dim=64, inter_dim=32, n_experts=8, topk=2, n_shared=1, swiglu_limit=7.0, route_scale=1.5,
            norm_topk=True, with_bias_vl=False).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g).mul(8).round().div(32))  # exact in bf16
        m.gate.bias[3] = 100.0
    return m.to(dtype)

def run(make, x, fast):
    m = make()
    try:
        if fast:
            install(m)
            with torch.inference_mode():
                return m(x)
        with kernels.disabled(), torch.no_grad():
            return m(x)
    except RuntimeError:
        return RuntimeError

def shared(name):
    def make():
        m = small_moe()
        getattr(m.shared_experts, name).bfloat16()
        return m
    return make

def hooked_gate():
    m = small_moe()
    m.gate.register_forward_hook(lambda module, args, out: (out[0], out[1].bfloat16()))
    return m

def fp32_expert_in_bf16():
    m = small_moe(torch.bfloat16)
    m.experts[3].float()
    return m

x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1))
for make, xs in [(shared("w1"), x), (shared("w2"), x), (small_moe, torch.randn(1, 3, 80)),
                 (fp32_expert_in_bf16, x.bfloat16())]:
    fast, slow = run(make, xs, True), run(make, xs, False)
    assert fast is RuntimeError and slow is RuntimeError, (make, fast, slow)
fast, slow = run(hooked_gate, x, True), run(hooked_gate, x, False)
torch.testing.assert_close(fast, slow, rtol=2e-2, atol=2e-2)
""",
}


@pytest.mark.parametrize("case", list(ISOLATED))
def test_inputs_outside_the_kernel_limits_take_the_torch_code(case):
    """Run in a child process: a kernel called outside its limits would read or write past a buffer."""
    done = subprocess.run([sys.executable, "-c", ISOLATED[case]], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-1000:]}"


# ------------------------------------------------------------------- few-query attention, router, SwiGLU, MoE
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


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("k", [None, 0, 5])
def test_attend_few_is_close_in_inference_mode_only(calls, T, k):
    args = attention_inputs(T, k, seed=20 + T + (k or 0))
    q, q_pos, keys, key_pos, window = args[:5]
    # The inputs cover every case of the mask (row 0) and queries that see no key (row 1).
    seen = visible(q_pos, key_pos, window)
    assert not seen[1].any() and 0 < seen[0, 0].sum() < (key_pos[0] >= 0).sum()
    assert (q_pos[1] - window < -1).all()  # an empty key is masked by its -1 alone
    with kernels.disabled(), torch.no_grad():
        want = sparse_attention(*args)
    with torch.inference_mode():
        got = sparse_attention(*args)
    assert calls["attend_few"] == 1
    assert_close_to_scale(got, want, ATTEND_TOL)
    if not k:  # only the sink is left for row 1's queries: the output is 0 both ways
        assert (want[1] == 0).all() and (got[1] == 0).all()
    else:  # the entries are all they attend to
        assert want[1].abs().min() > 0
    with torch.no_grad():
        plain = sparse_attention(*args)
    assert calls["attend_few"] == 1, "attend_few ran outside inference mode"
    assert_same_bits(plain, want)


def test_attend_few_ignores_masked_picks_and_keys(calls):
    """A pick of -1 and a key outside the window count for nothing: changing what they read changes no bit of the
    kernel's result (the torch code gives them probability 0)."""
    q, q_pos, keys, key_pos, window, topk, gather, sink, scale = attention_inputs(3, 5, seed=30)
    with torch.inference_mode():
        got = _attend_few(q, q_pos, keys, key_pos, window, topk, gather, sink, scale)
        hidden = ~visible(q_pos, key_pos, window).any(1)  # [B, L]: seen by no query
        other_keys = torch.where(hidden[..., None], keys * -7 + 3, keys)

        def other_gather(idx):
            return torch.where((idx < 0)[..., None], 5.0, gather(idx))

        again = _attend_few(q, q_pos, other_keys, key_pos, window, topk, other_gather, sink, scale)
    assert calls["attend_few"] == 2 and hidden.sum() > 6
    assert_same_bits(again, got)
    with kernels.disabled(), torch.no_grad():
        want = _attend_few(q, q_pos, keys, key_pos, window, topk, gather, sink, scale)
    assert_close_to_scale(got, want, ATTEND_TOL)


def router(n_experts: int, topk: int, norm_topk: bool, seed: int, dim: int = 64) -> Gate:
    g = torch.Generator().manual_seed(seed)
    gate = Gate(dim, n_experts, topk, 2.5, norm_topk, with_bias_vl=False).eval()
    with torch.no_grad():
        gate.weight.copy_(torch.randn(n_experts, dim, generator=g) * 0.1)
        gate.bias.copy_(torch.randn(n_experts, generator=g) * 0.1)
    fast.install(gate)
    return gate


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
    """The copies the fast backend packs for ``moe``, installed (again) now."""
    fast.install(moe)
    return moe.__dict__["_fast_moe"]


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


@pytest.mark.parametrize("generic", ["-mno-avx512f", "-march=x86-64"])
def test_moe_fp4_of_the_generic_code_gives_the_same_bits(tmp_path, monkeypatch, generic):
    """The C code without AVX-512 (weight_pairs', x_pairs' and sum16's generic forms, the index scores' even / odd
    path key by key where AVX-512 puts 16 keys in vector lanes) or without any AVX (sum8's too), built into a
    second library with the loader's flags, gives the default build's bits for moe_fp4, moe_bf16, index scores
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
    monkeypatch.setattr(kernels, "CFLAGS", flags)
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

# ---------------------------------------------------------------------------------- dense projections (GEMV)
# kernels.linear sums in fp32 in another order than ATen. A bf16 output is that sum rounded once to nearest even,
# as ATen rounds its own fp32 sums: the two are at most one bf16 ulp apart (measured: 1 to 2 elements in 5,000 differ
# at all) except where a sum cancels to near 0.
LINEAR_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                 (torch.float32, torch.bfloat16)]  # (x, weight)
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


# ------------------------------------------------------------------------------------ bf16 through the kernels
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


# bf16 experts, kernels vs torch code. Expert: the same bf16 roundings both ways (measured: identical for 100
# seeds). MoE: moe_bf16 keeps the projections' outputs in fp32 where the torch code rounds them to bf16; measured at
# most 7.1e-3 of the largest output (30 models x 4 token counts).
EXPERT_BF16_TOL = 2e-2


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


def test_bf16_engine_logits_are_close_with_and_without_the_kernels(calls):
    """A bf16 model's greedy decode with the kernels, then without them forced along the same tokens (bf16 rounds
    differently in the two, and the tokens of a random model part after a few steps otherwise): each forward's
    logits are close. Measured over 8 random models: at most 0.19 of the largest logit, 0.09 on average relative
    to the logits' norm (the discrete routing and top-k picks amplify bf16's rounding); a wrong group in the
    GEMV kernel gives > 1. The unit tests above pin the precision of each kernel."""
    from deepseek_v41.engine import LLM, SamplingParams
    from deepseek_v41.model.transformer import Transformer

    torch.manual_seed(1)
    model = Transformer(tiny_config().replace(max_position_embeddings=8192)).eval().bfloat16()
    g = torch.Generator().manual_seed(14)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (20, 13)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(force: list[torch.Tensor] | None = None):
        """Tokens and the last position's logits of each forward; ``force``: each forward's tokens to pick."""
        logits = []
        llm = LLM(model, max_model_len=256)  # installs the fast backend (nothing with the kernels off)
        head = model.lm_head  # the installed LM head, or the reference one

        def spy(streams, pre):
            out = head(upcast(model.norm(collapse(streams, pre))))  # Transformer.logits with that head
            logits.append(out[:, -1].clone())
            if force is not None:
                out = out.clone()
                out[torch.arange(out.shape[0]), -1, force[len(logits) - 1]] = 1e4
            return out

        model.logits = spy
        try:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            del model.logits
        return tokens, logits

    tokens, logits = run()
    used = dict(calls)
    with kernels.disabled():
        want_tokens, want_logits = run(force=[step.argmax(-1) for step in logits])
    assert dict(calls) == used  # nothing ran with the kernels off
    for name in ("linear", "attend_few", "gate", "swiglu", "moe_bf16", "index_scores", "rms_norm", "hc_mix",
                 "hc_collapse", "hc_expand", "window_step", "fp4_gather", "fp4_scatter", "rope"):
        assert used.get(name, 0) > 0, name
    # Forwards: each prompt's prefill (its first token), then 5 batched decode steps.
    assert want_tokens == tokens and len(logits) == len(want_logits) == 2 + 5
    norms = []
    for got, want in zip(logits, want_logits, strict=True):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        assert_close_to_scale(got, want, 0.3)
        norms.append(((got - want).norm() / want.norm()).item())
    assert sum(norms) / len(norms) <= 0.15, norms


# ------------------------------------------------------------------------------------- indexer scores, direct
# (64, 16, 3): c * H * di / 32 = 96 query vectors, beyond the even / odd path's 64 (cpu_kernels.c
# INDEX_PAIR_VECTORS), and a table too large: the widening path; (32, 16, 5): 80 vectors, a table of 65536 floats:
# the lookup table from INDEX_LUT_ROWS keys; the others take the even / odd path at any length (with AVX-512 16 keys
# at a time in vector lanes, then the last n % 16 of a chunk of 256; (32, 4, 1): a decode query of the bench's
# indexer shape, whose last keys go two per pass, then the odd one).
@pytest.mark.parametrize("di,H,c", [(32, 4, 3), (32, 4, 1), (64, 5, 3), (32, 8, 3), (64, 16, 3), (32, 16, 5)])
@pytest.mark.parametrize("n", [100, kernels.INDEX_LUT_ROWS + 37])  # below / above the lookup-table threshold
@pytest.mark.parametrize("ratio", [4, 3])  # 4: page-aligned pool (walked page by page); 3: block_size 8 % 3 != 0
def test_index_scores_equal_scoring_the_decoded_keys(di, H, c, n, ratio):
    """kernels.index_scores (its lookup-table, even / odd and widening paths) against decoding every key of the pool
    through the block tables and scoring with IndexScorer, to fp32 rounding; an entry past its table raises."""
    block_size = 8
    codes, scales, tables, q, w = index_inputs(di, H, c, n, ratio, block_size, seed=di + H + n + ratio)
    per_page, cols = block_size // ratio, tables.shape[1]
    got = kernels.index_scores(codes, scales, 32, "ue8m0", tables, ratio, block_size, q, w, n)
    s = torch.arange(n)
    page = tables[:, (s * ratio) // block_size]  # [B, n]
    keys = dequantize_fp4(codes[page, s % per_page], scales[page, s % per_page], 32, "ue8m0")  # [B, n, di]
    want = IndexScorer()(q, w, keys)
    assert (want > 0).float().mean() > 0.3
    assert_close_to_scale(got, want, 2e-6)
    with pytest.raises(IndexError):
        kernels.index_scores(codes, scales, 32, "ue8m0", tables[:, : cols - 1], ratio, block_size, q, w, n)


def test_index_scores_read_scale_bytes_255_as_nan_and_0_as_2_to_the_minus_127():
    """Keys whose codes are all 1.0 scored by one head with positive query values, so no product is 0 x scale: a
    key whose scale byte is 255 scores NaN (an infinite scale would score +inf), one whose byte is 0 a positive
    score (2**-127 per value), as IndexScorer on the keys dequantize_fp4 decodes; keys 0 .. 31 take the even / odd
    path 16 at a time in lanes (with AVX-512), 32 .. 39 one at a time."""
    n, nan_keys, tiny_keys = 40, [3, 20, 37], [5, 21, 38]
    codes = torch.full((n, 1, 16), 0x22, dtype=torch.uint8)  # E2M1 1.0 in both nibbles
    scales = torch.full((n, 1, 1), 127, dtype=torch.uint8)
    scales[nan_keys], scales[tiny_keys] = 255, 0
    q, w = torch.rand(1, 1, 1, 32, generator=torch.Generator().manual_seed(5)) + 0.5, torch.ones(1, 1, 1)
    got = kernels.index_scores(codes, scales, 32, "ue8m0", torch.arange(n)[None], 1, 1, q, w, n)[0, 0]
    want = IndexScorer()(q, w, dequantize_fp4(codes[:, 0], scales[:, 0], 32, "ue8m0")[None])[0, 0]
    assert got.isnan().nonzero().flatten().tolist() == want.isnan().nonzero().flatten().tolist() == nan_keys
    assert (got[tiny_keys] > 0).all() and (got[tiny_keys] < 2.0**-120).all()
    assert torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------- indexer top-k
@pytest.mark.parametrize("N,k", [(1, 1), (7, 3), (300, 64), (5000, 64), (64, 64)])
def test_topk_set_kernel_gives_the_torch_codes_indices(calls, N, k):
    """Indices only, so exactly the torch code's: random scores with many exact ties (FP4-like values), runs of
    -inf (invisible entries), +inf, -0 / 0; per row the k largest, ties to the lowest indices, ascending."""
    g = torch.Generator().manual_seed(N + k)
    rows = torch.randint(0, 6, (2, 3, N), generator=g).float() * 0.5  # ties everywhere
    rows[0, 0, N // 2:] = float("-inf")  # fewer visible than k in some rows
    rows[0, 1, : N // 3] = -0.0
    rows[1, 2, -1] = float("inf")
    if N > 2:
        rows[1, 1, 1:] = float("-inf")  # one visible entry
    for drop in (False, True):
        calls.clear()
        got = topk_entries(rows, k) if drop else topk_set(rows, k)
        assert calls["topk_set"] == 1
        with kernels.disabled():
            want = topk_entries(rows, k) if drop else topk_set(rows, k)
        assert calls["topk_set"] == 1
        assert torch.equal(got, want)
    if N >= 7:
        assert (topk_entries(rows, k) == -1).any()  # -inf picks read -1


@pytest.mark.parametrize("N,k", [(100, 1), (5003, 64), (16411, 64)])
def test_topk_set_kernel_on_distinct_scores_in_any_order(calls, N, k):
    """Distinct scores (random, rising: every run of 16 enters the heap, falling: none after the first k,
    a late maximum in a short last run): the kernel's picks are the torch code's."""
    g = torch.Generator().manual_seed(N)
    noise = torch.randn(N, generator=g)
    late = torch.randn(N, generator=g)
    late[-1] = 100.0
    rows = torch.stack([noise, torch.arange(N) + noise * 0.1, -torch.arange(N) + noise * 0.1, late])
    got = topk_set(rows, k)
    with kernels.disabled():
        want = topk_set(rows, k)
    assert calls["topk_set"] == 1 and torch.equal(got, want)


def test_topk_set_kernel_leaves_nan_rows_and_large_k_to_the_torch_code(calls):
    scores = torch.tensor([[0.5, float("nan"), 1.0, 2.0]])
    got = topk_set(scores, 2)
    with kernels.disabled():
        want = topk_set(scores, 2)
    assert calls["topk_set"] == 1 and torch.equal(got, want)  # the kernel declined; torch.topk ranks NaN first
    assert kernels.topk_set(scores, 2) is None and kernels.topk_set(scores[:, 2:], 3) is None
    with pytest.raises(RuntimeError):
        topk_set(scores[:, 2:], 3)  # k > N: torch.topk's error
