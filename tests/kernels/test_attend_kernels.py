"""The few-query attention (csrc/attention.c, ``kernels.attend_few``) against the torch code,
to fp32 rounding, under ``torch.inference_mode`` only.
"""


import pytest
import torch
from kernel_cases import (
    ATTEND_TOL,
    _attend_few,
    assert_close_to_scale,
    assert_same_bits,
    attention_inputs,
    sparse_attention,
    visible,
)

from deepseek_v41 import kernels


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("k", [None, 0, 5])
def test_attend_few_is_close_in_inference_mode_only(calls, T, k):
    args = attention_inputs(T, k, seed=20 + T + (k or 0))
    q, q_pos, keys, key_pos, window = args[:5]
    # The inputs cover every case of the mask (row 0) and queries that see no key (row 1).
    seen = visible(q_pos, key_pos, window)
    assert not seen[1].any() and 0 < seen[0, 0].sum() < (key_pos[0] >= 0).sum()
    assert (q_pos[1] - window < -1).all()  # an empty key is masked by its -1 alone
    with kernels.disabled(), torch.no_grad():
        want = sparse_attention(*args)
    with torch.inference_mode():
        got = sparse_attention(*args)
    assert calls["attend_few"] == 1
    assert_close_to_scale(got, want, ATTEND_TOL)
    if not k:  # only the sink is left for row 1's queries: the output is 0 both ways
        assert (want[1] == 0).all() and (got[1] == 0).all()
    else:  # the entries are all they attend to
        assert want[1].abs().min() > 0
    with torch.no_grad():
        plain = sparse_attention(*args)
    assert calls["attend_few"] == 1, "attend_few ran outside inference mode"
    assert_same_bits(plain, want)


def test_attend_few_ignores_masked_picks_and_keys(calls):
    """A pick of -1 and a key outside the window count for nothing: changing what they read changes no bit of the
    kernel's result (the torch code gives them probability 0)."""
    q, q_pos, keys, key_pos, window, topk, gather, sink, scale = attention_inputs(3, 5, seed=30)
    with torch.inference_mode():
        got = _attend_few(q, q_pos, keys, key_pos, window, topk, gather, sink, scale)
        hidden = ~visible(q_pos, key_pos, window).any(1)  # [B, L]: seen by no query
        other_keys = torch.where(hidden[..., None], keys * -7 + 3, keys)

        def other_gather(idx):
            return torch.where((idx < 0)[..., None], 5.0, gather(idx))

        again = _attend_few(q, q_pos, other_keys, key_pos, window, topk, other_gather, sink, scale)
    assert calls["attend_few"] == 2 and hidden.sum() > 6
    assert_same_bits(again, got)
    with kernels.disabled(), torch.no_grad():
        want = _attend_few(q, q_pos, keys, key_pos, window, topk, gather, sink, scale)
    assert_close_to_scale(got, want, ATTEND_TOL)
