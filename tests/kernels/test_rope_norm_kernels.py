"""RoPE (bit for bit) and RMSNorm (csrc/rope_norm.c) against the torch code. RMSNorm adds
in another order, so it agrees to fp32 rounding and only runs under ``torch.inference_mode``: outside it the
result is the torch code's, bit for bit.
"""


import pytest
import torch
from kernel_cases import ATOL, RTOL, assert_same_bits, both_ways, close_in_inference_mode_and_exact_outside

from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels.fast import install
from deepseek_v41.model.norm import RMSNorm, rms_normalize
from deepseek_v41.model.rope import RotaryEmbedding


# ------------------------------------------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("heads", [None, 4])
@pytest.mark.parametrize("d,r,yarn", [(32, 16, True), (16, 16, False), (64, 8, True)])
def test_rope_equals_the_torch_code(calls, dtype, inverse, heads, d, r, yarn):
    cfg = tiny_config()
    rope = RotaryEmbedding(r, 10000.0 if yarn else 160000.0, cfg.yarn if yarn else None)
    assert install(rope).modules == {"RotaryEmbedding": 1}
    g = torch.Generator().manual_seed(d + r)
    B, T = 3, 7
    x = (torch.randn((B, T, d) if heads is None else (B, T, heads, d), generator=g) * 4).to(dtype)
    positions = torch.randint(0, 200_000, (B, T), generator=g)
    assert kernels.usable(x, *rope.phases(positions))
    fast, slow = both_ways(rope, x, positions, inverse=inverse)
    assert calls["rope"] == 1
    assert_same_bits(fast, slow)
    assert not torch.equal(fast[..., -r:], x[..., -r:]) and torch.equal(fast[..., :-r], x[..., :-r])


def test_rms_norm_is_close_in_inference_mode_only(calls):
    g = torch.Generator().manual_seed(7)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=g) + 0.5)
    assert install(norm).modules == {"RMSNorm": 1}
    x = torch.randn(2, 5, 64, generator=g) * 3
    close_in_inference_mode_and_exact_outside(calls, "rms_norm", norm, x)
    calls.clear()
    # The weightless kernel (no weight: the normalisation hc_mix's kernel does per row) against rms_normalize.
    odd = torch.randn(3, 37, generator=g)  # a width that is not a multiple of the kernel's 8 lanes
    for rows, eps in ((x * 1e-8, 1e-20), (odd, 1e-6)):
        with torch.inference_mode():
            got = kernels.rms_norm(rows, None, eps)
        torch.testing.assert_close(got, rms_normalize(rows, eps), rtol=RTOL, atol=ATOL)
    calls.clear()
    wide = RMSNorm(64, 1e-6).double()
    assert install(wide).modules == {}  # a float64 weight: nothing installed
    with torch.inference_mode():  # float64 stays on the torch code, also through an fp32 norm
        wide(x.double())
        norm(x.double())
    assert calls["rms_norm"] == 0
    xb = x.bfloat16()
    with torch.inference_mode():  # bf16: the kernel on the upcast input, the result in bf16
        got = norm(xb)
    assert calls["rms_norm"] == 1 and got.dtype == torch.bfloat16
    with torch.no_grad():
        want = norm(xb)
    assert calls["rms_norm"] == 1
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)  # one bf16 rounding apart at most
