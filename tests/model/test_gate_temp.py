"""The router temperature ``gate_temp`` (issue 23; MODEL_REFERENCE.md §3.14, §9 item 3).

Oracles: ``sqrt(softplus(x W^T / gate_temp))`` written out by hand; the model built from a config without the key
(gate_temp 1.0 must give the same bits, and keep the C router kernel); the exact forward (torch route, outside
inference mode) against the engine's inference-mode forwards, where the C router kernel and the fused MoE
kernels run for a few tokens.
"""

import pytest
import torch
import torch.nn.functional as F

from deepseek_v41 import kernels
from deepseek_v41.config import ModelConfig, tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.model.moe import Gate, MoE
from deepseek_v41.model.transformer import Transformer


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A tiny model whose routers are far from their init (spread logits, biases), so routing is sensitive."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_fn"):
                p.normal_(0, 0.05)
            elif name.endswith(("_base", "attn_sink", "gate.bias")):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.15)
    return model.eval()


def with_gate_temp(model: Transformer, gate_temp: float) -> Transformer:
    """The same weights under another config (built from the dict, as a config.json with the key would be)."""
    data = model.config.to_dict()
    data["text_config"]["gate_temp"] = gate_temp
    other = Transformer(ModelConfig.from_dict(data)).eval()
    other.load_state_dict(model.state_dict())
    return other


def routing(model: Transformer, ids: torch.Tensor, mode=torch.no_grad) -> tuple[torch.Tensor, list]:
    """``model(ids)`` under ``mode`` and every router call's (indices, weights), in call order."""
    seen, handles = [], []
    for module in model.modules():
        if isinstance(module, Gate):
            handles.append(module.register_forward_hook(lambda m, args, out: seen.append(out)))
    try:
        with mode():
            logits = model(ids)
    finally:
        for h in handles:
            h.remove()
    return logits, seen


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config())


def test_gate_divides_the_logits_before_the_score_function():
    torch.manual_seed(1)
    gate = Gate(16, 8, 3, 1.5, True, False, gate_temp=2.0).eval()
    with torch.no_grad():
        gate.weight.normal_(0, 1.0)
        gate.bias.normal_(0, 0.3)
    x = torch.randn(40, 16)
    s = torch.sqrt(F.softplus(x @ gate.weight.detach().t() / 2.0))
    want = torch.topk(s + gate.bias, 3).indices
    w = s.gather(-1, want)
    for mode in (torch.no_grad, torch.inference_mode):  # torch route, then where the C kernel would run
        with mode():
            indices, weights = gate(x)
        assert torch.equal(indices, want), mode
        assert torch.allclose(weights, w / w.sum(-1, keepdim=True) * 1.5, atol=1e-6, rtol=0), mode


def test_gate_temp_2_changes_the_routing_of_the_tiny_model(model):
    hot = with_gate_temp(model, 2.0)
    assert hot.config.gate_temp == 2.0
    # Every router carries it, the DSpark draft's included (DSPARK.md §10 item 4: the backbone's gate function).
    gates = [m for m in hot.modules() if isinstance(m, Gate)]
    assert len(gates) == model.config.num_hidden_layers + model.config.num_nextn_predict_layers
    assert all(g.gate_temp == 2.0 for g in gates)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))
    cold_logits, cold_seen = routing(model, ids)
    hot_logits, hot_seen = routing(hot, ids)
    assert len(cold_seen) == len(hot_seen) == model.config.num_hidden_layers
    # The first router sees the same input in both models: its weights differ everywhere, its picks somewhere.
    (ci, cw), (hi, hw) = cold_seen[0], hot_seen[0]
    assert not torch.equal(ci.sort(-1).values, hi.sort(-1).values)
    assert (cw.sort(-1).values - hw.sort(-1).values).abs().max() > 1e-3
    assert (cold_logits - hot_logits).abs().max() > 1e-3


def test_gate_temp_1_is_the_identity_and_keeps_the_router_kernel(model, monkeypatch):
    """A config with ``gate_temp: 1.0`` is the config without the key: equal configs, the same logits bit for
    bit in the exact forward and in inference mode, where the installed fast backend's C router kernel runs."""
    same = with_gate_temp(model, 1.0)
    assert same.config == model.config
    calls = []
    original = kernels.gate
    monkeypatch.setattr(kernels, "gate", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(same(ids), model(ids))
    assert not calls  # outside inference mode: the torch route
    try:
        fast.install(same), fast.install(model)
        with torch.inference_mode():
            a, b = same(ids), model(ids)
    finally:
        fast.uninstall(same), fast.uninstall(model)
    assert torch.equal(a, b)
    if kernels.library() is not None:
        assert len(calls) == 2 * model.config.num_hidden_layers


def test_the_router_kernel_is_left_for_the_torch_route_when_gate_temp_is_not_1(model, monkeypatch):
    hot = with_gate_temp(model, 2.0)
    calls = []
    original = kernels.gate
    monkeypatch.setattr(kernels, "gate", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    done = fast.install(hot)  # the routers get no fast version; the experts' kernels still do
    with torch.inference_mode():
        hot(ids)
    assert not calls and "Gate" not in done.modules
    assert kernels.library() is None or done.modules["MoE"] == sum(isinstance(m, MoE) for m in hot.modules())


def test_inference_mode_forward_and_the_engine_agree_with_the_exact_forward_at_gate_temp_2(model):
    """fp32: few-token forwards in inference mode (the fast-path gates, fused MoE kernels) route as the exact
    forward does; the engine's greedy tokens follow the exact forward's argmax loop (the project's comparison
    rule: equal up to a reference top-2 margin below 1e-4)."""
    from deepseek_v41.engine import LLM, SamplingParams

    hot = with_gate_temp(model, 2.0)
    ids = torch.randint(3, 512, (1, 10), generator=torch.Generator().manual_seed(4))
    exact, exact_seen = routing(hot, ids)
    fast.install(hot)  # as the engine does
    try:
        quick, fast_seen = routing(hot, ids, torch.inference_mode)
    finally:
        fast.uninstall(hot)
    assert (quick - exact).abs().max().item() < 1e-4
    for (ei, ew), (fi, fw) in zip(exact_seen, fast_seen, strict=True):
        assert torch.equal(ei, fi)
        assert torch.allclose(ew, fw, atol=1e-5, rtol=0)

    prompt, steps = ids[0].tolist(), 12
    seq, ref_logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = hot(torch.tensor([seq]))[0, -1]
            ref_logits.append(row)
            seq.append(int(row.argmax()))
    ref = seq[len(prompt):]
    llm = LLM(hot, prefill_mode="exact", max_model_len=256)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))[0].outputs[0].token_ids
    for step, (tok, want, row) in enumerate(zip(out, ref, ref_logits, strict=True)):
        top2 = torch.topk(row.double(), 2).values
        if (top2[0] - top2[1]).item() < 1e-4:
            break
        assert tok == want, f"step {step}: engine {tok}, exact forward {want}"
    # At gate_temp 1 the same weights decode otherwise: the engine did apply the temperature.
    cold = LLM(model, prefill_mode="exact", max_model_len=256).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    assert cold[0].outputs[0].token_ids != out
