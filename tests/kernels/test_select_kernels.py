"""Attention.select at decode in few kernel calls: the candidate pool's blocks (``kernels.candidate_blocks``), a
Reindex layer's top-k inside the pool straight from the packed FP4 index keys (``kernels.pool_select``) and the
visibility mask folded into ``kernels.index_scores``, against the torch code they stand in for. Picks are indices:
they must be equal. The pools hold FP4 keys with scales near 1 and the queries FP4 values with head weights in
quarters, so every score is exact in any order of addition and exact ties (duplicated keys, equal dots) are
common: the kernels' picks must equal the torch code's, ties and all."""

from __future__ import annotations

import pytest
import torch
from fast_oracles import installed_models
from kernel_oracles import count_calls, greedy_run, perturbed_models

from deepseek_v41 import kernels
from deepseek_v41.cache.kv_cache import PagedKVCache
from deepseek_v41.cache.paged_context import PagedContext
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.model.attention import Attention
from deepseek_v41.model.indexer import (
    Indexer,
    IndexScorer,
    candidate_blocks,
    mask_invisible,
    pool_entries,
    topk_entries,
)
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.quant import dequantize_fp4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@pytest.fixture
def calls(monkeypatch):
    return count_calls(monkeypatch, "pool_select", "candidate_blocks")


def fp4_pool(g: torch.Generator, B: int, n: int, di: int, ratio: int, block_size: int, duplicates: int):
    """An FP4 index-key pool of n entries per row, as in kernel_cases.index_inputs (random pages through block tables;
    ratio 3 with block_size 8: not page-aligned), with scales 2^-1 .. 2^1 and ``duplicates`` entries per row
    copied from another entry of the row (exact ties). Returns (codes, scales, tables, keys [B, n, di])."""
    per_page = block_size // ratio
    pages = B * (n // per_page + 2) + 2
    codes = torch.randint(0, 256, (pages, per_page, di // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(126, 129, (pages, per_page, di // 32), generator=g, dtype=torch.uint8)
    cols = -(-n * ratio // block_size)
    order = torch.randperm(pages, generator=g)
    tables = order[: B * cols].view(B, cols).contiguous()
    s = torch.arange(n)
    for b in range(B):
        for _ in range(duplicates):
            src, dst = torch.randint(0, n, (2,), generator=g).tolist()
            for pool in (codes, scales):
                pool[tables[b, dst * ratio // block_size], dst % per_page] = \
                    pool[tables[b, src * ratio // block_size], src % per_page]
    page = tables[:, (s * ratio) // block_size]
    keys = dequantize_fp4(codes[page, s % per_page], scales[page, s % per_page], 32, "ue8m0")
    return codes, scales, tables, keys


def queries(g: torch.Generator, B: int, c: int, H: int, di: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 values times 2^-1 or 1 (q [B, c, H, di], half of them negative) and head weights in quarters (w [B, c,
    H]): every dot and score is exact in fp32, whatever the order of addition."""
    q = E2M1[torch.randint(0, 8, (B, c, H, di), generator=g)] * (1 - 2 * torch.randint(0, 2, (B, c, H, di),
                                                                                      generator=g))
    q = q * 2.0 ** -torch.randint(0, 2, (B, c, H, 1), generator=g)
    return q, torch.randint(1, 5, (B, c, H), generator=g) / 4


def random_blocks(g: torch.Generator, B: int, c: int, nblocks: int, keep: int) -> torch.Tensor:
    """Block masks [B, c, nblocks] holding at most ``keep`` blocks: some full, some short of ``keep``, one empty."""
    blocks = torch.zeros(B, c, nblocks, dtype=torch.bool)
    for b in range(B):
        for t in range(c):
            m = min(keep, nblocks) if (b + t) % 3 == 0 else int(torch.randint(0, min(keep, nblocks) + 1, (1,),
                                                                            generator=g))
            blocks[b, t, torch.randperm(nblocks, generator=g)[:m]] = True
    blocks[0, -1] = False
    return blocks


def torch_pool_picks(keys, q, w, n, blocks, block, keep, visible, k):
    """What Attention.select's torch code picks inside the pool (keys [B, n, di]: every index key decoded)."""
    ids, valid = pool_entries(blocks, block, keep, n)
    B = ids.shape[0]
    pool_keys = keys.gather(1, ids.flatten(1)[..., None].expand(-1, -1, keys.shape[-1])).view(*ids.shape, -1)
    scores = IndexScorer()(q, w, pool_keys)
    scores = mask_invisible(scores, ids, visible).masked_fill(~valid, float("-inf"))
    local = topk_entries(scores, k)
    assert local.shape[0] == B
    return torch.where(local >= 0, ids.gather(-1, local.clamp(min=0)), -1)


# --------------------------------------------------------------------------------------- Reindex, direct
@pytest.mark.parametrize("di,H", [(32, 4), (64, 3), (64, 24)])  # (64, 24): beyond the even / odd path
@pytest.mark.parametrize("n,block,keep", [(203, 8, 6), (61, 4, 3), (40, 8, 9)])  # 40: keep > nblocks
@pytest.mark.parametrize("ratio", [4, 3])
def test_pool_select_gives_the_torch_codes_picks(di, H, n, block, keep, ratio):
    """Random pools with duplicated keys, masks holding keep blocks or fewer (one none), queries seeing all, some
    (fewer than k) or none of the entries, n not a multiple of the block: the same ids, -1s in the same places."""
    g = torch.Generator().manual_seed(di + H + n + ratio)
    B, c, block_size = 3, 4, 8
    codes, scales, tables, keys = fp4_pool(g, B, n, di, ratio, block_size, duplicates=n // 3)
    q, w = queries(g, B, c, H, di)
    nblocks = -(-n // block)
    blocks = random_blocks(g, B, c, nblocks, keep)
    visible = torch.randint(0, n + 1, (B, c), generator=g)
    visible[0, 0], visible[1, 1], visible[2, 2] = n, 0, 3  # all, none, fewer than k
    k = min(16, min(keep, nblocks) * block)
    got = kernels.pool_select(codes, scales, 32, "ue8m0", tables, ratio, block_size, q, w, n, blocks, block, keep,
                              visible, k)
    with kernels.disabled():
        want = torch_pool_picks(keys, q, w, n, blocks, block, keep, visible, k)
    assert torch.equal(got, want)
    assert (want == -1).any() and (want >= 0).any()
    if H * di <= 128:  # the even / odd path: FP4-like scores tie at the cut
        scores = IndexScorer()(q, w, keys)
        assert any(len(set(row.tolist())) < n for row in scores.flatten(0, 1))
    q[0, 0, 0, 0] = float("nan")  # a query that sees every entry of a full pool
    assert kernels.pool_select(codes, scales, 32, "ue8m0", tables, ratio, block_size, q, w, n, blocks, block, keep,
                               visible, k) is None
    with pytest.raises(IndexError):
        kernels.pool_select(codes, scales, 32, "ue8m0", tables[:, :1], ratio, block_size, q, w, n, blocks, block,
                            keep, visible, k)


def test_pool_select_of_a_pool_from_candidate_blocks():
    """Masks as the candidate source makes them (its own scores of the same keys): the same picks."""
    g = torch.Generator().manual_seed(5)
    B, c, n, di, H, block, keep, k = 2, 5, 300, 32, 4, 8, 10, 64
    codes, scales, tables, keys = fp4_pool(g, B, n, di, 4, 16, duplicates=60)
    visible = torch.tensor([[300, 299, 64, 7, 1], [150, 151, 152, 0, 8]])
    q_src, w_src = queries(g, B, c, H, di)
    q, w = queries(g, B, c, H, di)
    with kernels.disabled():
        blocks = candidate_blocks(mask_invisible(IndexScorer()(q_src, w_src, keys), torch.arange(n), visible),
                                  visible, block, keep)
        want = torch_pool_picks(keys, q, w, n, blocks, block, keep, visible, k)
    got = kernels.pool_select(codes, scales, 32, "ue8m0", tables, 4, 16, q, w, n, blocks, block, keep, visible, k)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------- candidate pool, direct
@pytest.mark.parametrize("N,block,keep", [(203, 8, 6), (64, 8, 8), (61, 4, 100), (9, 4, 1)])
def test_candidate_blocks_kernel_gives_the_torch_codes_mask(calls, N, block, keep):
    """Scores with exact ties, whole blocks of -inf (not visible) and +inf, rows seeing nothing, one entry or
    everything: the same mask; a NaN takes the torch code."""
    g = torch.Generator().manual_seed(N + keep)
    B, c = 3, 6
    scores = torch.randint(0, 5, (B, c, N), generator=g).float() * 0.5
    visible = torch.randint(0, N + 1, (B, c), generator=g)
    visible[0, :3] = torch.tensor([0, 1, N])
    scores = mask_invisible(scores, torch.arange(N), visible)
    scores[1, 0, : 2 * block] = float("-inf")
    scores[2, 1, 0] = float("inf")
    indexer = Indexer(16, 8, 16, 2, 32, False, 1e-6)
    assert fast.install(indexer).modules == {"Indexer": 1, "Linear": 2}  # (its projections: kernels/fast/dense)
    got = indexer.candidate_blocks(scores, visible, block, keep)
    assert calls["candidate_blocks"] == 1
    want = candidate_blocks(scores, visible, block, keep)  # the reference
    assert torch.equal(got, want) and got.dtype == torch.bool
    scores[0, 1, 0] = float("nan")
    assert kernels.candidate_blocks(scores, visible, block, keep) is None
    want = candidate_blocks(scores, visible, block, keep)
    assert torch.equal(indexer.candidate_blocks(scores, visible, block, keep), want)  # the torch code's, NaN and all


@pytest.mark.parametrize("n", [100, kernels.INDEX_LUT_ROWS + 37])
def test_index_scores_with_visible_counts_mask_as_mask_invisible(n):
    """-inf from each query's visible count on, the other scores the same bits as without the mask."""
    g = torch.Generator().manual_seed(n)
    B, c, di, H = 2, 3, 32, 4
    codes, scales, tables, _ = fp4_pool(g, B, n, di, 4, 8, duplicates=0)
    q, w = torch.randn(B, c, H, di, generator=g), torch.rand(B, c, H, generator=g)
    visible = torch.tensor([[0, 1, n], [n - 1, 17, 50]])
    plain = kernels.index_scores(codes, scales, 32, "ue8m0", tables, 4, 8, q, w, n)
    got = kernels.index_scores(codes, scales, 32, "ue8m0", tables, 4, 8, q, w, n, visible)
    assert torch.equal(got, mask_invisible(plain, torch.arange(n), visible))


# ------------------------------------------------------------------------------------ through Attention
@pytest.fixture(scope="module")
def model():
    return installed_models(perturbed_models(max_position_embeddings=8192))[torch.float32]


def paged_decode(model, g: torch.Generator, starts: list[int]) -> PagedContext:
    """A decode step's context (one token per row at ``starts``) over a cache holding random entries and index keys
    of every earlier position in both kv sources of tiny_config (layers 2 and 4)."""
    cfg = model.config
    block_size = 8
    cols = [-(-(s + 1) // block_size) for s in starts]
    cache = PagedKVCache(cfg, num_pages=sum(cols) + 2, block_size=block_size, num_slots=len(starts))
    tables, first = [], 1
    for n in cols:
        tables.append(list(range(first, first + n)))
        first += n
    G = max(starts)
    fill = PagedContext(cache, list(range(len(starts))), tables, torch.arange(G).expand(len(starts), G).contiguous(),
                        [G] * len(starts), torch.float32)
    for layer, m in ((2, 2), (4, 1)):
        groups = torch.arange(G // m).expand(len(starts), -1).contiguous()
        fill.add_entries(layer, torch.randn(len(starts), G // m, cfg.head_dim, generator=g),
                         torch.randn(len(starts), G // m, cfg.index_head_dim, generator=g), groups)
    return PagedContext(cache, list(range(len(starts))), tables, torch.tensor(starts)[:, None],
                        [s + 1 for s in starts], torch.float32)


def select_all(model, ctx, q_lat, x) -> dict:
    """Attention.select of tiny_config's index sources in layer order (layer 4 makes the pool layer 6 reads)."""
    out = {}
    for layer in (2, 4, 6):
        out[layer] = model.layers[layer].attn.select(q_lat, x, ctx)
        ctx.shared[("topk", layer)] = out[layer]
    out["pool"] = ctx.shared[("pool", 4)]
    return out


def test_select_takes_the_kernels_in_inference_mode_only(model, calls):
    """At decode in inference mode the Reindex layer takes pool_select and the candidate source candidate_blocks,
    with the torch code's picks and pool; under no_grad outside inference mode the Reindex layer keeps the torch
    code (its scores would round differently)."""
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    starts = [90, 41, 13, 70]  # 13 entries of ratio 1: just past the pool of 3 x 4
    B = len(starts)
    q_lat, x = torch.randn(B, 1, cfg.q_lora_rank, generator=g), torch.randn(B, 1, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        got = select_all(model, paged_decode(model, torch.Generator().manual_seed(4), starts), q_lat, x)
    assert calls == {"pool_select": 1, "candidate_blocks": 1}
    with torch.inference_mode(), kernels.disabled():
        want = select_all(model, paged_decode(model, torch.Generator().manual_seed(4), starts), q_lat, x)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert (got[6] >= 0).sum() == B * cfg.index_topk
    with torch.no_grad():
        plain = select_all(model, paged_decode(model, torch.Generator().manual_seed(4), starts), q_lat, x)
    assert calls["pool_select"] == 1
    for key in want:
        assert torch.equal(plain[key], want[key]), key


def test_engine_decode_takes_the_select_kernels_with_the_same_tokens(calls, monkeypatch):
    """The decode steps' Reindex layer takes pool_select (the prompts are past the pool; at least once per step of
    the 9, more where the scheduler splits the rows), and the greedy tokens and their log-probabilities are those of
    the torch code."""
    torch.manual_seed(0)
    model = Transformer(tiny_config().replace(max_position_embeddings=8192)).eval().float()
    g = torch.Generator().manual_seed(12)
    requests = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (60, 33, 47)]

    def run():
        return greedy_run(model, requests, max_tokens=10)

    tokens, logprobs = run()
    decode_steps = 9
    taken = calls["pool_select"]
    assert taken >= decode_steps and calls["candidate_blocks"] >= decode_steps
    with monkeypatch.context() as m:
        m.setattr(PagedContext, "pool_topk", lambda self, *args: None)
        m.setattr(kernels, "candidate_blocks", lambda *args: None)
        want_tokens, want_logprobs = run()
    assert calls["pool_select"] == taken
    assert tokens == want_tokens and all(len(t) == 10 for t in tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-4)


def test_attention_forward_runs_the_torch_code_outside_inference_mode(model, calls):
    """The exact forward (DenseContext, no_grad) never asks for the select kernels' Reindex path."""
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
    assert calls["pool_select"] == 0 and torch.isfinite(logits).all()
    assert isinstance(model.layers[6].attn, Attention)
