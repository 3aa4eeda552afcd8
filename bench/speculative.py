"""DSpark speculative decoding benchmark: decode tokens/s with DSpark against without (DSPARK.md, SPEC.md §4.4).

For each batch size (default 1 and 8) it builds, in ONE process, three engines over the same weights:

- **plain**: no speculation (the baseline of the ratios);
- **dspark (scheduler)**: ``speculative="dspark"`` with the adaptive scheduler (the default): it measures the
  engine's own plain and speculative steps and runs each step plain or speculative, with the verification
  length, that gives the most expected tokens per second;
- **dspark (full block)**: ``speculative_cost_table="fixed"``, every step verifies the whole block.

Each engine first decodes one warm-up batch, then the arms run ``--rounds`` rounds of the same greedy requests
(prefix caching off, so every round computes the same thing) **in lockstep**: every arm gets the batch, and the
arms take engine steps in turn (the order reversed after each turn) until all are done. An arm's decode time is
the sum of its own steps' wall times from the step that emitted its first token on, so a busy neighbour's
burst slows every arm alike instead of whichever round it fell on (run one after the other, rounds of the same
arm differed by +-15 % on a shared 2-core machine; in lockstep the per-round ratios stay within a few %). It
prints the median decode tokens/s per arm (generated tokens after each request's first / that decode time), the
median of the per-round ratios to plain and their range,
the mean accepted length (accepted drafts + the bonus token per verified draft), the step mix (share of decode
steps that were plain, drafted but verified nothing, or verified ℓ = 1..L drafts), and whether the greedy output
equals plain's in every round. A ratio below 1 is printed as it is. The machines are noisy: read the ratios.

    python bench/speculative.py --model checkpoints/v41-tiny/ [--batch-sizes 1 8] [--max-tokens 128]
        [--prompt-tokens 128] [--rounds 5] [--text path/to/heldout.txt]
"""

from __future__ import annotations

import argparse
import statistics
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


def engine(model: Path, size: int, engine_args: dict, warmup: list[list[int]], max_tokens: int):
    """One engine with room for ``size`` sequences, warmed up on a first batch (its counters include it)."""
    from deepseek_v41.engine import LLM, SamplingParams

    # fp32 as the README's table: in the checkpoint's bf16 (LLM's default) the batched verify forward rounds
    # differently from plain decoding, so greedy tokens may differ
    llm = LLM(model, dtype="float32", max_num_seqs=max(8, size), enable_prefix_caching=False, **engine_args)
    llm.generate([{"prompt_token_ids": p} for p in warmup],
                 SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return llm


def counters_between(before: dict, after: dict) -> dict:
    """The spec_decode counters an engine added between two ``LLM.stats`` snapshots (empty without DSpark)."""
    counters = {}
    if "spec_decode_num_drafts" in after:
        for key in ("num_drafts", "num_accepted_tokens", "num_draft_tokens", "num_plain_steps"):
            counters[key] = after[f"spec_decode_{key}"] - before[f"spec_decode_{key}"]
        counters["verify_lengths"] = [a - b for a, b in zip(after["spec_decode_verify_lengths"],
                                                            before["spec_decode_verify_lengths"], strict=True)]
    return counters


def run_lockstep(llms: dict, batch: list[list[int]], max_tokens: int) -> dict:
    """One round of ``batch`` on every engine of ``llms`` (name -> LLM) in lockstep (module docstring): per name
    (decode tokens/s, token ids per request, spec counters of the round)."""
    from deepseek_v41.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = {name: llm.stats for name, llm in llms.items()}
    ids = {}
    for name, llm in llms.items():
        ids[name] = [f"bench-{next(llm._ids)}" for _ in batch]
        for rid, prompt in zip(ids[name], batch, strict=True):
            llm.engine.add_request(rid, prompt, params)
    seconds = dict.fromkeys(llms, 0.0)
    decoding = dict.fromkeys(llms, False)
    done: dict[str, dict] = {name: {} for name in llms}
    order = list(llms)
    while any(len(done[name]) < len(batch) for name in llms):
        for name in order:
            engine = llms[name].engine
            if len(done[name]) == len(batch):
                continue
            started = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - started
            if decoding[name]:
                seconds[name] += elapsed
            for out in outputs:
                decoding[name] |= bool(out.outputs[0].token_ids)
                if out.finished:
                    done[name][out.request_id] = out
                    engine.release(out.request_id)
        order.reverse()
    results = {}
    for name, llm in llms.items():
        outs = [done[name][rid] for rid in ids[name]]
        generated = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        results[name] = (generated / max(seconds[name], 1e-9), [o.outputs[0].token_ids for o in outs],
                         counters_between(before[name], llm.stats))
    return results


def step_mix(counters: dict) -> str:
    """Shares of decode steps: plain (no draft), drafted but nothing verified (0d), then each ℓ >= 1."""
    lengths = counters["verify_lengths"]
    total = max(1, sum(lengths))
    plain = counters["num_plain_steps"]
    parts = [f"plain {plain / total:.0%}", f"0d {(lengths[0] - plain) / total:.0%}"]
    parts += [f"{ell}:{n / total:.0%}" for ell, n in enumerate(lengths) if ell and n]
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="rounds, every arm in lockstep (medians are printed)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--text", type=Path, default=None, help="held-out text to take prompts from")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bad = [f"--{name.replace('_', '-')} {value}" for name, value in (("rounds", args.rounds),
           ("max_tokens", args.max_tokens), ("prompt_tokens", args.prompt_tokens)) if value < 1]
    bad += [f"--batch-sizes {size}" for size in args.batch_sizes if size < 1]
    if bad:
        print(f"error: {', '.join(bad)}: must be >= 1", file=sys.stderr)
        return 2
    if args.text is not None and not (args.text.is_file() and args.text.stat().st_size > 0):
        print(f"error: --text {args.text}: not a non-empty file (held-out text, e.g. data/corpus/heldout.txt from "
              f"`dsv41 data prepare --out data/corpus`; without --text the prompts are random ids)", file=sys.stderr)
        return 2
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
          f"{args.rounds} rounds in lockstep, medians; torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5}  {'mode':<20} {'decode tok/s':>12} {'ratio':>6} {'ratio range':>11} {'accepted len':>12}  "
          f"same output  step mix")
    for size in args.batch_sizes:
        batch = all_prompts[:size]
        engines = {mode: engine(args.model, size, engine_args, batch, args.max_tokens)
                   for mode, engine_args in MODES.items()}
        modes = list(MODES)
        rates = {mode: [] for mode in modes}
        ratios = {mode: [] for mode in modes}
        same = dict.fromkeys(modes, True)
        totals = {mode: {} for mode in modes}
        for _ in range(args.rounds):
            results = run_lockstep(engines, batch, args.max_tokens)
            for mode in modes:
                rate, tokens, counters = results[mode]
                rates[mode].append(rate)
                ratios[mode].append(rate / results["plain"][0])
                same[mode] &= tokens == results["plain"][1]
                for key, value in counters.items():
                    if isinstance(value, list):
                        old = totals[mode].get(key, [0] * len(value))
                        totals[mode][key] = [a + b for a, b in zip(old, value, strict=True)]
                    else:
                        totals[mode][key] = totals[mode].get(key, 0) + value
        for mode in modes:
            counters = totals[mode]
            accepted = (f"{1 + counters['num_accepted_tokens'] / counters['num_drafts']:.2f}"
                        if counters.get("num_drafts") else "-")
            mix = step_mix(counters) if counters else "-"
            spread = f"{min(ratios[mode]):.2f}-{max(ratios[mode]):.2f}"
            print(f"{size:>5}  {mode:<20} {statistics.median(rates[mode]):>12.1f} "
                  f"{statistics.median(ratios[mode]):>6.2f} {spread:>11} {accepted:>12}  "
                  f"{'yes' if same[mode] else 'NO':<11}  {mix}", flush=True)
        del engines
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
