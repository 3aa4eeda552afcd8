"""Inputs outside a kernel's limits (odd FP4 blocks, hc > 16, broadcast RoPE positions) must
take the torch code; they run in a child process because a kernel reading past a buffer could crash.
"""

import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import assert_same_results, both_ways

from deepseek_v41.quant import (
    quantize_fp4,
)


# ------------------------------------------------------------------------ inputs outside the kernels' limits
def test_fp4_odd_block_sizes_equal_the_torch_code(calls):
    # Six values in blocks of 3: the torch code accepts them (even n). The row is a prefix of a wider buffer so
    # the kernel's read past its end stays inside our memory.
    x = torch.tensor([[1.0, 2.0, 100.0, 0.5, 0.25, 3.0, 7.0, 7.0]])[:, :6]
    assert x.is_contiguous()
    assert_same_results(*both_ways(quantize_fp4, x, 3, "ue8m0"))


ISOLATED = {
    # The mHC kernel keeps the mixing logits in float[16 * 18]: more than 16 streams must take the torch code.
    "hc_mult above 16": """
import torch
from deepseek_v41 import kernels
from deepseek_v41.kernels.fast.block import hc_mix
hc, D = 24, 8
g = torch.Generator().manual_seed(0)
args = (torch.randn(1, 1, hc, D, generator=g), torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.05,
        torch.zeros((2 + hc) * hc), torch.ones(3), hc, 1e-6, 1e-6, 20)
with torch.inference_mode():
    fast = hc_mix(*args)
    with kernels.disabled():
        slow = hc_mix(*args)
for a, b in zip(fast, slow):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-6)
""",
    # The RoPE kernel reads cos / sin as [B * T, r]; phases of positions [1, T] broadcast in the torch code only.
    "rope positions [1, T] for x [B, T]": """
import torch
from deepseek_v41 import kernels
from deepseek_v41.model.rope import RotaryEmbedding
from deepseek_v41.kernels.fast import install
rope = RotaryEmbedding(16, 10000.0, None)
assert install(rope).modules == {"RotaryEmbedding": 1}
x, positions = torch.randn(3, 5, 4, 32), torch.arange(5)[None]
fast = rope(x, positions)
with kernels.disabled():
    slow = rope(x, positions)
assert torch.equal(fast, slow), (fast - slow).abs().max()
""",
    # moe_bf16 reads the router weights as fp32 [N, k], the shared expert's three weights in one dtype and every
    # row as wide as the experts; the router kernel reads x rows as wide as its weight. Inputs that break these
    # must take the torch code (which raises where the dtypes or widths do not match).
    "MoE inputs the moe_bf16 and router kernels cannot read": """
import torch
from deepseek_v41 import kernels
from deepseek_v41.kernels.fast import install
from deepseek_v41.model.moe import MoE

def small_moe(dtype=torch.float32):
    m = MoE(dim=64, inter_dim=32, n_experts=8, topk=2, n_shared=1, swiglu_limit=7.0, route_scale=1.5,
            norm_topk=True, with_bias_vl=False).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g).mul(8).round().div(32))  # exact in bf16
        m.gate.bias[3] = 100.0
    return m.to(dtype)

def run(make, x, fast):
    m = make()
    try:
        if fast:
            install(m)
            with torch.inference_mode():
                return m(x)
        with kernels.disabled(), torch.no_grad():
            return m(x)
    except RuntimeError:
        return RuntimeError

def shared(name):
    def make():
        m = small_moe()
        getattr(m.shared_experts, name).bfloat16()
        return m
    return make

def hooked_gate():
    m = small_moe()
    m.gate.register_forward_hook(lambda module, args, out: (out[0], out[1].bfloat16()))
    return m

def fp32_expert_in_bf16():
    m = small_moe(torch.bfloat16)
    m.experts[3].float()
    return m

x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1))
for make, xs in [(shared("w1"), x), (shared("w2"), x), (small_moe, torch.randn(1, 3, 80)),
                 (fp32_expert_in_bf16, x.bfloat16())]:
    fast, slow = run(make, xs, True), run(make, xs, False)
    assert fast is RuntimeError and slow is RuntimeError, (make, fast, slow)
fast, slow = run(hooked_gate, x, True), run(hooked_gate, x, False)
torch.testing.assert_close(fast, slow, rtol=2e-2, atol=2e-2)
""",
}


@pytest.mark.parametrize("case", list(ISOLATED))
def test_inputs_outside_the_kernel_limits_take_the_torch_code(case):
    """Run in a child process: a kernel called outside its limits would read or write past a buffer."""
    done = subprocess.run([sys.executable, "-c", ISOLATED[case]], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-1000:]}"
