"""The FP8 / FP4 codecs and the paged FP4 entries (csrc/codecs.c) against the torch code, bit for bit:
each test runs the same call with the kernels and inside ``kernels.disabled()``; E4M3 / E2M1 codes are also
checked against ml_dtypes. The tests also check that the kernel was really called (a spy on the module's entry
points). Without a C compiler these tests skip, except under CI=true, where a missing library fails.
"""


import numpy as np
import pytest
import torch
from kernel_cases import F32, assert_same_bits, assert_same_results, both_ways, entries_context
from optional_deps import require

from deepseek_v41 import kernels
from deepseek_v41.cache.block_manager import BlockManager
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.config import tiny_config
from deepseek_v41.quant import (
    dequantize_fp4,
    dequantize_fp8,
    fake_quant_fp4,
    fake_quant_fp8,
    quantize_fp4,
    quantize_fp8,
    quantize_fp8_values,
)


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
