"""``dsv41 train-sft`` (issue 26): the loss covers exactly the last assistant message; a few steps on a tiny
random model lower it; the DSpark draft and the Engram tables do not move; resume continues the same run."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from deepseek_v41.chat import encode_messages
from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.train.evaluate import stream_nats
from deepseek_v41.train.sft import (
    Example,
    SFTArgs,
    SFTTrainer,
    collate,
    epoch_batches,
    masked_nats,
    tokenize_record,
)
from deepseek_v41.train.trainer import training_loss

MODEL = Path(__file__).parents[2] / "checkpoints" / "v41-tiny"

TOOLS = [{"type": "function", "function": {
    "name": "textwrap_dedent", "description": "Remove any common leading whitespace from every line in `text`.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
TOOL_RESULT_RECORD = {
    "id": "tool_result/textwrap.dedent/0", "kind": "tool_result", "thinking": True, "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Remove the indentation of \"  a\"."},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.", "tool_calls": [
            {"id": "call_0", "type": "function",
             "function": {"name": "textwrap_dedent", "arguments": "{\"text\": \"  a\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "a"},
        {"role": "assistant", "content": "The result is `a`.", "reasoning_content": "Report it."}],
    "reference": {"answer": "The result is `a`."}}


def test_mask_covers_exactly_the_last_assistant_message():
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    example = tokenize_record(TOOL_RESULT_RECORD, tok)
    qa = tokenize_record({"id": "qa/x", "kind": "qa", "thinking": False, "tools": None, "messages": [
        {"role": "user", "content": "What does `textwrap.dedent` do?"},
        {"role": "assistant", "content": "Remove any common leading whitespace."}]}, tok)
    ids, mask = collate([example, qa], pad_id=2)
    assert ids.shape == (2, len(example.ids)) and mask.shape == (2, len(example.ids) - 1)
    whole = encode_messages(TOOL_RESULT_RECORD["messages"], tools=TOOLS, thinking=True)
    last = "Report it.</think>The result is `a`.<｜end▁of▁sentence｜>"
    assert whole.endswith(last)
    targets = ids[:, 1:]
    assert tok.decode(targets[0][mask[0]].tolist(), skip_special_tokens=False) == last
    # everything before, the first assistant's DSML call included, is context only
    assert "DSML" not in tok.decode(targets[0][mask[0]].tolist(), skip_special_tokens=False)
    assert "DSML" in tok.decode(targets[0][~mask[0]].tolist(), skip_special_tokens=False)
    assert tok.decode(targets[1][mask[1]].tolist(), skip_special_tokens=False) == \
        "Remove any common leading whitespace.<｜end▁of▁sentence｜>"
    assert not mask[1, len(qa.ids) - 1:].any()  # padding is never a target


def test_masked_loss_is_the_mean_over_the_masked_targets_only():
    torch.manual_seed(0)
    model = Transformer(tiny_config())
    ids = torch.randint(3, 512, (2, 40))
    mask = torch.zeros(2, 39, dtype=torch.bool)
    mask[0, 30:] = True
    mask[1, 10:20] = True
    _, parts = training_loss(model, ids, False, 0.0, loss_mask=mask)
    nats = np.stack([stream_nats(model, ids[row].numpy(), 40) for row in range(2)])  # the plain forward
    assert parts["lm"] == pytest.approx(nats[mask.numpy()].mean(), rel=1e-3)
    assert parts["lm"] != pytest.approx(nats.mean(), rel=1e-3)
    with pytest.raises(ValueError, match="loss_mask"):
        training_loss(model, ids, False, 0.0, loss_mask=torch.zeros(2, 39, dtype=torch.bool))


def synthetic_examples(n: int, seed: int) -> list[Example]:
    """Prompts of random tokens, each answered by the same short reply (learnable in a few steps)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(3, 500, size=int(rng.integers(6, 16)))
        out.append(Example(f"s/{i}", np.concatenate([[0], prompt, [7, 8, 9, 10, 1]]).astype(np.int64),
                           len(prompt) + 1))
    return out


def micro_args(**changes) -> SFTArgs:
    return SFTArgs(**{**dict(steps=6, batch_tokens=128, lr=3e-3, warmup_steps=1, eval_every=0,
                             checkpoint_minutes=1e9, seed=0), **changes})


def test_a_few_steps_lower_the_masked_loss_and_leave_the_draft_and_engram(tmp_path):
    torch.manual_seed(0)
    model = Transformer(tiny_config())
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.") or
              ".engram.embed." in n}
    assert any(".engram.embed." in n for n in frozen) and any(n.startswith("mtp.") for n in frozen)
    train = synthetic_examples(24, 0)
    trainer = SFTTrainer(model, train, train[:8], tmp_path, micro_args(), pad_id=2)
    before = trainer.evaluate()["nats_per_token"]
    state = trainer.train(progress=False, log=lambda line: None)
    after = trainer.evaluate()["nats_per_token"]
    assert state.step == 6 and after < before - 1.0
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert (tmp_path / "checkpoint" / "state.json").is_file()


def test_resume_continues_the_same_run(tmp_path):
    train = synthetic_examples(16, 1)
    args = micro_args(steps=4)
    torch.manual_seed(0)
    whole = SFTTrainer(Transformer(tiny_config()), train, [], tmp_path / "a", args, 2)
    a = [h["loss"] for h in whole.train(progress=False, log=lambda line: None).history]
    torch.manual_seed(0)
    SFTTrainer(Transformer(tiny_config()), train, [], tmp_path / "b", args, 2).train(
        progress=False, stop_at=2, log=lambda line: None)
    resumed = SFTTrainer(Transformer(tiny_config()), train, [], tmp_path / "b", args, 2, resume=True)
    assert resumed.state.step == 2
    b = [h["loss"] for h in resumed.train(progress=False, log=lambda line: None).history]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_epoch_batches_cover_every_example_once_within_the_budget():
    lengths = [int(x) for x in np.random.default_rng(0).integers(10, 300, size=500)]
    batches = epoch_batches(lengths, 1024, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(len(b) * max(lengths[i] for i in b) <= 1024 for b in batches)
    assert batches == epoch_batches(lengths, 1024, seed=0, epoch=0) != epoch_batches(lengths, 1024, 0, 1)
    with pytest.raises(ValueError, match="batch-tokens"):
        epoch_batches([2000], 1024, 0, 0)


def test_masked_nats_counts_only_target_tokens():
    torch.manual_seed(0)
    examples = synthetic_examples(5, 2)
    result = masked_nats(Transformer(tiny_config()), examples, 2, 400)
    assert result["tokens"] == sum(len(e.ids) - e.start for e in examples) and result["nats_per_token"] > 0
    assert json.dumps(result)


def test_cli_says_what_is_missing(tmp_path):
    from typer.testing import CliRunner

    from deepseek_v41.cli.main import app

    result = CliRunner().invoke(app, ["train-sft", "--model", str(MODEL), "--data", str(tmp_path / "none"),
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "train.jsonl" in result.output
