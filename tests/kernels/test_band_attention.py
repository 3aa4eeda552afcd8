"""``band_attention`` (issue 25): a prefill chunk's window band as one dense matmul per query chunk, against the
reference ``sparse_attention`` (the oracle), bit for bit on the shapes the fast ``attend`` gives it."""

import pytest
import torch

from deepseek_v41.kernels.fast.attention import BAND_KEYS, BAND_TOKENS
from deepseek_v41.kernels.fast.band_attention import band_attention
from deepseek_v41.model.attention import sparse_attention


def inputs(B, T, H, d, P, start, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, d, generator=g).to(dtype)
    keys = torch.randn(B, P + T, d, generator=g).to(dtype)
    q_pos = (torch.arange(start, start + T) + torch.arange(B)[:, None]).contiguous()  # rows at different positions
    prev_pos = torch.randint(-1, max(start, 1), (B, P), generator=g)
    key_pos = torch.cat((prev_pos, q_pos), 1)
    entries = torch.randn(B, 40, d, generator=g).to(dtype)
    topk = torch.randint(-1, 40, (B, T, k), generator=g) if k else None

    def gather(idx):
        rows = entries[torch.arange(B)[:, None, None], idx.clamp(min=0)]
        return torch.where((idx >= 0)[..., None], rows, 0)

    sink = torch.randn(H, generator=g)
    return q, q_pos, keys, key_pos, topk, gather, sink


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,window,P,start,k", [
    (32, 64, 64, 80, 0, 16),    # the serving bench: 32 prompts of 64 tokens (bundled checkpoint)
    (3, 17, 16, 20, 5, 4),      # a short chunk after earlier rows
    (2, 200, 64, 80, 40, 16),   # several query chunks
    (2, 256, 128, 144, 0, 0),   # the widest band, no compressed entries
    (4, 40, 64, 0, 0, 16),      # no earlier rows, T < window
])
def test_band_attention_is_the_reference_bit_for_bit(dtype, B, T, window, P, start, k):
    q, q_pos, keys, key_pos, topk, gather, sink = inputs(B, T, 4, 64, P, start, k, dtype)
    chunk = min(256, BAND_KEYS + 1 - min(window, T))  # what the fast attend passes
    with torch.inference_mode():
        want = sparse_attention(q, q_pos, keys, key_pos, window, topk, gather, sink, 0.125, 256)
        got = band_attention(q, q_pos, keys, key_pos, window, topk, gather, sink, 0.125, chunk)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_the_fast_attend_takes_band_attention_only_for_short_causal_chunks(monkeypatch):
    from deepseek_v41.kernels.fast import attention as fast_attention

    taken = []
    monkeypatch.setattr(fast_attention, "band_attention", lambda *a: taken.append(a[0].shape[1]) or a[0])
    for T, key_limit in ((64, None), (BAND_TOKENS + 1, None), (64, "image")):
        q, q_pos, keys, key_pos, topk, gather, sink = inputs(1, T, 4, 64, 8, 0, 4, torch.float32)
        limit = None if key_limit is None else q_pos + 1
        with torch.inference_mode():
            fast_attention.attend(None, q, q_pos, keys, key_pos, 64, topk, gather, sink, 0.125, key_limit=limit)
    assert taken == [64]
