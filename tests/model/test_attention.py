"""The attention core against a plain dense re-derivation (issue 4; MODEL_REFERENCE.md §3.6)."""

import math

import torch

from deepseek_v41.config import tiny_config
from deepseek_v41.model.context import DenseContext
from deepseek_v41.model.transformer import Transformer


def dense_attention(q, window_keys, entries, visible_entries, sink, window, scale):
    """Loops over tokens and heads: one softmax over the window keys (p - window, p] and every visible compressed
    entry, with the sink in the denominator (MODEL_REFERENCE.md §3.6)."""
    T, H, d = q.shape
    out = torch.zeros(T, H, d, dtype=torch.float64)
    for t in range(T):
        keys = [window_keys[j] for j in range(max(0, t - window + 1), t + 1)]
        keys += [entries[g] for g in range(visible_entries(t))]
        K = torch.stack(keys).double()
        for h in range(H):
            s = (K @ q[t, h].double()) * scale
            m = max(s.max().item(), sink[h].item())
            e = torch.exp(s - m)
            out[t, h] = (e[:, None] * K).sum(0) / (e.sum() + math.exp(sink[h].item() - m))
    return out


def test_with_fewer_entries_than_topk_sparse_equals_dense():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    T = 15  # layer 2 (ratio 2) has 7 entries < index_topk 8: the top-k holds all of them
    ids = torch.randint(3, 512, (1, T), generator=torch.Generator().manual_seed(1))
    ctx = DenseContext(1, T, "cpu", fake_quant=True)
    captured = {}
    with torch.no_grad():
        streams, pre = model.embed_streams(ids)
        rows = model.hasher(ids, None)
        streams, pre = model.run_layers(range(2), streams, pre, ctx, None, rows)
        block = model.layers[2]
        x = block.attention_input(streams, pre)
        attn = block.attn
        original = attn.core.forward

        def spy(q, q_pos, keys, key_pos, *args, **kwargs):
            captured.update(q=q, keys=keys)
            o = original(q, q_pos, keys, key_pos, *args, **kwargs)
            captured["o"] = o
            return o

        attn.core.forward = spy
        attn(x, ctx)
    assert (ctx.shared[("topk", 2)] >= 0).sum(-1).max() == 7
    entries = ctx._entries[2][0]
    ref = dense_attention(captured["q"][0], captured["keys"][0], entries, lambda t: (t + 1) // 2, attn.attn_sink,
                          cfg.sliding_window, cfg.head_dim ** -0.5)
    assert torch.allclose(captured["o"][0].double(), ref, atol=1e-5, rtol=0)
