"""Parameter accounting from modules on meta (issue 3; MODEL_REFERENCE.md §6)."""

import pytest

from deepseek_v41.analysis.params import build_on_meta, count_params, group_of
from deepseek_v41.config import flash_config, tiny_config
from deepseek_v41.model.transformer import Transformer


@pytest.fixture(scope="module")
def flash_counts():
    return count_params(build_on_meta(flash_config()))


def test_official_backbone_and_engram_tables(flash_counts):
    # MODEL_REFERENCE.md §6 / SPEC.md §5: 551.9B backbone, 196.6B Engram tables.
    assert round(flash_counts["backbone"] / 1e9, 1) == 551.9
    assert round(flash_counts["engram"] / 1e9, 1) == 196.6
    # The tables are exactly the config's rows x 256.
    assert flash_counts["engram"] == (384_006_168 + 384_016_682) * 256


def test_official_active_parameters(flash_counts):
    assert flash_counts["active_prefill"] == pytest.approx(7.9e9, rel=0.03)
    assert flash_counts["active_decode"] == pytest.approx(16.1e9, rel=0.03)


def test_meta_counts_equal_a_real_model():
    cfg = tiny_config()
    real = Transformer(cfg)
    meta = build_on_meta(cfg)
    assert count_params(meta) == count_params(real)
    assert count_params(real)["total"] == sum(p.numel() for p in real.parameters())
    by_group: dict[str, int] = {}
    for name, p in real.named_parameters():
        by_group[group_of(name)] = by_group.get(group_of(name), 0) + p.numel()
    assert all(count_params(real)[g] == n for g, n in by_group.items())


def test_active_counts_follow_the_routing_arithmetic():
    cfg = tiny_config()
    model = Transformer(cfg)
    counts = count_params(model)
    expert = sum(p.numel() for p in model.layers[0].ffn.experts[0].parameters())
    routed_all = sum(p.numel() for b in model.layers for p in b.ffn.experts.parameters())
    table = sum(b.engram.embed.weight.numel() for b in model.layers if b.engram is not None)
    gathered = sum(b.engram.embed.head_dim * model.hasher.layout.n_cols for b in model.layers if b.engram)
    embed = model.embed.weight.numel()
    stored_backbone = counts["backbone"]
    # decode: everything but the embedding matrix, the tables and the unrouted experts.
    assert counts["active_decode"] == (stored_backbone - embed - routed_all
                                       + len(model.layers) * cfg.num_experts_per_tok * expert + gathered)
    assert table == counts["engram"]
    assert counts["active_prefill"] < counts["active_decode"]


def test_official_draft_and_vision(flash_counts):
    # MODEL_REFERENCE.md §6: DSpark about 14.2B, vision + aligner about 0.49B, about 763B stored in all.
    assert flash_counts["dspark"] == pytest.approx(14.2e9, rel=0.03)
    assert flash_counts["vision"] == pytest.approx(0.49e9, rel=0.03)
    assert flash_counts["total"] == pytest.approx(763e9, rel=0.01)
