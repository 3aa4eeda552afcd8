"""``dsv41 generate``: one prompt through the engine, the text and a stats line (SPEC.md §4).

With ``--follow-up`` a second turn runs after the first: its prompt is the first prompt, the first completion and
the follow-up text (with ``--chat``: the conversation plus the reply and the follow-up as a new user message), so it
shows the prefix cache at work. Every turn gets its own stats, the DSpark mean accepted length included (from that
turn's ``RequestOutput``, not the engine's running totals).

Output: each turn's text on stdout and its stats line on stderr; before the second turn's text a line
``--- turn 2 (...) ---`` on stderr. With ``--json`` exactly one JSON object on stdout (see :func:`json_result`).
Sampling defaults come from the model's ``generation_config.json`` (``--generation-config``, as ``dsv41 serve``);
an option given on the command line wins. A bad option, an unreadable prompt file, a device this machine lacks or a
model that cannot be loaded exit with status 2 and an ``error: ...`` line on stderr.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from deepseek_v41.server.cli import DTYPES, check_device, fail, resolve_dtype
from deepseek_v41.server.generation_config import GenerationConfigError, load_sampling_defaults

# Sampling without an option and without a generation config: greedy, 128 tokens per turn.
FALLBACK_SAMPLING = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0}

JSON_HELP = ("Print exactly one JSON object: the last turn's text, token_ids and stats at the top level, and "
             "'turns', a list with one such object per turn (two with --follow-up, else one).")


def generate(
    model: Path = typer.Option(..., help="Model folder (config.json, safetensors, tokenizer.json)."),
    prompt: str | None = typer.Option(None, help="Prompt text."),
    prompt_file: Path | None = typer.Option(None, help="Read the prompt from this UTF-8 file."),
    chat: bool = typer.Option(False, help="Render the prompt as one user turn with the official chat encoder."),
    thinking: bool = typer.Option(False, help="With --chat: thinking mode."),
    max_tokens: int | None = typer.Option(None, min=1, help="Tokens to generate at most (per turn; default: the "
                                          "generation config's max_new_tokens, else 128)."),
    temperature: float | None = typer.Option(None, min=0.0, help="0 = greedy (default: the generation config's, "
                                             "else 0)."),
    top_p: float | None = typer.Option(None, help="Nucleus sampling, in (0, 1] (default: the generation "
                                       "config's, else 1)."),
    top_k: int | None = typer.Option(None, min=0, help="0 = off (default: the generation config's, else 0)."),
    generation_config: str = typer.Option("auto", help="Sampling defaults, as dsv41 serve: 'auto' = the model's "
                                          "generation_config.json, 'vllm' = none, or a folder holding one."),
    seed: int | None = typer.Option(None),
    prefill_mode: str | None = typer.Option(None, help="ced | exact (default: ced when the layout allows)."),
    dtype: str = typer.Option("auto", help=f"Weights dtype: {', '.join(DTYPES)} (as dsv41 serve; auto = the "
                                           "checkpoint's torch_dtype, else bf16 where native, else float32)."),
    device: str = typer.Option("cpu", help="torch device, e.g. cpu, cuda or cuda:1 (checked at start)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
    speculative: str | None = typer.Option(None, help="'dspark': speculative decoding with the checkpoint's DSpark "
                                                     "draft (default: off)."),
    speculative_max_len: int | None = typer.Option(None, min=1, help="Drafts verified per step at most (default: "
                                                                     "the checkpoint's dspark_block_size)."),
    follow_up: str | None = typer.Option(None, help="A second turn: prompt + first completion + this text, run "
                                                   "after the first (it reuses the first turn's prefix cache)."),
) -> None:
    """Generate a continuation and print it with a stats line (prompt and cached tokens, TTFT, tokens/s,
    KV cache bytes)."""
    from deepseek_v41.config import ConfigError
    from deepseek_v41.engine import LLM, SamplingParams
    from deepseek_v41.model.checkpoint import CheckpointError

    if (prompt is None) == (prompt_file is None):
        fail("give exactly one of --prompt and --prompt-file")
    if thinking and not chat:
        fail("--thinking needs --chat (thinking mode is part of the chat template)")
    if speculative_max_len is not None and speculative is None:
        fail("--speculative-max-len needs --speculative dspark (speculative decoding is off)")
    text = prompt if prompt is not None else _read_prompt(prompt_file)
    if not model.is_dir():
        fail(f"model directory {model} not found")
    try:
        defaults, _ = load_sampling_defaults(generation_config, model)
    except GenerationConfigError as exc:
        fail(str(exc))
    torch_device = check_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, model)
    # An option given wins, then the generation config, then this command's own defaults (greedy, 128 tokens).
    sampling = {**FALLBACK_SAMPLING, **defaults}
    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    sampling.update({name: value for name, value in given.items() if value is not None})
    try:
        params = SamplingParams(**sampling, seed=seed)
        llm = LLM(model, dtype=torch_dtype, device=str(torch_device), prefill_mode=prefill_mode,
                  speculative=speculative, speculative_max_len=speculative_max_len)
        prompts = [text] if follow_up is None else [text, None]
        messages = [{"role": "user", "content": text}]
        results = []
        for turn in range(len(prompts)):
            if turn > 0 and not as_json:
                how = ("conversation + reply + follow-up as a user message" if chat else
                       "turn 1 + completion + follow-up")
                typer.echo(f"--- turn {turn + 1} (prompt = {how}) ---", err=True)
            start = time.perf_counter()
            out = (llm.chat(messages, params, thinking=thinking) if chat else llm.generate(prompts[turn], params))[0]
            result = turn_result(out, llm, time.perf_counter() - start)
            results.append(result)
            if not as_json:
                _print_turn(result)
            if turn + 1 < len(prompts):
                prompts[turn + 1] = prompts[turn] + out.outputs[0].text + follow_up
                messages += [{"role": "assistant", "content": out.outputs[0].text},
                             {"role": "user", "content": follow_up}]
    except (FileNotFoundError, ValueError, ConfigError, CheckpointError) as exc:
        fail(str(exc))
    if as_json:
        typer.echo(json.dumps(json_result(results), indent=2))


def _read_prompt(path: Path) -> str:
    """The text of ``--prompt-file``; exits 2 naming the file when it is missing, a directory, unreadable or not
    UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"--prompt-file {path}: no such file")
    except IsADirectoryError:
        fail(f"--prompt-file {path} is a directory; give a UTF-8 text file")
    except UnicodeDecodeError as exc:
        fail(f"--prompt-file {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})")
    except OSError as exc:
        fail(f"--prompt-file {path} cannot be read: {exc.strerror or exc}")


def turn_result(out, llm, wall: float) -> dict[str, Any]:
    """One turn as a dict: ``text``, ``token_ids`` and the stats (prompt / cached / replayed / generated tokens,
    finish reason, TTFT, decode rate, wall time, KV bytes, prefill mode; with speculative decoding this turn's
    ``spec_accepted_tokens``, ``spec_verify_steps`` and ``spec_decode_mean_accepted_length`` = 1 +
    accepted / steps, None when no speculative step ran)."""
    completion = out.outputs[0]
    ttft = out.metrics.time_to_first_token
    decode_time = (out.metrics.finished_time or 0) - (out.metrics.first_token_time or 0)
    generated = len(completion.token_ids)
    stats = llm.stats
    result = {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens,
        "replayed_tokens": getattr(out, "num_replayed_tokens", 0),
        "generated_tokens": generated,
        "finish_reason": completion.finish_reason,
        "ttft_s": ttft,
        "decode_tokens_per_s": (generated - 1) / decode_time if generated > 1 and decode_time > 0 else None,
        "wall_s": wall,
        "kv_bytes_per_token": stats["kv_allocated_bytes_per_token"],
        "window_bytes_per_sequence": stats["window_bytes_per_sequence_logical"],
        "prefill_mode": stats["prefill_mode"],
    }
    if llm.engine.speculator is not None:
        accepted, steps = out.spec_accepted_tokens, out.spec_verify_steps
        result.update(spec_accepted_tokens=accepted, spec_verify_steps=steps,
                      spec_decode_mean_accepted_length=1 + accepted / steps if steps else None)
    return result


def json_result(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``--json`` object: the last turn's fields at the top level (the single-turn shape of earlier versions)
    and ``turns``, every turn's fields in order (each with its ``turn`` number, 1-based)."""
    return {**turns[-1], "turns": [{"turn": i + 1, **t} for i, t in enumerate(turns)]}


def _print_turn(result: dict[str, Any]) -> None:
    """A turn's text on stdout and its stats line on stderr."""
    typer.echo(result["text"])
    spec = ""
    if "spec_decode_mean_accepted_length" in result:
        mean = result["spec_decode_mean_accepted_length"]
        spec = (f"; DSpark mean accepted length {mean:.2f} over {result['spec_verify_steps']} steps"
                if mean is not None else "; DSpark: no speculative step")
    rate = f"{result['decode_tokens_per_s']:.1f} tok/s" if result["decode_tokens_per_s"] else "n/a"
    ttft = f"{result['ttft_s'] * 1000:.0f} ms" if result["ttft_s"] is not None else "n/a"
    typer.echo(f"\n[{result['prompt_tokens']} prompt tokens, {result['cached_tokens']} cached "
               f"({result['replayed_tokens']} replayed), {result['generated_tokens']} generated "
               f"({result['finish_reason']}); TTFT {ttft}; decode {rate}; "
               f"KV {result['kv_bytes_per_token']:.0f} B/token + window {result['window_bytes_per_sequence']:,} "
               f"B/seq; prefill {result['prefill_mode']}{spec}]", err=True)
