"""The MoE (model/moe.py, MODEL_REFERENCE.md §3.14) against independent oracles, and its installed fast paths
(kernels/fast/moe.py) against it.

Oracles: a per-token, per-expert Python loop written here from the equations (router scores, bias / bias_vl
selection, renormalised weights, clamped SwiGLU experts, the shared expert); mlx-lm's ``deepseek_v41`` port's MoE
(``Router``, ``SwitchGLU`` experts, ``SharedMLP``) on the same weights, a missing port skipping the test except
under CI=true. The fast backend must install on a plain MoE (not on a hooked instance or a subclass) and give the
reference's result to rounding in inference mode, fp32 and bf16, with FP4 experts when the weights are FP4 values.
"""

import collections
import copy
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from optional_deps import require

from deepseek_v41 import kernels
from deepseek_v41.kernels import fast
from deepseek_v41.kernels.fast.moe import pack_copies
from deepseek_v41.model.moe import Expert, Gate, MoE
from deepseek_v41.quant import dequantize_fp4, quantize_fp4

LIMIT = 7.0


def random_moe(seed: int, dim: int = 64, inter: int = 32, n_experts: int = 8, topk: int = 2, n_shared: int = 1,
               gate_temp: float = 1.0, fp4: bool = False, bias_vl: bool = True) -> MoE:
    """A MoE with weights far from init: spread router logits and biases; ``fp4``: the routed experts' weights are
    FP4 values (E2M1 in blocks of 32, UE8M0 scales), as weights decoded from the checkpoint are."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(dim, inter, n_experts, topk, n_shared, LIMIT, 1.5, True, bias_vl, gate_temp).eval()
    with torch.no_grad():
        for name, p in moe.named_parameters():
            w = torch.randn(p.shape, generator=g) * (0.5 if "bias" in name else 0.3)
            if fp4 and name.startswith("experts."):
                with kernels.disabled():
                    w = dequantize_fp4(*quantize_fp4(w, 32, "ue8m0"), 32, "ue8m0")
            p.copy_(w)
    return moe


def loop_oracle(moe: MoE, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """MODEL_REFERENCE.md §3.14 token by token, expert by expert, in float64: x [N, D] -> [N, D]."""
    P = {k: v.detach().double() for k, v in moe.state_dict().items()}
    gate = moe.gate

    def expert(prefix: str, v: torch.Tensor) -> torch.Tensor:
        g, u = P[prefix + "w1.weight"] @ v, P[prefix + "w3.weight"] @ v
        return P[prefix + "w2.weight"] @ (F.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT))

    out = []
    for n, v in enumerate(x.double()):
        s = torch.sqrt(F.softplus(P["gate.weight"] @ v / gate.gate_temp))
        image = image_mask is not None and bool(image_mask[n])
        bias = P["gate.bias_vl"] if image else P["gate.bias"]
        chosen = sorted(range(len(s)), key=lambda e: -float(s[e] + bias[e]))[: gate.topk]
        total = sum(float(s[e]) for e in chosen)
        y = sum(float(s[e]) / (total + 1e-20) * 1.5 * expert(f"experts.{e}.", v) for e in chosen)
        out.append(y + expert("shared_experts.", v))
    return torch.stack(out)


@pytest.mark.parametrize("gate_temp", [1.0, 2.0])
def test_reference_equals_the_per_expert_loop(gate_temp):
    """float64: the same arithmetic to float64 rounding; fp32: to fp32 rounding (the routing is the same: margins
    between the k-th and (k+1)-th biased scores are far above fp32 noise for these seeds)."""
    moe = random_moe(0, gate_temp=gate_temp)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, 3:7] = True  # image tokens route with bias_vl
    want = loop_oracle(moe, x.reshape(18, 64), mask.reshape(18)).reshape(x.shape)
    with torch.no_grad():
        assert not torch.allclose(moe(x), moe(x, mask), atol=1e-3)  # bias_vl routes otherwise
        got = moe(x, mask)
        got64 = copy.deepcopy(moe).double()(x.double(), mask)
    torch.testing.assert_close(got64, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32


def test_reference_without_a_shared_expert_and_one_token():
    moe = random_moe(2, n_shared=0, topk=3, bias_vl=False)
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = moe.double()(x.double())
    P = {k: v.detach() for k, v in moe.state_dict().items()}
    s = torch.sqrt(F.softplus(P["gate.weight"] @ x[0, 0].double()))
    idx = torch.topk(s + P["gate.bias"], 3).indices.tolist()
    want = sum(s[e] / s[idx].sum() * 1.5 * moe.experts[e](x[0].double())[0] for e in idx)
    torch.testing.assert_close(got[0, 0], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gate_temp", [1.0, 2.0])
def test_reference_equals_the_mlx_port(gate_temp, monkeypatch):
    """mlx-lm's MoE on the same weights (fp32): outputs to fp32 rounding, the same top-k sets."""
    mx = require("mlx.core")
    port = require("mlx_lm.models.deepseek_v41")
    from deepseek_v41.config import tiny_config

    cfg = tiny_config().replace(gate_temp=gate_temp)
    moe = random_moe(4, dim=cfg.hidden_size, inter=cfg.moe_intermediate_size, n_experts=cfg.n_routed_experts,
                     topk=cfg.num_experts_per_tok, gate_temp=gate_temp, bias_vl=False)
    args = cfg.to_dict()
    # The port has no Engram (its MoE does not depend on it); random_moe's SwiGLU limit and routing scale.
    args["text_config"].update(engram_layer_ids=[], swiglu_limit=LIMIT, routed_scaling_factor=1.5)
    theirs = port.MoE(port.ModelArgs.from_dict(args))
    assert theirs.gate.gate_temp == gate_temp
    P = {k: mx.array(v.detach().float().numpy()) for k, v in moe.state_dict().items()}
    stack = {name: mx.stack([P[f"experts.{e}.{w}.weight"] for e in range(cfg.n_routed_experts)])
             for w, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}
    weights = {"gate.weight": P["gate.weight"], "gate.e_score_correction_bias": P["gate.bias"],
               **{f"experts.switch_mlp.{name}.weight": w for name, w in stack.items()},
               **{f"shared_experts.{name}.weight": P[f"shared_experts.{w}.weight"]
                  for w, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}}
    theirs.load_weights(list(weights.items()), strict=True)
    x = torch.randn(3, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = moe(x)
        our_idx = moe.gate(x.reshape(21, -1))[0]
    want = torch.from_numpy(np.array(theirs(mx.array(x.numpy())).astype(mx.float32)))
    their_idx = np.array(theirs.gate(mx.array(x.reshape(21, -1).numpy()))[0])
    assert [set(r) for r in our_idx.tolist()] == [set(r) for r in their_idx.tolist()]
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ the fast backend
@pytest.fixture
def calls(monkeypatch) -> collections.Counter:
    """Calls of the kernels the fast MoE takes (the fast versions look them up on the module at each call)."""
    counts = collections.Counter()
    for name in ("gate", "swiglu", "moe_bf16", "moe_fp4", "linear"):
        def spy(*args, _fn=getattr(kernels, name), _name=name, **kw):
            counts[_name] += 1
            return _fn(*args, **kw)
        monkeypatch.setattr(kernels, name, spy)
    return counts


def installed(module: torch.nn.Module) -> fast.Installed:
    """``fast.install(module)``; without the C library (no compiler) the test skips, or fails under CI=true."""
    if kernels.library() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the C kernels are required in CI")
        pytest.skip("the C kernels are unavailable")
    return fast.install(module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp4", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, kernels.FEW_ROWS, 40])
def test_installed_moe_equals_the_reference_in_inference_mode(calls, dtype, fp4, tokens):
    """Few tokens take the fused kernel (moe_fp4 for FP4 values, moe_bf16 for bf16 weights), more the grouped /
    per-expert torch code; all equal the reference to rounding (fp32: ~1e-6 of the output's scale; bf16: the
    reference rounds between steps the kernel fuses)."""
    moe = random_moe(6, fp4=fp4).to(dtype)
    x = (torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(7)) * 2).to(dtype)
    with torch.no_grad():
        want = moe(x)
    assert not any(calls.values())
    done = installed(moe)
    assert done.modules == {"MoE": 1, "Gate": 1, "Expert": 9}
    with torch.inference_mode():
        got = moe(x)
    fused = tokens <= kernels.FEW_ROWS and (fp4 or dtype == torch.bfloat16)
    assert calls["gate"] == 1
    assert (calls["moe_fp4"], calls["moe_bf16"]) == ((int(fused and fp4), int(fused and not fp4)))
    scale = want.float().abs().max().item()
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and (got.float() - want.float()).abs().max().item() <= tol * scale
    fast.uninstall(moe)
    with torch.inference_mode():
        assert torch.equal(moe(x), want)  # the reference again


@pytest.mark.parametrize("tokens", [1, 20])
def test_installed_float64_moe_gives_the_reference_bits(tokens):
    """float64 (tests compare computation orders with it): no kernel or grouped matmul takes it (torch._grouped_mm
    refused float64 before this was checked); the one-token path adds in the reference's order."""
    moe = random_moe(14).double()
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    with torch.no_grad():
        want = moe(x)
    assert "MoE" in installed(moe).modules
    with torch.inference_mode():
        assert torch.equal(moe(x), want)


def test_a_hooked_instance_or_a_subclass_gets_no_override():
    class MyMoE(MoE):
        pass

    moe = random_moe(8)
    moe.gate.register_forward_hook(lambda module, args, out: None)
    moe.experts[2].register_forward_pre_hook(lambda module, args: None)
    done = installed(moe)
    assert "forward" not in moe.gate.__dict__ and "forward" not in moe.experts[2].__dict__
    assert "forward" in moe.__dict__ and "forward" in moe.experts[1].__dict__
    assert done.modules == {"MoE": 1, "Expert": 8}
    packed = moe.__dict__["_fast_moe"]
    assert packed.fp4 is None and packed.pending is not None  # the decode copies wait for the first decode step
    assert not pack_copies(packed).fp4_ok[2]  # its tokens take the torch code, which calls it
    sub = MyMoE(64, 32, 8, 2, 1, LIMIT, 1.5, True, False)
    done = installed(sub)
    assert "MyMoE" not in done.modules and "forward" not in sub.__dict__


def test_fp4_copies_are_packed_once_at_the_first_few_token_step_and_reinstalling_follows_changed_weights(calls):
    """Install packs no decode copies; the first few-token step makes them, from the weights then (a many-token
    forward, a prefill, leaves them unmade). A change in place after that is not seen by the FP4 copies until the
    backend is installed again (the documented contract), after which the result is the reference's."""
    moe = random_moe(10, fp4=True)
    with torch.no_grad():
        moe.gate.bias[3] = 100.0  # every token picks expert 3
    x = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(11))
    many = torch.randn(1, kernels.FEW_ROWS + 1, 64, generator=torch.Generator().manual_seed(12))
    installed(moe)
    packed = moe.__dict__["_fast_moe"]
    assert moe.experts[3].w3.weight.data_ptr() == packed.stacked[0][3, 32:].data_ptr()
    with torch.inference_mode():
        moe(many)
    assert packed.fp4 is None and packed.pending is not None and calls["moe_fp4"] == 0
    with torch.inference_mode():
        moe(x)
    assert packed.fp4 is not None and packed.fp4_all and packed.pending is None and calls["moe_fp4"] == 1
    with torch.no_grad():
        moe.experts[3].w2.weight.mul_(2)  # still FP4 values
        want = moe(x)
    with torch.inference_mode():
        stale = moe(x)
    installed(moe)
    with torch.inference_mode():
        fresh = moe(x)
    assert calls["moe_fp4"] == 3
    assert (stale - want).abs().max() > 0.1
    assert (fresh - want).abs().max() <= 2e-6 * want.abs().max()


def test_gate_temp_installs_no_router_kernel(calls):
    moe = random_moe(12, gate_temp=2.0, fp4=True)
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        want = moe(x)
    assert "Gate" not in installed(moe).modules
    with torch.inference_mode():
        got = moe(x)
    assert calls["gate"] == 0 and calls["moe_fp4"] == 1
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


# ------------------------------------------------------------------ moved from test_transformer.py (issue 24)
def test_grouped_experts_equal_the_per_expert_loop_and_keep_one_copy_of_the_weights():
    """Installed, inference groups every expert's rows into one torch._grouped_mm per projection (install makes
    the expert parameters views of one tensor); the result is the per-expert loop's and nothing is duplicated."""
    from deepseek_v41.kernels.fast.moe import Packed

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    torch.manual_seed(0)
    moe = MoE(32, 16, 6, 2, 1, 10.0, 1.5, True, False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 9, 32)
    loop = moe(x)  # the reference: the per-expert loop
    installed(moe)
    packed: Packed = moe.__dict__["_fast_moe"]
    with torch.no_grad():
        grouped = moe(x)
    torch.testing.assert_close(grouped, loop, rtol=1e-6, atol=1e-6)
    w13, _ = packed.stacked
    assert moe.experts[3].w3.weight.data_ptr() == w13[3, 16:].data_ptr()  # a view, not a copy
    assert not w13.requires_grad and w13.grad_fn is None
    torch.testing.assert_close(copy.deepcopy(moe)(x), loop)  # still an ordinary module
    with torch.no_grad():  # in-place updates reach the stack
        moe.experts[2].w2.weight.mul_(2)
        doubled = moe(x)
    fast.uninstall(moe)
    moe.double()  # new parameter tensors; the module keeps no reference to the old stack
    assert not any(isinstance(v, torch.Tensor) for v in vars(moe).values())
    moe.float()
    installed(moe)  # stacks them again
    with torch.no_grad():
        again = moe(x)
    assert moe.experts[3].w3.weight.data_ptr() == moe.__dict__["_fast_moe"].stacked[0][3, 16:].data_ptr()
    assert not torch.allclose(doubled, grouped)
    torch.testing.assert_close(again, doubled, rtol=1e-6, atol=1e-6)


def test_expert_projections_keep_their_hooks_and_wrappers():
    """The reference calls the projections as modules; the installed fast paths compute on the weights only for
    plain experts, so a hooked or wrapped projection (LoRA, a probe) is called as a module, in training, in the
    grouped inference path and for a single token."""
    torch.manual_seed(0)
    moe = MoE(32, 16, 6, 2, 1, 10.0, 1.5, True, False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    doubled = copy.deepcopy(moe)
    with torch.no_grad():
        for e in (*doubled.experts, doubled.shared_experts):
            e.w3.weight.mul_(2)
    for e in (*moe.experts, moe.shared_experts):  # the same as doubling w3: a hook doubling its output
        e.w3.register_forward_hook(lambda module, args, out: out * 2)
    installed(moe), installed(doubled)
    assert "forward" not in moe.experts[0].__dict__ and "forward" in doubled.experts[0].__dict__
    for x in (torch.randn(2, 9, 32), torch.randn(1, 1, 32)):
        torch.testing.assert_close(moe(x), doubled(x), rtol=1e-6, atol=1e-6)  # grad mode: the per-expert loop
        with torch.no_grad():
            torch.testing.assert_close(moe(x), doubled(x), rtol=1e-6, atol=1e-6)  # inference paths

    class Wrapped(torch.nn.Module):  # a LoRA-style wrapper without a .weight of its own
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x) * 2

    fast.uninstall(doubled)
    wrapped, x = copy.deepcopy(doubled), torch.randn(2, 9, 32)
    for e in (*wrapped.experts, wrapped.shared_experts):
        e.w3.weight.data.div_(2)
        e.w3 = Wrapped(e.w3)
    installed(wrapped), installed(doubled)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), doubled(x), rtol=1e-6, atol=1e-6)
    # Hooks on the expert itself, and backward hooks, also keep the experts off the fast paths.
    fast.uninstall(doubled)
    zeroed = copy.deepcopy(doubled)
    for e in zeroed.experts:
        e.register_forward_hook(lambda module, args, out: out * 0)
    installed(zeroed)
    with torch.no_grad():
        torch.testing.assert_close(zeroed(x), doubled.shared_experts(x.reshape(-1, 32)).reshape(x.shape))
    probed = copy.deepcopy(doubled)
    seen = []
    probed.experts[0].w1.register_full_backward_hook(lambda module, gin, gout: seen.append(1))
    installed(probed)
    assert "forward" not in probed.experts[0].__dict__
    probed(torch.randn(4, 32, 32, requires_grad=True)).sum().backward()
    assert seen


def test_a_model_with_stacked_experts_saves_and_loads(tmp_path):
    from deepseek_v41.config import tiny_config
    from deepseek_v41.model.checkpoint import load_model
    from deepseek_v41.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    ids = torch.randint(3, 300, (1, 12))
    installed(model)  # stacks every MoE's experts
    with torch.no_grad():
        before = model(ids)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path).eval()
    installed(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), before, rtol=0, atol=0)


def test_bf16_grouped_experts_pad_each_group_to_32_rows_without_changing_rows(monkeypatch):
    """bf16 grouped matmuls pad each expert's rows with zero rows to a multiple of GROUP_ROWS (oneDNN compiles a
    kernel per new row count); the padding reaches no output: rows equal the per-expert loop's to bf16 rounding,
    and the grouped call saw only padded group sizes, including for experts with no rows."""
    from deepseek_v41.kernels.fast import moe as fast_moe

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    torch.manual_seed(1)
    moe = MoE(64, 32, 6, 2, 1, 10.0, 1.5, True, False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe = moe.bfloat16()
    x = torch.randn(1, 45, 64).bfloat16()  # 90 picks over 6 experts: counts off the multiples of 32
    seen = []
    grouped = fast_moe.grouped_experts

    def spy(packed, sorted_x, offsets):
        seen.append((sorted_x.shape[0], offsets.tolist()))
        return grouped(packed, sorted_x, offsets)

    loop = moe(x)  # the reference: the per-expert loop
    installed(moe)
    monkeypatch.setattr(fast_moe, "grouped_experts", spy)
    with torch.no_grad():
        padded = moe(x)
    (rows, offsets), = seen
    sizes = [b - a for a, b in zip([0, *offsets[:-1]], offsets, strict=True)]
    assert all(s % fast_moe.GROUP_ROWS == 0 for s in sizes) and rows == offsets[-1] > 90
    assert padded.shape == loop.shape and padded.dtype == torch.bfloat16
    torch.testing.assert_close(padded.float(), loop.float(), rtol=2e-2, atol=2e-2)
    flat = x.reshape(-1, 64)
    idx, w = moe.gate(flat)
    counts = torch.bincount(idx.reshape(-1), minlength=6)
    assert sizes == ((counts + fast_moe.GROUP_ROWS - 1) // fast_moe.GROUP_ROWS * fast_moe.GROUP_ROWS).tolist()


def test_gate_and_expert_classes_are_served():
    """The installers are registered for exactly these classes."""
    from deepseek_v41.kernels.fast import INSTALLERS

    assert all(cls in INSTALLERS for cls in (Gate, Expert, MoE))
