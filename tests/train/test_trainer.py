"""The trainer (issue 5): a micro model learns, resumes bit for bit, balances its experts, trains the indexer."""

from pathlib import Path

import numpy as np
import pytest
import torch

from deepseek_v41.config import tiny_config
from deepseek_v41.model.moe import Gate
from deepseek_v41.train.trainer import TrainArgs, Trainer, lr_at, training_loss

SLICE = Path(__file__).parent / "data" / "slice.txt"


def byte_stream() -> np.ndarray:
    """The shipped text slice as byte-level ids (+3: ids 0-2 are BOS/EOS/PAD), fitting the tiny vocab of 512."""
    return np.frombuffer(SLICE.read_bytes(), dtype=np.uint8).astype(np.int64) + 3


def micro_args(**changes) -> TrainArgs:
    base = dict(steps=20, batch_size=4, context=64, lr=3e-3, warmup_steps=4, dense_indexer_steps=5,
                eval_every=0, checkpoint_minutes=1e9, seed=0)
    return TrainArgs(**{**base, **changes})


def test_micro_model_loss_goes_down(tmp_path):
    stream = byte_stream()
    state = Trainer(tiny_config(), stream, stream[:2000], tmp_path, micro_args()).train(progress=False)
    losses = [h["lm"] for h in state.history]
    assert len(losses) == 20
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert all(h["kl"] > 0 for h in state.history)  # the indexers are trained in both phases
    assert (tmp_path / "checkpoint" / "tensors.safetensors").is_file()


@pytest.mark.slow  # (12 s: with the slow tests, to keep make test under 5 minutes on 2 cores)
def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    stream = byte_stream()
    whole = Trainer(tiny_config(), stream, stream[:2000], tmp_path / "a", micro_args()).train(progress=False)
    Trainer(tiny_config(), stream, stream[:2000], tmp_path / "b", micro_args()).train(progress=False, stop_at=12)
    resumed = Trainer(tiny_config(), stream, stream[:2000], tmp_path / "b", micro_args(), resume=True)
    assert resumed.state.step == 12
    state = resumed.train(progress=False)
    a = [h["loss"] for h in whole.history]
    b = [h["loss"] for h in state.history]
    assert len(a) == len(b) == 20
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_expert_biases_move_toward_balance(tmp_path):
    stream = byte_stream()
    trainer = Trainer(tiny_config(), stream, stream[:2000], tmp_path, micro_args(steps=3))
    trainer.train(progress=False)
    gates = [m for m in trainer.model.layers.modules() if isinstance(m, Gate)]  # the draft is not trained here
    moved = [g.bias.abs().max().item() for g in gates]
    assert all(0 < v <= 3 * 1e-3 + 1e-9 for v in moved)  # at most one step of the update rate per training step
    assert all(g.expert_load.sum() == 0 for g in gates)  # counters are read and reset every step


def test_indexer_learns_only_from_its_kl():
    torch.manual_seed(0)
    from deepseek_v41.model.transformer import Transformer

    model = Transformer(tiny_config())
    ids = torch.from_numpy(byte_stream()[:2 * 65].reshape(2, 65))
    loss, parts = training_loss(model, ids, dense_indexer=False, kl_weight=0.0)
    loss.backward()
    indexer = model.layers[2].attn.indexer
    assert indexer.wq_b.weight.grad is None or indexer.wq_b.weight.grad.abs().max() == 0  # LM loss: no gradient
    model.zero_grad()
    loss, parts = training_loss(model, ids, dense_indexer=False, kl_weight=1.0)
    loss.backward()
    assert indexer.wq_b.weight.grad.abs().max() > 0 and parts["kl"] > 0


def test_schedule():
    args = TrainArgs(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, args) == pytest.approx(0.1) and lr_at(9, args) == pytest.approx(1.0)
    assert lr_at(100, args) == pytest.approx(0.1) and 0.1 < lr_at(55, args) < 1.0


def test_heldout_eval_spreads_its_windows_over_the_stream():
    """The progress-bar perplexity reads windows from the whole held-out stream, not just its first tokens."""
    from deepseek_v41.model.transformer import Transformer
    from deepseek_v41.train.evaluate import stream_nats
    from deepseek_v41.train.trainer import heldout_nats

    torch.manual_seed(0)
    model = Transformer(tiny_config())
    stream = byte_stream()[:400]
    got = heldout_nats(model, stream, context=16, tokens=48)  # 3 windows: start, middle, end
    starts = [0, (400 - 17) // 2, 400 - 17]
    want = np.concatenate([stream_nats(model.eval(), stream[s: s + 17], 16) for s in starts]).mean()
    assert got["nats_per_token"] == pytest.approx(float(want), rel=1e-9)
    head = stream_nats(model, stream[:49], 16).mean()
    assert abs(got["nats_per_token"] - float(head)) > 1e-6  # not the first 48 tokens


def test_load_streams_checks_the_corpus_before_creating_the_cache(tmp_path):
    from deepseek_v41.train.trainer import load_streams

    cache = tmp_path / "missing" / "tokens"
    with pytest.raises(FileNotFoundError, match="dsv41 data prepare"):
        load_streams(tmp_path / "missing", Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny", cache)
    assert not cache.exists()
