"""The SWA window ring's step (csrc/window.c) against the torch code of the paged KV cache, bit for bit.
"""


import pytest
import torch
from kernel_cases import assert_same_bits

from deepseek_v41 import kernels
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.paged_context import PagedContext
from deepseek_v41.config import tiny_config


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
