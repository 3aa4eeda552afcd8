"""Differential tests against mlx-lm's ``deepseek_v41`` port (issue 3).

The same random weights are loaded into our model and into mlx-lm's (through its own ``sanitize`` of the
official checkpoint names), and the fp32 logits and the top-k sets of every index layer are compared. mlx-lm has
no Engram, DSpark or vision, so these configs have none. Where our code follows MODEL_REFERENCE.md rather than
the port: kv / index sources of a layer are looked up among layers of the *same* compress ratio (the port takes
the latest source of any ratio), and a Reindex layer's picks outside the candidate pool are ruled out by config
validation (the pool, whose newest block may hold one entry, must hold ``index_topk`` entries) rather than kept
with -inf scores; the configs below are ones where both rules agree.
"""

import numpy as np
import pytest
import torch
from optional_deps import require

from deepseek_v41.config import ModelConfig
from deepseek_v41.model import attention as our_attention
from deepseek_v41.model import context as our_context
from deepseek_v41.model import indexer as our_indexer
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.plan import LayerRole, build_layer_plan

BASE = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32,
    o_lora_rank=24, o_groups=2, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, index_n_heads=16, index_head_dim=32, hc_mult=4,
    rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 128},
    max_position_embeddings=512,
)

CONFIGS = {
    # Every role, CED layout: window-only, Full m=2, Reuse, Full m=1 candidate source, Reindex, Reuse after it.
    "ced8": dict(num_hidden_layers=8, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1], kv_source_layer_ids=[2, 4],
                 index_source_layer_ids=[2, 4, 6], candidate_source_layer_id=4, sliding_window=16, index_topk=8,
                 candidate_topk_blocks=3, candidate_block_size=4),
    # Two m=2 kv sources, two Reindex layers, a longer pool; no CED (odd layer count).
    "deep11": dict(num_hidden_layers=11, compress_ratios=[0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1],
                   kv_source_layer_ids=[1, 3, 5], index_source_layer_ids=[1, 3, 5, 7, 9],
                   candidate_source_layer_id=5, sliding_window=12, index_topk=6, candidate_topk_blocks=3,
                   candidate_block_size=4),
    # m=1 only, Reindex right after the candidate source, window 8, wide top-k.
    "flat6": dict(num_hidden_layers=6, compress_ratios=[0, 1, 1, 1, 1, 1], kv_source_layer_ids=[1],
                  index_source_layer_ids=[1, 2, 4], candidate_source_layer_id=1, sliding_window=8, index_topk=10,
                  candidate_topk_blocks=4, candidate_block_size=8, num_experts_per_tok=3),
}


SEEDS = {"ced8": 1, "deep11": 0, "flat6": 1}


def make_config(name: str) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "deepseek_v41", **BASE, **CONFIGS[name]})


def random_model(cfg: ModelConfig, seed: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_fn",)):
                p.normal_(0, 0.05)
            elif name.endswith(("_base", "attn_sink", "gate.bias")):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.15)
    return model.eval()


def mlx_model(cfg: ModelConfig, model: Transformer, fake_quant: bool, monkeypatch):
    mx = require("mlx.core")
    port = require("mlx_lm.models.deepseek_v41")
    if not fake_quant:
        monkeypatch.setattr(port, "_fake_quant_fp8", lambda x, block_size=32: x)
        monkeypatch.setattr(port, "_fake_quant_fp4", lambda x, **kwargs: x)
    args = port.ModelArgs.from_dict(cfg.to_dict())
    net = port.Model(args)
    weights = {k: mx.array(v.detach().float().numpy()) for k, v in model.state_dict().items()}
    net.load_weights(list(net.sanitize(weights).items()), strict=True)
    return mx, port, net


def record_topk(monkeypatch, port):
    """Capture (ours: scores and picks per index layer) and (port: picks per index layer), in layer order."""
    ours, theirs, scores_seen = [], [], []
    original_topk, original_select = our_indexer.Indexer.topk_entries, our_attention.Attention.select

    def ours_topk(self, scores, k):
        scores_seen.append(scores)  # a Reindex layer's scores cover its candidate pool only: fine for margins
        return original_topk(self, scores, k)

    def ours_select(self, *args, **kwargs):
        picks = original_select(self, *args, **kwargs)
        ours.append((scores_seen[-1], picks))
        return picks

    monkeypatch.setattr(our_indexer.Indexer, "topk_entries", ours_topk)
    monkeypatch.setattr(our_attention.Attention, "select", ours_select)
    call = port.Indexer.__call__

    def theirs_call(self, *args, **kwargs):
        topk, candidates = call(self, *args, **kwargs)
        theirs.append(np.array(topk))
        return topk, candidates

    monkeypatch.setattr(port.Indexer, "__call__", theirs_call)
    return ours, theirs


def record_fake_quant(monkeypatch, port):
    """Capture the outputs of every fake-quant call on both sides, in call order (window FP8, entry FP4, index
    key FP4, index query FP4 per layer: the same order in both implementations)."""
    ours, theirs = [], []
    fp8, fp4 = our_context.fake_quant_fp8, our_context.fake_quant_fp4

    def ours_fp8(x, block_size=32):
        ours.append(fp8(x, block_size))
        return ours[-1]

    def ours_fp4(x, block_size, scale_format):
        ours.append(fp4(x, block_size, scale_format))
        return ours[-1]

    monkeypatch.setattr(our_context, "fake_quant_fp8", ours_fp8)
    monkeypatch.setattr(our_context, "fake_quant_fp4", ours_fp4)
    monkeypatch.setattr(our_indexer, "fake_quant_fp4", ours_fp4)
    their_fp8, their_fp4 = port._fake_quant_fp8, port._fake_quant_fp4

    def theirs_fp8(x, block_size=32):
        y = their_fp8(x, block_size)
        theirs.append(np.array(y))
        return y

    def theirs_fp4(x, **kwargs):
        y = their_fp4(x, **kwargs)
        theirs.append(np.array(y))
        return y

    monkeypatch.setattr(port, "_fake_quant_fp8", theirs_fp8)
    monkeypatch.setattr(port, "_fake_quant_fp4", theirs_fp4)
    return ours, theirs


def first_flip(ours, theirs, T: int) -> int:
    """The first token position where any fake-quantized value differs between the two runs (T if none).

    Float noise (~1e-6) between two correct implementations moves a value across a rounding boundary now and
    then; that value then differs by a whole grid step and the difference cascades through later layers and
    top-k choices. Positions before the first such flip are unaffected (attention is causal). Compressed entry
    g of a ratio-m layer first matters at token g*m + m - 1.
    """
    assert len(ours) == len(theirs) > 0
    first = T
    for a, b in zip(ours, theirs, strict=True):
        b = torch.from_numpy(b)
        n = min(a.shape[1], b.shape[1])
        ratio = 1 if n == T else 2
        differs = (a[:, :n] != b[:, :n]).flatten(2).any(-1).any(0)
        if differs.any():
            first = min(first, int(differs.nonzero()[0]) * ratio + ratio - 1)
    return first


def assert_same_topk_sets(ours, theirs, upto: int, margin=1e-6):
    assert len(ours) == len(theirs) > 0
    compared = 0
    for (scores, picks), their_picks in zip(ours, theirs, strict=True):
        k = min(picks.shape[-1], their_picks.shape[-1])
        ordered = torch.sort(scores, dim=-1, descending=True).values
        for b in range(picks.shape[0]):
            for t in range(min(upto, picks.shape[1])):
                row = ordered[b, t]
                finite = int(torch.isfinite(row).sum())
                if finite > k and not (row[k - 1] - row[k]).abs() > margin:
                    continue  # a tie at the k-th place: either pick is right
                a = {int(i) for i in picks[b, t] if i >= 0}
                c = {int(i) for i in their_picks[b, t] if i >= 0}
                assert a == c, (b, t)
                compared += 1
    assert compared > 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_topk_match_mlx_port_without_fake_quant(name, monkeypatch):
    cfg = make_config(name)
    assert {s.role for s in build_layer_plan(cfg).layers} == set(LayerRole)
    model = random_model(cfg, seed=SEEDS[name])
    model.fake_quant = False
    mx, port, net = mlx_model(cfg, model, False, monkeypatch)
    ours_topk, their_topk = record_topk(monkeypatch, port)
    T = 5 * cfg.sliding_window + 3  # longer than the window; top-k and the pool both cut
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(SEEDS[name]))
    with torch.no_grad():
        ours = model(ids)
    theirs = torch.from_numpy(np.array(net(mx.array(ids.numpy())).astype(mx.float32)))
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert_same_topk_sets(ours_topk, their_topk, T)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_topk_match_mlx_port_with_fake_quant(name, monkeypatch):
    """With the reference fake-quant on, logits agree within 2e-3 up to the first position where float noise
    flipped a quantized value (see :func:`first_flip`). Every seed is checked up to its own flip; at least one
    seed must reach past two windows, so that top-k and the candidate pool are covered."""
    cfg = make_config(name)
    T = 5 * cfg.sliding_window + 3
    reach = []
    for seed in range(4):
        with monkeypatch.context() as patch:
            model = random_model(cfg, seed=seed)
            mx, port, net = mlx_model(cfg, model, True, patch)
            ours_topk, their_topk = record_topk(patch, port)
            ours_q, their_q = record_fake_quant(patch, port)
            ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                ours = model(ids)
            theirs = torch.from_numpy(np.array(net(mx.array(ids.numpy())).astype(mx.float32)))
            upto = first_flip(ours_q, their_q, T)
            reach.append(upto)
            if upto == 0:
                continue
            assert (ours[:, :upto] - theirs[:, :upto]).abs().max().item() < 2e-3, seed
            assert torch.equal(ours[:, :upto].argmax(-1), theirs[:, :upto].argmax(-1)), seed
            assert_same_topk_sets(ours_topk, their_topk, upto)
    assert max(reach) > 2 * cfg.sliding_window + 2, reach


def test_fake_quant_functions_equal_the_ports(monkeypatch):
    """Our fake-quant (the codec's dequantize(quantize(x))) and the port's give identical values."""
    mx = require("mlx.core")
    port = require("mlx_lm.models.deepseek_v41")
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 128)
    theirs = {
        "fp8": port._fake_quant_fp8(mx.array(x.numpy()), 32),
        "e4m3": port._fake_quant_fp4(mx.array(x.numpy()), block_size=16, e4m3_scale=True),
        "ue8m0": port._fake_quant_fp4(mx.array(x.numpy()), block_size=32),
    }
    ours = {
        "fp8": our_context.fake_quant_fp8(x, 32),
        "e4m3": our_context.fake_quant_fp4(x, 16, "e4m3"),
        "ue8m0": our_context.fake_quant_fp4(x, 32, "ue8m0"),
    }
    for kind, value in theirs.items():
        assert torch.equal(ours[kind], torch.from_numpy(np.array(value))), kind


def test_gate_temp_matches_mlx_port(monkeypatch):
    """``gate_temp`` 2.0 (the port's ``ModelArgs`` key: logits / gate_temp before the score function): logits
    and top-k sets agree with the port, and differ from the same weights at 1.0 (the temperature does route)."""
    cfg = make_config("flat6").replace(gate_temp=2.0)
    model = random_model(cfg, seed=SEEDS["flat6"])
    model.fake_quant = False
    T = 3 * cfg.sliding_window + 3
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(7))
    cold = random_model(make_config("flat6"), seed=SEEDS["flat6"])  # the same weights at gate_temp 1.0
    cold.fake_quant = False
    with torch.no_grad():
        cold_logits = cold(ids)
    mx, port, net = mlx_model(cfg, model, False, monkeypatch)
    assert net.args.gate_temp == 2.0
    ours_topk, their_topk = record_topk(monkeypatch, port)
    with torch.no_grad():
        ours = model(ids)
    theirs = torch.from_numpy(np.array(net(mx.array(ids.numpy())).astype(mx.float32)))
    assert (ours - theirs).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert_same_topk_sets(ours_topk, their_topk, T)
    assert (ours - cold_logits).abs().max().item() > 1e-2
