"""``dsv41 train-vlm``: a tiny vision-language model that reads rendered text (issue 27, VISION_DESIGN.md §10).

The model is a trained text checkpoint (``checkpoints/v41-tiny-chat``) plus a small vision path
(:func:`~deepseek_v41.model.vision.add_vision`: ViT, 3x3 aligner, the ``image_start`` / ``image_newline`` /
``image_end`` vectors and each router's ``bias_vl``) built by :func:`build_vlm`. The ViT, the aligner and the
delimiters start from scratch; ``bias_vl`` starts as a copy of the router's text ``bias`` (image tokens first
route as text tokens do). The data are :mod:`deepseek_v41.train.vision_data` renders of training-split text, a
pure function of ``(seed, step, row)``: a resumed run sees the same batches.

Each step: a batch of rendered snippets (layout ``"cells"``: one character per image token) in the chat turn
"image + Transcribe the text." -> the snippet, spelled one token per character; the trainer's forward
(:func:`~deepseek_v41.train.trainer.training_loss` with ``token_types`` and ``images``: image spans filled by the
vision path, routed with ``bias_vl``, masked out of Engram, attention bidirectional inside each span);
next-token cross-entropy over the answer tokens and the end token only, plus the indexers' KL as ``dsv41
train-sft`` has it, plus the auxiliary per-cell loss (:func:`cell_loss`). The first ``vision_only_steps`` train
the vision path against :func:`cell_loss` alone (no text model). What trains: the vision path (learning rate
``lr``) and the text model (``text_lr``), except the DSpark draft (``mtp.*``, not run by the forward) and the
Engram tables, kept as ``dsv41 train-sft`` keeps them. AdamW, warmup + cosine, clipping, aux-loss-free balancing
and the checkpoint format (safetensors + JSON, ``--resume``) are the trainer's (:mod:`deepseek_v41.train.trainer`).

Evaluation (:func:`evaluate_transcription`): greedy transcription of held-out renders with the exact forward in a
small loop of its own (the full forward per generated token, no KV cache: the answers are a few tokens), scored
by character accuracy ``1 - CER``; the baseline is the same model given the same prompt without the image.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from deepseek_v41.analysis.params import count_params
from deepseek_v41.config import VisionConfig
from deepseek_v41.model.checkpoint import load_model
from deepseek_v41.model.engram_hash import build_token_map
from deepseek_v41.model.image_processor import TokenType
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.model.vision import encode_images
from deepseek_v41.train.trainer import CHECKPOINT_DIR, Trainer, TrainState, balance_experts, lr_at, training_loss
from deepseek_v41.train.vision_data import (
    BLANK,
    CELL_CLASSES,
    PROMPT,
    RenderSpec,
    VisionExample,
    cell_labels,
    char_accuracy,
    char_token_ids,
    collate,
    corpus_lines,
    find_fonts,
    make_example,
    prompt_example,
    prompt_ids,
    render_sample,
)

FROZEN = ("mtp.", ".engram.embed.")  # the DSpark draft and the Engram tables, as dsv41 train-sft
VISION_PARAMS = ("vision.", "aligner.", "image_start", "image_newline", "image_end")
EVAL_SEED = 1_000_003  # evaluation renders use seeds [EVAL_SEED, i], never a training step's [seed, step, row]


def tiny_vision_config(hidden_size: int = 96, num_hidden_layers: int = 3, num_attention_heads: int = 4,
                       max_image_tokens: int = 64) -> VisionConfig:
    """The tiny VLM's vision config: patch 14, 3x3 merge, SwiGLU width 2x, ``min_pixels`` one 42x42 token (so
    renders, whose sides are multiples of 42, are never scaled up)."""
    return VisionConfig(num_hidden_layers=num_hidden_layers, hidden_size=hidden_size,
                        num_attention_heads=num_attention_heads, intermediate_size=2 * hidden_size,
                        max_image_tokens=max_image_tokens, min_pixels=42 * 42)


def build_vlm(base_dir: str | Path, vision: VisionConfig, seed: int = 0) -> Transformer:
    """The text checkpoint ``base_dir`` (fp32) with a fresh vision path of config ``vision`` (seeded
    ``seed``); ``bias_vl`` of each router copied from its ``bias``. Raises ValueError when the base already has
    a vision path or its config has no ``image_token_id``."""
    base = load_model(base_dir, dtype=torch.float32)
    if base.config.vision_config is not None:
        raise ValueError(f"{base_dir} already has a vision path")
    if base.config.image_token_id is None:
        raise ValueError(f"{base_dir}/config.json has no image_token_id for the image placeholder")
    torch.manual_seed(seed)
    model = Transformer(base.config.replace(vision_config=vision))
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    new = [n for n in missing if not (n.startswith(VISION_PARAMS) or n.endswith(".bias_vl"))]
    if new or unexpected:
        raise ValueError(f"text weights do not match: missing {new}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias_vl"):
                p.copy_(model.get_parameter(name[: -len("_vl")]))
    if model.hasher is not None:
        model.hasher.set_token_map(build_token_map(Path(base_dir) / "tokenizer.json"))
    model.name_or_path = str(base_dir)  # save_pretrained copies the tokenizer files from here
    return model


@dataclass
class VLMArgs:
    """Training settings."""

    steps: int = 4500
    batch_size: int = 16
    lr: float = 1e-3  # the vision path (from scratch)
    text_lr: float = 1e-3  # the text model (fine-tuned)
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3
    indexer_loss_weight: float = 1.0  # the indexers' KL, as dsv41 train-sft
    cell_loss_weight: float = 5.0  # the auxiliary per-column character probe (cell_loss); 0 = off
    match_weight: float = 1.0  # within cell_loss: a character cell's row toward its character's token embedding
    spell_answers: bool = True  # answers one token per character (vision_data.build_example)
    vision_lm_start: int = 1500  # steps before the language-model loss reaches the vision path (probe alone first)
    vision_only_steps: int = 1500  # first steps that train the ViT, aligner and probe alone (no text model: faster)
    eval_every: int = 300
    eval_samples: int = 64  # held-out renders transcribed per evaluation during training
    checkpoint_minutes: float = 4.0
    max_chars: int = 16  # snippet length at most (the cells layout draws at most 16)
    seed: int = 0


def vlm_loss(model: Transformer, ids: torch.Tensor, types: torch.Tensor, mask: torch.Tensor, images: list,
             kl_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The trainer's loss (:func:`~deepseek_v41.train.trainer.training_loss`, sparse indexer KL weighted
    ``kl_weight``) of a :func:`~deepseek_v41.train.vision_data.collate` batch: ``ids`` / ``types`` [B, L],
    ``mask`` bool [B, L - 1] over the targets ``ids[:, 1:]``, ``images`` one per row. The spans all lie in the
    prompts, so dropping the last column never cuts one. Returns (loss, {"loss", "lm", "kl"} floats)."""
    return training_loss(model, ids, False, kl_weight, loss_mask=mask, token_types=types[:, :-1], images=images)


def cell_loss(model: Transformer, probe: torch.nn.Linear, examples: list[VisionExample], char_tokens: torch.Tensor,
              match_weight: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Auxiliary loss on the aligner rows of renders (training only; returns (loss, {"cell", "cell_acc", "match",
    "scale", "spread"} floats)):

    - ``cell``: a linear ``probe`` [hidden -> 96] on each token column (rows averaged, RMS-normalised) classifies
      it (:func:`~deepseek_v41.train.vision_data.cell_labels`: its character or blank), cross-entropy;
    - ``match`` (weight ``match_weight``): the mean squared distance of a character column's rows from the input
      embedding of that character's token (``char_tokens`` int64 [95], :func:`~deepseek_v41.train.vision_data.
      char_token_ids`), over the embeddings' mean square: the image span then starts out reading like the
      spelled text, which the text model already knows how to copy;
    - ``scale``: ``log(rms(rows) / rms(embed))^2``, which holds every row, blank columns too, at the embeddings'
      scale.

    Why: from the language-model loss alone a fresh ViT's rows collapsed to one large constant vector (RMS ~30x
    the embeddings', loss unchanged with grey images at step 1000 of a first run); a multi-label probe over
    proportional lines flattened near its prior in 3,000 steps (checkpoints/v41-tiny-vl/MODEL_CARD.md history).
    The probe is not part of the exported model."""
    feats = encode_images(model, [e.image for e in examples])
    columns, labels = [], []
    for e, f in zip(examples, feats, strict=True):
        g = e.image.grid
        columns.append(f.view(g.n_llm_h, g.n_llm_w, -1).mean(0))
        labels.append(cell_labels(e))
    column, label = torch.cat(columns), torch.cat(labels)
    # RMS-normalised: the rows sit at the embeddings' small scale (RMS ~0.04), from which a plain linear probe
    # would need its weights to grow ~25x before it could say anything
    logits = probe(column * torch.rsqrt(column.pow(2).mean(-1, keepdim=True) + 1e-12))
    ce = torch.nn.functional.cross_entropy(logits, label)
    embed = model.embed.weight.detach()
    chars = label != BLANK
    match = column.new_zeros(())
    if match_weight and bool(chars.any()):
        target = embed[char_tokens[label[chars]]]
        match = (column[chars] - target).pow(2).mean() / embed.pow(2).mean()
    rows = torch.cat(feats)
    rms = rows.pow(2).mean().sqrt()
    scale = torch.log(rms / embed.pow(2).mean().sqrt()) ** 2
    spread = rows.detach().std(0).mean().item() / max(rms.item(), 1e-12)  # ~0 when the rows do not vary
    accuracy = (logits.detach().argmax(-1) == label).float().mean().item()
    return ce + scale + match_weight * match, {"cell": ce.item(), "cell_acc": accuracy, "match": match.item(),
                                               "scale": scale.item(), "spread": spread}


@torch.no_grad()
def greedy_transcribe(model: Transformer, tokenizer: Tokenizer, examples: list[VisionExample], with_image: bool,
                      max_new_tokens: int = 24, batch_size: int = 32) -> list[str]:
    """Greedy answers to the examples' prompts (the turn up to the assistant header, i.e. ``ids[:start]``), with
    the image or — ``with_image=False`` — the same prompt with no image part. Batched, right-padded; each step
    reruns the exact forward over the rows so far (causal: padding after a row's end is never read). Stops at
    the end token. Returns the decoded answers."""
    was_training = model.training
    model.train(False)
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    text_prompt = prompt_ids(tokenizer, with_image=False)
    answers: list[str] = []
    for b in range(0, len(examples), batch_size):
        chunk = examples[b: b + batch_size]
        prompts = [(e.ids[: e.start], e.token_types[: e.start]) if with_image else
                   (np.asarray(text_prompt), np.full(len(text_prompt), int(TokenType.TEXT))) for e in chunk]
        lengths = np.array([len(p) for p, _ in prompts])
        ids = torch.full((len(chunk), int(lengths.max()) + max_new_tokens), pad, dtype=torch.int64)
        types = torch.full_like(ids, int(TokenType.TEXT))
        for row, (p, t) in enumerate(prompts):
            ids[row, : len(p)] = torch.from_numpy(np.asarray(p, dtype=np.int64))
            types[row, : len(t)] = torch.from_numpy(np.asarray(t, dtype=np.int64))
        images = [e.image for e in chunk] if with_image else []
        done = np.zeros(len(chunk), dtype=bool)
        out: list[list[int]] = [[] for _ in chunk]
        cur = lengths.copy()
        for _ in range(max_new_tokens):
            width = int(cur.max())
            logits = model(ids[:, :width], token_types=types[:, :width], images=images)
            nxt = logits[torch.arange(len(chunk)), torch.from_numpy(cur - 1)].argmax(-1).tolist()
            for row, token in enumerate(nxt):
                if done[row]:
                    continue
                ids[row, cur[row]] = token
                cur[row] += 1
                if token == eos:
                    done[row] = True
                else:
                    out[row].append(token)
            if done.all():
                break
        answers += [tokenizer.decode(o, skip_special_tokens=True) for o in out]
    model.train(was_training)
    return answers


def read_image(model: Transformer, tokenizer: Tokenizer, image, max_new_tokens: int = 24) -> str:
    """The model's greedy answer to "<image> Transcribe the text." for one image (a PIL image, a path or encoded
    bytes). Raises ValueError for a model without a vision path."""
    from PIL import Image

    cfg = model.config
    if cfg.vision_config is None:
        raise ValueError("this model has no vision path (no vision_config): it cannot read images")
    if isinstance(image, (bytes, bytearray, memoryview)):
        image = Image.open(io.BytesIO(bytes(image)))
    elif isinstance(image, (str, Path)):
        image = Image.open(image)
    example = prompt_example(image, tokenizer, cfg.vision_config, cfg.image_token_id)
    return greedy_transcribe(model, tokenizer, [example], with_image=True, max_new_tokens=max_new_tokens)[0]


def eval_examples(lines: list[str], fonts: list[str], tokenizer: Tokenizer, model: Transformer, n: int,
                  max_chars: int, spec: RenderSpec = RenderSpec()) -> list[VisionExample]:
    """The ``n`` evaluation renders (seeds ``[EVAL_SEED, i]``, layout and ranges ``spec``) of held-out ``lines``."""
    cfg = model.config
    return [make_example(lines, [EVAL_SEED, i], fonts, tokenizer, cfg.vision_config, cfg.image_token_id, spec,
                         max_chars=max_chars) for i in range(n)]


def evaluate_transcription(model: Transformer, tokenizer: Tokenizer, examples: list[VisionExample],
                           baseline: bool = True) -> dict[str, Any]:
    """Character accuracy of greedy transcriptions with the image and (``baseline``) without it, and the first
    ten (reference, with image, without image) triples."""
    refs = [e.text for e in examples]
    seen = greedy_transcribe(model, tokenizer, examples, with_image=True)
    result: dict[str, Any] = {"with_image": char_accuracy(refs, seen)}
    # Without the image every prompt is the same, so greedy decoding gives one answer for all of them.
    blind = greedy_transcribe(model, tokenizer, examples[:1], with_image=False) * len(refs) if baseline else (
        [""] * len(refs))
    if baseline:
        result["text_only"] = char_accuracy(refs, blind)
    result["samples"] = [{"reference": r, "with_image": s, "text_only": t}
                         for r, s, t in list(zip(refs, seen, blind, strict=True))[:10]]
    return result


class VLMTrainer(Trainer):
    """Trains ``model`` (from :func:`build_vlm`) on renders of ``train_lines``; run folder ``out`` (checkpoint/
    as :class:`~deepseek_v41.train.trainer.Trainer` writes it, so ``resume`` continues)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, train_lines: list[str],
                 eval_set: list[VisionExample], fonts: list[str], out: Path, args: VLMArgs, resume: bool = False):
        self.args, self.out, self.model, self.tokenizer = args, Path(out), model, tokenizer
        self.train_lines, self.eval_set, self.fonts = train_lines, eval_set, fonts
        for name, p in model.named_parameters():
            p.requires_grad_(not any(tag in name for tag in FROZEN))
        model.train()
        torch.manual_seed(args.seed)
        self.probe = torch.nn.Linear(model.config.hidden_size, CELL_CLASSES)
        self.char_tokens = torch.tensor(char_token_ids(tokenizer), dtype=torch.int64)
        vision = [p for n, p in model.named_parameters() if p.requires_grad and n.startswith(VISION_PARAMS)]
        vision += list(self.probe.parameters())
        text = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith(VISION_PARAMS)]
        self.lr_scale = [1.0, args.text_lr / args.lr]
        self.optimizer = torch.optim.AdamW([{"params": vision}, {"params": text}], lr=args.lr, betas=(0.9, 0.95),
                                           weight_decay=args.weight_decay)
        self.state = TrainState()
        if resume and (self.out / CHECKPOINT_DIR / "state.json").is_file():
            self.load_checkpoint()

    def examples(self, step: int) -> list[VisionExample]:
        """The renders of global ``step``: rows from seeds ``[seed, step, row]``."""
        cfg = self.model.config
        return [make_example(self.train_lines, [self.args.seed, step, row], self.fonts, self.tokenizer,
                             cfg.vision_config, cfg.image_token_id, max_chars=self.args.max_chars,
                             spell=self.args.spell_answers)
                for row in range(self.args.batch_size)]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        """The collated batch of global ``step`` (:meth:`examples`)."""
        return collate(self.examples(step), self.model.config.pad_token_id)

    def save_checkpoint(self) -> Path:
        """The trainer's checkpoint, the probe included (as ``cell_probe.*``; never in the exported model)."""
        self.model.add_module("cell_probe", self.probe)
        try:
            return super().save_checkpoint()
        finally:
            del self.model.cell_probe

    def load_checkpoint(self) -> None:
        """The trainer's checkpoint with the probe. Raises ValueError when its tensors do not fit this model (a run
        resumed with other vision settings)."""
        self.model.add_module("cell_probe", self.probe)
        try:
            super().load_checkpoint()
        except (RuntimeError, KeyError) as exc:
            raise ValueError(f"{self.out / CHECKPOINT_DIR} does not fit this model (was it trained with other "
                             f"--vision-* settings?): resume with the settings it was trained with, or use a new "
                             f"--out. {str(exc).splitlines()[0]}") from exc
        finally:
            del self.model.cell_probe

    def lr_at(self, step: int) -> float:
        """Warmup + cosine (:func:`~deepseek_v41.train.trainer.lr_at`) over each phase on its own: the
        ``vision_only_steps`` first, then the rest."""
        first = self.args.vision_only_steps
        if step < first:
            return lr_at(step, replace(self.args, steps=first))
        return lr_at(step - first, replace(self.args, steps=self.args.steps - first))

    def update(self, loss: torch.Tensor, lr: float) -> None:
        """One AdamW update: the vision group at ``lr``, the text group at ``lr * text_lr / lr``; gradients
        clipped to ``grad_clip``; then the routers' aux-loss-free bias update."""
        for group, scale in zip(self.optimizer.param_groups, self.lr_scale, strict=True):
            group["lr"] = lr * scale
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*self.model.parameters(), *self.probe.parameters()], self.args.grad_clip)
        self.optimizer.step()
        balance_experts(self.model, self.args.bias_update_rate)

    def train(self, stop_at: int | None = None, log=print) -> TrainState:
        """Run to ``args.steps`` (or checkpoint and stop at step ``stop_at``); ``log`` gets one line per step."""
        args, state = self.args, self.state
        last_checkpoint = time.time()
        while state.step < min(args.steps, stop_at or args.steps):
            started = time.time()
            examples = self.examples(state.step)
            ids, types, mask, images = collate(examples, self.model.config.pad_token_id)
            lr = self.lr_at(state.step)
            if state.step < args.vision_only_steps:  # the glyphs first: the probe alone, no text model
                loss, parts = cell_loss(self.model, self.probe, examples, self.char_tokens, args.match_weight)
                parts.update(lm=float("nan"), kl=float("nan"))
            else:
                cut = self.model.aligner.register_forward_hook(lambda module, inputs, out: out.detach()) if (
                    state.step < args.vision_lm_start) else None
                try:
                    loss, parts = vlm_loss(self.model, ids, types, mask, images, args.indexer_loss_weight)
                finally:
                    if cut is not None:
                        cut.remove()
                if args.cell_loss_weight:
                    aux, aux_parts = cell_loss(self.model, self.probe, examples, self.char_tokens, args.match_weight)
                    loss = loss + args.cell_loss_weight * aux
                    parts.update(aux_parts)
            self.update(loss, lr)
            state.step += 1
            state.tokens += int(mask.sum())
            elapsed = time.time() - started
            state.wall_seconds += elapsed
            state.history.append({"step": state.step, "lr": lr, "width": ids.shape[1], "seconds": elapsed, **parts})
            lm_kl = (f"loss {parts['lm']:.4f} kl {parts['kl']:.4f}" if np.isfinite(parts["lm"]) else
                     "loss - kl - (vision only)")
            log(f"step {state.step}/{args.steps} {lm_kl} "
                f"cell {parts.get('cell', 0):.4f} acc {parts.get('cell_acc', 0):.3f} match {parts.get('match', 0):.3f} "
                f"scale {parts.get('scale', 0):.4f} "
                f"spread {parts.get('spread', 0):.3f} lr {lr:.2e} rows {ids.shape[0]}x{ids.shape[1]} {elapsed:.2f}s")
            if (args.eval_every and state.step % args.eval_every == 0 and self.eval_set
                    and state.step > args.vision_only_steps):
                result = evaluate_transcription(self.model, self.tokenizer, self.eval_set, baseline=False)
                acc = result["with_image"]
                state.evals.append({"step": state.step, **acc})
                log(f"step {state.step}: held-out char accuracy {acc['char_accuracy']:.4f} exact "
                    f"{acc['exact_match']:.3f} e.g. {result['samples'][0]}")
            if time.time() - last_checkpoint > args.checkpoint_minutes * 60:
                self.save_checkpoint()
                last_checkpoint = time.time()
        self.save_checkpoint()
        return state


def _cell(text: str) -> str:
    """A string as a Markdown table cell: code-quoted (JSON-escaped, so newlines and quotes stay visible), pipes
    escaped."""
    return "`" + json.dumps(text, ensure_ascii=False)[1:-1].replace("|", "\\|").replace("`", "'") + "`"


def write_card(model_dir: Path, facts: dict[str, Any], overwrite: bool = False) -> Path:
    """Write ``model_dir/MODEL_CARD.md`` from ``facts`` (:func:`train_vlm_command`'s summary). Raises
    FileExistsError when the card exists and ``overwrite`` is False (a card may carry hand-written sections)."""
    card = Path(model_dir) / "MODEL_CARD.md"
    if card.exists() and not overwrite:
        raise FileExistsError(f"{card} exists (it may hold hand-written sections): pass overwrite=True to replace it")
    v, a, p = facts["vision_config"], facts["args"], facts["params"]
    final = facts["final_eval"]
    rows = [("this model, with the image", final["with_image"]),
            ("this model, same prompt without the image", final["text_only"])]
    if "base_text_only" in final:
        rows.append((f"{facts['base_model']} (no vision), prompt without the image", final["base_text_only"]))
    if "line_layout" in final:
        rows.append(("this model, the same snippets as proportional lines (layout \"line\", not trained on)",
                     final["line_layout"]))
    lm_steps = min(10, facts["steps"] - a["vision_only_steps"])
    corpus = (f" (`dsv41 data prepare`, manifest sha256 {facts['corpus_manifest_sha256'][:12]}: Python and Linux "
              "kernel documentation, the standard library, Shakespeare)" if facts.get("corpus_manifest_sha256")
              else "")
    threads = f"{facts['threads']} CPU threads" if facts.get("threads") else "CPU"
    lines = [
        f"# {facts.get('export', 'v41-tiny-vl')}: a tiny DeepSeek-V4.1 vision-language model trained to read "
        "rendered text",
        "",
        f"`{facts['base_model']}` plus a small vision path trained from scratch on images of rendered text "
        f"(`dsv41 train-vlm`): a ViT of {v['num_hidden_layers']} blocks, width {v['hidden_size']}, "
        f"{v['num_attention_heads']} heads, patch {v['patch_size']}, then the {v['downsample_ratio']}x"
        f"{v['downsample_ratio']} aligner into the text width; at most {v['max_image_tokens']} image-span "
        f"positions per image, `min_pixels` {v['min_pixels']}. The text model was fine-tuned with it.",
        "",
        f"**A toy.** It was trained to answer the chat turn \"<image> {PROMPT}\" with one line of printed ASCII "
        "text in the fonts of its renders; how far it got is in the held-out results below. It has not seen "
        "photographs, handwriting or any other task.",
        "",
        "## Size",
        f"- {p['total']:,} parameters: vision path {p['vision']:,}, text backbone {p['backbone']:,}, Engram "
        f"{p['engram']:,}, DSpark draft {p['dspark']:,} (unchanged from the base; re-distil it for speculation).",
        "",
        "## Data",
        f"- Renders (`deepseek_v41/train/vision_data.py`, layout \"cells\") of 1-3 consecutive words (at most "
        f"{a['max_chars']} characters) of one line of `{facts['data']}/train.txt` for training and of "
        f"`heldout.txt` for the evaluation{corpus}, in "
        f"{len(facts['fonts'])} TrueType faces ({', '.join(facts['fonts'])}). One character per 42-pixel cell of a "
        "single 42-pixel row (fixed pitch, as on a terminal: each glyph centred in its cell, up to 3 px off), font "
        "sizes 22-34 px, up to two blank cells after the text, random ink and background colours (a fifth light on "
        "dark), rotations up to 3 degrees, Gaussian noise, a light blur on some and stray strokes. Widths are "
        "multiples of 42 px, so the processor never resizes or pads them. Proportional lines (layout \"line\") "
        "are not what it was trained on.",
        "- Chat turn (the project's encoding, chat mode): user = the image and \"" + PROMPT + "\", assistant = "
        "the text spelled one token per character (it decodes to the same string; the tokenizer's BPE pieces span "
        "several cells); loss on the answer tokens and the end token only.",
        "",
        "## Training",
        f"- {facts['steps']:,} steps of {a['batch_size']} renders ({facts['target_tokens']:,} answer tokens), "
        f"{facts['wall_seconds'] / 60:.0f} min of step time on {threads}; the first "
        f"{a['vision_only_steps']:,} steps train the vision path alone (no text model), the rest the two together; "
        f"AdamW, lr {a['lr']} for the vision path and {a['text_lr']} for the text model, warmup "
        f"{a['warmup_steps']} and cosine to {a['min_lr_ratio']} x in each phase, clip {a['grad_clip']}; the "
        "DSpark draft and the Engram tables frozen; `bias_vl` started as a copy of each router's text bias.",
    ]
    if a.get("cell_loss_weight"):
        lines.append(
            f"- Auxiliary loss (weight {a['cell_loss_weight']}, training only, `vlm.cell_loss`): a linear probe "
            "classifies each cell's aligner row (its character or blank), the row of a character cell is pulled "
            f"toward the input embedding of that character's token (weight {a.get('match_weight', 0)}), and a term "
            "holds the rows' RMS at the embeddings'. The probe is not in the checkpoint. From the language-model "
            "loss alone a first run's ViT rows collapsed to one constant vector and the model ignored the image.")
    if facts.get("loss_first_10") is not None and lm_steps > 0:
        lines.append(f"- Training loss (the answer tokens): {facts['loss_first_10']:.3f} over the first {lm_steps} "
                     f"joint steps, {facts['loss_last_10']:.3f} over the last {lm_steps}.")
    lines += [
        "",
        f"## Held-out character accuracy ({final['with_image']['samples']} renders of held-out text)",
        "",
        "Greedy transcription with the exact forward (a loop in `deepseek_v41/train/vlm.py`), weights as shipped "
        "(bf16, computed in fp32). Character accuracy = max(0, 1 - CER), CER = total edit distance / total "
        "reference characters.",
        "",
        "| model | character accuracy | CER | exact match |",
        "|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['char_accuracy']:.3f} | {r['cer']:.3f} | {r['exact_match']:.3f} |")
    lines += ["", "Examples (reference -> with the image / without):", "", "| reference | with the image | without |",
              "|---|---|---|"]
    for smp in final["examples"]:
        lines.append("| " + " | ".join(_cell(smp[k]) for k in ("reference", "with_image", "text_only")) + " |")
    lines += ["", "## Reproduce", "", "```", facts["command"], "```", ""]
    if facts.get("notes"):
        lines += ["## Notes", "", *[f"- {note}" for note in facts["notes"]], ""]
    card.write_text("\n".join(lines))
    return card


def train_vlm_command(base: Path, data: Path, out: Path, args: VLMArgs, vision: VisionConfig, resume: bool = False,
                      stop_at: int | None = None, threads: int | None = None, export: Path | None = None,
                      eval_samples: int = 200, command: str = "", log=print) -> Path:
    """What ``dsv41 train-vlm`` does: build the VLM from ``base`` (or resume ``out/checkpoint``), train on renders
    of ``data/train.txt`` (until ``args.steps``, or ``stop_at``), export it in bf16 to ``export`` (default
    ``out/model``) with the tokenizer files, then reload the export and score ``eval_samples`` renders of
    ``data/heldout.txt`` with and without the image (and the base without it); write ``vlm_train.json`` and
    ``MODEL_CARD.md`` there. Returns the export folder. Raises FileNotFoundError for a missing corpus split."""
    if threads:
        torch.set_num_threads(threads)
    base, data, out = Path(base), Path(data), Path(out)
    if not (base / "config.json").is_file() or not (base / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{base} is not a model folder (config.json and tokenizer.json): --model must be a "
                                f"text checkpoint such as checkpoints/v41-tiny-chat")
    widest = RenderSpec().max_tokens_w + 3  # the span of the widest render: one row of cells, newline, start, end
    if vision.max_image_tokens < widest:
        raise ValueError(f"max_image_tokens {vision.max_image_tokens} is below {widest}, the span of the widest "
                         f"render ({RenderSpec().max_tokens_w} cells): renders would be scaled down")
    if not 1 <= args.max_chars <= RenderSpec().max_tokens_w:
        raise ValueError(f"max_chars {args.max_chars} must lie in 1..{RenderSpec().max_tokens_w} (one cell each)")
    for split in ("train.txt", "heldout.txt"):
        if not (data / split).is_file():
            raise FileNotFoundError(f"{data / split} not found: --data must be a `dsv41 data prepare` folder")
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    fonts = find_fonts()
    log(f"fonts: {[Path(f).stem for f in fonts] or 'none found, Pillow built-in'}")
    train_lines, heldout_lines = corpus_lines(data / "train.txt"), corpus_lines(data / "heldout.txt")
    log(f"lines: {len(train_lines):,} train, {len(heldout_lines):,} held-out")
    model = build_vlm(base, vision, args.seed)
    eval_set = eval_examples(heldout_lines, fonts, tokenizer, model, eval_samples, args.max_chars)
    out.mkdir(parents=True, exist_ok=True)
    trainer = VLMTrainer(model, tokenizer, train_lines, eval_set[: args.eval_samples], fonts, out, args, resume)
    if resume:
        log(f"resuming at step {trainer.state.step} of {args.steps}")
    started = time.time()
    state = trainer.train(stop_at=stop_at, log=log)
    target = Path(export) if export else out / "model"
    model.save_pretrained(target, dtype=torch.bfloat16)
    log(f"exported step {state.step} to {target}; evaluating {eval_samples} held-out renders ...")
    shipped = load_model(target, dtype=torch.float32)
    final = evaluate_transcription(shipped, tokenizer, eval_set)
    blind = greedy_transcribe(load_model(base, dtype=torch.float32), tokenizer, eval_set[:1], with_image=False)[0]
    final["base_text_only"] = char_accuracy([e.text for e in eval_set], [blind] * len(eval_set))
    # the same held-out snippets drawn as proportional lines, a layout it was not trained on
    lines_set = eval_examples(heldout_lines, fonts, tokenizer, shipped, eval_samples, args.max_chars,
                              RenderSpec(layout="line"))
    final["line_layout"] = char_accuracy([e.text for e in lines_set],
                                         greedy_transcribe(shipped, tokenizer, lines_set, with_image=True))
    final["examples"] = final.pop("samples")
    manifest = data / "manifest.json"
    lm = [h["lm"] for h in state.history if np.isfinite(h["lm"])]  # the vision-only steps have no text loss
    summary = {
        "base_model": str(base), "data": str(data), "command": command, "args": asdict(args),
        "vision_config": asdict(vision), "fonts": [Path(f).stem for f in fonts],
        "corpus_manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None,
        "train_lines": len(train_lines), "heldout_lines": len(heldout_lines), "eval_seed": EVAL_SEED,
        "steps": state.step, "target_tokens": state.tokens, "wall_seconds": state.wall_seconds,
        "last_session_seconds": time.time() - started, "frozen": list(FROZEN), "threads": torch.get_num_threads(),
        "export": target.name,
        "loss_first_10": float(np.mean(lm[:10])) if lm else None,
        "loss_last_10": float(np.mean(lm[-10:])) if lm else None,
        "params": count_params(shipped), "evals": state.evals, "final_eval": final}
    (target / "vlm_train.json").write_text(json.dumps(summary, indent=2) + "\n")
    text, image, _, _ = render_sample(heldout_lines, [EVAL_SEED, 0], fonts, max_chars=args.max_chars)
    image.save(target / "example.png")  # the first evaluation render, for the README's example
    (target / "example.txt").write_text(text + "\n")
    write_card(target, summary, overwrite=True)
    for name, r in (("with image", final["with_image"]), ("text only", final["text_only"]),
                    ("base, text only", final["base_text_only"]), ("line layout", final["line_layout"])):
        log(f"{name}: char accuracy {r['char_accuracy']:.4f} CER {r['cer']:.4f} exact {r['exact_match']:.3f}")
    return target
