"""Bytes a decode step reads (issue 25), checked against counts made independently: the loaded modules' own tensors,
FP4 / KV sizes from the formats' arithmetic, and a simulation of the expert draws."""

import random

import pytest
import torch

from deepseek_v41.analysis.decode_bytes import decode_step_bytes, expected_distinct_experts, expert_format
from deepseek_v41.config import tiny_config
from deepseek_v41.kernels import fast
from deepseek_v41.model.checkpoint import load_model
from deepseek_v41.model.transformer import Transformer


def _config():
    return tiny_config().replace(engram_layer_ids=[], engram_num_embeddings=[])


@pytest.fixture(scope="module")
def fp4_model(tmp_path_factory, kernel_library):
    """The tiny config (no Engram) saved with FP4 experts and loaded in fp32, fast paths installed as the engine
    does (they make the packed FP4 copies: with the kernels off there are none to count)."""
    path = tmp_path_factory.mktemp("fp4")
    torch.manual_seed(0)
    Transformer(_config()).save_pretrained(path, quantization="official")
    model = load_model(path, dtype=torch.float32).eval()
    fast.install(model)
    return model


def _dense_bytes(model) -> float:
    """Every layer's tensors but its routed experts, the final norm and head, and one embedding row."""
    children = {name for name, m in model.named_children() if any(True for _ in m.parameters())}
    assert children == {"embed", "layers", "norm", "head", "mtp"}  # nothing else a step could read
    layers = sum(sum(p.nbytes for p in b.parameters()) - sum(p.nbytes for p in b.ffn.experts.parameters())
                 for b in model.layers)
    head = sum(p.nbytes for m in (model.norm, model.head) for p in m.parameters())
    return layers + head + model.embed.weight[0].nbytes


def _kv_bytes(cfg, context: int) -> float:
    """FP4 main entries (E4M3 scale / 16) and index keys (UE8M0 scale / 32) of every kv-source layer, and FP8
    window rows (scale / 32) of every layer."""
    ratios = [cfg.compress_ratios[i] for i in cfg.kv_source_layer_ids]
    entry = cfg.head_dim / 2 + cfg.head_dim / 16 + cfg.index_head_dim / 2 + cfg.index_head_dim / 32
    window = min(context, cfg.sliding_window) * (cfg.head_dim + cfg.head_dim / 32) * cfg.num_hidden_layers
    return sum(context / m for m in ratios) * entry + window


def test_batch_one_reads_dense_tensors_k_packed_experts_and_the_kv(fp4_model):
    cfg = fp4_model.config
    fp4_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * (4 + 8 / 32) / 8  # codes + UE8M0 scale / 32
    routed = cfg.num_hidden_layers * cfg.num_experts_per_tok * fp4_expert
    parts = decode_step_bytes(fp4_model, batch=1, context=256)
    assert expert_format(fp4_model, 1) == "packed FP4"
    assert parts["routed_experts"] == pytest.approx(routed)
    assert parts["kv"] == pytest.approx(_kv_bytes(cfg, 256))
    assert parts["dense"] + parts["lm_head"] + parts["embedding"] == pytest.approx(_dense_bytes(fp4_model))
    assert parts["total"] == pytest.approx(_dense_bytes(fp4_model) + routed + _kv_bytes(cfg, 256))


def test_batch_eight_reads_the_dense_weights_once_and_the_expected_distinct_experts(fp4_model):
    cfg = fp4_model.config
    one, eight = decode_step_bytes(fp4_model, 1, 1024), decode_step_bytes(fp4_model, 8, 1024)
    assert eight["dense"] == one["dense"] and eight["lm_head"] == one["lm_head"]
    assert eight["embedding"] == pytest.approx(8 * one["embedding"])
    assert eight["kv"] == pytest.approx(8 * _kv_bytes(cfg, 1024))
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    assert eight["routed_experts"] == pytest.approx(one["routed_experts"] / k * E * (1 - (1 - k / E) ** 8))


def test_unpacked_experts_count_their_parameters():
    torch.manual_seed(0)
    model = Transformer(_config()).eval()  # no fast paths installed: the reference reads the fp32 parameters
    cfg = model.config
    parts = decode_step_bytes(model, 1, 64)
    assert expert_format(model, 1) == "torch.float32"
    assert parts["routed_experts"] == cfg.num_hidden_layers * cfg.num_experts_per_tok * (
        3 * cfg.moe_intermediate_size * cfg.hidden_size * 4)


def test_expected_distinct_experts_matches_a_simulation():
    rng = random.Random(0)
    for E, k, B in ((16, 2, 8), (8, 2, 3), (16, 2, 1)):
        trials = 20000
        mean = sum(len(set().union(*(rng.sample(range(E), k) for _ in range(B))))
                   for _ in range(trials)) / trials
        assert expected_distinct_experts(E, k, B) == pytest.approx(mean, abs=0.05)
    assert expected_distinct_experts(16, 2, 1) == pytest.approx(2)


def test_bad_input_is_refused():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="batch and context"):
        decode_step_bytes(Transformer(_config()), 0, 16)
    with pytest.raises(ValueError, match="Engram"):
        decode_step_bytes(Transformer(tiny_config()), 1, 16)
