"""The bundled checkpoint (issues 5 and 7): what it ships, and its DSpark draft's acceptance on held-out prompts.

Oracles: the issue's limits (at most 10M parameters in bf16, every mechanism on, 64K positions), plain greedy
decoding (speculation must not change a token) and the acceptance floor of issue 26 (mean accepted length >= 2.5
at a full block of 5, bonus token counted) on prompts cut from held-out documents (tests/data/README.md).
"""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from deepseek_v41 import load_model
from deepseek_v41.analysis.params import count_params
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.plan import build_layer_plan

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "checkpoints" / "v41-tiny"
PROMPTS = json.loads((ROOT / "tests" / "data" / "heldout_prompts.json").read_text(encoding="utf-8"))


def test_the_bundled_checkpoint_keeps_every_mechanism_under_10m_parameters():
    model = load_model(BUNDLED)
    cfg = model.config
    assert count_params(model)["total"] <= 10_000_000
    plan = build_layer_plan(cfg)
    assert plan.ced and cfg.engram_layer_ids and cfg.hc_mult == 4 and cfg.n_shared_experts >= 1
    assert cfg.max_position_embeddings >= 65536 and model.mtp is not None
    assert {s.compress_ratio for s in plan.layers} == {0, 1, 2}
    with safe_open(BUNDLED / "model.safetensors", "pt") as f:
        assert str(f.get_slice("embed.weight").get_dtype()) == "BF16"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "MODEL_CARD.md", "prompt.txt", "follow_up.txt"):
        assert (BUNDLED / name).is_file(), name


@pytest.mark.slow
def test_the_bundled_draft_is_accepted_on_held_out_prompts():
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    # fp32: the batched verify forward rounds differently from plain decoding in the checkpoint's bf16
    common = dict(dtype="float32", max_num_seqs=16, max_model_len=512)
    plain = LLM(BUNDLED, **common).generate(PROMPTS, params)
    spec = LLM(BUNDLED, **common, speculative="dspark", speculative_cost_table="fixed")
    outs = spec.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    accepted = sum(o.spec_accepted_tokens for o in outs)
    steps = sum(o.spec_verify_steps for o in outs)
    assert spec.stats["spec_decode_mean_verify_length"] == pytest.approx(5, abs=0.25)  # a full block
    assert 1 + accepted / steps >= 2.5
