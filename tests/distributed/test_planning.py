"""``dsv41 report --tensor-parallel-size``: the per-rank plan built from the model sharded on meta (issue 28),
checked against sizes worked out from the config by hand."""

import json

import pytest
import torch
from typer.testing import CliRunner

from deepseek_v41.analysis.parallel import meta_model_as_loaded, parallel_plan
from deepseek_v41.cli import app
from deepseek_v41.config import tiny_config
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.shard import shard_bytes


def test_tensor_parallel_decode_step_moves_what_the_layout_says():
    """TP=2 without expert parallelism: per decode step, one all-reduce of [B, 1, D] for the embedding and two per
    layer (attention output in the weights' dtype; MoE output in fp32, the dtype the MoE sums its experts in), one
    all-gather of each rank's half of the vocabulary's logits; split Engram tables add one all-reduce of the rows
    looked up (fp32) per Engram layer."""
    cfg = tiny_config()
    whole = parallel_plan(cfg, ParallelConfig(tensor_parallel_size=2, shard_engram=False), dtype=torch.bfloat16,
                          batches=(1, 3))
    split = parallel_plan(cfg, ParallelConfig(tensor_parallel_size=2), dtype=torch.bfloat16, batches=(1, 3))
    D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    model = meta_model_as_loaded(cfg)
    engram = [b.engram for b in model.layers if b.engram is not None]
    assert engram
    for batch in (1, 3):
        step = whole["decode_step_comm"][batch]
        assert step["calls"] == {"all_reduce": 1 + 2 * L, "all_gather": 1}
        assert step["all_reduce"] == (1 + L) * batch * D * 2 + L * batch * D * 4
        rows = sum(batch * e.embed.head_dim * model.hasher.layout.n_cols * 4 for e in engram)
        assert split["decode_step_comm"][batch]["all_reduce"] == step["all_reduce"] + rows
        assert split["decode_step_comm"][batch]["calls"]["all_reduce"] == 1 + 2 * L + len(engram)
        assert step["all_gather"] == batch * (V // 2) * 4  # fp32 logits (the final norm computes in fp32)
        assert step["all_to_all"] == 0
        assert step["total"] == step["all_reduce"] + step["all_gather"]


def test_weights_per_rank_split_as_the_layout_says():
    cfg = tiny_config()
    whole = shard_bytes(meta_model_as_loaded(cfg, torch.bfloat16))
    tp = parallel_plan(cfg, ParallelConfig(tensor_parallel_size=2, shard_engram=False), batches=(1,))
    split = parallel_plan(cfg, ParallelConfig(tensor_parallel_size=2), batches=(1,))
    ep = parallel_plan(cfg, ParallelConfig(expert_parallel_size=2), batches=(1,))
    assert tp["weights_one_process"] == whole
    for part in ("embed", "head", "experts", "shared"):  # split in two by TP
        assert tp["weights_per_rank"][part] * 2 == whole[part], part
    assert tp["weights_per_rank"]["engram"] == whole["engram"]  # whole on every rank with --no-shard-engram
    assert split["weights_per_rank"]["engram"] < whole["engram"]  # split by rows (the default)
    assert ep["weights_per_rank"]["experts"] * 2 == whole["experts"]
    for part in ("embed", "head", "shared", "attention"):  # EP alone: everything else replicated
        assert ep["weights_per_rank"][part] == whole[part], part
    # The KV cache is replicated: every rank holds the global KV of every token.
    assert tp["kv_bytes_per_token_per_rank"] == ep["kv_bytes_per_token_per_rank"] > 0


def test_loaded_dtypes_on_meta_are_the_loaders():
    """bf16 weights, fp32 where the checkpoint keeps fp32 (mHC), FP8 Engram tables with UE8M0 scales."""
    model = meta_model_as_loaded(tiny_config(), torch.bfloat16)
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    assert dtypes["embed.weight"] == torch.bfloat16 and dtypes["layers.0.hc_attn_fn"] == torch.float32
    engram = [name for name in dtypes if ".engram.embed." in name]
    assert engram and {dtypes[n] for n in engram} == {torch.float8_e4m3fn, torch.float8_e8m0fnu}


def test_report_prints_the_plan_and_refuses_sizes_that_do_not_divide():
    runner = CliRunner()
    result = runner.invoke(app, ["report", "--config", "tiny", "--no-flops", "--json", "-tp", "2",
                                 "--enable-expert-parallel"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["parallel"]
    assert plan["tensor_parallel_size"] == plan["expert_parallel_size"] == plan["world_size"] == 2
    assert plan["weights_per_rank"]["total"] < plan["weights_one_process"]["total"]
    assert plan["decode_step_comm"]["1"]["all_to_all"] > 0
    bad = runner.invoke(app, ["report", "--config", "tiny", "--no-flops", "-tp", "3"])
    assert bad.exit_code == 2 and "3" in bad.output
    bad = runner.invoke(app, ["report", "--config", "tiny", "--no-flops", "-tp", "2", "--expert-parallel-size", "4"])
    assert bad.exit_code == 2 and "expert_parallel_size" in bad.output


@pytest.mark.slow
def test_flash_plan_engram_dominates_unless_split():
    """The official config at TP=8 + EP: with Engram whole on every rank it is most of a rank's bytes; split by
    rows, about an eighth (the figures README's planning section quotes)."""
    from deepseek_v41.config import load_config

    cfg = load_config("flash")
    whole = parallel_plan(cfg, ParallelConfig(tensor_parallel_size=8, enable_expert_parallel=True,
                                              shard_engram=False), batches=(1,))
    split = parallel_plan(cfg, ParallelConfig(tensor_parallel_size=8, enable_expert_parallel=True), batches=(1,))
    w, s = whole["weights_per_rank"], split["weights_per_rank"]
    assert w["engram"] > 0.5 * w["total"]
    # The tables split in eight; the Engram projections (a few hundred MB) stay whole on every rank.
    assert w["engram"] / 8 < s["engram"] < w["engram"] / 7
    assert whole["kv_bytes_per_token_per_rank"] == 890


def test_a_checkpoint_directorys_engram_tables_keep_their_stored_format():
    """The bundled checkpoint stores its Engram tables unquantized: the plan of that directory holds them as the
    loader does (so bench/parallel.py's measured bytes can equal the plan's)."""
    from pathlib import Path

    from deepseek_v41.config import load_config
    from deepseek_v41.model.checkpoint import load_model

    path = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
    state = load_model(path, dtype=torch.float32).state_dict()
    loaded = {n: t.dtype for n, t in state.items() if ".engram.embed." in n}
    planned = meta_model_as_loaded(load_config(path), torch.float32, model_path=path).state_dict()
    assert loaded and {n: planned[n].dtype for n in loaded} == loaded
