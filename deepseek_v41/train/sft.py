"""``dsv41 train-sft``: supervised chat fine-tuning of a trained checkpoint (issue 26).

The data are the JSONL records of ``dsv41 data chat`` (:mod:`deepseek_v41.train.chat_data`). Each record is
rendered with the project's chat encoder; the loss is the next-token cross-entropy over the **last assistant
message only** (its thinking, content or DSML tool calls, and the end-of-sentence token: the tokens after the
prompt's generation header), everything before is context. One record per row, rows of similar length batched
up to ``batch_tokens`` (right-padded; padding is after every real token, so a causal model never reads it).

What trains: the backbone (attention, MoE, mHC, embeddings, head) and the indexers, with the same indexer KL as
``dsv41 train`` in its sparse phase (the chat prompts put the tool schemas hundreds of tokens back, beyond the
64-token window, so the compressed entries and their selection must follow the fine-tuned attention). What does
not: the DSpark draft (``mtp.*``, not run by the training forward; re-distil it on the chat model separately) and
the Engram tables (``engram.embed``), which are kept as they are. Otherwise the loop is the trainer's: AdamW,
warmup + cosine (:func:`~deepseek_v41.train.trainer.lr_at`), clipping, aux-loss-free expert balancing,
checkpoints in safetensors + JSON from which ``--resume`` continues bit for bit.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from deepseek_v41.model.checkpoint import load_model
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.train.chat_data import render
from deepseek_v41.train.trainer import (
    CHECKPOINT_DIR,
    Trainer,
    TrainState,
    lr_at,
    make_optimizer,
    optimizer_step,
    training_loss,
)

FROZEN = ("mtp.", ".engram.embed.")  # the DSpark draft and the Engram tables


@dataclass
class SFTArgs:
    """Fine-tuning settings."""

    steps: int = 300
    batch_tokens: int = 4096  # rows x padded length per step, at most
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    indexer_loss_weight: float = 1.0
    bias_update_rate: float = 1e-3
    eval_every: int = 100
    eval_records: int = 0  # held-out records scored per evaluation (0: all)
    checkpoint_minutes: float = 10.0
    seed: int = 0


@dataclass(frozen=True)
class Example:
    """One tokenized record: ``ids`` (int64 [n]) and ``start``, the first target position: ids[start:] is the
    last assistant message."""

    id: str
    ids: np.ndarray
    start: int


def tokenize_record(record: dict[str, Any], tokenizer: Tokenizer) -> Example:
    """Render a record (:func:`~deepseek_v41.train.chat_data.render`) and tokenize it without added special
    tokens (BOS is in the text). Raises ValueError when the prompt's tokens are not a prefix of the whole's
    (the prompt ends with a special token, so they always are for the V4.1 encoding)."""
    prompt, target = render(record)
    ids = tokenizer.encode(prompt + target, add_special_tokens=False).ids
    head = tokenizer.encode(prompt, add_special_tokens=False).ids
    if ids[: len(head)] != head or len(ids) == len(head):
        raise ValueError(f"record {record['id']}: the prompt does not tokenize to a prefix of the conversation")
    return Example(record["id"], np.asarray(ids, dtype=np.int64), len(head))


def read_examples(path: Path, tokenizer: Tokenizer) -> list[Example]:
    """Every record of a JSONL file, tokenized, in file order."""
    with open(path, encoding="utf-8") as f:
        return [tokenize_record(json.loads(line), tokenizer) for line in f if line.strip()]


def collate(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``ids`` int64 [B, L] and the loss mask bool [B, L - 1] over the targets ``ids[:, 1:]``: True
    exactly at the last assistant message's tokens (target position j predicts token j + 1)."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(examples), width - 1), dtype=torch.bool)
    for row, e in enumerate(examples):
        ids[row, : len(e.ids)] = torch.from_numpy(e.ids)
        mask[row, e.start - 1: len(e.ids) - 1] = True
    return ids, mask


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches of example indices: shuffled (seeded by seed and epoch), sorted by length inside
    chunks of 256 so rows of a batch have similar lengths, grouped while rows x longest <= ``batch_tokens``,
    then the batches shuffled. Raises ValueError when one example alone is longer than ``batch_tokens``."""
    if max(lengths) > batch_tokens:
        raise ValueError(f"an example has {max(lengths)} tokens, more than --batch-tokens {batch_tokens}")
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    batches: list[list[int]] = []
    for c in range(0, len(order), 256):
        chunk = sorted(order[c: c + 256].tolist(), key=lambda i: lengths[i])
        current: list[int] = []
        for i in chunk:
            if current and (len(current) + 1) * max(lengths[i], *(lengths[j] for j in current)) > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        batches.append(current)
    return [batches[i] for i in rng.permutation(len(batches))]


def batch_at(step: int, lengths: list[int], batch_tokens: int, seed: int) -> list[int]:
    """The batch of global ``step`` (0-based): epochs follow each other, each with its own order."""
    epoch = 0
    while True:
        batches = epoch_batches(lengths, batch_tokens, seed, epoch)
        if step < len(batches):
            return batches[step]
        step -= len(batches)
        epoch += 1


@torch.no_grad()
def masked_nats(model: Transformer, examples: list[Example], pad_id: int, batch_tokens: int) -> dict[str, float]:
    """Mean nats per target token over ``examples`` (the same masked cross-entropy as training, no indexer
    term), batched by length; returns nats_per_token, perplexity and tokens."""
    was_training = model.training
    model.train(False)
    total, count = 0.0, 0
    lengths = [len(e.ids) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: lengths[i])
    current: list[int] = []
    groups = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    for group in groups:
        ids, mask = collate([examples[i] for i in group], pad_id)
        _, parts = training_loss(model, ids, False, 0.0, loss_mask=mask)
        n = int(mask.sum())
        total += parts["lm"] * n
        count += n
    model.train(was_training)
    mean = total / max(count, 1)
    return {"nats_per_token": mean, "perplexity": math.exp(mean), "tokens": count}


class SFTTrainer(Trainer):
    """Fine-tunes ``model`` (loaded, fp32) on ``train`` examples, scoring ``heldout`` ones; run folder ``out``
    (checkpoint/ as :class:`~deepseek_v41.train.trainer.Trainer` writes it, so ``resume`` continues)."""

    def __init__(self, model: Transformer, train: list[Example], heldout: list[Example], out: Path,
                 args: SFTArgs, pad_id: int, resume: bool = False):
        if not train:
            raise ValueError("no training examples")
        self.args, self.out, self.pad_id = args, Path(out), pad_id
        self.train_examples, self.heldout_examples = train, heldout
        self.lengths = [len(e.ids) for e in train]
        torch.manual_seed(args.seed)
        self.model = model
        for name, p in model.named_parameters():
            p.requires_grad_(not any(tag in name for tag in FROZEN))
        model.train()
        self.optimizer = make_optimizer(model, args.lr, args.weight_decay)
        self.state = TrainState()
        if resume and (self.out / CHECKPOINT_DIR / "state.json").is_file():
            self.load_checkpoint()

    def evaluate(self) -> dict[str, float]:
        """Held-out masked loss (the first ``eval_records`` held-out examples, or all)."""
        chosen = self.heldout_examples[: self.args.eval_records or None]
        return masked_nats(self.model, chosen, self.pad_id, self.args.batch_tokens)

    def train(self, progress: bool = True, stop_at: int | None = None, log=print) -> TrainState:
        """Run to ``args.steps`` (or checkpoint and stop at step ``stop_at``); ``log`` gets one line per step."""
        from tqdm import tqdm

        args, state = self.args, self.state
        last_checkpoint = time.time()
        bar = tqdm(total=args.steps, initial=state.step, disable=not progress, unit="step", dynamic_ncols=True)
        while state.step < min(args.steps, stop_at or args.steps):
            started = time.time()
            ids, mask = collate([self.train_examples[i] for i in batch_at(
                state.step, self.lengths, args.batch_tokens, args.seed)], self.pad_id)
            lr = lr_at(state.step, args)
            loss, parts = training_loss(self.model, ids, False, args.indexer_loss_weight, loss_mask=mask)
            optimizer_step(self.model, self.optimizer, loss, lr, args.grad_clip, args.bias_update_rate)
            state.step += 1
            state.tokens += int(mask.sum())
            elapsed = time.time() - started
            state.wall_seconds += elapsed
            state.history.append({"step": state.step, "lr": lr, "rows": ids.shape[0], "width": ids.shape[1],
                                  "target_tokens": int(mask.sum()), "seconds": elapsed, **parts})
            bar.update(1)
            log(f"step {state.step}/{args.steps} loss {parts['lm']:.4f} kl {parts['kl']:.4f} lr {lr:.2e} "
                f"rows {ids.shape[0]}x{ids.shape[1]} {elapsed:.1f}s")
            if args.eval_every and state.step % args.eval_every == 0 and self.heldout_examples:
                result = self.evaluate()
                state.evals.append({"step": state.step, **result})
                log(f"step {state.step}: held-out masked loss {result['nats_per_token']:.4f}")
            if time.time() - last_checkpoint > args.checkpoint_minutes * 60:
                self.save_checkpoint()
                last_checkpoint = time.time()
        bar.close()
        self.save_checkpoint()
        return state


def train_sft_command(model_dir: Path, data: Path, out: Path, args: SFTArgs, resume: bool = False,
                      threads: int | None = None, export: Path | None = None, log=print) -> Path:
    """What ``dsv41 train-sft`` does: load ``model_dir`` in fp32, tokenize ``data/train.jsonl`` and
    ``data/heldout.jsonl`` with its tokenizer, score the held-out masked loss, fine-tune (resuming when asked),
    score again, and export the weights in bf16 to ``export`` (default ``out/model``) with the tokenizer files,
    ``generation_config.json`` and ``sft_train.json`` (arguments, wall time, losses). Returns the export folder.
    """
    if threads:
        torch.set_num_threads(threads)
    model_dir, data, out = Path(model_dir), Path(data), Path(out)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    train = read_examples(data / "train.jsonl", tokenizer)
    heldout = read_examples(data / "heldout.jsonl", tokenizer) if (data / "heldout.jsonl").is_file() else []
    model = load_model(model_dir, dtype=torch.float32)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    if resume and not (out / CHECKPOINT_DIR / "state.json").is_file():
        log(f"--resume: no checkpoint in {out / CHECKPOINT_DIR}, starting at step 0")
    trainer = SFTTrainer(model, train, heldout, out, args, pad_id, resume=resume)
    if resume and trainer.state.step:
        log(f"resuming at step {trainer.state.step} of {args.steps}")
    summary_file = out / "sft_summary.json"
    summary = json.loads(summary_file.read_text()) if resume and summary_file.is_file() else {}
    if "heldout_before" not in summary and heldout:
        log(f"held-out masked loss of {model_dir} over {len(heldout)} records ...")
        summary["heldout_before"] = trainer.evaluate()
        summary_file.write_text(json.dumps(summary, indent=2))
    if "heldout_before" in summary:
        log(f"held-out masked loss before: {summary['heldout_before']['nats_per_token']:.4f}")
    started = time.time()
    state = trainer.train(progress=sys.stderr.isatty(), log=log)  # a log file gets the per-step lines only
    if heldout:
        summary["heldout_after"] = trainer.evaluate()
        log(f"held-out masked loss after: {summary['heldout_after']['nats_per_token']:.4f}")
    manifest = data / "manifest.json"
    summary.update({
        "base_model": str(model_dir), "data": str(data), "args": asdict(args),
        "data_manifest_sha256": json.loads(manifest.read_text()).get("sha256") if manifest.is_file() else None,
        "train_records": len(train), "heldout_records": len(heldout), "steps": state.step,
        "target_tokens": state.tokens, "wall_seconds": state.wall_seconds,
        "last_session_seconds": time.time() - started, "frozen": list(FROZEN),
        "loss_first_10": float(np.mean([h["lm"] for h in state.history[:10]])) if state.history else None,
        "loss_last_10": float(np.mean([h["lm"] for h in state.history[-10:]])) if state.history else None,
        "evals": state.evals})
    summary_file.write_text(json.dumps(summary, indent=2))
    target = Path(export) if export else out / "model"
    trainer.model.save_pretrained(target, dtype=torch.bfloat16)
    (target / "sft_train.json").write_text(json.dumps(summary, indent=2) + "\n")
    return target
