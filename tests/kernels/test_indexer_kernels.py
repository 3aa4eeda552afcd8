"""The indexer's queries of a few tokens in one kernel call (``kernels.indexer_queries``: wq_b, RoPE, the FP4
fake quant and the head weights), against the module calls of ``Indexer.queries`` they stand in for."""

from __future__ import annotations

import pytest
import torch
from fast_oracles import hooked as hooked_and_installed
from fast_oracles import installed_models, reference
from kernel_oracles import perturbed_models

from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.model.indexer import Indexer
from deepseek_v41.model.transformer import Transformer

INDEX_LAYERS = (2, 4, 6)  # tiny_config's index sources


@pytest.fixture(scope="module")
def models():
    return installed_models(perturbed_models())


@pytest.fixture
def calls(monkeypatch):
    """Every kernels.indexer_queries call's RoPE phases (cos, sin), in call order."""
    seen = []

    def spy(*args, _fn=kernels.indexer_queries):
        seen.append(args[5:7])
        return _fn(*args)

    monkeypatch.setattr(kernels, "indexer_queries", spy)
    return seen


def kernel_path(indexer, q_lat, x, pos, rope, fake_quant):
    """Indexer.queries of an installed indexer (its fast version computes the RoPE phases of a few tokens)."""
    return indexer.queries(q_lat, x, pos, rope, fake_quant)


def inputs(model, dtype, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    q_lat = torch.randn(B, T, cfg.q_lora_rank, generator=g).to(dtype)
    x = torch.randn(B, T, cfg.hidden_size, generator=g).to(dtype)
    return q_lat, x, torch.randint(0, 4000, (B, T), generator=g)


@pytest.mark.parametrize("fake_quant", [False, True], ids=["plain", "fake_quant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (2, 5), (1, 16)])
def test_queries_equal_the_module_calls(models, dtype, B, T, fake_quant, calls):
    """bf16: the same bits (the projections and RoPE rounded where the modules round them, the fake quant's
    values rounded to bf16 before the upcast); fp32: within a few ulps (the GEMVs add in another order than
    ATen). Both come back fp32, the module path's shapes."""
    model = models[dtype]
    for i, layer in enumerate(INDEX_LAYERS):
        attn = model.layers[layer].attn
        q_lat, x, pos = inputs(model, dtype, B, T, seed=B * 100 + T + i)
        with torch.inference_mode():
            got = kernel_path(attn.indexer, q_lat, x, pos, attn.rope, fake_quant)
            want = Indexer.queries(attn.indexer, q_lat, x, pos, attn.rope, fake_quant)  # the reference
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
            if dtype == torch.bfloat16:
                assert torch.equal(a, b)
            else:
                assert (a - b).abs().max() <= 2e-6 * b.abs().max(), (a - b).abs().max()
    assert len(calls) == len(INDEX_LAYERS)


@pytest.mark.parametrize("fake_quant", [False, True], ids=["plain", "fake_quant"])
def test_fp32_rope_and_fake_quant_give_the_torch_bits(models, fake_quant, calls):
    """With inputs and weights whose products and sums are exact in fp32 (small integers times powers of two) the
    GEMVs' order does not matter, so the kernel's fp32 result is the torch code's bit for bit (every kernel off:
    ATen's GEMM, torch's RoPE and FP4 codec) — RoPE at large positions and the fake quant included."""
    model = models[torch.float32]
    attn = model.layers[2].attn
    indexer = attn.indexer
    g = torch.Generator().manual_seed(7)
    saved = {name: p.detach().clone() for name, p in indexer.named_parameters()}
    try:
        with torch.no_grad():
            indexer.wq_b.weight.copy_(torch.randint(-8, 9, indexer.wq_b.weight.shape, generator=g) / 64)
            indexer.weights_proj.weight.copy_(torch.randint(-8, 9, indexer.weights_proj.weight.shape, generator=g) / 8)
        for B, T in ((1, 1), (4, 3)):
            q_lat = torch.randint(-16, 17, (B, T, model.config.q_lora_rank), generator=g) / 4
            x = torch.randint(-16, 17, (B, T, model.config.hidden_size), generator=g) / 4
            pos = torch.randint(0, 100_000, (B, T), generator=g)
            with torch.inference_mode():
                got = kernel_path(indexer, q_lat, x, pos, attn.rope, fake_quant)
                with kernels.disabled():
                    want = indexer.queries(q_lat, x, pos, attn.rope, fake_quant)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b)
    finally:
        with torch.no_grad():
            for name, p in indexer.named_parameters():
                p.copy_(saved[name])
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_takes_it_for_a_few_tokens_only(models, dtype, calls, monkeypatch):
    """Up to FEW_ROWS tokens in inference mode take the kernel in every index-source layer, with the RoPE phases
    the attention computed for its own queries (the same tensors, from the forward's cache); the logits are those
    of the module calls (the other kernels on): bit for bit in bf16, to rounding in fp32 (there also to those with
    every kernel off). More tokens, or outside inference mode, take the module calls."""
    model = models[dtype]
    prologue = []

    def spy(*args, _fn=kernels.attn_prologue):
        prologue.append(args[9:11])
        return _fn(*args)

    monkeypatch.setattr(kernels, "attn_prologue", spy)
    g = torch.Generator().manual_seed(3)
    for T, takes in ((4, True), (kernels.FEW_ROWS + 1, False)):
        ids = torch.randint(3, 512, (1, T), generator=g)
        before, prologue[:] = len(calls), []
        with torch.inference_mode():
            got = model(ids)
        assert len(calls) - before == (len(INDEX_LAYERS) if takes else 0)
        if takes:
            assert all(any(cos is c and sin is s for c, s in prologue) for cos, sin in calls[before:])
        with reference(model, Indexer, "queries"), torch.inference_mode():
            want = model(ids)
        if dtype == torch.bfloat16 or not takes:
            assert torch.equal(got, want)
        else:
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        if dtype == torch.float32:  # (bf16 with every kernel off rounds elsewhere: other selections, other logits)
            with torch.inference_mode(), kernels.disabled():
                off = model(ids)
            assert (got - off).abs().max() <= 1e-5 * off.abs().max()
    count = len(calls)
    with torch.no_grad():  # outside inference mode: the module calls
        model(ids[:, :4])
    assert len(calls) == count


def test_fake_quant_off_in_the_forward(models, calls):
    """``model.fake_quant = False`` reaches the kernel (the unquantized queries), as the module calls."""
    model = models[torch.float32]
    ids = torch.randint(3, 512, (2, 3), generator=torch.Generator().manual_seed(8))
    try:
        model.fake_quant = False
        with torch.inference_mode():
            got = model(ids)
            with kernels.disabled():
                off = model(ids)
    finally:
        model.fake_quant = True
    assert len(calls) == len(INDEX_LAYERS)
    assert (got - off).abs().max() <= 1e-5 * off.abs().max()


@pytest.mark.parametrize("hooked", ["wq_b", "weights_proj", "rope"])
def test_a_hooked_module_keeps_the_module_calls(models, calls, hooked):
    """A hook on wq_b, weights_proj or the attention's RoPE makes that layer take the module calls (and the hook
    runs); the other layers still take the kernel."""
    model = models[torch.float32]
    attn = model.layers[INDEX_LAYERS[0]].attn
    module = attn.rope if hooked == "rope" else getattr(attn.indexer, hooked)
    ids = torch.randint(3, 512, (1, 3), generator=torch.Generator().manual_seed(4))
    ran = []
    with hooked_and_installed(model, module, lambda m, args, out: ran.append(m)), torch.inference_mode():
        model(ids)
    assert ran and len(calls) == len(INDEX_LAYERS) - 1


@pytest.mark.parametrize("name,delta", [("wq_b", (-32, 0)), ("wq_b", (0, 8)), ("weights_proj", (0, -8)),
                                        ("weights_proj", (1, 0))])
def test_a_weight_of_another_shape_takes_the_torch_code(name, delta, calls):
    """A weight the kernel would read past (or misread) is left to the torch code, which raises; the right shape
    takes the kernel again."""
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    module = getattr(model.layers[INDEX_LAYERS[0]].attn.indexer, name)
    ids = torch.randint(3, 512, (1, 2), generator=torch.Generator().manual_seed(5))
    before = module.weight
    module.weight = torch.nn.Parameter(torch.randn(before.shape[0] + delta[0], before.shape[1] + delta[1]))
    fast.install(model)
    try:
        with torch.inference_mode(), pytest.raises(RuntimeError):
            model(ids)
    finally:
        module.weight = before
    assert calls == []
    fast.install(model)
    with torch.inference_mode():
        model(ids)
    assert len(calls) == len(INDEX_LAYERS)


def test_float64_and_autograd_take_the_torch_code(models, calls):
    """float64 inputs stay float64 (the torch code); with autograd wanted, the torch code (gradients flow)."""
    model = models[torch.float32]
    attn = model.layers[2].attn
    q_lat, x, pos = inputs(model, torch.float32, 1, 2, seed=9)
    indexer64 = Indexer(64, 32, 32, 2, 32, False, 1e-6).double()
    with torch.inference_mode():
        q, w = kernel_path(indexer64, q_lat.double(), x.double(), pos, attn.rope, True)
    assert q.dtype == w.dtype == torch.float64
    q, w = kernel_path(attn.indexer, q_lat.requires_grad_(), x, pos, attn.rope, True)
    (q.sum() + w.sum()).backward()
    assert q_lat.grad is not None and calls == []


def test_phases_the_kernel_would_misread_take_the_module_calls(models, calls):
    """A RoPE module whose phases the kernel would misread (float64 tables, an odd or too wide rotation) reaches
    no kernel: Indexer.queries then runs its module calls (which use the RoPE module itself, and raise where it
    does not fit)."""
    from deepseek_v41.model.rope import RotaryEmbedding

    model = models[torch.float32]
    attn = model.layers[2].attn
    q_lat, x, pos = inputs(model, torch.float32, 2, 3, seed=10)
    di, r = attn.indexer.head_dim, attn.rope.rope_dim
    with torch.inference_mode():
        wide = RotaryEmbedding(r, 10000.0, None).double()
        want = Indexer.queries(attn.indexer, q_lat, x, pos, wide, True)
        got = attn.indexer.queries(q_lat, x, pos, wide, True)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        for bad in (RotaryEmbedding(r - 1, 10000.0, None), RotaryEmbedding(di + 2, 10000.0, None)):
            with pytest.raises(RuntimeError):
                attn.indexer.queries(q_lat, x, pos, bad, True)
    assert calls == []
