"""DSpark speculative decoding benchmark: decode tokens/s with DSpark against without (DSPARK.md, SPEC.md §4.4).

For each batch size (default 1 and 8) it runs the same greedy requests, in ONE process, on three engines over the
same weights:

- **plain**: no speculation (the baseline of the ratios);
- **dspark (scheduler)**: ``speculative="dspark"`` with the cost table measured at engine start, so the
  scheduler picks the verification length from the draft's confidences;
- **dspark (full block)**: ``speculative_cost_table="fixed"``, every step verifies the whole block.

and prints decode tokens/s (generated tokens after the first / time from the first token to the last), the
ratio to plain, the mean accepted length (accepted drafts + the bonus token per verify step), the mean
verification length, and whether the greedy output equals plain's. A ratio below 1 is printed as it is.
One run: these machines are noisy, read the ratios, not the absolute rates.

    python bench/speculative.py --model checkpoints/v41-tiny/ [--batch-sizes 1 8] [--max-tokens 64]
        [--prompt-tokens 128] [--text path/to/heldout.txt]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-tiny"
MODES = {"plain": {}, "dspark (scheduler)": {"speculative": "dspark"},
         "dspark (full block)": {"speculative": "dspark", "speculative_cost_table": "fixed"}}


def prompts(tokenizer, vocab_size: int, count: int, length: int, text: Path | None, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids: evenly spaced slices of the text when given, else random ids."""
    import random

    if text is not None and tokenizer is not None:
        ids = tokenizer.encode(text.read_text(encoding="utf-8"), add_special_tokens=False).ids
        if len(ids) < length + count:
            ids = ids * ((length + count) // max(1, len(ids)) + 1)
        step = (len(ids) - length) // count
        return [ids[i * step: i * step + length] for i in range(count)]
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def decode_rate(outputs) -> float:
    """Generated tokens after each request's first, per second from the first first-token to the last finish."""
    generated = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    start = min(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.finished_time for o in outputs)
    return generated / max(end - start, 1e-9)


def run(model: Path, batch: list[list[int]], max_tokens: int, engine_args: dict):
    """One engine: a warm-up request, then the batch; returns (outputs, engine stats)."""
    from deepseek_v41.engine import LLM, SamplingParams

    # fp32 as the README's table: in the checkpoint's bf16 (LLM's default) the batched verify forward rounds
    # differently from plain decoding, so greedy tokens may differ
    llm = LLM(model, dtype="float32", max_num_seqs=max(8, len(batch)), **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate({"prompt_token_ids": batch[0]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    before = dict(llm.stats)
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    stats = llm.stats
    if "spec_decode_num_drafts" in stats:  # counters of the batch only (the warm-up ran first)
        drafts = stats["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        accepted = stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        verified = stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        stats = {**stats, "mean_accepted_length": 1 + accepted / max(1, drafts),
                 "mean_verify_length": verified / max(1, drafts)}
    return outputs, stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--text", type=Path, default=None, help="held-out text to take prompts from")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: no model at {args.model} (config.json missing)", file=sys.stderr)
        return 2
    import torch

    from deepseek_v41.engine import LLM

    torch.manual_seed(args.seed)
    probe = LLM(args.model, max_num_seqs=1)
    if probe.engine.model.mtp is None:
        print(f"error: {args.model} has no DSpark draft (num_nextn_predict_layers = 0)", file=sys.stderr)
        return 2
    all_prompts = prompts(probe.tokenizer, probe.engine.config.vocab_size, max(args.batch_sizes),
                          args.prompt_tokens, args.text, args.seed)
    del probe
    print(f"model {args.model}, prompts of {args.prompt_tokens} tokens, {args.max_tokens} greedy tokens each, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5}  {'mode':<20} {'decode tok/s':>12} {'ratio':>6} {'accepted len':>12} {'verify len':>10}"
          f"  same output")
    for size in args.batch_sizes:
        batch = all_prompts[:size]
        plain = None
        for mode, engine_args in MODES.items():
            started = time.perf_counter()
            outputs, stats = run(args.model, batch, args.max_tokens, engine_args)
            rate = decode_rate(outputs)
            tokens = [o.outputs[0].token_ids for o in outputs]
            if plain is None:
                plain = (rate, tokens)
            accepted = f"{stats['mean_accepted_length']:.2f}" if "mean_accepted_length" in stats else "-"
            verify = f"{stats['mean_verify_length']:.2f}" if "mean_verify_length" in stats else "-"
            print(f"{size:>5}  {mode:<20} {rate:>12.1f} {rate / plain[0]:>6.2f} {accepted:>12} {verify:>10}"
                  f"  {'yes' if tokens == plain[1] else 'NO'}   ({time.perf_counter() - started:.1f} s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
