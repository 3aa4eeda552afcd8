"""Attention.compress of a few tokens in one kernel call (``kernels.compress``: the compressor's pairs or ratio-1
latent, its norm, the entry RoPE and the index keys), against the module calls it stands in for."""

from __future__ import annotations

import pytest
import torch
from fast_oracles import hooked, installed_models, reference
from kernel_oracles import greedy_run, perturbed_models

from deepseek_v41 import kernels
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast import attention as fast_attention
from deepseek_v41.model.attention import Attention
from deepseek_v41.model.transformer import Transformer

KV_SOURCES = {2: 2, 4: 1}  # tiny_config's kv-source layers and their compress ratios


@pytest.fixture(scope="module")
def models():
    return installed_models(perturbed_models(max_position_embeddings=8192))


@pytest.fixture
def counted(monkeypatch):
    """Calls of ``kernels.compress``, each recorded as whether it made entries (phases given)."""
    calls: list[bool] = []

    def spy(*args, _fn=kernels.compress, **kw):
        calls.append(args[4] is not None)
        return _fn(*args, **kw)

    monkeypatch.setattr(kernels, "compress", spy)
    return calls


def module_path(attn, x, pos, pending):
    """What Attention.compress computes with the module calls: (latent, group, new pending, entries, keys)."""
    latent, group, new_pending = attn.compressor(x, pos, pending)
    entry_pos = group.clamp(min=0) * attn.spec.compress_ratio
    return latent, group, new_pending, attn.rope(latent, entry_pos), attn.indexer.keys(latent, entry_pos, attn.rope)


def kernel_path(attn, x, pos, pending, entries=True):
    c, ix = attn.compressor, attn.indexer
    phases = None
    if entries:
        phases = attn.rope.phases(pos if c.ratio == 1 else torch.cat((pos[:, :1] - 1, pos), 1))
    return kernels.compress(x, pos, c.ratio, pending if c.ratio == 2 else None, phases, c.wkv.weight,
                            c.wgate.weight if c.ratio == 2 else None, c.norm.weight, c.norm.eps, ix.wk.weight,
                            ix.k_norm.weight, ix.k_norm.eps)


def assert_close(got, want, dtype, exact):
    """bf16 where the module calls run the same GEMV: the same bits; else within a few ulps of the dtype."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if exact:
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    else:
        ulps = 2 ** -7 if dtype == torch.bfloat16 else 2e-6
        assert (got.float() - want.float()).abs().max() <= ulps * want.float().abs().max()


def pending_views(B, d, g):
    """Open pairs as the engine's context hands them over: the two halves of a [B, 2, d] tensor (strided rows)."""
    state = torch.randn(B, 2, d, generator=g)
    return state[:, 0], state[:, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layer", sorted(KV_SOURCES), ids=lambda layer: f"ratio{KV_SOURCES[layer]}")
@pytest.mark.parametrize("B,T", [(1, 1), (4, 1), (2, 2), (3, 5), (4, 4), (1, 16)])
def test_compress_equals_the_module_calls(models, dtype, layer, B, T):
    """Rows start at positions of both parities (odd ones close a pending pair); with and without a pending pair
    and with and without entries. bf16 ratio 1: the same bits; bf16 ratio 2 (the torch code's projections are
    ATen fp32 matmuls) and fp32: within a few ulps; the entries and keys of the kernel's own latent: the bits of the
    module calls (fp32 keys: a few ulps, wk runs on ATen there)."""
    attn = models[dtype].layers[layer].attn
    ratio = KV_SOURCES[layer]
    g = torch.Generator().manual_seed(100 * B + T + layer)
    exact = dtype == torch.bfloat16 and ratio == 1
    for pending in (pending_views(B, attn.head_dim, g), None):
        x = torch.randn(B, T, attn.compressor.wkv.weight.shape[1], generator=g).to(dtype)
        start = torch.randint(0, 4000, (B, 1), generator=g)
        if B > 1:
            start[0, 0] = 1  # an odd start whose entry lies at position 0
        pos = start + torch.arange(T)
        with torch.inference_mode():
            want = module_path(attn, x, pos, pending)
            got = kernel_path(attn, x, pos, pending)
            bare = kernel_path(attn, x, pos, pending, entries=False)
            entry_pos = got[1].clamp(min=0) * ratio
            own = attn.rope(got[0], entry_pos), attn.indexer.keys(got[0], entry_pos, attn.rope)
        latent, group, new_pending, entries, keys = got
        assert torch.equal(group, want[1]) and group.dtype == torch.int64
        assert_close(latent, want[0], dtype, exact)
        assert_close(entries, want[3], dtype, exact)
        assert_close(keys, want[4], dtype, exact)
        assert torch.equal(entries, own[0])
        assert_close(keys, own[1], dtype, exact=dtype == torch.bfloat16)
        if ratio == 1:
            assert new_pending is None and want[2] is None
        else:
            for a, b in zip(new_pending, want[2], strict=True):
                assert a.shape == b.shape == (B, attn.head_dim) and a.dtype == torch.float32
                assert (a - b).abs().max() <= 2e-6 * max(b.abs().max(), 1e-30)
        assert torch.equal(bare[0], latent) and torch.equal(bare[1], group) and bare[3] is None and bare[4] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pending_pairs_across_calls(models, dtype):
    """Ratio 2 over a sequence fed in calls of 1, 3, 2, 1, 4 and 1 tokens, rows three positions apart (so their
    parities differ): the kernel's pending pairs carry over as the module calls' do, and every entry of the
    sequence comes out once, in order, as the module calls make it."""
    attn = models[dtype].layers[2].attn
    B, D = 2, attn.compressor.wkv.weight.shape[1]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, 12, D, generator=g).to(dtype)
    offset = torch.tensor([[0], [3]])
    done, got_pending, want_pending = 0, None, None
    got_entries, want_entries = [], []
    for T in (1, 3, 2, 1, 4, 1):
        pos = offset + torch.arange(done, done + T)
        with torch.inference_mode():
            chunk = x[:, done: done + T].contiguous()  # the kernel reads contiguous tokens (Attention checks)
            latent, group, got_pending, entries, _ = kernel_path(attn, chunk, pos, got_pending)
            want = module_path(attn, x[:, done: done + T], pos, want_pending)
        want_pending = want[2]
        assert torch.equal(group, want[1])
        assert_close(entries, want[3], dtype, exact=False)
        got_entries += [(int(gid), entries[b, j]) for b in range(B) for j, gid in enumerate(group[b]) if gid >= 0]
        want_entries += [(int(gid), want[3][b, j]) for b in range(B) for j, gid in enumerate(want[1][b]) if gid >= 0]
        done += T
    assert [gid for gid, _ in got_entries] == [gid for gid, _ in want_entries]
    assert sorted(gid for gid, _ in got_entries) == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_takes_the_kernel_for_a_few_tokens_only(models, dtype, counted, monkeypatch):
    """Up to FEW_ROWS tokens in inference mode: one kernel call per kv source, and the model's logits are those of
    the module calls (the other kernels on in both) to rounding; more tokens, or outside inference mode, take the
    module calls."""
    model = models[dtype]
    g = torch.Generator().manual_seed(3)
    for T, takes in ((5, True), (kernels.FEW_ROWS + 1, False)):
        ids = torch.randint(3, 512, (2, T // 2 + 1) if takes else (1, T), generator=g)
        before = len(counted)
        with torch.inference_mode():
            got = model(ids)
        assert len(counted) - before == (len(KV_SOURCES) if takes else 0)
        with reference(model, Attention, "compress"), torch.inference_mode():
            want = model(ids)
        assert len(counted) - before == (len(KV_SOURCES) if takes else 0)
        tol = 0.05 if dtype == torch.bfloat16 else 1e-5
        assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    with torch.no_grad():
        before = len(counted)
        plain = model(ids[:, :4])
        with kernels.disabled():
            assert torch.equal(plain, model(ids[:, :4]))
        assert len(counted) == before


def test_float64_and_indexer_training_take_the_module_calls(models, counted):
    """A float64 model, and a context that collects indexer losses (training), keep the module calls."""
    from deepseek_v41.model.context import DenseContext

    ids = torch.randint(3, 512, (1, 3), generator=torch.Generator().manual_seed(6))
    wide = Transformer(models[torch.float32].config).eval()
    wide.load_state_dict(models[torch.float32].state_dict())
    with torch.inference_mode():
        wide.double()(ids)
    assert counted == []
    attn = models[torch.float32].layers[2].attn
    x = torch.randn(1, 3, attn.compressor.wkv.weight.shape[1], generator=torch.Generator().manual_seed(7))
    entries = []
    for losses in ([], None):
        ctx = DenseContext(1, 3, "cpu", fake_quant=False)
        ctx.indexer_losses = losses
        with torch.inference_mode():
            attn.compress(x, ctx)
        entries.append(ctx.all_entries(2))
    assert counted == [True]  # only the context without losses took the kernel
    assert (entries[0] - entries[1]).abs().max() <= 2e-6 * entries[1].abs().max()


@pytest.mark.parametrize("prompts", [(40, 38), (40, 37)], ids=["same-parity", "mixed-parity"])
def test_engine_decode_takes_the_kernel_with_the_same_tokens(counted, monkeypatch, prompts):
    """The engine's decode steps take the kernel in both kv sources (rows of one parity: every other step makes no
    entry, so the kernel only updates the pending pair); the greedy tokens and their log-probabilities are those
    of the module calls."""
    torch.manual_seed(0)
    model = Transformer(tiny_config().replace(max_position_embeddings=8192)).eval().float()
    g = torch.Generator().manual_seed(12)
    requests = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in prompts]

    def run():
        return greedy_run(model, requests, max_tokens=10)

    tokens, logprobs = run()
    decode_steps = 9
    assert len(counted) == len(KV_SOURCES) * decode_steps
    if prompts == (40, 38):
        assert sum(counted) == decode_steps + decode_steps // 2  # ratio 1 each step, ratio 2 every other
    else:
        assert all(counted)
    with monkeypatch.context() as m:  # the engine installs the backend without the compress kernel
        m.setattr(fast_attention, "_install_compress", lambda attn, rope: False)
        want_tokens, want_logprobs = run()
    assert len(counted) == len(KV_SOURCES) * decode_steps
    assert tokens == want_tokens and all(len(t) == 10 for t in tokens)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["compressor", "compressor.wkv", "compressor.wgate", "compressor.norm",
                                  "indexer", "indexer.wk", "indexer.k_norm", "rope"])
def test_a_hooked_module_keeps_the_module_calls(models, counted, name):
    """A hook on any module the kernel stands in for keeps that layer on the module calls once the backend is
    reinstalled; the other kv source still takes the kernel. The compressor's hooks need no reinstall: the
    engine's speculative verify puts a pre-hook on it for one step to capture its inputs."""
    model = models[torch.float32]
    module = model.layers[2].attn.get_submodule(name)
    seen = []
    ids = torch.randint(3, 512, (1, 3), generator=torch.Generator().manual_seed(4))
    if name == "compressor":
        handle = module.register_forward_pre_hook(lambda m, args: seen.append(1))
        try:
            with torch.inference_mode():
                model(ids)
        finally:
            handle.remove()
    else:
        with hooked(model, module, lambda m, args: seen.append(1), pre=True), torch.inference_mode():
            model(ids)
    assert len(counted) == len(KV_SOURCES) - 1
    if name not in ("compressor.wkv", "compressor.wgate", "indexer"):  # ratio 2 reads those modules' weights only
        assert seen


@pytest.mark.parametrize("layer,name,change", [(2, "compressor.wkv", (-8, 0)), (2, "compressor.wgate", (0, 8)),
                                               (4, "compressor.wkv", (0, -8)), (4, "indexer.wk", (0, 8)),
                                               (4, "indexer.k_norm", (8,)), (2, "compressor.norm", (-8,))])
def test_a_weight_of_another_shape_takes_the_module_calls(counted, layer, name, change):
    """A weight the kernel would read past (or misread) is left to the module calls, which raise; the right shape
    takes the kernel again."""
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    module = model.layers[layer].attn.get_submodule(name)
    before = module.weight
    module.weight = torch.nn.Parameter(torch.randn([n + c for n, c in zip(before.shape, change, strict=True)]))
    ids = torch.randint(3, 512, (1, 2), generator=torch.Generator().manual_seed(5))
    fast.install(model)
    try:
        with torch.inference_mode(), pytest.raises(RuntimeError):
            model(ids)
    finally:
        module.weight = before
    assert len(counted) == (1 if layer == 4 else 0)  # layer 2 runs first
    fast.install(model)
    with torch.inference_mode():
        model(ids)
    assert len(counted) >= len(KV_SOURCES)
