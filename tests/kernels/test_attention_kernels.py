"""The attention projections of a few tokens in one kernel call each (``kernels.attn_prologue``: q_lat, q and the
window KV; ``kernels.attn_epilogue``: inverse RoPE, wo_a, wo_b), against the module calls they stand in for."""

from __future__ import annotations

import os

import pytest
import torch
from fast_oracles import hooked, installed_models, reference
from kernel_oracles import count_calls, perturbed_models

from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.model.transformer import Transformer


@pytest.fixture(scope="module")
def models():
    return installed_models(perturbed_models())


@pytest.fixture
def counted(monkeypatch):
    return count_calls(monkeypatch, "attn_prologue", "attn_epilogue")


def module_path(attn, x, pos):
    """What Attention.forward computed before the kernels: the seven module calls, and the output side."""
    B, T, _ = x.shape
    q_lat = attn.q_norm(attn.wq_a(x))
    q = attn.rope(attn.wq_b(q_lat).view(B, T, attn.n_heads, attn.head_dim), pos)
    kv = attn.rope(attn.kv_norm(attn.wkv(x)), pos)
    return q_lat, q, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (2, 5), (1, 16)])
def test_prologue_and_epilogue_equal_the_module_calls(models, dtype, B, T):
    """bf16: the same bits (every step rounded where the modules round); fp32: within a few ulps (the GEMVs add
    in another order than ATen)."""
    model = models[dtype]
    g = torch.Generator().manual_seed(B * 100 + T)
    for layer in (0, 2):
        attn = model.layers[layer].attn
        x = torch.randn(B, T, model.config.hidden_size, generator=g).to(dtype)
        pos = torch.randint(0, 4000, (B, T), generator=g)
        o = torch.randn(B, T, attn.n_heads, attn.head_dim, generator=g).to(dtype)
        with torch.inference_mode():
            cos, sin = attn.rope.phases(pos)
            got = kernels.attn_prologue(x, attn.wq_a.weight, attn.q_norm.weight, attn.q_norm.eps, attn.wq_b.weight,
                                        attn.n_heads, attn.wkv.weight, attn.kv_norm.weight, attn.kv_norm.eps, cos, sin)
            y = kernels.attn_epilogue(o, cos, sin, attn.wo_a.weight, attn.o_groups, attn.wo_b.weight)
            want = module_path(attn, x, pos)
            want_y = attn.wo_b(attn.wo_a(attn.rope(o, pos, inverse=True).reshape(B, T, attn.o_groups, -1)))
        for a, b in (*zip(got, want, strict=True), (y, want_y)):
            assert a.shape == b.shape and a.dtype == b.dtype == dtype
            if dtype == torch.bfloat16:
                assert torch.equal(a.view(torch.int16), b.view(torch.int16))
            else:
                assert (a - b).abs().max() <= 2e-6 * b.abs().max(), (a - b).abs().max()  # a few ulps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_takes_them_for_a_few_tokens_only(models, dtype, counted, monkeypatch):
    """Up to FEW_ROWS tokens in inference mode take the two kernels in every layer; the model's logits are those
    of the module calls (the other kernels on in both): bit for bit in bf16, to a few ulps in fp32. More tokens,
    or outside inference mode, take the module calls."""
    from deepseek_v41.model.attention import Attention

    model = models[dtype]
    n_layers = len(model.layers)
    g = torch.Generator().manual_seed(3)
    for T, takes in ((4, True), (kernels.FEW_ROWS + 1, False)):
        ids = torch.randint(3, 512, (1, T), generator=g)
        before = dict(counted)
        with torch.inference_mode():
            got = model(ids)
        calls = {k: counted[k] - before[k] for k in counted}
        assert calls == ({"attn_prologue": n_layers, "attn_epilogue": n_layers} if takes
                         else {"attn_prologue": 0, "attn_epilogue": 0})
        with reference(model, Attention, "project", "output"), torch.inference_mode():
            want = model(ids)
        if dtype == torch.bfloat16 or not takes:
            assert torch.equal(got, want)
        else:
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    with torch.no_grad():  # outside inference mode: the module calls, the same bits as with the kernels off
        plain = model(ids[:, :4])
        with kernels.disabled():
            assert torch.equal(plain, model(ids[:, :4]))
    assert counted["attn_prologue"] == n_layers


def test_a_hooked_or_biased_projection_keeps_the_module_calls(models, counted):
    model = models[torch.float32]
    attn = model.layers[0].attn
    ids = torch.randint(3, 512, (1, 3), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        base = model(ids)
    assert counted["attn_prologue"] == len(model.layers)
    with hooked(model, attn.wq_b, lambda module, args, out: out * 2), torch.inference_mode():
        doubled = model(ids)
    assert counted["attn_prologue"] == 2 * len(model.layers) - 1  # layer 0 took the module calls
    assert (doubled - base).abs().max() > 1e-3  # the hook ran
    with hooked(model, attn.wo_b, lambda module, args: None, pre=True), torch.inference_mode():
        again = model(ids)
    assert counted["attn_epilogue"] == 3 * len(model.layers) - 1
    assert (again - base).abs().max() <= 5e-5 * base.abs().max()


PROLOGUE_WIDE_HEADS = """
import torch
from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer

torch.manual_seed(0)
attn = Transformer(tiny_config().replace(head_dim=1024)).eval().layers[0].attn
for B, T in ((1, 1), (2, 3)):
    x, pos = torch.randn(B, T, 64), torch.randint(0, 1000, (B, T))
    with torch.inference_mode():
        cos, sin = attn.rope.phases(pos)
        got = kernels.attn_prologue(x, attn.wq_a.weight, attn.q_norm.weight, attn.q_norm.eps, attn.wq_b.weight,
                                    attn.n_heads, attn.wkv.weight, attn.kv_norm.weight, attn.kv_norm.eps, cos, sin)
        with kernels.disabled():
            q_lat = attn.q_norm(attn.wq_a(x))
            want = (q_lat, attn.rope(attn.wq_b(q_lat).view(B, T, attn.n_heads, attn.head_dim), pos),
                    attn.rope(attn.kv_norm(attn.wkv(x)), pos))
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()
    junk = [torch.empty(5) for _ in range(100)]  # allocations that trip over a corrupted heap
print("ok")
"""


def test_prologue_with_heads_wider_than_the_input_and_the_query_rank():
    """head_dim (1024) above hidden_size (64) and q_lora_rank (32), which the config allows: kv_norm's row
    scratch must hold head_dim floats (it held max(D, qr), and the heap was overwritten: an abort at the next
    malloc). Run in a child, so a corrupted heap fails this test, not the test process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PROLOGUE_WIDE_HEADS], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_replaced_weight_of_another_shape_takes_the_module_calls(counted):
    """A weight the kernels would read past (wq_b with fewer rows, wo_a with a wider input) is left to the module
    calls, which raise; a weight of the right shape still takes the kernels."""
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    attn = model.layers[0].attn
    ids = torch.randint(3, 512, (1, 2), generator=torch.Generator().manual_seed(5))
    for module, shape in ((attn.wq_b, (attn.n_heads * attn.head_dim - 32, model.config.q_lora_rank)),
                          (attn.wo_a, (attn.wo_a.weight.shape[0], attn.wo_a.weight.shape[1] + 32))):
        before = module.weight
        module.weight = torch.nn.Parameter(torch.randn(shape))
        fast.install(model)
        try:
            with torch.inference_mode(), pytest.raises(RuntimeError):
                model(ids)
        finally:
            module.weight = before
    fast.install(model)
    with torch.inference_mode():
        model(ids)
    assert counted["attn_prologue"] >= len(model.layers) and counted["attn_epilogue"] >= len(model.layers)


def test_weights_of_another_shape_reach_no_kernel():
    """Shapes the kernels would misread take the torch code, which raises (or broadcasts) as it always did: a norm
    weight of another width, RoPE wider than the vector, window rows of another width."""
    from deepseek_v41.model.norm import RMSNorm
    from deepseek_v41.model.rope import RotaryEmbedding

    with torch.inference_mode():
        norm = RMSNorm(8, 1e-6)
        with pytest.raises(RuntimeError):
            norm(torch.randn(1, 1, 6))
        rope = RotaryEmbedding(16, 10000.0, None)
        with pytest.raises(RuntimeError):
            rope(torch.randn(1, 1, 8), torch.tensor([[3]]))
        wide = torch.randn(1, 1, 32)
        assert torch.equal(rope(wide, torch.tensor([[3]])), rope(wide.clone(), torch.tensor([[3]])))
