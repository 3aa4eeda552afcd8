"""Config loading, presets and validation (issue 2; MODEL_REFERENCE.md §2)."""

import json

import pytest

from deepseek_v41.config import ConfigError, ModelConfig, flash_config, load_config, tiny_config

# The released text_config values, typed from MODEL_REFERENCE.md §2.1 (the oracle for the flash preset).
RELEASED = {
    "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304, "num_hidden_layers": 40,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu", "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20, "tie_word_embeddings": False, "max_position_embeddings": 1048576,
    "rope_theta": 10000, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "sliding_window": 128, "compress_rope_theta": 160000,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
}


def released_wrapper() -> dict:
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
        "transformers_version": "5.6.0", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": {"model_type": "deepseek_v41_text", "attention_bias": False, "attention_dropout": 0.0,
                        "initializer_range": 0.02, "use_cache": True, **RELEASED},
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024,
                          "num_attention_heads": 16, "intermediate_size": 2816, "patch_size": 14,
                          "rope_theta": 10000, "downsample_ratio": 3, "max_image_tokens": 1024,
                          "min_pixels": 295936, "max_wh_ratio": None},
    }


def test_flash_preset_sets_every_released_key():
    cfg = flash_config()
    for key, value in RELEASED.items():
        assert getattr(cfg, key) == value, key
    assert cfg.image_token_id == 129264
    assert cfg.quantization_config.expert_dtype == "fp4"
    assert cfg.vision_config.hidden_size == 1024


def test_wrapper_json_equals_flash_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(released_wrapper()))
    assert ModelConfig.from_pretrained(tmp_path) == flash_config()
    assert ModelConfig.from_pretrained(tmp_path / "config.json") == flash_config()


def test_round_trip_through_config_json(tmp_path):
    for cfg in (flash_config(), tiny_config()):
        cfg.save(tmp_path)
        assert ModelConfig.from_pretrained(tmp_path) == cfg


def test_flat_small_config_without_feature_keys_has_features_off():
    cfg = ModelConfig.from_dict({"model_type": "deepseek_v41", "vocab_size": 100, "hidden_size": 32,
                                 "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 32,
                                 "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_lora_rank": 8, "o_groups": 1,
                                 "index_head_dim": 32})
    assert cfg.compress_ratios == [0, 0]
    assert cfg.engram_layer_ids == [] and cfg.num_nextn_predict_layers == 0
    assert cfg.vision_config is None and cfg.quantization_config is None
    assert cfg.candidate_source_layer_id == -1 and cfg.kv_source_layer_ids == []
    assert cfg.yarn is None


def test_load_config_accepts_preset_names_and_paths(tmp_path):
    assert load_config("tiny") == tiny_config()
    tiny_config().save(tmp_path)
    assert load_config(str(tmp_path)) == tiny_config()
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing")


def broken(**changes) -> list[str]:
    data = {**released_wrapper()}
    data["text_config"] = {**data["text_config"], **changes}
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(data)
    return info.value.problems


@pytest.mark.parametrize("changes, fragment", [
    ({"model_type": "llama"}, "unknown model_type 'llama'"),
    ({"compress_ratios": [0] * 39}, "compress_ratios has 39 entries; expected num_hidden_layers (40) or"),
    ({"compress_ratios": [0, 0, 4] + [2] * 17 + [1] * 20}, "compress_ratios values must be in"),
    ({"kv_source_layer_ids": [8, 14, 20]}, "layer 2 (compress ratio 2) has no kv source of the same ratio"),
    ({"index_source_layer_ids": [8, 14, 20, 24], "kv_source_layer_ids": [8, 14, 20]},
     "layer 2 (compress ratio 2) has no index source"),
    ({"kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [8, 14, 20, 24]},
     "kv source layer 2 is not an index source"),
    ({"kv_source_layer_ids": [0, 2]}, "kv_source_layer_ids entry 0 has compress ratio 0"),
    ({"kv_source_layer_ids": [2, 8, 14, 20, 45]}, "kv_source_layer_ids entry 45 is outside the layers"),
    ({"candidate_source_layer_id": 21}, "candidate_source_layer_id 21 is not an index source"),
    ({"engram_layer_ids": [1, 24]}, "Engram layer 24 is outside the encoder"),
    ({"engram_num_embeddings": [384006168]}, "engram_num_embeddings has 1 entries for 2 Engram layers"),
    ({"engram_num_embeddings": [384006168, 384016683]}, "the prime table sizes of that layer sum to 384016682"),
    ({"index_topk": 0}, "index_topk must be positive, got 0"),
    ({"sliding_window": -1}, "sliding_window must be positive, got -1"),
    ({"num_experts_per_tok": 400}, "num_experts_per_tok (400) exceeds n_routed_experts (384)"),
    ({"dspark_target_layer_ids": [37, 38, 40]}, "dspark_target_layer_ids entry 40 is outside the layers"),
    ({"dspark_noise_token_id": 200000}, "dspark_noise_token_id 200000 is outside the vocabulary"),
    ({"compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 1]}, "entries of the DSpark draft layers must be 0"),
    ({"head_dim": 500}, "head_dim must be a multiple of 32"),
    ({"num_attention_heads": 60}, "must be a multiple of o_groups"),
    ({"index_topk": "512"}, "index_topk must be an integer"),
    ({"candidate_topk_blocks": 64}, "the candidate pool can hold as few as (candidate_topk_blocks - 1) x"),
    ({"compress_ratio": [1]}, "unknown config key 'compress_ratio'"),
])
def test_each_validation_error_has_its_message(changes, fragment):
    problems = broken(**changes)
    assert any(fragment in p for p in problems), problems


def test_dspark_keys_only_checked_when_draft_layers_exist():
    cfg = tiny_config().replace(num_nextn_predict_layers=0, compress_ratios=tiny_config().compress_ratios[:8],
                                dspark_noise_token_id=10**9, dspark_target_layer_ids=[])
    assert cfg.num_nextn_predict_layers == 0
    with pytest.raises(ConfigError, match="dspark_noise_token_id"):
        tiny_config().replace(dspark_noise_token_id=10**9)


def test_several_problems_reported_together():
    problems = broken(index_topk=0, sliding_window=0, model_type="x")
    assert len(problems) >= 3


def test_bad_json_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_gate_temp_is_read_and_written_only_when_not_the_default(tmp_path):
    """``gate_temp`` (a reference ModelArgs key that mlx-lm's port writes) is accepted in the wrapper's
    text_config and in a flat config; 1.0 is the default and is left out of the written JSON, so a default
    config keeps the release layout; another value round-trips through config.json."""
    assert flash_config().gate_temp == 1.0
    data = released_wrapper()
    data["text_config"]["gate_temp"] = 2.0
    cfg = ModelConfig.from_dict(data)
    assert cfg.gate_temp == 2.0 and cfg == flash_config().replace(gate_temp=2.0)
    flat = {**RELEASED, "model_type": "deepseek_v41_text", "gate_temp": 0.5}
    assert ModelConfig.from_dict(flat).gate_temp == 0.5
    data["text_config"]["gate_temp"] = 1.0
    assert ModelConfig.from_dict(data) == flash_config()
    assert "gate_temp" not in flash_config().to_dict()["text_config"]
    assert "gate_temp" not in tiny_config().to_dict()["text_config"]
    hot = tiny_config().replace(gate_temp=2.0)
    assert hot.to_dict()["text_config"]["gate_temp"] == 2.0
    hot.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["text_config"]["gate_temp"] == 2.0
    assert ModelConfig.from_pretrained(tmp_path) == hot


@pytest.mark.parametrize("value, fragment", [
    (0, "gate_temp must be a finite number > 0"),
    (-1.0, "gate_temp must be a finite number > 0"),
    (float("nan"), "gate_temp must be a finite number > 0"),
    (float("inf"), "gate_temp must be a finite number > 0"),
    ("2.0", "gate_temp must be a number"),
    (True, "gate_temp must be a number"),
])
def test_bad_gate_temp_is_refused_with_its_message(value, fragment):
    problems = broken(gate_temp=value)
    assert any(fragment in p for p in problems), problems
    if "finite" in fragment:
        with pytest.raises(ConfigError, match="gate_temp must be a finite number > 0"):
            tiny_config().replace(gate_temp=value)


def test_gate_temp_nan_and_infinity_in_config_json_are_refused(tmp_path):
    for literal in ("NaN", "Infinity", "-Infinity"):
        text = json.dumps(tiny_config().to_dict())
        (tmp_path / "config.json").write_text(text.replace('"text_config": {', f'"text_config": {{"gate_temp": '
                                                                              f'{literal}, ', 1))
        with pytest.raises(ConfigError, match=r"gate_temp must be a finite number > 0 \(the router divides"):
            ModelConfig.from_pretrained(tmp_path)


def test_dsv41_report_takes_a_config_with_gate_temp_and_refuses_a_bad_one(tmp_path):
    from typer.testing import CliRunner

    from deepseek_v41.cli import app

    tiny_config().replace(gate_temp=2.0).save(tmp_path)
    result = CliRunner().invoke(app, ["report", "--config", str(tmp_path), "--json", "--no-flops"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layers"]["num_hidden_layers"] == 8
    data = json.loads((tmp_path / "config.json").read_text())
    data["text_config"]["gate_temp"] = -2.0
    (tmp_path / "config.json").write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["report", "--config", str(tmp_path), "--json", "--no-flops"])
    assert result.exit_code == 2
    assert "gate_temp must be a finite number > 0" in result.output
