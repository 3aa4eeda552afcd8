"""Top-k selection (MODEL_REFERENCE.md §3.9): the k largest scores, ties at the cut to the lowest indices,
whatever the tensor size (the engine's fast path for large inputs included)."""

import pytest
import torch

from deepseek_v41.model.indexer import topk_entries, topk_set


def reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    rows = scores.reshape(-1, scores.shape[-1]).tolist()
    picked = [sorted(sorted(range(len(r)), key=lambda i: (-r[i], i))[:k]) for r in rows]
    return torch.tensor(picked).view(*scores.shape[:-1], k)


def test_ties_at_the_cut_go_to_the_lowest_indices_small_and_large():
    g = torch.Generator().manual_seed(0)
    for shape, k in (((2, 3, 40), 7), ((1, 300, 300), 64), ((1, 4, 20000), 64)):  # the last two: >= 2**16
        scores = torch.randint(0, 6, shape, generator=g).float()  # heavy ties everywhere
        scores[..., : shape[1] // 2, shape[-1] // 3:] = float("-inf")  # rows with few visible entries
        scores[0, 0, :] = torch.randn(shape[-1], generator=g)  # a row without ties
        assert torch.equal(topk_set(scores, k), reference(scores, k))


def test_k_zero_gives_no_picks_and_k_outside_the_scores_is_refused():
    scores = torch.randn(2, 3, 10)
    for picks in (topk_set(scores, 0), topk_entries(scores, 0)):
        assert picks.shape == (2, 3, 0) and picks.dtype == torch.long
    assert torch.equal(topk_set(scores, 10), torch.arange(10).expand(2, 3, 10))
    for k in (-1, 11):
        with pytest.raises(ValueError, match=r"k must be in \[0, 10\]"):
            topk_set(scores, k)


def test_pool_entries_lists_each_chosen_blocks_entries_in_ascending_order():
    """The pool's ids are the chosen blocks' entries in ascending order, valid below n_entries; a mask with fewer
    than ``keep`` blocks pads with the lowest unchosen blocks, marked invalid (with kernels on and off)."""
    from deepseek_v41 import kernels
    from deepseek_v41.model.indexer import pool_entries

    g = torch.Generator().manual_seed(3)
    block, keep, nblocks = 4, 3, 9
    n_entries = nblocks * block - 2  # the last block is short
    blocks = torch.zeros(2, 5, nblocks, dtype=torch.bool)
    for b in range(2):
        for c in range(5):
            blocks[b, c, torch.randperm(nblocks, generator=g)[: 1 + (b + c) % keep]] = True
    blocks[0, 0] = False
    blocks[0, 0, nblocks - 1] = True  # the short block
    for off in (False, True):
        with torch.inference_mode(), (kernels.disabled() if off else torch.no_grad()):
            ids, valid = pool_entries(blocks, block, keep, n_entries)
        assert ids.shape == valid.shape == (2, 5, keep * block)
        for b in range(2):
            for c in range(5):
                chosen = blocks[b, c].nonzero().flatten().tolist()
                pad = [j for j in range(nblocks) if j not in chosen][: keep - len(chosen)]
                want_blocks = sorted(chosen + pad)
                want = [j * block + i for j in want_blocks for i in range(block)]
                assert ids[b, c].tolist() == [min(e, n_entries - 1) for e in want]
                assert valid[b, c].tolist() == [j in chosen and j * block + i < n_entries
                                                for j in want_blocks for i in range(block)]
