"""Bidirectional window attention inside image spans (issue 27; VISION_DESIGN.md decision 1).

Oracle: the [T, T] visibility of every (query, key) pair written from the spans by hand (a key is seen when it
lies in the causal window ``(p - W, p]``, or when query and key lie in the same image span and ``p < k < p + W``),
then one float64 softmax per query and head over the visible keys, its selected compressed entries and the sink,
in plain loops. ``sparse_attention`` (chunked, with and without earlier ring rows) and ``attend_few`` must agree.
"""

import math

import pytest
import torch

from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.model.attention import attend_few, sparse_attention
from deepseek_v41.model.context import DenseContext
from deepseek_v41.model.image_processor import TokenType
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.model.vision import window_key_limit

S, I, N, E, TXT = (int(t) for t in (TokenType.IMAGE_START, TokenType.IMAGE, TokenType.IMAGE_NEWLINE,
                                    TokenType.IMAGE_END, TokenType.TEXT))


def span_types(T: int, spans: list[tuple[int, int]]) -> list[int]:
    """Token types of one row of T positions with image spans [s, e) given as row indices (a NEWLINE every 3rd
    inner position, so the spans look like real ones; the mask only reads START .. END)."""
    types = [TXT] * T
    for s, e in spans:
        types[s], types[e - 1] = S, E
        for j in range(s + 1, e - 1):
            types[j] = N if (j - s) % 3 == 0 else I
    return types


def visible(q_pos: int, k_pos: int, spans_pos: list[tuple[int, int]], window: int) -> bool:
    """The rule written out: causal window, plus the later keys of the query's own span within the window."""
    if k_pos < 0 or k_pos <= q_pos - window:
        return False
    if k_pos <= q_pos:
        return True
    return any(s <= q_pos < e and s <= k_pos < e for s, e in spans_pos) and k_pos < q_pos + window


def dense_oracle(q, q_pos, keys, key_pos, spans_pos, window, entries, topk, sink, scale):
    """float64 loops: o [B, T, H, d] and the selected entries' probabilities [B, T, H, k]."""
    B, T, H, d = q.shape
    k = topk.shape[-1]
    out = torch.zeros(B, T, H, d, dtype=torch.float64)
    probs = torch.zeros(B, T, H, k, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            p = int(q_pos[b, t])
            rows = [j for j in range(keys.shape[1]) if visible(p, int(key_pos[b, j]), spans_pos[b], window)]
            picked = [(c, int(topk[b, t, c])) for c in range(k) if int(topk[b, t, c]) >= 0]
            K = torch.stack([keys[b, j] for j in rows] + [entries[b, g] for _, g in picked]).double()
            for h in range(H):
                s = (K @ q[b, t, h].double()) * scale
                m = max(s.max().item(), sink[h].item())
                e = torch.exp(s - m)
                z = e.sum() + math.exp(sink[h].item() - m)
                out[b, t, h] = (e[:, None] * K).sum(0) / z
                for n, (c, _) in enumerate(picked):
                    probs[b, t, h, c] = e[len(rows) + n] / z
    return out, probs


# Row 0: a span at the start longer than the window (W = 5) and a short one; row 1: two spans, one at the end.
SPANS = [[(0, 9), (12, 15)], [(3, 6), (14, 22)]]


def inputs(T=22, P=0, seed=0, window=5, spans=SPANS):
    g = torch.Generator().manual_seed(seed)
    B, H, d, k = 2, 3, 8, 4
    start = torch.tensor([[P + 3], [P + 7]])  # the forward's first position per row (earlier rows before it)
    q_pos = start + torch.arange(T)
    prev_pos = torch.stack([torch.randperm(int(start[b]), generator=g)[:P] for b in range(B)])
    prev_pos[0, :1] = -1  # an empty ring row
    key_pos = torch.cat((prev_pos, q_pos), 1)
    q = torch.randn(B, T, H, d, generator=g, dtype=torch.float64)
    keys = torch.randn(B, P + T, d, generator=g, dtype=torch.float64)
    entries = torch.randn(B, 9, d, generator=g, dtype=torch.float64)
    topk = torch.randint(-1, 9, (B, T, k), generator=g)
    sink = torch.randn(H, generator=g, dtype=torch.float64)

    def gather(idx):
        rows = idx.clamp(min=0).reshape(B, -1, 1).expand(-1, -1, d)
        return entries.gather(1, rows).view(*idx.shape, d).masked_fill((idx < 0)[..., None], 0.0)

    types = torch.tensor([span_types(T, s) for s in spans])
    spans_pos = [[(int(start[b]) + s, int(start[b]) + e) for s, e in spans[b]] for b in range(B)]
    limit = window_key_limit(types, q_pos, window)
    return dict(q=q, q_pos=q_pos, keys=keys, key_pos=key_pos, window=window, topk=topk, gather=gather, sink=sink,
                scale=d ** -0.5), entries, spans_pos, limit


def test_key_limit_by_hand():
    types = torch.tensor([span_types(12, [(0, 7)]), span_types(12, [(4, 7)])])
    positions = torch.arange(12).expand(2, 12) + torch.tensor([[0], [10]])
    limit = window_key_limit(types, positions, 3)
    # Row 0: span [0, 7): min(7, p + 3) for p < 7, then p + 1. Row 1 (starts at 10): span [14, 17).
    assert limit[0].tolist() == [3, 4, 5, 6, 7, 7, 7, 8, 9, 10, 11, 12]
    assert limit[1].tolist() == [11, 12, 13, 14, 17, 17, 17, 18, 19, 20, 21, 22]


def test_key_limit_rejects_a_span_cut_by_the_end_and_bad_shapes():
    types = torch.tensor([span_types(10, [(5, 10)])[:8]])
    with pytest.raises(ValueError, match="no IMAGE_END"):
        window_key_limit(types, torch.arange(8)[None], 4)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        window_key_limit(types, torch.arange(7)[None], 4)
    # A replay that starts inside a span (its START before this forward) is fine: the END is here.
    tail = torch.tensor([span_types(10, [(2, 8)])[4:]])
    assert window_key_limit(tail, torch.arange(6)[None] + 4, 4).tolist() == [[8, 8, 8, 8, 9, 10]]


@pytest.mark.parametrize("P", [0, 4])
def test_sparse_attention_matches_the_dense_visibility(P):
    args, entries, spans_pos, limit = inputs(P=P)
    want, want_probs = dense_oracle(args["q"], args["q_pos"], args["keys"], args["key_pos"], spans_pos,
                                    args["window"], entries, args["topk"], args["sink"], args["scale"])
    for chunk in (7, 64):
        got, probs = sparse_attention(**args, chunk=chunk, entry_probs=True, key_limit=limit)
        assert torch.allclose(got, want, atol=1e-12, rtol=0)
        assert torch.allclose(probs, want_probs, atol=1e-12, rtol=0)
        assert torch.allclose(sparse_attention(**args, chunk=chunk, key_limit=limit), want, atol=1e-12, rtol=0)
    assert torch.allclose(attend_few(**args, key_limit=limit), want, atol=1e-12, rtol=0)
    # Without the spans it is the causal window: the rule with no spans.
    causal, _ = dense_oracle(args["q"], args["q_pos"], args["keys"], args["key_pos"], [[], []], args["window"],
                             entries, args["topk"], args["sink"], args["scale"])
    assert torch.allclose(sparse_attention(**args, chunk=7), causal, atol=1e-12, rtol=0)
    assert not torch.allclose(causal, want, atol=1e-6, rtol=0)


def test_few_queries_take_attend_few_with_the_spans():
    T = 10  # <= FEW_QUERIES: sparse_attention hands over to attend_few
    args, entries, spans_pos, limit = inputs(T=T, spans=[[(1, 8)], [(0, 4), (5, 10)]])
    want, _ = dense_oracle(args["q"], args["q_pos"], args["keys"], args["key_pos"], spans_pos, args["window"],
                           entries, args["topk"], args["sink"], args["scale"])
    assert torch.allclose(sparse_attention(**args, key_limit=limit), want, atol=1e-12, rtol=0)


def test_fast_backend_honours_key_limit():
    """The installed SparseAttention (fp32, inference mode: the C kernel's conditions) runs the reference when a
    forward has image spans."""
    args, _, _, limit = inputs(T=10, spans=[[(1, 8)], [(0, 10)]])
    args32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in args.items()}
    args32["gather"] = lambda idx: args["gather"](idx).float()
    model = Transformer(tiny_config()).eval()
    fast.install(model)
    core = model.layers[0].attn.core
    with torch.inference_mode():
        got = core(*(args32[k] for k in ("q", "q_pos", "keys", "key_pos", "window", "topk", "gather", "sink",
                                         "scale")), key_limit=limit)
        ref = sparse_attention(**args32, key_limit=limit)
    assert torch.equal(got, ref)


# ---------------------------------------------------------------------------------------------- the whole model
def _model():
    torch.manual_seed(0)
    return Transformer(tiny_config()).eval()


def test_text_forward_is_unchanged_bit_for_bit():
    """All-text token types give no key_limit, and a key_limit of p + 1 everywhere (the text rule) gives the very
    bits of the causal code."""
    model = _model()
    T = 40
    ids = torch.randint(3, 500, (2, T), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(T).expand(2, T)
    text = torch.full((2, T), TXT)
    assert model.key_limit(text, positions) is None
    with torch.no_grad():
        plain = model(ids)
        assert torch.equal(model(ids, token_types=text), plain)
        out = []
        for limit in (None, positions + 1):
            ctx = DenseContext(2, T, "cpu", model.fake_quant, key_limit=limit)
            streams, pre = model.embed_streams(ids)
            streams, pre = model.run_layers(range(len(model.layers)), streams, pre, ctx, None, model.hasher(ids))
            out.append(model.logits(streams, pre))
    assert torch.equal(out[0], plain) and torch.equal(out[1], plain)


def test_image_token_sees_a_later_token_of_its_span():
    """Changing a later position of a span changes an earlier image position's output (bidirectional), never a
    text position before the span; under the causal window (no token types) it changes neither."""
    model = _model()
    T, span = 40, (10, 32)  # span longer than the window (16)
    types = torch.tensor([span_types(T, [span])])
    ids = torch.randint(3, 500, (1, T), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 20] = (ids[0, 20] + 7) % 500
    with torch.no_grad():
        a, b = model(ids, token_types=types), model(changed, token_types=types)
        mask = types != TXT
        ca, cb = model(ids, image_mask=mask), model(changed, image_mask=mask)  # causal: no spans given
    # (Not bit-equal: the MoE batches each expert's tokens, and position 20 may move to another expert.)
    same = dict(atol=1e-5, rtol=0)
    assert torch.allclose(a[0, :10], b[0, :10], **same)  # text before the span
    assert (a[0, 12] - b[0, 12]).abs().max() > 1e-2  # image position 12 sees 20 (< 12 + 16)
    assert torch.allclose(ca[0, :20], cb[0, :20], **same)
    assert torch.allclose(ca[0, :10], a[0, :10], **same)


def test_training_loss_takes_the_image_spans():
    """``dsv41 train``'s loss with token types is the cross-entropy of the exact forward's logits with them
    (spans bidirectional, bias_vl, Engram masking), not of the text forward's."""
    from deepseek_v41.train.trainer import training_loss

    model = _model()
    T = 40
    ids = torch.randint(3, 500, (1, T + 1), generator=torch.Generator().manual_seed(3))
    types = torch.tensor([span_types(T, [(5, 30)])])
    with torch.no_grad():
        _, stats = training_loss(model, ids, dense_indexer=False, kl_weight=1.0, token_types=types)
        lm = [torch.nn.functional.cross_entropy(model(ids[:, :-1], **kw)[0], ids[0, 1:]).item()
              for kw in ({"token_types": types}, {"image_mask": types != TXT}, {})]
    assert stats["lm"] == pytest.approx(lm[0], abs=1e-5)
    assert abs(lm[0] - lm[1]) > 1e-4 and abs(lm[0] - lm[2]) > 1e-4
