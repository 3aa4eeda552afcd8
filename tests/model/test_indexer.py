"""Top-k selection (MODEL_REFERENCE.md §3.9): the k largest scores, ties at the cut to the lowest indices,
whatever the tensor size (the engine's fast path for large inputs included)."""

import torch

from deepseek_v41.model.indexer import topk_set


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
