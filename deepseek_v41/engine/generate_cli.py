"""``dsv41 generate``: one prompt through the engine, the text and a stats line (SPEC.md §4)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer


def generate(
    model: Path = typer.Option(..., help="Model folder (config.json, safetensors, tokenizer.json)."),
    prompt: str | None = typer.Option(None, help="Prompt text."),
    prompt_file: Path | None = typer.Option(None, help="Read the prompt from this file."),
    chat: bool = typer.Option(False, help="Render the prompt as one user turn with the official chat encoder."),
    thinking: bool = typer.Option(False, help="With --chat: thinking mode."),
    max_tokens: int = typer.Option(128, help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0, help="0 = off."),
    seed: int | None = typer.Option(None),
    prefill_mode: str | None = typer.Option(None, help="ced | exact [default: ced when the layout allows]."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16."),
    device: str = typer.Option("cpu"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with text, token_ids and stats."),
    speculative: str | None = typer.Option(None, help="'dspark': speculative decoding with the checkpoint's DSpark "
                                                     "draft [default: off]."),
    speculative_max_len: int | None = typer.Option(None, help="Drafts verified per step at most [default: the "
                                                             "checkpoint's dspark_block_size]."),
    follow_up: str | None = typer.Option(None, help="A second turn: prompt + first completion + this text, run "
                                                   "after the first (it reuses the first turn's prefix cache)."),
) -> None:
    """Generate a continuation and print it with a stats line (prompt and cached tokens, TTFT, tokens/s,
    KV cache bytes)."""
    import torch

    from deepseek_v41.config import ConfigError
    from deepseek_v41.engine import LLM, SamplingParams
    from deepseek_v41.model.checkpoint import CheckpointError

    if (prompt is None) == (prompt_file is None):
        raise typer.BadParameter("give exactly one of --prompt and --prompt-file")
    text = prompt if prompt is not None else prompt_file.read_text(encoding="utf-8")
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        llm = LLM(model, dtype=dtypes[dtype], device=device, prefill_mode=prefill_mode, speculative=speculative,
                  speculative_max_len=speculative_max_len)
        turns = [text] if follow_up is None else [text, None]
        messages = [{"role": "user", "content": text}]
        for turn in range(len(turns)):
            start = time.perf_counter()
            out = (llm.chat(messages, params, thinking=thinking) if chat else llm.generate(turns[turn], params))[0]
            wall = time.perf_counter() - start
            if turn + 1 < len(turns):
                _print(out, llm, wall, as_json)
                turns[turn + 1] = turns[turn] + out.outputs[0].text + follow_up
                messages += [{"role": "assistant", "content": out.outputs[0].text},
                             {"role": "user", "content": follow_up}]
    except (FileNotFoundError, ValueError, ConfigError, CheckpointError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    _print(out, llm, wall, as_json)


def _print(out, llm, wall: float, as_json: bool) -> None:
    """The completion and its stats line (or one JSON object)."""
    completion = out.outputs[0]
    ttft = out.metrics.time_to_first_token
    decode_time = (out.metrics.finished_time or 0) - (out.metrics.first_token_time or 0)
    generated = len(completion.token_ids)
    stats = {
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens,
        "replayed_tokens": getattr(out, "num_replayed_tokens", 0),
        "generated_tokens": generated,
        "finish_reason": completion.finish_reason,
        "ttft_s": ttft,
        "decode_tokens_per_s": (generated - 1) / decode_time if generated > 1 and decode_time > 0 else None,
        "wall_s": wall,
        "kv_bytes_per_token": llm.stats["kv_allocated_bytes_per_token"],
        "window_bytes_per_sequence": llm.stats["window_bytes_per_sequence_logical"],
        "prefill_mode": llm.stats["prefill_mode"],
    }
    if "spec_decode_mean_accepted_length" in llm.stats:
        stats["spec_decode_mean_accepted_length"] = llm.stats["spec_decode_mean_accepted_length"]
    if as_json:
        typer.echo(json.dumps({"text": completion.text, "token_ids": completion.token_ids, **stats}, indent=2))
        return
    typer.echo(completion.text)
    spec = ""
    if "spec_decode_mean_accepted_length" in stats:
        spec = f"; DSpark mean accepted length {stats['spec_decode_mean_accepted_length']:.2f}"
    rate = f"{stats['decode_tokens_per_s']:.1f} tok/s" if stats["decode_tokens_per_s"] else "n/a"
    typer.echo(f"\n[{stats['prompt_tokens']} prompt tokens, {stats['cached_tokens']} cached "
               f"({stats['replayed_tokens']} replayed), {generated} generated "
               f"({completion.finish_reason}); TTFT {ttft * 1000:.0f} ms; decode {rate}; "
               f"KV {stats['kv_bytes_per_token']:.0f} B/token + window {stats['window_bytes_per_sequence']:,} B/seq; "
               f"prefill {stats['prefill_mode']}{spec}]", err=True)
