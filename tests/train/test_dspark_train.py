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
