"""``dsv41 generate``: one prompt through the engine, its text streamed as it is produced, then the stats (SPEC.md
§4), as ``mlx_lm.generate``.

The text goes to stdout piece by piece, as the engine's incremental detokenizer releases it (so a piece never ends
inside a UTF-8 character and is never taken back); then a newline. The stats go to stderr after a ``==========``
line, in mlx-lm's words: ``Prompt: N tokens, X tokens-per-sec`` (with the cached, replayed and computed tokens, the
TTFT and the prefill mode), ``Generation: N tokens, Y tokens-per-sec`` (with the finish reason and, with
``--speculative dspark``, that turn's DSpark mean accepted length), ``Peak memory: Z GB`` and the KV bytes.

The model folder is the positional MODEL or ``--model``. mlx-lm's short names work too: ``--temp`` for
``--temperature``, ``-m`` for ``--max-tokens``.

Prompt: ``--prompt TEXT`` (``-p``; ``-`` reads stdin, as mlx-lm) or ``--prompt-file PATH``. The chat format is the
default when the checkpoint has a chat template (:func:`chat_template_source`), as mlx-lm uses the tokenizer's
template when it has one; ``--chat`` / ``--no-chat`` (mlx-lm: ``--use-default-chat-template`` /
``--ignore-chat-template``) force it on or off. In chat mode the prompt is one user message (after the
``--system-prompt`` message, if given) rendered by the official V4.1 encoder.

``--image FILE`` (repeatable; a model with a vision tower) sends images with the prompt: in chat mode they are
image parts of the user message, before its text (``--image a.png --prompt "Transcribe the text."``), in prompt
order; in raw mode the prompt holds one ``<｜deepseek_image｜>`` where each image goes. Any format Pillow reads.

With ``--follow-up`` a second turn runs after the first: its prompt is the first prompt, the first completion and
the follow-up text (in chat mode: the conversation plus the reply and the follow-up as a new user message), so it
shows the prefix cache at work. Every turn is streamed and gets its own stats, the DSpark mean accepted length
included (from that turn's ``RequestOutput``, not the engine's running totals); before the second turn's text a
line ``--- turn 2 (...) ---`` on stderr. One prompt gives one sample (there is no ``--n``).

With ``--json`` nothing is streamed: exactly one JSON object on stdout (see :func:`json_result`).
Sampling defaults come from the model's ``generation_config.json`` (``--generation-config``, as ``dsv41 serve``);
an option given on the command line wins. A bad option, an unreadable prompt file, a device this machine lacks or a
model that cannot be loaded exit with status 2 and an ``error: ...`` line on stderr.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import typer

from deepseek_v41.chat import IMAGE, assistant_message, encode_messages
from deepseek_v41.chat.tokens import IMAGE_NAMES
from deepseek_v41.cli import parallel
from deepseek_v41.cli.serve import DTYPES, check_device, choose_model, fail, resolve_dtype
from deepseek_v41.config import ConfigError
from deepseek_v41.engine import LLM, SamplingParams
from deepseek_v41.engine.sampling_params import StructuredOutputsParams
from deepseek_v41.model.checkpoint import CheckpointError
from deepseek_v41.server.generation_config import GenerationConfigError, load_sampling_defaults
from deepseek_v41.structured.tool_choice import TOOL_CHOICES, resolve_tool_choice, tool_choice_tag

# Sampling without an option and without a generation config: greedy, 128 tokens per turn.
FALLBACK_SAMPLING = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0}

JSON_HELP = ("Print exactly one JSON object instead of streaming: a single turn's text, token_ids and stats; with "
             "--follow-up {'turns': [one such object per turn]}.")
CHAT_HELP = ("Render the prompt as a user message with the official V4.1 chat encoder (on / off; the second "
             "pair are mlx_lm's names). Default: on when the checkpoint has a chat template (tokenizer_config.json's "
             "chat_template, chat_template.jinja / .json, or the official encoding/encoding.py), else off.")
SEPARATOR = "=========="  # before the stats, as mlx_lm.generate
_request_ids = itertools.count()  # this command's engine request ids (apart from LLM's "0", "1", ...)


def generate(
    model_tag: Path | None = typer.Argument(None, metavar="MODEL", show_default=False, help="Model folder "
                                           "(config.json, safetensors, tokenizer.json)."),
    model: Path | None = typer.Option(None, "--model", help="The model folder, as the positional MODEL."),
    prompt: str | None = typer.Option(None, "--prompt", "-p", help="Prompt text; '-' reads it from stdin."),
    prompt_file: Path | None = typer.Option(None, help="Read the prompt from this UTF-8 file."),
    chat: bool | None = typer.Option(None, "--chat/--no-chat", "--use-default-chat-template/--ignore-chat-template",
                                     help=CHAT_HELP, show_default=False),
    system_prompt: str | None = typer.Option(None, help="Chat mode: a system message before the prompt."),
    thinking: bool = typer.Option(False, help="With --chat: thinking mode."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", "-m", min=1, help="Tokens to generate at most "
                                          "(per turn; default: the generation config's max_new_tokens, else 128)."),
    temperature: float | None = typer.Option(None, "--temperature", "--temp", min=0.0, help="0 = greedy "
                                             "(default: the generation config's, else 0)."),
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
    tools: Path | None = typer.Option(None, help="With --chat: a JSON file holding an OpenAI `tools` list (function "
                                      "tools) rendered into the prompt; calls the model makes are printed."),
    tool_choice: str | None = typer.Option(None, help="With --tools: auto (default), none, required, or a tool's "
                                           "function name (that call is forced); as /v1/chat/completions."),
    image: list[Path] = typer.Option([], "--image", help="An image file for the prompt (repeatable, in order; a "
                                     "model with a vision tower). Chat mode: image parts of the user message before "
                                     "its text; raw mode: one <｜deepseek_image｜> in the prompt per image."),
    tensor_parallel_size: int = parallel.tensor_parallel_size_option(),
    enable_expert_parallel: bool = parallel.enable_expert_parallel_option(),
    expert_parallel_size: int | None = parallel.expert_parallel_size_option(),
    distributed_executor_backend: str | None = parallel.backend_option(),
    nnodes: int = parallel.nnodes_option(),
    node_rank: int = parallel.node_rank_option(),
    master_addr: str = parallel.master_addr_option(),
    master_port: int = parallel.master_port_option(),
    headless: bool = parallel.headless_option(),
    distributed_timeout_s: float = parallel.timeout_option(),
    shard_engram: bool = parallel.shard_engram_option(),
) -> None:
    """Generate a continuation, streaming it to stdout, then print the stats on stderr (prompt and cached tokens,
    TTFT, tokens/s, peak memory, KV cache bytes)."""

    model = choose_model(model_tag, model, "dsv41 generate MODEL")
    parallel_config = parallel.parallel_config(fail, tensor_parallel_size, enable_expert_parallel,
                                               expert_parallel_size, distributed_executor_backend, nnodes, node_rank,
                                               master_addr, master_port, headless, distributed_timeout_s,
                                               shard_engram)
    if parallel_config.headless:
        if not model.is_dir():
            fail(f"model directory {model} not found")
        parallel.run_headless(parallel_config, model)
    if (prompt is None) == (prompt_file is None):
        fail("give exactly one of --prompt and --prompt-file")
    if speculative_max_len is not None and speculative is None:
        fail("--speculative-max-len needs --speculative dspark (speculative decoding is off)")
    if not model.is_dir():
        fail(f"model directory {model} not found")
    chat = _chat_mode(model, chat, thinking=thinking, system_prompt=system_prompt)
    tool_list, mode, tag = _tool_setup(tools, tool_choice, chat, thinking)
    text = _read_stdin() if prompt == "-" else prompt if prompt is not None else _read_prompt(prompt_file)
    images = [_read_image(path) for path in image]
    if images and not chat and sum(text.count(name) for name in IMAGE_NAMES) != len(images):
        fail(f"--image without the chat format: the prompt must hold one {IMAGE} per image ({len(images)} given, "
             f"{sum(text.count(name) for name in IMAGE_NAMES)} in the prompt), or add --chat")
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
    write = None if as_json else write_text
    llm = None
    try:
        params = SamplingParams(**sampling, seed=seed)
        if tag is not None:
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(structural_tag=tag))
        llm = LLM(model, dtype=torch_dtype, device=str(torch_device), prefill_mode=prefill_mode,
                  speculative=speculative, speculative_max_len=speculative_max_len,
                  **parallel.llm_kwargs(parallel_config))
        if llm.tokenizer is None:
            fail(f"{model} has no tokenizer.json: dsv41 generate takes a text prompt")
        if images and llm.engine.config.vision_config is None:
            fail(f"--image: {model} has no vision tower (no vision_config in its config.json); it takes text only")
        turns = [text] if follow_up is None else [text, follow_up]
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        context = ""  # raw mode: the text so far (prompts and completions)
        results = []
        for turn, new_text in enumerate(turns):
            if turn > 0 and not as_json:
                how = ("conversation + reply + follow-up as a user message" if chat else
                       "turn 1 + completion + follow-up")
                typer.echo(f"--- turn {turn + 1} (prompt = {how}) ---", err=True)
            if chat:
                # The parts only place the placeholders; the bytes read above go to the engine beside the prompt.
                parts = [{"type": "image_url", "image_url": {"url": path.resolve().as_uri()}} for path in image] \
                    if turn == 0 else []
                messages.append({"role": "user", "content": [*parts, {"type": "text", "text": new_text}]
                                 if parts else new_text})
                prompt_text = encode_messages(messages, tools=tool_list if mode != "none" else None,
                                              thinking=thinking)
            else:
                context += new_text
                prompt_text = context
            start = time.perf_counter()
            out = stream(llm, prompt_text, params, add_special_tokens=not chat, write=write, images=images)
            result = turn_result(out, llm, time.perf_counter() - start, torch_device)
            reply = {"role": "assistant", "content": result["text"]}
            if tool_list is not None:
                full = llm.tokenizer.decode(result["token_ids"], skip_special_tokens=False)
                reply = assistant_message(full, thinking, tools_active=mode != "none")
                result["tool_calls"] = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                        for c in reply.get("tool_calls") or []]
                if not as_json:
                    for call in result["tool_calls"]:
                        typer.echo(f"[tool call] {call['name']}({call['arguments']})")
            results.append(result)
            if not as_json:
                _print_stats(result)
            messages.append(reply)
            context += result["text"]
    except (FileNotFoundError, ValueError, ConfigError, CheckpointError) as exc:
        fail(str(exc))
    except typer.Exit:  # fail() above (click's Exit is a RuntimeError)
        raise
    except RuntimeError as exc:  # a worker rank of a parallel engine failed (named in the message)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    finally:
        if llm is not None:
            llm.shutdown()
    if as_json:
        typer.echo(json.dumps(json_result(results), indent=2))


def _tool_setup(tools: Path | None, tool_choice: str | None, chat: bool, thinking: bool
                ) -> tuple[list | None, str, str | None]:
    """``--tools`` / ``--tool-choice`` -> (the tools list or None, the tool_choice mode, the structural tag that
    enforces it or None), by the server's one mapping (:mod:`deepseek_v41.structured.tool_choice`). A bare function
    name is the named choice. Exits 2 for tools without the chat format, a file that is not a JSON list, a choice
    without tools, or a choice / tool the mapping refuses."""
    if tools is None:
        if tool_choice is not None:
            fail("--tool-choice needs --tools (a JSON file with the tools list)")
        return None, "none", None
    if not chat:
        fail("--tools needs --chat (tools are part of the chat format)")
    try:
        tool_list = json.loads(tools.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        fail(f"--tools {tools}: cannot read a JSON tools list ({exc})")
    if not isinstance(tool_list, list) or not tool_list:
        fail(f"--tools {tools} must hold a non-empty JSON list of OpenAI function tools")
    choice = tool_choice
    if tool_choice is not None and tool_choice not in TOOL_CHOICES:
        choice = {"type": "function", "function": {"name": tool_choice}}
    try:
        mode, name = resolve_tool_choice(tool_list, choice)
        tag = tool_choice_tag(tool_list, mode, name, thinking=thinking)
    except ValueError as exc:
        fail(f"--tools / --tool-choice: {exc}")
    return tool_list, mode, tag


def chat_template_source(model: Path) -> str | None:
    """Why the checkpoint in ``model`` counts as having a chat template (so ``dsv41 generate`` renders the chat
    format by default, as mlx-lm does when its tokenizer has one), or None when it has none.

    A checkpoint has one when its ``tokenizer_config.json`` (in the folder or its ``tokenizer/`` sub-folder, the
    official layout) sets ``chat_template``, when it ships ``chat_template.jinja`` / ``chat_template.json`` (where
    ``transformers`` saves templates now), or when it ships the official encoder ``encoding/encoding.py`` (the
    DeepSeek-V4.1 release has no Jinja template: its chat format is that Python encoder). The template itself is
    never run: prompts are always rendered by this package's port of the official encoder. The bundled
    ``checkpoints/v41-tiny`` has none of these (a plain language model, not chat-tuned).

    Raises ValueError when a ``tokenizer_config.json`` is not a JSON object."""
    for config in (model / "tokenizer_config.json", model / "tokenizer" / "tokenizer_config.json"):
        if not config.is_file():
            continue
        try:
            values = json.loads(config.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{config} is not valid JSON ({exc})") from exc
        if not isinstance(values, dict):
            raise ValueError(f"{config} must hold a JSON object, got {type(values).__name__}")
        if values.get("chat_template"):
            return f"{config.relative_to(model)} sets chat_template"
    for name in ("chat_template.jinja", "chat_template.json", "encoding/encoding.py"):
        if (model / name).is_file():
            return f"it ships {name}"
    return None


def _chat_mode(model: Path, chat: bool | None, thinking: bool, system_prompt: str | None) -> bool:
    """``--chat`` / ``--no-chat`` as given, else the checkpoint's default (:func:`chat_template_source`); exits 2
    when ``--thinking`` or ``--system-prompt`` is given and the chat format is off."""
    if chat is None:
        try:
            chat = chat_template_source(model) is not None
        except ValueError as exc:
            fail(str(exc))
        why = "the checkpoint has no chat template, so the prompt is raw text by default; add --chat"
    else:
        why = "drop --no-chat"
    if thinking and not chat:
        fail(f"--thinking needs --chat (thinking mode is part of the chat format): {why}")
    if system_prompt is not None and not chat:
        fail(f"--system-prompt needs --chat (a system message is part of the chat format): {why}")
    return chat


def _read_stdin() -> str:
    """The prompt of ``--prompt -``: all of stdin as UTF-8; exits 2 when it is not UTF-8."""
    if sys.stdin.isatty():
        typer.echo("Reading the prompt from stdin (end it with Ctrl-D)...", err=True)
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        fail(f"--prompt -: stdin is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})")


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


def _read_image(path: Path) -> bytes:
    """The bytes of an ``--image`` file; exits 2 naming it when it is missing, a directory or unreadable (whether it
    is an image is checked by the engine, which names what is wrong)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        fail(f"--image {path}: no such file")
    except IsADirectoryError:
        fail(f"--image {path} is a directory; give an image file")
    except OSError as exc:
        fail(f"--image {path} cannot be read: {exc.strerror or exc}")


def write_text(text: str) -> None:
    """Write a streamed piece of the completion to stdout now (flushed: a pipe sees it at once)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def stream(llm, prompt: str, params, add_special_tokens: bool, write: Callable[[str], None] | None,
           images: list | None = None):
    """Generate one completion of ``prompt`` on ``llm``'s engine step by step, passing each step's new text
    (``CompletionOutput.new_text``: what the incremental detokenizer released, never part of a UTF-8 character,
    never taken back) to ``write`` as it comes, then a newline; ``write`` None streams nothing. ``images``: one per
    image placeholder of ``prompt``, in order (:meth:`LLM.generate`'s ``multi_modal_data``).

    Returns the finished ``RequestOutput``. Raises ValueError for a prompt the engine refuses (too long for
    ``max_model_len`` or the KV pool, images that do not decode or match the placeholders). Whatever ends the loop
    (an error, Ctrl-C), the request leaves the engine."""
    engine = llm.engine
    request = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
    _, ids, multi_modal_data = llm.prompt_inputs(request, add_special_tokens=add_special_tokens)
    request_id = f"generate-{next(_request_ids)}"
    extra = {"multi_modal_data": multi_modal_data} if multi_modal_data else {}
    engine.add_request(request_id, ids, params, prompt=prompt, **extra)
    try:
        while True:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if write is not None and out.outputs[0].new_text:
                    write(out.outputs[0].new_text)
                if out.finished:
                    if write is not None:
                        write("\n")
                    return out
    finally:
        engine.abort_request(request_id)  # a no-op once finished
        engine.release(request_id)
        if engine.prefix_cache is not None:
            engine.prefix_cache.flush()  # pages on their way to disk are there for the next turn / process


def peak_memory_bytes(device) -> tuple[int, str]:
    """The peak memory so far and what it measures: on CUDA ``torch.cuda.max_memory_allocated`` (tensors on that
    device, as mlx-lm's peak is its allocator's), elsewhere the process's peak resident set size (weights, KV
    cache and Python included; ``ru_maxrss``, KiB on Linux, bytes on macOS)."""
    if device.type == "cuda":

        return torch.cuda.max_memory_allocated(device), "CUDA allocated"

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak if sys.platform == "darwin" else peak * 1024), "process peak RSS"


def turn_result(out, llm, wall: float, device) -> dict[str, Any]:
    """One turn as a dict: ``text``, ``token_ids`` (the generated ids, each once) and the stats (prompt / cached /
    replayed / generated tokens, finish reason, TTFT, prompt rate over the computed prompt tokens, decode rate, wall
    time, peak memory bytes, KV bytes, prefill mode; with speculative decoding this turn's
    ``spec_accepted_tokens``, ``spec_verify_steps`` and ``spec_decode_mean_accepted_length`` = 1 +
    accepted / steps, None when no speculative step ran)."""
    completion = out.outputs[0]
    ttft = out.metrics.time_to_first_token
    decode_time = (out.metrics.finished_time or 0) - (out.metrics.first_token_time or 0)
    generated = len(completion.token_ids)
    computed = len(out.prompt_token_ids) - out.num_cached_tokens + out.num_replayed_tokens
    stats = llm.stats
    peak, peak_kind = peak_memory_bytes(device)
    result = {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens": out.num_cached_tokens,
        "replayed_tokens": out.num_replayed_tokens,
        "generated_tokens": generated,
        "finish_reason": completion.finish_reason,
        "ttft_s": ttft,
        "prompt_tokens_per_s": computed / ttft if ttft else None,
        "decode_tokens_per_s": (generated - 1) / decode_time if generated > 1 and decode_time > 0 else None,
        "wall_s": wall,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
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
    """The ``--json`` object, every generated token id in it once: a single turn's fields (:func:`turn_result`), or
    with ``--follow-up`` ``{"turns": [...]}``, each turn's fields with its ``turn`` number (1-based)."""
    if len(turns) == 1:
        return turns[0]
    return {"turns": [{"turn": i + 1, **t} for i, t in enumerate(turns)]}


def _print_stats(result: dict[str, Any]) -> None:
    """A turn's stats on stderr after a separator line, in mlx_lm.generate's words."""
    def rate(value: float | None) -> str:
        return f"{value:.3f} tokens-per-sec" if value else "n/a tokens-per-sec"

    computed = result["prompt_tokens"] - result["cached_tokens"] + result["replayed_tokens"]
    ttft = f"{result['ttft_s'] * 1000:.0f} ms" if result["ttft_s"] is not None else "n/a"
    spec = ""
    if "spec_decode_mean_accepted_length" in result:
        mean = result["spec_decode_mean_accepted_length"]
        spec = (f"; DSpark mean accepted length {mean:.2f} over {result['spec_verify_steps']} steps"
                if mean is not None else "; DSpark: no speculative step")
    lines = [
        SEPARATOR,
        f"Prompt: {result['prompt_tokens']} tokens, {rate(result['prompt_tokens_per_s'])} "
        f"({result['cached_tokens']} cached, {result['replayed_tokens']} replayed, {computed} computed; "
        f"TTFT {ttft}; prefill {result['prefill_mode']})",
        f"Generation: {result['generated_tokens']} tokens, {rate(result['decode_tokens_per_s'])} "
        f"({result['finish_reason']}{spec})",
        f"Peak memory: {result['peak_memory_bytes'] / 1e9:.3f} GB ({result['peak_memory_kind']})",
        f"KV cache: {result['kv_bytes_per_token']:.0f} B/token + window {result['window_bytes_per_sequence']:,} "
        f"B/sequence",
    ]
    typer.echo("\n".join(lines), err=True)
