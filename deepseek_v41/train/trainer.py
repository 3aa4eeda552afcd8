"""``dsv41 train``: train a small V4.1 replica on a token stream (issue 5; SPEC.md §1.4).

A plain loop a researcher can edit. Each step:

1. a batch of random windows of ``context + 1`` tokens from the training stream (offsets drawn from a seeded
   numpy generator whose state is checkpointed, so a resumed run sees the same batches);
2. the exact forward (the model's own pieces over a :class:`~deepseek_v41.model.context.DenseContext`) with the
   reference fake-quant of the KV as quantization-aware training (straight-through gradients), the candidate
   pool restricted exactly as in inference;
3. loss = next-token cross-entropy + the indexers' KL toward the main attention over the selected entries
   (:func:`~deepseek_v41.train.indexer_loss.indexer_kl`). For the first ``dense_indexer_steps`` steps every visible
   entry is selected (dense warm-up), then the indexer's own top-k (sparse) — as DeepSeek trained V3.2's
   indexer; the LM loss gives selection no gradient and the indexer's inputs are detached;
4. AdamW with warmup + cosine, gradient clipping, optional bf16 autocast;
5. aux-loss-free MoE balancing: each router's correction bias moves by ``bias_update_rate`` toward the
   under-loaded experts (``+rate`` below the mean load, ``-rate`` above), DeepSeek-V3 style.

Every ``eval_every`` steps the held-out perplexity; every ``checkpoint_minutes`` a checkpoint (weights, optimizer,
RNGs and data order in safetensors + JSON — no pickles), from which ``--resume`` continues bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from deepseek_v41.config import ModelConfig, load_config
from deepseek_v41.model.context import DenseContext
from deepseek_v41.model.engram_hash import build_token_map
from deepseek_v41.model.moe import Gate
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.model.vision import image_token_mask
from deepseek_v41.train.data import read_documents
from deepseek_v41.train.evaluate import stream_nats
from deepseek_v41.train.indexer_loss import IndexerLosses
from deepseek_v41.train.tokenizer import encode_documents, tokenizer_config_values

CHECKPOINT_DIR = "checkpoint"


@dataclass
class TrainArgs:
    """Training settings (the defaults train the bundled ``v41-tiny``)."""

    steps: int = 4000
    batch_size: int = 8
    context: int = 512  # tokens per training window (> index_topk * ratio and > the candidate pool)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dense_indexer_steps: int = 300  # indexer warm-up with every visible entry selected
    indexer_loss_weight: float = 1.0
    bias_update_rate: float = 1e-3
    eval_every: int = 250
    eval_tokens: int = 32768
    checkpoint_minutes: float = 10.0
    seed: int = 0
    bf16: bool = False


@dataclass
class TrainState:
    """What a checkpoint holds besides tensors (JSON)."""

    step: int = 0
    tokens: int = 0
    wall_seconds: float = 0.0
    data_rng: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # per step: loss, lm, kl, lr
    evals: list[dict] = field(default_factory=list)  # step, heldout perplexity and bits


def lr_at(step: int, args: TrainArgs) -> float:
    """Linear warmup to ``lr``, then cosine to ``lr * min_lr_ratio`` at ``steps``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sample_batch(stream: np.ndarray, rng: np.random.Generator, batch: int, context: int) -> torch.Tensor:
    """``batch`` windows of ``context + 1`` consecutive tokens at random offsets: int64 [batch, context + 1]."""
    starts = rng.integers(0, len(stream) - context - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s: s + context + 1] for s in starts]).astype(np.int64))


def training_loss(model: Transformer, ids: torch.Tensor, dense_indexer: bool, kl_weight: float,
                  bf16: bool = False, loss_mask: torch.Tensor | None = None, token_types: torch.Tensor | None = None,
                  images: list | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one batch ``ids`` [B, T + 1]: cross-entropy of tokens 1..T plus the indexers' KL (see module
    docstring). ``loss_mask`` (bool [B, T], for the targets ``ids[:, 1:]``): the cross-entropy is the mean over
    the True positions only (supervised fine-tuning, :mod:`deepseek_v41.train.sft`); it must hold at least one.
    ``token_types`` [B, T] (image span roles of the inputs ``ids[:, :-1]``, -1 = text) and ``images`` (their
    preprocessed images in prompt order): the vision path as in ``Transformer.forward`` (aligner rows in the
    spans, ``bias_vl`` routing, Engram masking, bidirectional attention inside each span).
    Returns the loss tensor and its parts as floats."""
    inputs, targets = ids[:, :-1], ids[:, 1:]
    if loss_mask is not None:
        if loss_mask.shape != targets.shape or not bool(loss_mask.any()):
            raise ValueError(f"loss_mask must be a bool [B, T] = {list(targets.shape)} with a True position, got "
                             f"{list(loss_mask.shape)}")
        targets = targets.masked_fill(~loss_mask, -100)  # cross_entropy's ignore_index
    B, T = inputs.shape
    if token_types is not None and token_types.shape != inputs.shape:
        raise ValueError(f"token_types must be [B, T] = {list(inputs.shape)}, got {list(token_types.shape)}")
    image_mask = image_token_mask(token_types.to(inputs.device)) if token_types is not None else None
    positions = torch.arange(T, device=inputs.device).expand(B, T)
    ctx = DenseContext(B, T, inputs.device, fake_quant=True, key_limit=model.key_limit(token_types, positions))
    ctx.indexer_losses = IndexerLosses()
    ctx.dense_indexer = dense_indexer
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=bf16):
        rows = model.hasher(inputs, image_mask) if model.hasher is not None else None
        streams, pre = model.embed_streams(inputs, token_types, images)
        streams, pre = model.run_layers(range(len(model.layers)), streams, pre, ctx, image_mask, rows)
        logits = model.logits(streams, pre)
    lm = torch.nn.functional.cross_entropy(logits.float().reshape(B * T, -1), targets.reshape(-1))
    kl = ctx.indexer_losses.total(lm)
    loss = lm + kl_weight * kl
    return loss, {"loss": loss.item(), "lm": lm.item(), "kl": kl.item()}


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, lr: float,
                   grad_clip: float, bias_update_rate: float) -> None:
    """One update of ``model`` from ``loss`` (a scalar): every parameter group at learning rate ``lr``, gradients
    clipped to norm ``grad_clip``, then the routers' aux-loss-free bias update (:func:`balance_experts`). Shared by
    ``dsv41 train`` and ``dsv41 train-sft``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    balance_experts(model, bias_update_rate)


@torch.no_grad()
def balance_experts(model: torch.nn.Module, rate: float) -> None:
    """Aux-loss-free balancing: move each router's correction bias toward its under-loaded experts."""
    for gate in (m for m in model.modules() if isinstance(m, Gate)):
        load = gate.expert_load
        if load.sum() > 0:
            gate.bias.add_(rate * torch.sign(load.mean() - load))
        load.zero_()


@torch.no_grad()
def heldout_nats(model: Transformer, stream: np.ndarray, context: int, tokens: int) -> dict[str, float]:
    """Mean nats per token of about ``tokens`` held-out tokens: ``ceil(tokens / context)`` windows of ``context``
    tokens spread evenly over the whole held-out stream (the first tokens alone can be one unrepresentative
    document), each scored from its own start."""
    was_training = model.training
    model.eval()
    windows = max(1, math.ceil(tokens / context))
    last = max(0, len(stream) - context - 1)
    starts = sorted({int(s) for s in np.linspace(0, last, num=windows)})
    nats = np.concatenate([stream_nats(model, stream[s: s + context + 1], context) for s in starts])
    model.train(was_training)
    mean = float(nats.mean())
    return {"nats_per_token": mean, "perplexity": math.exp(mean)}


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) over the parameters that require gradients; weight decay on matrices except the
    mHC ``*_fn`` ones."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2 and not n.endswith("_fn")]
    other = [p for n, p in model.named_parameters() if p.requires_grad and not (
        p.dim() >= 2 and not n.endswith("_fn"))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


class Trainer:
    """Owns the model, optimizer, data and checkpoints of one run in ``out``.

    ``token_map``: the Engram compressed token map of the tokenizer (``build_token_map(tokenizer.json)``); needed
    when the config's compressed vocabulary differs from its vocabulary. Raises ValueError when the training
    stream is shorter than one window.
    """

    def __init__(self, config: ModelConfig, train_stream: np.ndarray, heldout_stream: np.ndarray, out: Path,
                 args: TrainArgs, resume: bool = False, token_map: torch.Tensor | None = None):
        self.args, self.out = args, Path(out)
        self.train_stream, self.heldout_stream = train_stream, heldout_stream
        if len(train_stream) <= args.context + 1:
            raise ValueError(f"the training stream has {len(train_stream)} tokens, fewer than one window of "
                             f"{args.context + 1}")
        torch.manual_seed(args.seed)
        self.model = Transformer(config)
        if token_map is not None and self.model.hasher is not None:
            self.model.hasher.set_token_map(token_map)  # Engram's compressed ids come from the tokenizer
        self.model.train()
        self.optimizer = make_optimizer(self.model, args.lr, args.weight_decay)
        self.state = TrainState(data_rng=np.random.default_rng(args.seed).bit_generator.state)
        if resume and (self.out / CHECKPOINT_DIR / "state.json").is_file():
            self.load_checkpoint()

    # ------------------------------------------------------------------ checkpoints (safetensors + JSON)
    def save_checkpoint(self) -> Path:
        """Write weights, optimizer moments, torch RNG and the JSON state atomically into ``out/checkpoint``."""
        final = self.out / CHECKPOINT_DIR
        tmp = self.out / (CHECKPOINT_DIR + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        names = {id(p): n for n, p in self.model.named_parameters()}
        tensors = {f"model/{k}": v.detach().contiguous() for k, v in self.model.state_dict().items()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    tensors[f"optim/{names[id(p)]}/{key}"] = value.detach().reshape(value.shape).contiguous()
        tensors["rng/torch"] = torch.get_rng_state()
        save_file(tensors, tmp / "tensors.safetensors")
        meta = {"state": asdict(self.state), "args": asdict(self.args),
                "config": self.model.config.to_dict()}
        (tmp / "state.json").write_text(json.dumps(meta))
        if final.exists():
            for f in final.iterdir():
                f.unlink()
            final.rmdir()
        tmp.rename(final)
        return final

    def load_checkpoint(self) -> None:
        folder = self.out / CHECKPOINT_DIR
        meta = json.loads((folder / "state.json").read_text())
        tensors = load_file(folder / "tensors.safetensors")
        self.model.load_state_dict({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
        params = dict(self.model.named_parameters())
        for key, value in tensors.items():
            if key.startswith("optim/"):
                _, name, slot = key.split("/")
                self.optimizer.state[params[name]][slot] = value.clone()
        torch.set_rng_state(tensors["rng/torch"])
        self.state = TrainState(**meta["state"])

    # ------------------------------------------------------------------ the loop
    def train(self, progress: bool = True, stop_at: int | None = None) -> TrainState:
        """Run until ``args.steps`` (or until step ``stop_at``, checkpointing there: an interruption that leaves
        the schedule unchanged). Returns the state."""
        from tqdm import tqdm

        args, state = self.args, self.state
        rng = np.random.default_rng()
        rng.bit_generator.state = state.data_rng
        last_checkpoint = time.time()
        bar = tqdm(total=args.steps, initial=state.step, disable=not progress, unit="step", dynamic_ncols=True)
        while state.step < min(args.steps, stop_at or args.steps):
            started = time.time()
            ids = sample_batch(self.train_stream, rng, args.batch_size, args.context)
            lr = lr_at(state.step, args)
            loss, parts = training_loss(self.model, ids, state.step < args.dense_indexer_steps,
                                        args.indexer_loss_weight, args.bf16)
            optimizer_step(self.model, self.optimizer, loss, lr, args.grad_clip, args.bias_update_rate)
            state.step += 1
            state.tokens += ids.numel() - ids.shape[0]
            elapsed = time.time() - started
            state.wall_seconds += elapsed
            state.data_rng = rng.bit_generator.state
            state.history.append({"step": state.step, "lr": lr, **parts})
            bar.update(1)
            bar.set_postfix(loss=f"{parts['lm']:.3f}", kl=f"{parts['kl']:.3f}",
                            tok_s=f"{(ids.numel() - ids.shape[0]) / elapsed:,.0f}")
            if args.eval_every and state.step % args.eval_every == 0 and len(self.heldout_stream) > 1:
                result = heldout_nats(self.model, self.heldout_stream, args.context, args.eval_tokens)
                state.evals.append({"step": state.step, **result})
                bar.write(f"step {state.step}: held-out perplexity {result['perplexity']:.2f}")
            if time.time() - last_checkpoint > args.checkpoint_minutes * 60:
                self.save_checkpoint()
                last_checkpoint = time.time()
        bar.close()
        self.save_checkpoint()
        return state

    def export(self, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Save the trained weights as a model directory (``dtype``; mHC, sinks and router biases stay fp32)."""
        self.model.save_pretrained(path, dtype=dtype)


def load_streams(data: Path, tokenizer_dir: Path, cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """Token streams of ``data/train.txt`` and ``data/heldout.txt`` (every document ``BOS .. EOS``), cached as
    uint16/int32 ``.npy`` files in ``cache`` keyed by the tokenizer's hash. Raises FileNotFoundError, before
    creating ``cache``, when either text file is missing."""
    tok_file = Path(tokenizer_dir) / "tokenizer.json"
    digest = hashlib.sha256(tok_file.read_bytes()).hexdigest()[:12]
    tokenizer = Tokenizer.from_file(str(tok_file))
    for split in ("train", "heldout"):
        if not (data / f"{split}.txt").is_file():
            raise FileNotFoundError(f"{data / f'{split}.txt'} not found: DATA must be a `dsv41 data prepare` folder")
    cache.mkdir(parents=True, exist_ok=True)
    out = []
    for split in ("train", "heldout"):
        file = cache / f"{split}-{digest}.npy"
        if not file.is_file():
            stream = encode_documents(tokenizer, read_documents(Path(data) / f"{split}.txt"))
            dtype = np.uint16 if tokenizer.get_vocab_size() <= 65536 else np.int32
            np.save(file, stream.astype(dtype))
        out.append(np.load(file).astype(np.int64))
    return out[0], out[1]


def run_summary(state: TrainState) -> dict[str, Any]:
    """Headline numbers of a run for the model card."""
    return {"steps": state.step, "tokens": state.tokens, "wall_hours": state.wall_seconds / 3600,
            "final_lm_loss": state.history[-1]["lm"] if state.history else None,
            "evals": state.evals[-3:]}


def train_command(config: str, data: Path, out: Path, tokenizer: Path | None, args: TrainArgs, resume: bool,
                  threads: int | None) -> Path:
    """What ``dsv41 train`` does: tokenize (cached), build the model from ``config`` with the tokenizer's ids,
    train (resuming when asked), export the final weights in bf16 with the tokenizer to ``out/model``."""
    if threads:
        torch.set_num_threads(threads)
    tokenizer = Path(tokenizer or data / "tokenizer")
    if not (tokenizer / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {tokenizer}: run `dsv41 tokenizer train` or pass --tokenizer")
    cfg = load_config(config).replace(**tokenizer_config_values(tokenizer))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_stream, heldout_stream = load_streams(data, tokenizer, out / "tokens")
    trainer = Trainer(cfg, train_stream, heldout_stream, out, args, resume=resume,
                      token_map=build_token_map(tokenizer / "tokenizer.json"))
    state = trainer.train()
    model_dir = export_checkpoint(out, out / "model", tokenizer)
    (out / "train_summary.json").write_text(json.dumps(run_summary(state), indent=2))
    return model_dir


def export_checkpoint(run: Path, out: Path, tokenizer: Path) -> Path:
    """Export the weights of a run's last checkpoint (``run/checkpoint``) as a bf16 model directory with the
    tokenizer, without touching the run (training may still be going on)."""
    meta = json.loads((Path(run) / CHECKPOINT_DIR / "state.json").read_text())
    tensors = load_file(Path(run) / CHECKPOINT_DIR / "tensors.safetensors")
    config = ModelConfig.from_dict(meta["config"])
    trainer = Trainer.__new__(Trainer)  # only the model: no data, no optimizer
    trainer.model = Transformer(config)
    trainer.model.load_state_dict({k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")})
    out = Path(out)
    trainer.export(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer) / name, out / name)
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "do_sample": False,
        "temperature": 0.0, "max_new_tokens": 256}, indent=2) + "\n")
    return out
