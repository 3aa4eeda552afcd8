"""The indexer's scores straight from the paged FP4 index keys (csrc/indexer.c) against scoring
the decoded keys.
"""


import pytest
import torch
from kernel_cases import assert_close_to_scale, index_inputs

from deepseek_v41 import kernels
from deepseek_v41.model.indexer import IndexScorer
from deepseek_v41.quant import (
    dequantize_fp4,
)


# ------------------------------------------------------------------------------------- indexer scores, direct
# (64, 16, 3): c * H * di / 32 = 96 query vectors, beyond the even / odd path's 64 (csrc/index_keys.h
# INDEX_PAIR_VECTORS), and a table too large: the widening path; (32, 16, 5): 80 vectors, a table of 65536 floats:
# the lookup table from INDEX_LUT_ROWS keys; the others take the even / odd path at any length (with AVX-512 16 keys
# at a time in vector lanes, then the last n % 16 of a chunk of 256; (32, 4, 1): a decode query of the bench's
# indexer shape, whose last keys go two per pass, then the odd one).
@pytest.mark.parametrize("di,H,c", [(32, 4, 3), (32, 4, 1), (64, 5, 3), (32, 8, 3), (64, 16, 3), (32, 16, 5)])
@pytest.mark.parametrize("n", [100, kernels.INDEX_LUT_ROWS + 37])  # below / above the lookup-table threshold
@pytest.mark.parametrize("ratio", [4, 3])  # 4: page-aligned pool (walked page by page); 3: block_size 8 % 3 != 0
def test_index_scores_equal_scoring_the_decoded_keys(di, H, c, n, ratio):
    """kernels.index_scores (its lookup-table, even / odd and widening paths) against decoding every key of the pool
    through the block tables and scoring with IndexScorer, to fp32 rounding; an entry past its table raises."""
    block_size = 8
    codes, scales, tables, q, w = index_inputs(di, H, c, n, ratio, block_size, seed=di + H + n + ratio)
    per_page, cols = block_size // ratio, tables.shape[1]
    got = kernels.index_scores(codes, scales, 32, "ue8m0", tables, ratio, block_size, q, w, n)
    s = torch.arange(n)
    page = tables[:, (s * ratio) // block_size]  # [B, n]
    keys = dequantize_fp4(codes[page, s % per_page], scales[page, s % per_page], 32, "ue8m0")  # [B, n, di]
    want = IndexScorer()(q, w, keys)
    assert (want > 0).float().mean() > 0.3
    assert_close_to_scale(got, want, 2e-6)
    with pytest.raises(IndexError):
        kernels.index_scores(codes, scales, 32, "ue8m0", tables[:, : cols - 1], ratio, block_size, q, w, n)


def test_index_scores_read_scale_bytes_255_as_nan_and_0_as_2_to_the_minus_127():
    """Keys whose codes are all 1.0 scored by one head with positive query values, so no product is 0 x scale: a
    key whose scale byte is 255 scores NaN (an infinite scale would score +inf), one whose byte is 0 a positive
    score (2**-127 per value), as IndexScorer on the keys dequantize_fp4 decodes; keys 0 .. 31 take the even / odd
    path 16 at a time in lanes (with AVX-512), 32 .. 39 one at a time."""
    n, nan_keys, tiny_keys = 40, [3, 20, 37], [5, 21, 38]
    codes = torch.full((n, 1, 16), 0x22, dtype=torch.uint8)  # E2M1 1.0 in both nibbles
    scales = torch.full((n, 1, 1), 127, dtype=torch.uint8)
    scales[nan_keys], scales[tiny_keys] = 255, 0
    q, w = torch.rand(1, 1, 1, 32, generator=torch.Generator().manual_seed(5)) + 0.5, torch.ones(1, 1, 1)
    got = kernels.index_scores(codes, scales, 32, "ue8m0", torch.arange(n)[None], 1, 1, q, w, n)[0, 0]
    want = IndexScorer()(q, w, dequantize_fp4(codes[:, 0], scales[:, 0], 32, "ue8m0")[None])[0, 0]
    assert got.isnan().nonzero().flatten().tolist() == want.isnan().nonzero().flatten().tolist() == nan_keys
    assert (got[tiny_keys] > 0).all() and (got[tiny_keys] < 2.0**-120).all()
    assert torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=0)
