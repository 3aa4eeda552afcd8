"""The fast backend's dense and block installers (kernels/fast/dense.py, kernels/fast/block.py, issue 24).

Installing on the tiny model replaces the methods of exactly the instances that have a fast version (plain
``Linear`` without bias, ``RMSNorm``, ``RotaryEmbedding``, ``Block`` / ``DSparkBlock``, ``Transformer``), and the
installed model's forward under ``torch.inference_mode`` equals the reference forward to rounding; outside
inference mode the installed model runs the reference, bit for bit. A module with a hook of its own, or of a
subclass, gets no fast version. Without a C compiler these tests skip, except under CI=true, where a missing
library fails (the ``library`` fixture of tests/kernels/conftest.py)."""

import pytest
import torch
import torch.nn.functional as F
from kernel_oracles import count_calls
from torch import nn

from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.model.dspark import DSparkBlock
from deepseek_v41.model.linear import Linear
from deepseek_v41.model.norm import RMSNorm
from deepseek_v41.model.rope import RotaryEmbedding
from deepseek_v41.model.transformer import Block, Transformer

DENSE = ("forward", "rotate", "attention_input", "run_layers", "lm_head", "embed_streams")


def tiny(dtype: torch.dtype = torch.float32, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config()).eval().to(dtype)


def overridden(m: nn.Module) -> set[str]:
    """The methods of this backend's files replaced on ``m`` (others' installers may replace more)."""
    return {name for name in DENSE if name in m.__dict__}


def test_install_replaces_the_methods_of_every_dense_instance(library):
    model = tiny()
    done = fast.install(model)
    biasless = [m for m in model.modules() if type(m) is Linear and m.bias is None]
    want = {"Transformer": 1, "Block": sum(type(m) is Block for m in model.modules()),
            "DSparkBlock": sum(type(m) is DSparkBlock for m in model.modules()),
            "RMSNorm": sum(type(m) is RMSNorm for m in model.modules()), "Linear": len(biasless),
            "RotaryEmbedding": sum(type(m) is RotaryEmbedding for m in model.modules())}
    assert want["Block"] == len(model.layers) and want["Linear"] > 0 and want["DSparkBlock"] > 0
    assert {k: done.modules.get(k) for k in want} == want and not done.reason
    assert fast.installed(model) is done
    assert overridden(model) == {"run_layers", "lm_head", "embed_streams"}
    for m in model.modules():
        if type(m) in (Block, DSparkBlock):
            assert overridden(m) == {"forward", "attention_input"}
        elif type(m) in (RMSNorm, Linear) and not (type(m) is Linear and m.bias is not None):
            assert overridden(m) == {"forward"}
        elif type(m) is RotaryEmbedding:
            assert overridden(m) == {"rotate"}
    fast.uninstall(model)
    assert not any(overridden(m) for m in model.modules())
    assert fast.installed(model) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_the_installed_embed_streams_equals_the_reference(library, monkeypatch, dtype):
    """``embed_streams`` of text tokens (the fast path: rows by index_select, streams and ``pre`` copied) gives the
    reference's tensors exactly (values, dtypes, shapes, contiguity) without calling it; with gradients on, a
    hooked embedding or a global module hook it calls the reference (the hook sees the call)."""
    model = tiny(dtype)
    ids = torch.randint(0, model.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(2))
    want = Transformer.embed_streams(model, ids)
    fast.install(model)
    reference, calls = Transformer.embed_streams, []
    monkeypatch.setattr(Transformer, "embed_streams", lambda *a, **k: calls.append(1) or reference(*a, **k))
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            got = model.embed_streams(ids)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w) and g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
    assert calls == []
    seen = []
    handle = model.embed.register_forward_hook(lambda m, i, o: seen.append(1))
    with torch.no_grad():
        got = model.embed_streams(ids)
    handle.remove()
    assert seen == [1] and calls == [1] and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(2))
    try:
        with torch.no_grad():
            model.embed_streams(ids)
    finally:
        handle.remove()
    assert 2 in seen and calls == [1, 1]
    model.embed_streams(ids)  # gradients on (nn.Embedding's backward: padding_idx)
    assert calls == [1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_installed_forward_equals_the_reference(library, monkeypatch, dtype):
    """Inference mode: the kernels run (counted) and the logits agree with the reference to rounding (bf16: to
    the model's rounding); no_grad: the reference, bit for bit, and no mHC / norm / GEMV kernel runs."""
    model = tiny(dtype)
    ids = torch.randint(3, 500, (2, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
    fast.install(model)
    calls = count_calls(monkeypatch, "hc_mix", "hc_collapse", "hc_expand", "rms_norm", "linear")
    with torch.no_grad():
        assert torch.equal(model(ids), want)
    assert not any(calls.values()), dict(calls)
    with torch.inference_mode():
        got = model(ids)
    n = len(model.layers)
    assert calls["hc_mix"] == calls["hc_expand"] == 2 * n and calls["hc_collapse"] >= 2 * n
    assert calls["rms_norm"] > 0
    if dtype == torch.bfloat16:
        assert calls["linear"] > 0  # a few bf16 tokens: the projections and the LM head
    scale = want.abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 0.15  # measured over 4 inputs: at most 4e-7 and 0.071 (bf16 routing)
    assert (got - want).abs().max().item() <= tol * scale


def test_a_hooked_or_subclassed_module_gets_no_fast_version(library):
    class Wrapped(Linear):  # a LoRA-like subclass: its forward is its own
        def forward(self, x):
            return super().forward(x) * 2

    class MyBlock(Block):
        pass

    model = tiny()
    block = model.layers[0]
    seen = []
    block.attn_norm.register_forward_hook(lambda module, args, out: seen.append(out))
    proj = block.attn.wkv if type(block.attn.wkv) is Linear else None
    assert proj is not None
    proj.register_forward_pre_hook(lambda module, args: None)
    rope = block.attn.rope
    rope.register_forward_hook(lambda module, args, out: None)
    model.layers[1].__class__ = MyBlock
    wrapped = Wrapped(8, 4, bias=False)
    model.add_module("extra", wrapped)
    fast.install(model)
    assert not overridden(block.attn_norm) and not overridden(proj) and not overridden(rope)
    assert not overridden(model.layers[1]) and not overridden(wrapped)
    assert overridden(block) == {"forward", "attention_input"}  # the block itself is plain
    assert block.__dict__["_fast_norms"] == (False, True)  # its hooked attn_norm runs as a module
    ids = torch.randint(3, 500, (1, 2), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model(ids)
    assert len(seen) == 1  # the hook fired: the fused collapse did not stand in for the hooked norm


def test_a_hook_added_after_install_fires_and_reinstalling_drops_the_fast_version(library, monkeypatch):
    layer = Linear(32, 16, bias=False).bfloat16()
    assert fast.install(layer).modules == {"Linear": 1}
    calls = count_calls(monkeypatch, "linear")
    seen = []
    layer.register_forward_hook(lambda module, args, out: seen.append(out))
    x = torch.randn(2, 32).bfloat16()
    with torch.inference_mode():
        got = layer(x)
    assert calls["linear"] == 1 and seen == [got]
    assert fast.install(layer).modules == {}  # hooked now: nothing installed, the reference runs
    with torch.inference_mode():
        again = layer(x)
    assert calls["linear"] == 1 and torch.equal(again, F.linear(x, layer.weight))


def test_a_global_hook_uninstalls_before_the_next_step(library):
    model = tiny()
    fast.install(model)
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        assert not fast.still_valid(model)
        assert not any(overridden(m) for m in model.modules())
        assert fast.install(model).reason == "a global module hook is registered"
        assert fast.still_valid(model) and not fast.installed(model)  # the hook stays: the reference runs
    finally:
        handle.remove()
    assert fast.still_valid(model) and not fast.installed(model)  # nothing was suspended by still_valid
    fast.install(model)
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    assert not fast.still_valid(model)
    handle.remove()
    assert fast.still_valid(model)  # the hook is gone: installed again, without a call to install
    assert fast.installed(model) and any(overridden(m) for m in model.modules())


def test_nothing_is_installed_with_the_kernels_off(library):
    model = tiny()
    with kernels.disabled():
        done = fast.install(model)
    assert not done and "unavailable" in done.reason
    assert not any(overridden(m) for m in model.modules())
