"""A prefill chunk's sparse attention with its matmuls in C (issue 25): ``kernels.band_logits`` /
``kernels.band_output`` around torch's softmax, through the fast ``SparseAttention.forward``, against
``sparse_attention``: the same bits. The torch code's einsums are batched GEMMs whose every output ATen / MKL sums
as one chain of multiply-adds over the contraction (checked here on the machine through the outputs); the kernels
make the same chains. Narrow GEMMs (fewer than BAND_MIN earlier rows, band rows, entries or dims) run the
reference."""

from __future__ import annotations

import pytest
import torch

from deepseek_v41 import kernels
from deepseek_v41.kernels.fast.attention import BAND_MIN, attend
from deepseek_v41.model.attention import sparse_attention


def case(seed, B, T, P, H, d, k, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, d, generator=g).to(dtype)
    keys = torch.randn(B, P + T, d, generator=g).to(dtype)
    start = 300
    earlier = (start - 1 - torch.randperm(2 * P + 1, generator=g)[:P]).expand(B, P).clone()  # some out of window
    if P:
        earlier[:, :3] = -1  # empty ring slots
    key_pos = torch.cat([earlier, torch.arange(start, start + T).expand(B, T)], 1).contiguous()
    q_pos = torch.arange(start, start + T).expand(B, T).contiguous()
    entries = torch.randn(B, 700, d, generator=g).to(dtype)
    topk = torch.randint(-1, 700, (B, T, k), generator=g) if k else None

    def gather(idx):
        rows = entries[torch.arange(B)[:, None, None], idx.clamp(min=0)]
        return rows.masked_fill((idx < 0)[..., None], 0.0)

    return q, q_pos, keys, key_pos, topk, gather, torch.randn(H, generator=g).to(dtype)


@pytest.mark.parametrize(("B", "T", "P", "H", "d", "k", "window"), [
    (1, 300, 127, 4, 64, 64, 128),  # the bench's shape: a chunk of 256 queries and one of 44
    (1, 257, 0, 4, 64, 64, 128),    # the first chunk (no earlier rows); the last chunk holds one query
    (2, 40, 16, 8, 32, 16, 16),     # two rows, eight heads, a window of 16
    (1, 50, 20, 4, 64, 0, 128),     # no selected entries
    (1, 90, 17, 4, 48, 20, 64),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_band_attention_gives_the_torch_codes_bits(monkeypatch, B, T, P, H, d, k, window, dtype):
    q, q_pos, keys, key_pos, topk, gather, sink = case(T + P, B, T, P, H, d, k, dtype)
    calls = []
    real = kernels.band_logits
    monkeypatch.setattr(kernels, "band_logits", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    want = sparse_attention(q, q_pos, keys, key_pos, window, topk, gather, sink, d ** -0.5, 256)
    with torch.inference_mode():
        got = attend(None, q, q_pos, keys, key_pos, window, topk, gather, sink, d ** -0.5, 256)
    assert calls and got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize(("P", "k", "window", "H"),
                         [(5, 64, 128, 4), (20, 7, 128, 4), (20, 64, 8, 4), (20, 64, 128, 3)])
def test_narrow_gemms_run_the_reference(monkeypatch, P, k, window, H):
    """Fewer than BAND_MIN earlier rows, selected entries or band rows, or heads not a multiple of 4: ATen / MKL sum
    those GEMMs in another order (measured), so the reference runs (its bits, no kernel call)."""
    assert BAND_MIN == 16
    q, q_pos, keys, key_pos, topk, gather, sink = case(3, 1, 60, P, H, 64, k, torch.float32)
    calls = []
    monkeypatch.setattr(kernels, "band_logits", lambda *a, **kw: calls.append(1))
    want = sparse_attention(q, q_pos, keys, key_pos, window, topk, gather, sink, 0.125, 256)
    with torch.inference_mode():
        got = attend(None, q, q_pos, keys, key_pos, window, topk, gather, sink, 0.125, 256)
    assert not calls and torch.equal(got, want)


def test_band_wrappers_refuse_queries_outside_the_new_rows():
    q, q_pos, keys, key_pos = torch.ones(1, 4, 2, 16), torch.zeros(1, 4).long(), torch.ones(1, 10, 16), \
        torch.zeros(1, 10).long()
    with pytest.raises(ValueError, match="must lie in the 6 new rows"):
        kernels.band_logits(q, q_pos, keys, key_pos, 4, 3, 8, None, None, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="probs of width"):
        kernels.band_output(torch.ones(1, 4, 2, 5), keys, 4, 0, 8, None)


def test_an_infinite_earlier_row_gives_the_references_nans():
    """An earlier row holding inf (not seen by the queries past the window: probability 0, and 0 * inf is NaN in the
    reference's weighted sum): the kernels skip no row's product then, so the same NaNs and values."""
    q, q_pos, keys, key_pos, topk, gather, sink = case(4, 1, 300, 127, 4, 64, 64, torch.float32)
    keys[0, 10, 3] = float("inf")
    want = sparse_attention(q, q_pos, keys, key_pos, 128, topk, gather, sink, 0.125, 256)
    with torch.inference_mode():
        got = attend(None, q, q_pos, keys, key_pos, 128, topk, gather, sink, 0.125, 256)
    assert want.isnan().any() and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
