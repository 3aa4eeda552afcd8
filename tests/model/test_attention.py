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


def _random_attention_inputs(T: int, P: int, banded: bool, seed: int):
    """Queries at consecutive positions after P earlier ring rows (some empty, some out of the window, in ring
    order), T new rows (banded) and a top-k with padding."""
    g = torch.Generator().manual_seed(seed)
    B, H, d, k, window = 2, 3, 8, 5, 6
    start = torch.tensor([[9], [20]])
    q_pos = start + torch.arange(T)
    q = torch.randn(B, T, H, d, generator=g, dtype=torch.float64)
    prev_pos = torch.randint(-1, 9, (B, P), generator=g)
    prev_pos[1] += 11
    key_pos = torch.cat((prev_pos, q_pos), 1) if banded else torch.cat((prev_pos, q_pos[:, :1].expand(B, T)), 1)
    keys = torch.randn(B, key_pos.shape[1], d, generator=g, dtype=torch.float64)
    entries = torch.randn(B, 12, d, generator=g, dtype=torch.float64)
    topk = torch.randint(-1, 12, (B, T, k), generator=g)

    def gather(idx):
        rows = idx.clamp(min=0).reshape(B, -1, 1).expand(-1, -1, d)
        return entries.gather(1, rows).view(*idx.shape, d).masked_fill((idx < 0)[..., None], 0.0)

    sink = torch.randn(H, generator=g, dtype=torch.float64)
    return q, q_pos, keys, key_pos, window, topk, gather, sink


def test_few_query_path_equals_the_chunked_path(monkeypatch):
    """Decode / verify (T <= FEW_QUERIES) score every window row masked by position; the chunked path reads each
    query's band of new rows. Both are the same softmax (float64, so only summation order may differ)."""
    from deepseek_v41.model import attention

    for T, P, banded in ((1, 7, True), (4, 9, True), (16, 3, True), (3, 8, False), (1, 0, True)):
        args = _random_attention_inputs(T, P, banded, seed=T * 10 + P)
        q, q_pos, keys, key_pos, window, topk, gather, sink = args
        few = attention.sparse_attention(q, q_pos, keys, key_pos, window, topk, gather, sink, 0.3, banded=banded)
        monkeypatch.setattr(attention, "FEW_QUERIES", 0)
        chunked = attention.sparse_attention(q, q_pos, keys, key_pos, window, topk, gather, sink, 0.3, chunk=2,
                                             banded=banded)
        monkeypatch.setattr(attention, "FEW_QUERIES", 16)
        torch.testing.assert_close(few, chunked, rtol=1e-12, atol=1e-12)
        assert few.abs().sum() > 0
