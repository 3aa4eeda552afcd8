"""The indexer's top-k kernel (csrc/topk.c) against the torch code's indices.
"""


import pytest
import torch
from kernel_cases import topk_entries

from deepseek_v41 import kernels
from deepseek_v41.kernels.fast.attention import _topk_set as topk_set


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


@pytest.mark.parametrize("N,k", [(100, 1), (5003, 64), (8192, 64), (8193, 64), (16411, 64)])
def test_topk_set_kernel_on_distinct_scores_in_any_order(calls, N, k):
    """Distinct scores (random, rising: every run of 16 enters the heap, falling: none after the first k,
    a late maximum in a short last run): the kernel's picks are the torch code's. Up to 8,192 scores a row (the
    kernel's TOPK_BISECT_N) its k-th largest value is found by bisection on order-preserving keys, above by a
    heap (issue 25): both sides of the switch."""
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
    with pytest.raises(ValueError, match=r"k must be in \[0, 2\]"):
        topk_set(scores[:, 2:], 3)  # k > N: the reference's error
