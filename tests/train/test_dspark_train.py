"""``dsv41 train-dspark`` (issue 7): the draft learns the target's distribution, only ``mtp.*`` changes, and the
written model loads and serves speculatively.

Oracles: the loss and the analytic acceptance before and after training, the saved tensors against the source
directory's (read back with safetensors, not our loader), the engine's non-speculative greedy output.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.train.dspark_train import DSparkDistiller, DSparkTrainArgs, expected_accepted_length

SLICE = Path(__file__).parent / "data" / "slice.txt"


def byte_stream() -> np.ndarray:
    """The shipped text slice as byte-level ids (+3: ids 0-2 are BOS/EOS/PAD), fitting the tiny vocab of 512."""
    return np.frombuffer(SLICE.read_bytes(), dtype=np.uint8).astype(np.int64) + 3


def peaky_target(seed: int = 0) -> Transformer:
    """A random tiny target whose next-token distributions are far from uniform (a larger LM head), so the draft
    has something to learn."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config())
    with torch.no_grad():
        model.head.weight.mul_(40)
    return model


def test_expected_accepted_length():
    assert expected_accepted_length(torch.tensor([1.0, 1.0, 1.0])) == 4.0
    assert abs(expected_accepted_length(torch.tensor([0.5, 0.5])) - 1.75) < 1e-12


def test_distillation_trains_the_draft_only_and_raises_acceptance():
    model = peaky_target()
    stream = byte_stream()
    target_before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    draft_before = {k: v.clone() for k, v in model.mtp.state_dict().items()}
    args = DSparkTrainArgs(steps=60, batch_size=2, context=48, num_anchors=16, lr=3e-3, warmup_steps=2,
                           eval_windows=4)
    distiller = DSparkDistiller(model, stream, stream[-3000:], args)
    before = distiller.evaluate()
    history = distiller.train(progress=False)
    after = distiller.evaluate()
    tv = [h["tv"] for h in history]
    assert np.mean(tv[-5:]) < np.mean(tv[:5]) - 0.05
    assert after["expected_accepted_length"] > before["expected_accepted_length"] + 0.05
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in target_before.items())  # the target is frozen
    assert any(not torch.equal(v, model.mtp.state_dict()[k]) for k, v in draft_before.items())
    assert not model.training and model.mtp.training


def test_no_draft_is_an_error():
    cfg = tiny_config().replace(num_nextn_predict_layers=0, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="no DSpark draft"):
        DSparkDistiller(Transformer(cfg), byte_stream(), byte_stream(), DSparkTrainArgs())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random bf16 tiny model directory with a project tokenizer, and a corpus folder."""
    from deepseek_v41.model.checkpoint import keeps_fp32
    from deepseek_v41.train.data import write_documents
    from deepseek_v41.train.tokenizer import save_tokenizer, tokenizer_config_values, train_tokenizer

    root = tmp_path_factory.mktemp("dspark")
    text = SLICE.read_text(encoding="utf-8")
    documents = [text[i:i + 1500] for i in range(0, len(text), 1500)]
    corpus = root / "corpus"
    corpus.mkdir()
    write_documents(corpus / "train.txt", documents[:-2])
    write_documents(corpus / "heldout.txt", documents[-2:])
    tokenizer = root / "tokenizer"
    save_tokenizer(train_tokenizer(documents, vocab_size=512, show_progress=False), tokenizer)
    cfg = tiny_config().replace(max_position_embeddings=4096, **tokenizer_config_values(tokenizer))
    torch.manual_seed(0)
    target = Transformer(cfg)
    with torch.no_grad():  # the layout `dsv41 train` exports: bf16, mHC / sinks / router biases in fp32
        for name, p in target.named_parameters():
            if not keeps_fp32(name):
                p.data = p.data.to(torch.bfloat16)
    model = root / "model"
    target.save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((tokenizer / name).read_bytes())
    return model, corpus


def test_cli_writes_a_model_that_serves_speculatively(model_dir, tmp_path):
    from deepseek_v41.cli import app
    from deepseek_v41.engine import LLM, SamplingParams

    source, corpus = model_dir
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["train-dspark", "--model", str(source), "--data", str(corpus), "--steps", "3",
                                      "--out", str(out), "--batch-size", "2", "--context", "32", "--num-anchors",
                                      "8", "--cache", str(tmp_path / "tokens"), "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "expected accepted length" in result.output
    old, new = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert old.keys() == new.keys()
    for name, tensor in old.items():
        assert new[name].dtype == tensor.dtype, name
        assert name.startswith("mtp.") or torch.equal(new[name], tensor), name  # only the draft changed
    assert not torch.equal(new["mtp.0.main_proj.weight"], old["mtp.0.main_proj.weight"])
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert (out / "dspark_train.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(out, max_model_len=256).generate("The quick brown fox", params)[0].outputs[0].token_ids
    spec = LLM(out, max_model_len=256, speculative="dspark", speculative_cost_table="fixed")
    assert spec.generate("The quick brown fox", params)[0].outputs[0].token_ids == plain


def test_cli_errors_name_the_problem(tmp_path):
    from deepseek_v41.cli import app

    result = CliRunner().invoke(app, ["train-dspark", "--model", str(tmp_path / "none"), "--data", str(tmp_path)])
    assert result.exit_code == 2 and "no model at" in result.output


# ---------------------------------------------------------------------- greedy targets (issue 26)
def test_greedy_counts_are_conditional_prefix_agreement():
    from deepseek_v41.model.dspark import TeacherForced
    from deepseek_v41.train.dspark_train import greedy_counts

    V, K, T = 6, 3, 8
    target = torch.full((1, T, V), -5.0)
    target[0, torch.arange(T), torch.arange(T) % V] = 5.0  # the target's argmax at position t is t mod V
    draft = torch.zeros(1, 3, K, V)
    anchors = torch.tensor([[1, 2, 5]])
    guesses = [[1, 2, 0], [2, 0, 4], [5, 0, 1]]  # anchor 1: rows 0,1 agree; anchor 2: row 0; anchor 5: rows 0,1
    for a, row in enumerate(guesses):
        for k, g in enumerate(row):
            draft[0, a, k, g] = 1.0
    mask = torch.tensor([[[True] * K, [True] * K, [True, True, False]]])  # anchor 5 runs off the sequence
    out = TeacherForced(draft, torch.zeros(1, 3, K), torch.zeros(1, 3, K, dtype=torch.long), mask, anchors)
    counts = greedy_counts(out, target)
    # only the two full blocks count: prefix [2, 2, 1] anchors reached row k, [2, 1, 0] matched through it
    assert counts["greedy_prefix"].tolist() == [2.0, 2.0, 1.0]
    assert counts["greedy_matched"].tolist() == [2.0, 1.0, 0.0]


def test_prompt_windows_are_deterministic_slices_of_the_stream():
    from deepseek_v41.train.greedy_data import prompt_windows

    stream = np.arange(1000)
    a, b = prompt_windows(stream, 5, 32, seed=3), prompt_windows(stream, 5, 32, seed=3)
    assert a.shape == (5, 32) and np.array_equal(a, b)
    assert all(np.array_equal(row, np.arange(row[0], row[0] + 32)) for row in a)
    assert not np.array_equal(a, prompt_windows(stream, 5, 32, seed=4))
    with pytest.raises(ValueError, match="fewer than one prompt"):
        prompt_windows(stream[:10], 2, 32, seed=0)


def test_greedy_training_supervises_only_the_continuation():
    model = peaky_target()
    rows = np.stack([byte_stream()[i * 40: i * 40 + 40] for i in range(6)])
    prompt = 24
    args = DSparkTrainArgs(steps=2, batch_size=2, num_anchors=8, lr=3e-3, warmup_steps=1, eval_windows=2,
                           targets="greedy", block_size=5)
    distiller = DSparkDistiller(model, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), args,
                                greedy=(rows, rows[:2], prompt))
    assert model.mtp.block_size == 5 and model.config.dspark_block_size == 5  # the tiny config's is 4
    ids, mask = distiller._batch(np.random.default_rng(0))
    assert ids.shape == (2, 40) and mask[:, :prompt].sum() == 0 and mask[:, prompt:].all()
    from deepseek_v41.model.dspark import sample_anchors

    anchors = sample_anchors(mask, 64)
    assert ((anchors == -1) | (anchors >= prompt)).all() and (anchors >= prompt).sum() == 2 * (40 - 1 - prompt)
    result = distiller.evaluate()
    assert len(result["greedy_acceptance_per_position"]) == 5 and result["greedy_expected_accepted_length"] >= 1
    distiller.train(progress=False)
    assert distiller.step == 2


def test_checkpoint_resumes_where_it_stopped(tmp_path):
    args = DSparkTrainArgs(steps=4, batch_size=2, context=32, num_anchors=8, lr=3e-3, warmup_steps=1,
                           eval_windows=2, checkpoint_every=2)
    stream = byte_stream()
    full = DSparkDistiller(peaky_target(), stream, stream[-3000:], args)
    full.train(progress=False)
    half = DSparkDistiller(peaky_target(), stream, stream[-3000:], DSparkTrainArgs(**{**vars(args), "steps": 4}))
    half.args.steps = 2
    half.train(progress=False, checkpoint=tmp_path / "ck.pt")
    resumed = DSparkDistiller(peaky_target(), stream, stream[-3000:], args)
    with pytest.raises(ValueError, match="other arguments"):  # written with steps=2
        resumed.load_checkpoint(tmp_path / "ck.pt")
    half.args.steps = 4
    half.save_checkpoint(tmp_path / "ck.pt")
    resumed.load_checkpoint(tmp_path / "ck.pt")
    assert resumed.step == 2
    resumed.train(progress=False)
    assert [h["loss"] for h in resumed.history] == pytest.approx([h["loss"] for h in full.history], rel=1e-5)
    for k, v in full.model.mtp.state_dict().items():
        assert torch.allclose(v, resumed.model.mtp.state_dict()[k], atol=1e-6), k


def test_cli_greedy_data_then_greedy_training_at_block_5(model_dir, tmp_path):
    import json

    from deepseek_v41.cli import app
    from deepseek_v41.engine import LLM, SamplingParams

    source, corpus = model_dir
    runner = CliRunner()
    for split, n in (("train", 6), ("heldout", 2)):
        result = runner.invoke(app, ["data", "greedy", "--model", str(source), "--data", str(corpus), "--out",
                                     str(tmp_path / split), "--split", split, "--num-prompts", str(n),
                                     "--prompt-tokens", "16", "--max-tokens", "12", "--batch-size", "4",
                                     "--cache", str(tmp_path / "tokens"), "--threads", "1"])
        assert result.exit_code == 0, result.output
    tokens = np.load(tmp_path / "train" / "tokens.npy", allow_pickle=False)
    assert tokens.shape == (6, 28) and tokens.dtype == np.int32
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(source, dtype="float32", max_model_len=256)
    expected = llm.generate({"prompt_token_ids": tokens[0, :16].tolist()}, params)[0].outputs[0].token_ids
    assert tokens[0, 16:].tolist() == list(expected)  # the target's own greedy continuation
    out = tmp_path / "out"
    result = runner.invoke(app, ["train-dspark", "--model", str(source), "--targets", "greedy", "--greedy-data",
                                 str(tmp_path / "train"), "--greedy-heldout", str(tmp_path / "heldout"),
                                 "--block-size", "5", "--steps", "2", "--out", str(out), "--batch-size", "2",
                                 "--num-anchors", "8", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "greedy [" in result.output
    config = json.loads((out / "config.json").read_text())
    assert (config.get("text_config") or config)["dspark_block_size"] == 5
    old, new = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    assert old.keys() == new.keys()
    assert all(name.startswith("mtp.") or torch.equal(new[name], t) for name, t in old.items())
    spec = LLM(out, dtype="float32", max_model_len=256, speculative="dspark", speculative_cost_table="fixed")
    got = spec.generate({"prompt_token_ids": tokens[0, :16].tolist()}, params)[0].outputs[0].token_ids
    assert list(got) == list(expected) and spec.stats["spec_decode_max_len"] == 5
    assert (tmp_path / ".out.dspark-train.pt").is_file()  # the resumable checkpoint beside OUT
    summary = json.loads((out / "dspark_train.json").read_text())
    resumed = runner.invoke(app, ["train-dspark", "--model", str(source), "--targets", "greedy", "--greedy-data",
                                  str(tmp_path / "train"), "--greedy-heldout", str(tmp_path / "heldout"),
                                  "--block-size", "5", "--steps", "2", "--out", str(out), "--batch-size", "2",
                                  "--num-anchors", "8", "--threads", "1", "--resume"])
    assert resumed.exit_code == 0, resumed.output  # nothing left to train: the saved state is written again
    again = json.loads((out / "dspark_train.json").read_text())
    assert again["final"] == summary["final"] and again["heldout_before"] == summary["heldout_before"]
    other = runner.invoke(app, ["train-dspark", "--model", str(source), "--targets", "greedy", "--greedy-data",
                                str(tmp_path / "train"), "--greedy-heldout", str(tmp_path / "heldout"),
                                "--block-size", "5", "--steps", "3", "--out", str(out), "--batch-size", "2",
                                "--num-anchors", "8", "--threads", "1", "--resume"])
    assert other.exit_code == 2 and "other arguments (steps" in other.output
    bad = runner.invoke(app, ["train-dspark", "--model", str(source), "--targets", "greedy", "--out", str(out)])
    assert bad.exit_code == 2 and "greedy_data and greedy_heldout" in bad.output


def test_engine_walk_counts_verify_steps_not_positions():
    from deepseek_v41.train.dspark_train import engine_walk

    # anchors 10..19; from 10: run 4 -> 15 (run 0) -> 16 (run 2) -> 19 (run -1: block not supervised) stops
    anchors = torch.arange(10, 20)
    runs = torch.tensor([4, 0, 0, 0, 0, 0, 2, 0, 0, -1])
    steps, tokens, accepted = engine_walk(runs, anchors, 10, 5)
    assert (steps, tokens, accepted) == (3, 5 + 1 + 3, [2, 2, 1, 1, 0])
