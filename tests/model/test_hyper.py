"""mHC coefficients (MODEL_REFERENCE.md §3.13): the inference fast paths equal the textbook forms."""

import torch

from deepseek_v41 import kernels
from deepseek_v41.model.hyper import collapse, expand, hc_mix, sinkhorn


def textbook_sinkhorn(comb, iters, eps):
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def test_numpy_sinkhorn_equals_the_torch_one():
    g = torch.Generator().manual_seed(0)
    for shape, dtype in (((1, 1, 4, 4), torch.float32), ((8, 5, 4, 4), torch.float32), ((3, 2, 2), torch.float64)):
        comb = torch.rand(shape, generator=g, dtype=dtype) + 1e-3
        with torch.no_grad():
            fast = sinkhorn(comb, 20, 1e-6)  # CPU, no autograd: the NumPy path
        slow = sinkhorn(comb.clone().requires_grad_(), 20, 1e-6)  # autograd: the torch path
        want = textbook_sinkhorn(comb, 20, 1e-6)
        assert fast.dtype == dtype and torch.equal(slow.detach(), want)
        torch.testing.assert_close(fast, want, rtol=2e-7 if dtype == torch.float32 else 1e-15, atol=0)
        # Doubly stochastic to the precision 20 iterations reach.
        torch.testing.assert_close(fast.sum(-1), torch.ones(shape[:-1], dtype=dtype), rtol=0, atol=1e-3)


def test_hc_mix_collapse_expand_equal_the_textbook_forms():
    """The torch code (the fused CPU kernels are compared with it in tests/kernels)."""
    g = torch.Generator().manual_seed(1)
    B, T, hc, D = 2, 3, 4, 16
    streams = torch.randn(B, T, hc, D, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.1
    base = torch.randn((2 + hc) * hc, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    with torch.no_grad(), kernels.disabled():
        pre, post, comb = hc_mix(streams, fn, base, scale, hc, 1e-6, 1e-6, 20)
        y = torch.randn(B, T, D, generator=g)
        collapsed, expanded = collapse(streams, pre), expand(streams, y, post, comb)
    flat = streams.flatten(-2)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
    mix = flat @ fn.t()
    p, q, c = mix.split([hc, hc, hc * hc], -1)
    bp, bq, bc = base.split([hc, hc, hc * hc])
    assert torch.equal(pre, torch.sigmoid(p * scale[0] + bp) + 1e-6)
    assert torch.equal(post, 2 * torch.sigmoid(q * scale[1] + bq))
    want = textbook_sinkhorn(torch.softmax((c * scale[2] + bc).unflatten(-1, (hc, hc)), -1) + 1e-6, 20, 1e-6)
    torch.testing.assert_close(comb, want, rtol=2e-7, atol=0)
    torch.testing.assert_close(collapsed, torch.einsum("bthd,bth->btd", streams, pre))
    torch.testing.assert_close(expanded,
                               post[..., None] * y[:, :, None, :] + torch.einsum("btij,btid->btjd", comb, streams))
