"""A prefill chunk's index selection in one kernel call (issue 25): ``kernels.index_select`` and the fast
``Indexer.select_entries`` against the torch code they stand in for (``Indexer.select_entries``: IndexScorer, then
mask_invisible, topk_entries and candidate_blocks). Picks and pools are indices: they must be equal.

The kernel's scores are the torch code's bits where ATen's fp32 GEMM sums each dot as one chain of fused
multiply-adds (MKL's kernels on this machine): queries and keys of arbitrary fp32 values check that (a different
rounding would move picks at the cut), FP4 queries and keys (the paged cache's; every dot exact) with duplicated
keys, zero scores (ReLU) and fewer visible entries than k check the ties and the -1 padding."""

from __future__ import annotations

import pytest
import torch

from deepseek_v41 import kernels
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast.attention import _select_entries
from deepseek_v41.model.indexer import Indexer, IndexScorer, candidate_blocks, mask_invisible, topk_entries
from deepseek_v41.quant import fake_quant_fp4


def reference(q, w, keys, visible, k, pool):
    """The torch code: Indexer.select_entries of a plain indexer (its selection rules are module functions)."""
    scores = mask_invisible(IndexScorer()(q, w, keys), torch.arange(keys.shape[1]), visible)
    blocks = None if pool is None else candidate_blocks(scores, visible, *pool)
    return topk_entries(scores, k), blocks


def inputs(g, B, c, H, di, N, fp4, duplicates=0, start=None):
    """Queries q [B, c, H, di], head weights w [B, c, H], keys [B, N, di] and visible counts [B, c]: consecutive
    counts from ``start`` (a prefill chunk at that entry, ratio 1), else random in [0, N + 2]."""
    q = torch.randn(B, c, H, di, generator=g)
    keys = torch.randn(B, N, di, generator=g)
    w = torch.randn(B, c, H, generator=g)
    if fp4:  # the paged cache's values: FP4 with UE8M0 scales per 32 (di a multiple of 32); w in quarters
        q, keys = fake_quant_fp4(q, 32, "ue8m0"), fake_quant_fp4(keys, 32, "ue8m0")
        w = torch.round(w * 4) / 4
    for b in range(B):
        for _ in range(duplicates):
            src, dst = torch.randint(0, N, (2,), generator=g).tolist()
            keys[b, dst] = keys[b, src]
    if start is None:
        visible = torch.randint(0, N + 3, (B, c), generator=g)
    else:
        visible = (start + torch.arange(c)).clamp(max=N).expand(B, c).contiguous()
    return q, w, keys, visible


def check(q, w, keys, visible, k, pool):
    got = kernels.index_select(q, w, keys, visible, k, pool)
    assert got is not None
    picks, blocks = reference(q, w, keys, visible, k, pool)
    assert torch.equal(got[0], picks)
    if pool is None:
        assert got[1] is None
    else:
        assert got[1].dtype == torch.bool and torch.equal(got[1], blocks)


@pytest.mark.parametrize(("B", "c", "H", "di", "N"), [(1, 256, 4, 32, 1000), (2, 5, 4, 32, 37), (1, 7, 3, 20, 50),
                                                     (2, 4, 4, 64, 333), (1, 1, 4, 32, 1), (1, 9, 5, 16, 16)])
@pytest.mark.parametrize("fp4", [False, True], ids=["fp32", "fp4"])
def test_index_select_gives_the_torch_codes_picks_and_pool(B, c, H, di, N, fp4):
    if fp4 and di % 32:
        pytest.skip("FP4 values come in blocks of 32")
    g = torch.Generator().manual_seed(B * 1000 + c * 7 + N)
    q, w, keys, visible = inputs(g, B, c, H, di, N, fp4, duplicates=N // 4)
    for k in sorted({1, min(3, N), min(64, N), N}):  # (select never asks for k = 0)
        for pool in (None, (8, 4), (3, 2), (1, N + 5)):
            check(q, w, keys, visible, k, pool)


@pytest.mark.parametrize("start", [0, 100, 2048])
def test_a_prefill_chunk_past_its_start(start):
    """A chunk of 256 queries whose visible counts run from ``start`` (chunk start > 0): the bench's shape, k = 64,
    the candidate pool of 32 blocks of 8."""
    g = torch.Generator().manual_seed(start)
    N = start + 256
    q, w, keys, visible = inputs(g, 1, 256, 4, 32, N, True, duplicates=N // 8, start=start)
    check(q, w, keys, visible, min(64, N), (8, 32))
    check(q, w, keys, visible, min(64, N), None)


def test_ties_and_zero_scores_go_to_the_lowest_index():
    """Every visible score 0 (each head's dot negative: ReLU) or one of a few equal values: the picks are the
    lowest indices among the ties, -1 past the visible ones."""
    g = torch.Generator().manual_seed(5)
    N, c = 70, 6
    q = fake_quant_fp4(torch.rand(1, c, 4, 32, generator=g) + 0.1, 32, "ue8m0")
    keys = -fake_quant_fp4(torch.rand(1, N, 32, generator=g) + 0.1, 32, "ue8m0")  # every dot < 0
    keys[0, 10:N:7] = -keys[0, 10:N:7]  # a few positive, equal by pairs below
    keys[0, 30] = keys[0, 10]
    w = torch.ones(1, c, 4)
    visible = torch.tensor([[0, 5, 40, 64, 65, N]])
    for k in (1, 5, 64):
        check(q, w, keys, visible, k, (8, 3))
    got = kernels.index_select(q, w, keys, visible, 64, None)[0][0]
    assert got[0].eq(-1).all() and got[1, :5].tolist() == [0, 1, 2, 3, 4] and got[1, 5:].eq(-1).all()


def test_neg_inf_scores_among_the_visible_read_minus_one():
    q = torch.ones(1, 2, 4, 32)
    keys = torch.ones(1, 20, 32)
    w = torch.ones(1, 2, 4)
    w[0, 0, 1] = -torch.inf  # query 0: every visible score -inf
    check(q, w, keys, torch.tensor([[10, 20]]), 5, (4, 2))
    assert kernels.index_select(q, w, keys, torch.tensor([[10, 20]]), 5)[0][0, 0].eq(-1).all()


def test_a_nan_score_declines_and_the_fast_method_takes_the_torch_code():
    g = torch.Generator().manual_seed(1)
    q, w, keys, visible = inputs(g, 1, 8, 4, 32, 40, True, start=30)
    q[0, 3, 2, 5] = float("nan")
    assert kernels.index_select(q, w, keys, visible, 16, (8, 2)) is None
    m = Indexer(64, 32, 64, 4, 32, False, 1e-6)
    with torch.inference_mode():
        got = _select_entries(m, q, w, keys, visible, 16, (8, 2))
    ref = reference(q, w, keys, visible, 16, (8, 2))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_index_select_refuses_bad_k_and_pool():
    q, w, keys, visible = torch.ones(1, 2, 4, 32), torch.ones(1, 2, 4), torch.ones(1, 5, 32), torch.ones(1, 2).long()
    with pytest.raises(ValueError, match="k must be in"):
        kernels.index_select(q, w, keys, visible, 6)
    with pytest.raises(ValueError, match="block and keep"):
        kernels.index_select(q, w, keys, visible, 2, (0, 1))


def installed_indexer(monkeypatch, heads: int, head_dim: int) -> tuple[Indexer, list]:
    """An Indexer with the fast paths installed, and the list that gets a 1 per ``kernels.index_select`` call."""
    m = Indexer(64, 32, 64, heads, head_dim, False, 1e-6)
    fast.install(m)
    seen = []
    real = kernels.index_select
    monkeypatch.setattr(kernels, "index_select", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    return m, seen


def test_the_installed_method_takes_the_kernel_in_inference_mode_only(monkeypatch):
    """Installed on an Indexer: inference mode with fp32 queries takes one kernel call (bf16 keys widened, exact);
    outside inference mode, float64 queries or a hooked scorer run the torch code. The same picks either way."""
    m, seen = installed_indexer(monkeypatch, 4, 32)
    g = torch.Generator().manual_seed(2)
    q, w, keys, visible = inputs(g, 1, 16, 4, 32, 90, True, duplicates=20, start=70)
    ref = reference(q, w, keys, visible, 32, (8, 4))
    with torch.inference_mode():
        got = m.select_entries(q, w, keys.bfloat16(), visible, 32, (8, 4))
    assert seen == [1] and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    got = m.select_entries(q, w, keys, visible, 32, (8, 4))
    assert seen == [1] and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with torch.inference_mode():
        got = m.select_entries(q.double(), w.double(), keys.double(), visible, 32, None)
    assert seen == [1] and torch.equal(got[0], ref[0])
    handle = m.score.register_forward_hook(lambda *a: None)
    with torch.inference_mode():
        m.select_entries(q, w, keys, visible, 32, None)
    handle.remove()
    assert seen == [1]


def test_a_single_key_runs_the_torch_code_whose_gemv_overflows_otherwise(monkeypatch):
    """One index key: ATen's product is a GEMV summing in another order than the kernel's chain, so with scores
    near overflow the torch code reads -inf (then -1) where the chain stays finite; the installed method takes the
    torch code there (a break-it pass found the kernel picking the entry)."""
    m, seen = installed_indexer(monkeypatch, 1, 16)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        q, keys = torch.randn(1, 16, 1, 16, generator=g) * 1e19, torch.randn(1, 1, 16, generator=g) * 1e19
        w, visible = torch.randn(1, 16, 1, generator=g), torch.ones(1, 16, dtype=torch.long)
        with torch.inference_mode():
            got = m.select_entries(q, w, keys, visible, 1, None)
        assert torch.equal(got[0], reference(q, w, keys, visible, 1, None)[0])
    assert not seen


@pytest.mark.parametrize("scale", [2.0 ** -70, 2.0 ** 60, 1.0])
def test_fp4_values_near_the_ends_of_the_range(scale):
    """FP4 queries and keys scaled so that the dots' products would be subnormal (2^-140) or near overflow: the
    kernel's exact bf16 dot products apply only where every sum is exact and normal; the picks stay the torch
    code's either way (mixed: one query head far from the others)."""
    g = torch.Generator().manual_seed(9)
    q, w, keys, visible = inputs(g, 1, 12, 4, 32, 300, True, duplicates=40, start=250)
    q, keys = q * scale, keys * scale
    q[0, 5, 1] *= 2.0 ** 20
    check(q, w, keys, visible, 64, (8, 4))


@pytest.mark.parametrize("distinct", [1, 3, 40])
def test_long_rows_of_few_distinct_scores(distinct):
    """Keys drawn from ``distinct`` rows only (1: every score equal): thousands of scores tie at the k-th value, so
    the selection's candidates (every score at or above its bound) are most of the row."""
    g = torch.Generator().manual_seed(distinct)
    N = 3000
    q, w, keys, visible = inputs(g, 1, 9, 4, 32, N, True, start=N - 9)
    keys = keys[:, torch.randint(0, distinct, (N,), generator=g)].contiguous()
    for k in (1, 64, 700):
        check(q, w, keys, visible, k, (8, 32))


@pytest.mark.parametrize("spread", [8, 12, 30])
def test_rows_of_wide_exponent_spread(spread):
    """One key row's halves scaled 2^spread apart: the int8 codes (spreads <= 5) are off; up to a total spread of
    15 the bf16 dot products still give exact sums, past it the fp32 chains run. The picks are the torch code's."""
    g = torch.Generator().manual_seed(spread)
    q, w, keys, visible = inputs(g, 1, 16, 4, 32, 200, True, duplicates=20, start=180)
    keys[0, 3, :16] *= 2.0 ** spread
    keys[0, 150, 16:] *= 2.0 ** spread
    check(q, w, keys, visible, 64, (8, 4))
