"""``dsv41 train-dspark``: distil the DSpark draft (``mtp.*``) from a trained, frozen target (DSPARK.md §8).

A plain loop. Each step:

1. a batch of random windows of ``context`` tokens from the training stream (``sample_batch`` of the main
   trainer, seeded);
2. the frozen target's exact forward (reference fake-quant, as the engine computes it) gives its logits and the
   **input** residual streams of ``dspark_target_layer_ids`` — the draft's features at inference
   (:class:`~deepseek_v41.engine.speculative.TargetTaps`);
3. ``num_anchors`` anchors per window (:func:`~deepseek_v41.model.dspark.sample_anchors`), the draft's
   teacher-forced blocks at them (:meth:`~deepseek_v41.model.dspark.DSparkDraft.teacher_forced`) and
   :func:`~deepseek_v41.model.dspark.dspark_loss`: 0.1 CE + 0.9 L1 to the target's distribution + 1.0 BCE of the
   confidence head against 1 - ½L1, position-weighted;
4. AdamW on ``mtp.*`` only (the shared embedding and head, and the whole target, stay frozen), warmup + cosine,
   gradient clipping; aux-loss-free balancing of the draft's routers.

At the end the held-out acceptance per draft position (the analytic 1 - ½L1 of DSPARK.md §8's diagnostics) and
the expected accepted length at a full block, τ = 1 + Σ_k Π_{i<=k} acc_i, are measured, and the model directory
is written back with the trained ``mtp.*`` tensors (everything else byte-for-byte the same values, in the
directory's own dtype).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from deepseek_v41.engine.speculative import TargetTaps
from deepseek_v41.model.checkpoint import load_model, weight_files
from deepseek_v41.model.context import DenseContext
from deepseek_v41.model.dspark import dspark_loss, sample_anchors
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.train.trainer import balance_experts, load_streams, lr_at, sample_batch


@dataclass
class DSparkTrainArgs:
    """Draft-distillation settings (DeepSpec's recipe scaled down: lr 6e-4, 4 % warmup, cosine)."""

    steps: int = 2000
    batch_size: int = 8
    context: int = 256  # tokens per training window
    num_anchors: int = 64  # draft blocks per window (DeepSpec: 512 on 4K windows)
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 80
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3
    loss_decay: float | None = None  # position-weight decay exp(-k / decay); None = the block size
    eval_windows: int = 16  # held-out windows measured at the end
    seed: int = 0


@torch.no_grad()
def target_features(model: Transformer, ids: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The frozen target's exact forward over ``ids`` [B, T]: the input streams [B, T, hc, D] of every draft
    target layer, and the logits [B, T, V] fp32."""
    B, T = ids.shape
    ctx = DenseContext(B, T, ids.device, model.fake_quant)
    taps = TargetTaps(model.mtp.target_layer_ids)
    rows = model.hasher(ids) if model.hasher is not None else None
    streams, pre = model.embed_streams(ids)
    streams, pre = model.run_layers(range(len(model.layers)), streams, pre, ctx, None, rows, taps)
    return dict(taps), model.logits(streams, pre).float()


def draft_loss(model: Transformer, ids: torch.Tensor, num_anchors: int, generator: torch.Generator | None,
               decay: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DSPARK.md §8's loss of the draft on windows ``ids`` [B, T] at ``num_anchors`` random anchors per window;
    returns ``dspark_loss``'s (loss, stats)."""
    taps, logits = target_features(model, ids)
    anchors = sample_anchors(torch.ones_like(ids, dtype=torch.bool), num_anchors, generator)
    out = model.mtp.teacher_forced(taps, ids, model.embed.weight, model.head.weight, anchors=anchors)
    return dspark_loss(out, logits, decay)


def expected_accepted_length(acceptance: torch.Tensor) -> float:
    """τ = 1 + Σ_k Π_{i<=k} acc_i at a full block (DSPARK.md §4, §8 diagnostics): acceptance [K] per position."""
    return 1.0 + float(acceptance.double().cumprod(0).sum())


class DSparkDistiller:
    """Trains ``model.mtp`` of a loaded target on a token stream (see the module docstring).

    Raises ValueError when the model has no draft or the stream is shorter than one window.
    """

    def __init__(self, model: Transformer, train_stream: np.ndarray, heldout_stream: np.ndarray,
                 args: DSparkTrainArgs):
        if model.mtp is None:
            raise ValueError("the model has no DSpark draft (num_nextn_predict_layers = 0): nothing to train")
        if len(train_stream) <= args.context + 1:
            raise ValueError(f"the training stream has {len(train_stream)} tokens, fewer than one window of "
                             f"{args.context + 1}")
        self.model, self.args = model, args
        self.train_stream, self.heldout_stream = train_stream, heldout_stream
        torch.manual_seed(args.seed)
        model.eval()
        model.requires_grad_(False)
        draft = model.mtp
        draft.requires_grad_(True)
        draft.train()  # the draft's routers count expert load for balancing; the target's stay in eval
        decay = [p for n, p in draft.named_parameters() if p.dim() >= 2 and not n.endswith("_fn")]
        other = [p for n, p in draft.named_parameters() if not (p.dim() >= 2 and not n.endswith("_fn"))]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                            {"params": other, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
        self.generator = torch.Generator().manual_seed(args.seed)
        self.history: list[dict[str, float]] = []

    def train(self, progress: bool = True) -> list[dict[str, float]]:
        """Run ``args.steps`` steps; returns the per-step history (loss, ce, tv, conf, lr, acceptance[0])."""
        from tqdm import tqdm

        args, draft = self.args, self.model.mtp
        rng = np.random.default_rng(args.seed)
        bar = tqdm(total=args.steps, disable=not progress, unit="step", dynamic_ncols=True, desc="train-dspark")
        for step in range(args.steps):
            started = time.time()
            ids = sample_batch(self.train_stream, rng, args.batch_size, args.context - 1)
            lr = lr_at(step, args)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            loss, stats = draft_loss(self.model, ids, args.num_anchors, self.generator, args.loss_decay)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), args.grad_clip)
            self.optimizer.step()
            balance_experts(draft, args.bias_update_rate)
            tau = expected_accepted_length(stats["acceptance"])
            self.history.append({"step": step + 1, "lr": lr, "loss": loss.item(), "ce": stats["ce"].item(),
                                 "tv": stats["tv"].item(), "conf": stats["conf"].item(), "tau": tau})
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", tv=f"{stats['tv'].item():.3f}", tau=f"{tau:.2f}",
                            tok_s=f"{ids.numel() / (time.time() - started):,.0f}")
        bar.close()
        return self.history

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out acceptance per draft position and the expected accepted length τ at a full block, over
        ``eval_windows`` evenly spaced windows (every anchor of each)."""
        args, draft = self.args, self.model.mtp
        stream = self.heldout_stream if len(self.heldout_stream) > args.context + 1 else self.train_stream
        span = len(stream) - args.context - 1
        starts = np.linspace(0, span, num=max(1, args.eval_windows), dtype=np.int64)
        was_training = draft.training
        draft.eval()
        total = torch.zeros(draft.block_size, dtype=torch.float64)
        for start in starts:
            ids = torch.from_numpy(stream[start: start + args.context].astype(np.int64))[None]
            _, stats = draft_loss(self.model, ids, args.context, None, args.loss_decay)
            total += stats["acceptance"].double()
        draft.train(was_training)
        acceptance = total / len(starts)
        return {"acceptance_per_position": acceptance.tolist(),
                "expected_accepted_length": expected_accepted_length(acceptance), "windows": len(starts)}


def _stored_dtype(path: Path) -> torch.dtype:
    """The dtype the directory stores ``embed.weight`` in (bf16 for an exported model, fp32 otherwise)."""
    files = weight_files(path)
    with safe_open(str(files["embed.weight"]), "pt") as f:
        return torch.bfloat16 if f.get_slice("embed.weight").get_dtype() == "BF16" else torch.float32


def save_with_draft(model: Transformer, source: Path, out: Path) -> Path:
    """Write ``model`` as a model directory ``out`` in the dtype ``source`` stores (mHC, sinks and router biases
    stay fp32, as in ``Trainer.export``; an ``official``-format source is written in the official format).
    The other files of ``source`` (tokenizer, generation config) come along; ``out`` may be ``source``: the new
    weights are written next to it first and then moved in."""
    source, out = Path(source), Path(out)
    dtype = _stored_dtype(source)
    quantization = "official" if model.config.quantization_config is not None else "none"
    staging = out.parent / f".{out.name}.dspark-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    written = model.save_pretrained(staging, quantization, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != source.resolve():
        for item in source.iterdir():
            if item.is_file() and not item.name.endswith((".safetensors", ".safetensors.index.json")) \
                    and item.name != "config.json":
                shutil.copy2(item, out / item.name)
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        if stale.name not in {w.name for w in written}:
            stale.unlink(missing_ok=True)
    for item in staging.iterdir():
        os.replace(item, out / item.name)
    staging.rmdir()
    return out


def train_dspark_command(model_dir: Path, data: Path, out: Path | None, args: DSparkTrainArgs,
                         cache: Path | None = None, threads: int | None = None, progress: bool = True
                         ) -> tuple[Path, dict[str, Any]]:
    """What ``dsv41 train-dspark`` does: load the target from ``model_dir`` (its tokenizer gives the token
    streams of ``data/train.txt`` and ``data/heldout.txt``, cached as ``.npy`` in ``cache``, default
    ``data/tokens-dspark``), distil the draft, measure it on held-out windows and write the model to ``out``
    (default: ``model_dir`` itself) with a ``dspark_train.json`` summary. Returns (out, summary).

    Raises FileNotFoundError (no model / tokenizer / corpus) and ValueError (no draft in the config, a stream
    shorter than one window).
    """
    if threads:
        torch.set_num_threads(threads)
    model_dir, data = Path(model_dir), Path(data)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model at {model_dir}: expected config.json and safetensors there")
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}: the token streams need the model's tokenizer")
    train_stream, heldout_stream = load_streams(data, model_dir, Path(cache or data / "tokens-dspark"))
    model = load_model(model_dir, dtype=torch.float32)
    distiller = DSparkDistiller(model, train_stream, heldout_stream, args)
    before = distiller.evaluate()
    started = time.time()
    history = distiller.train(progress)
    after = distiller.evaluate()
    out = Path(out or model_dir)
    save_with_draft(model, model_dir, out)
    summary = {"steps": args.steps, "wall_hours": (time.time() - started) / 3600, "args": vars(args),
               "final": history[-1] if history else None, "heldout_before": before, "heldout_after": after}
    (out / "dspark_train.json").write_text(json.dumps(summary, indent=2))
    return out, summary
