"""The layer plan derived from the config (MODEL_REFERENCE.md §3.3, §3.11, §3.16)."""

import pytest

from deepseek_v41.config import flash_config, tiny_config
from deepseek_v41.plan import LayerRole, Stack, build_layer_plan


def expected_official_roles() -> dict[int, tuple[str, int | None, int | None]]:
    """MODEL_REFERENCE.md §3.11's table, typed in layer by layer: (role, kv source, top-k source)."""
    rows: dict[int, tuple[str, int | None, int | None]] = {0: ("window-only", None, None),
                                                           1: ("window-only", None, None)}
    for full in (2, 8, 14):
        rows[full] = ("Full", full, full)
        for j in range(full + 1, full + 6):
            rows[j] = ("Reuse", full, full)
    rows[20] = ("Full", 20, 20)
    for j in (21, 22, 23):
        rows[j] = ("Reuse", 20, 20)
    for reindex in (24, 28, 32, 36):
        rows[reindex] = ("Reindex", 20, reindex)
        for j in range(reindex + 1, reindex + 4):
            rows[j] = ("Reuse", 20, reindex)
    return rows


def test_official_plan_is_the_reference_table():
    plan = build_layer_plan(flash_config())
    expected = expected_official_roles()
    assert len(plan.layers) == 40 == len(expected)
    for spec in plan.layers:
        role, kv, index = expected[spec.layer_id]
        assert (spec.role.value, spec.kv_source, spec.index_source) == (role, kv, index), spec
        assert spec.candidate_source == (20 if role == "Reindex" else None)
        assert spec.is_candidate_source == (spec.layer_id == 20)
        assert spec.compress_ratio == (0 if spec.layer_id < 2 else 2 if spec.layer_id < 20 else 1)
        # RoPE: window-only layers use theta 10000 without YaRN, compressed layers 160000 with YaRN.
        assert (spec.rope_theta, spec.yarn) == ((10000.0, False) if spec.layer_id < 2 else (160000.0, True))
        assert spec.engram == (spec.layer_id in (1, 14))
        assert spec.stack is (Stack.ENCODER if spec.layer_id < 20 else Stack.DECODER)
    assert plan.ced and list(plan.encoder_layers) == list(range(20))
    assert list(plan.decoder_layers) == list(range(20, 40))
    assert plan.kv_source_layers == [2, 8, 14, 20]
    assert [(s.role, s.rope_theta, s.yarn) for s in plan.dspark_layers] == [(LayerRole.WINDOW, 10000.0, False)] * 3


def test_tiny_plan_has_every_role():
    plan = build_layer_plan(tiny_config())
    roles = [s.role for s in plan.layers]
    assert roles == [LayerRole.WINDOW, LayerRole.WINDOW, LayerRole.FULL, LayerRole.REUSE, LayerRole.FULL,
                     LayerRole.REUSE, LayerRole.REINDEX, LayerRole.REUSE]
    assert plan.layers[6].candidate_source == 4 and plan.layers[7].index_source == 6
    assert plan.ced


@pytest.mark.parametrize("changes, reason", [
    ({"num_hidden_layers": 7, "compress_ratios": [0, 0, 2, 2, 1, 1, 1],
      "dspark_target_layer_ids": [4, 5, 6]}, "num_hidden_layers (7) is odd"),
    ({"kv_source_layer_ids": [2, 4, 5], "index_source_layer_ids": [2, 4, 5, 6]},
     "decoder layers [5] must have compress ratio 1 and not be kv sources"),
    ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 0], "kv_source_layer_ids": [2, 6],
      "index_source_layer_ids": [2, 6], "candidate_source_layer_id": 6},
     "layer 4 (the first decoder layer) must be a kv source"),
])
def test_configs_without_ced_layout_say_why(changes, reason):
    plan = build_layer_plan(tiny_config().replace(**changes))
    assert not plan.ced
    assert reason in plan.ced_reason
    assert all(s.stack is None for s in plan.layers) and list(plan.encoder_layers) == []
    assert plan.decoder_start(500) == 0  # every layer runs over every token


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 127, 128, 129, 4096])
def test_the_plan_says_where_the_ced_decoder_starts(n):
    """MODEL_REFERENCE.md §3.16: the decoder runs over the trailing min(N, sliding_window) prompt tokens."""
    for cfg in (tiny_config(), flash_config()):
        start = build_layer_plan(cfg).decoder_start(n)
        assert start == max(0, n - cfg.sliding_window)
        assert n - start == min(n, cfg.sliding_window)
    with pytest.raises(ValueError, match="num_prompt_tokens must be >= 0, got -1"):
        build_layer_plan(tiny_config()).decoder_start(-1)
