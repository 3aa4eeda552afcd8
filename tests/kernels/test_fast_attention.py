"""The attention layer's fast paths are installed once per module instance (deepseek_v41/kernels/fast/attention.py):
what installs, that the installed forward is the reference forward to rounding, and what gets no override."""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import count_calls, perturbed_models

from deepseek_v41.kernels import fast
from deepseek_v41.model.attention import Attention, GroupedLinear, SparseAttention
from deepseek_v41.model.indexer import Indexer

FAST_METHODS = {Attention: {"project", "output", "compress"}, SparseAttention: {"forward"},
                GroupedLinear: {"forward"},
                Indexer: {"queries", "topk_entries", "candidate_blocks", "pool_entries", "select_entries"}}
KERNELS = ("attn_prologue", "attn_epilogue", "compress", "attend_few", "indexer_queries", "topk_set",
           "candidate_blocks", "index_select")


def overrides(m: torch.nn.Module) -> set[str]:
    return set(m.__dict__.get("_fast_overrides", ()))


@pytest.fixture(scope="module")
def models():
    out = perturbed_models(max_position_embeddings=8192)
    for model in out.values():  # (perturbed_models installs the backend: these tests start from the reference)
        fast.uninstall(model)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_install_counts_and_the_installed_forward_is_the_reference(models, dtype, monkeypatch):
    """Every layer's Attention, SparseAttention and GroupedLinear and every index source's Indexer get their fast
    methods (the kv sources' compress too); in inference mode a few tokens then run the attention kernels, and the
    logits are the reference forward's to rounding (fp32: a few ulps; bf16: the kernels skip bf16 roundings the
    modules make). Uninstalling restores the reference bit for bit."""
    model = models[dtype]
    layers = len(model.layers)
    instances = sum(type(m) is Attention for m in model.modules())  # (the DSpark draft's blocks too)
    index_sources = sum(layer.attn.indexer is not None for layer in model.layers)
    calls = count_calls(monkeypatch, *KERNELS)
    ids = torch.randint(3, 512, (2, 3), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = model(ids)
    with torch.no_grad():
        exact = model(ids)
    assert sum(calls.values()) == 0  # nothing installed: the reference (the model holds no kernel call)
    done = fast.install(model)
    try:
        assert {k: done.modules.get(k) for k in ("Attention", "SparseAttention", "GroupedLinear", "Indexer")} == {
            "Attention": instances, "SparseAttention": instances, "GroupedLinear": instances, "Indexer": index_sources}
        for m in model.modules():
            if type(m) in FAST_METHODS:
                wanted = FAST_METHODS[type(m)]
                if type(m) is Attention and m.compressor is None:
                    wanted = wanted - {"compress"}
                assert overrides(m) == wanted, type(m).__name__
        with torch.inference_mode():
            got = model(ids)
        # (attend_few: not here, the exact forward's positions are an expanded arange: test_attend_kernels.py)
        assert calls["attn_prologue"] == calls["attn_epilogue"] == layers
        # (the candidate source's pool: from index_select when it scores every key, issue 25)
        assert calls["compress"] == 2 and calls["indexer_queries"] == index_sources and calls["index_select"] >= 1
        # bf16: install puts the whole backend on (dense, mHC and MoE kernels skip bf16 roundings too): measured
        # 0.13 of the largest logit over the three tokens, against 0.05 with the attention installers alone.
        tol = 1e-5 if dtype == torch.float32 else 0.2
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
        with torch.no_grad():  # outside inference mode: the reference arithmetic, the same bits (only the exact
            before = dict(calls)  # selection rules may run in C: they give the reference's indices)
            assert torch.equal(model(ids), exact)
            assert all(calls[k] == before[k] for k in KERNELS[:5])
    finally:
        fast.uninstall(model)
    assert all(not overrides(m) for m in model.modules())
    with torch.inference_mode():
        assert torch.equal(model(ids), want)


def test_a_hooked_or_subclassed_instance_gets_no_override(models):
    """A hook of its own on an Attention (or on a module its fast method stands in for) at install leaves that
    method to the reference; an instance of a subclass (e.g. a LoRA wrapper's) gets no override at all."""
    model = models[torch.float32]
    first, second = model.layers[0].attn, model.layers[1].attn
    handles = [first.register_forward_hook(lambda m, args, out: None),
               second.wo_b.register_forward_pre_hook(lambda m, args: None)]
    try:
        fast.install(model)
        assert overrides(first) == set() and overrides(first.core) == {"forward"}
        assert overrides(second) == {"project"}  # the output side reads wo_b: the reference runs it
    finally:
        for handle in handles:
            handle.remove()
        fast.uninstall(model)

    class Wrapped(GroupedLinear):
        pass

    wrapped = Wrapped(16, 2, 4)
    plain = GroupedLinear(16, 2, 4)
    assert not fast.install(wrapped) and overrides(wrapped) == set()
    assert fast.install(plain).modules == {"GroupedLinear": 1} and overrides(plain) == {"forward"}


def test_weights_the_kernels_do_not_take_install_nothing():
    """float64 weights (no kernel dtype) install no projection kernel; the selection rules (exact for any input)
    still install on the Indexer."""
    from deepseek_v41.config import tiny_config
    from deepseek_v41.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval().double()
    fast.install(model)
    try:
        attn = model.layers[2].attn
        assert overrides(attn) == set() and overrides(attn.wo_a) == set()
        assert overrides(attn.indexer) == {"topk_entries", "candidate_blocks", "pool_entries", "select_entries"}
    finally:
        fast.uninstall(model)
