"""The engine's KV context reads back what it wrote, decoding only what it is asked for (SPEC.md §4.1)."""

import torch

from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.paged_context import PagedContext
from deepseek_v41.config import tiny_config
from deepseek_v41.quant import fake_quant_fp4, fake_quant_fp8


def test_index_keys_at_decodes_exactly_the_gathered_keys():
    cfg = tiny_config()
    cache = PagedKVCache(cfg, num_pages=8, block_size=8, num_slots=2)
    g = torch.Generator().manual_seed(0)
    T = 20
    ctx = PagedContext(cache, [0, 1], [[1, 2, 3], [4, 5, 6]], torch.arange(T).expand(2, T), [T, T], torch.float32)
    for layer, m in ((2, 2), (4, 1)):
        G = T // m
        entries = torch.randn(2, G, cfg.head_dim, generator=g)
        keys = torch.randn(2, G, cfg.index_head_dim, generator=g)
        ctx.add_entries(layer, entries, keys, torch.arange(G).expand(2, G))
        assert ctx.num_index_keys(layer) == G
        stored = ctx.index_keys(layer)
        assert torch.equal(stored, fake_quant_fp4(keys, 32, "ue8m0"))
        ids = torch.randint(0, G, (2, 3, 5), generator=g)
        want = stored.gather(1, ids.flatten(1)[..., None].expand(-1, -1, stored.shape[-1])).view(2, 3, 5, -1)
        assert torch.equal(ctx.index_keys_at(layer, ids), want)
        idx = torch.randint(-1, G, (2, 3, 4), generator=g)
        picked = ctx.gather_entries(layer, idx)
        quantized = fake_quant_fp4(entries, 16, "e4m3")
        for b in range(2):
            for c in range(3):
                for j in range(4):
                    n = int(idx[b, c, j])
                    assert torch.equal(picked[b, c, j], quantized[b, n] if n >= 0 else torch.zeros(cfg.head_dim))


def test_window_returns_earlier_rows_then_the_new_ones():
    cfg = tiny_config()
    cache = PagedKVCache(cfg, num_pages=4, block_size=8, num_slots=2)
    g = torch.Generator().manual_seed(1)
    first = torch.randn(1, 5, cfg.head_dim, generator=g)
    ctx = PagedContext(cache, [1], [[1]], torch.arange(5)[None], [5], torch.float32)
    keys, pos = ctx.window(0, first)
    assert torch.equal(keys[:, -5:], fake_quant_fp8(first, 32)) and pos[0, -5:].tolist() == list(range(5))
    assert (pos[0, :-5] == -1).all()
    new = torch.randn(1, 1, cfg.head_dim, generator=g)
    ctx = PagedContext(cache, [1], [[1]], torch.tensor([[5]]), [6], torch.float32)
    keys, pos = ctx.window(0, new)
    held = pos[0, :-1] >= 0
    assert sorted(pos[0, :-1][held].tolist()) == list(range(5)) and pos[0, -1] == 5
    order = pos[0, :-1][held].argsort()
    assert torch.equal(keys[0, :-1][held][order], fake_quant_fp8(first, 32)[0])
    assert torch.equal(keys[0, -1], fake_quant_fp8(new, 32)[0, 0])
