"""Structured outputs benchmark: decode tokens/s with and without a JSON-schema constraint (deepseek_v41.structured).

For each batch size (default 1 and 8) it runs, in ONE process on one engine, the same prompts at temperature 1
with the same seeds:

- **free**: no constraint (the baseline of the ratios; ``ignore_eos`` so that it runs ``--max-tokens``);
- **json schema**: ``structured_outputs=StructuredOutputsParams(json=SCHEMA)`` (xgrammar; the grammar compiled once
  before the timed runs, as the LRU cache serves a repeated schema);

and prints decode tokens/s (generated tokens after each request's first / time from the first token to the last),
the ratio to free, the tokens generated, the per-token mask cost in ms (filling the bitmask rows, applying them to
the logits and advancing the matchers, per constrained token) and, of the constrained outputs, how many parse with
the schema's required keys / how many the grammar ended (the rest reached ``--max-tokens``) / all. The first
compile of the schema (a cache miss) is printed once. One run: these
machines are noisy, read the ratios, not the absolute rates.

    python bench/structured.py --model checkpoints/v41-tiny/ [--batch-sizes 1 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-tiny"
PROMPT = "The model configuration, as JSON:"
SCHEMA = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "pattern": "^[A-Za-z0-9 .-]{1,24}$"},
        "layers": {"type": "integer", "minimum": 1, "maximum": 128},
        "dtype": {"enum": ["bf16", "fp8", "fp4"]},
        "experts": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 255},
                                             "name": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
            "required": ["id", "name"], "additionalProperties": False}},
    },
    "required": ["model", "layers", "dtype", "experts"],
    "additionalProperties": False,
}


def decode_rate(outputs) -> float:
    """Generated tokens after each request's first, per second from the first first-token to the last finish."""
    generated = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    start = min(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.finished_time for o in outputs)
    return generated / max(end - start, 1e-9)


class MaskTimer:
    """Wall time spent in the engine's structured-output work: filling and applying the bitmasks and advancing the
    matchers (``StructuredOutputManager.mask_logits`` and ``LLMEngine._advance_grammar``, wrapped while in use)."""

    def __init__(self, llm):
        self.engine = llm.engine
        self.seconds = 0.0

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return wrapper

    def __enter__(self) -> MaskTimer:
        manager = self.engine.structured_output_manager
        manager.mask_logits = self._timed(manager.mask_logits)
        self.engine._advance_grammar = self._timed(self.engine._advance_grammar)
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.structured_output_manager.mask_logits, self.engine._advance_grammar


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and all(k in value for k in SCHEMA["required"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: no model at {args.model} (config.json missing)", file=sys.stderr)
        return 2
    import torch

    from deepseek_v41.engine import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, dtype="float32", max_num_seqs=max(8, *args.batch_sizes))
    if llm.tokenizer is None:
        print(f"error: {args.model} has no tokenizer.json (structured outputs read the vocabulary)", file=sys.stderr)
        return 2
    constraint = StructuredOutputsParams(json=SCHEMA)
    manager = llm.engine.structured_output_manager
    manager.compile(StructuredOutputsParams(regex="[0-9]"))  # builds xgrammar's tokenizer info, untimed
    started = time.perf_counter()
    manager.compile(constraint)
    compile_ms = (time.perf_counter() - started) * 1e3

    def free(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=args.max_tokens, ignore_eos=True)

    def schema(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=args.seed + i, max_tokens=args.max_tokens,
                              structured_outputs=constraint)

    llm.generate([PROMPT] * 2, [free(0), schema(0)], use_tqdm=False)  # warm-up
    print(f"model {args.model}, vocab {llm.engine.config.vocab_size}, up to {args.max_tokens} tokens at "
          f"temperature 1, torch threads {torch.get_num_threads()}, schema compiled in {compile_ms:.1f} ms "
          f"(backend {manager.compile(constraint).backend})")
    print(f"{'batch':>5}  {'mode':<12} {'decode tok/s':>12} {'ratio':>6} {'tokens':>7} {'mask ms/token':>13}  "
          f"valid/ended/requests")
    for size in args.batch_sizes:
        base = None
        for mode, make in (("free", free), ("json schema", schema)):
            with MaskTimer(llm) as timer:
                outputs = llm.generate([PROMPT] * size, [make(i) for i in range(size)], use_tqdm=False)
            rate = decode_rate(outputs)
            base = base or rate
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            mask = f"{timer.seconds * 1e3 / max(1, tokens):.3f}" if mode != "free" else "-"
            ended = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
            ok = "-" if mode == "free" else f"{sum(valid(c.text) for c in ended)}/{len(ended)}/{size}"
            print(f"{size:>5}  {mode:<12} {rate:>12.1f} {rate / base:>6.2f} {tokens:>7} {mask:>13}  {ok}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
