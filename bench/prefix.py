"""Prefix-cache benchmark: time to first token cold against a hit, for long shared prefixes (SPEC.md §4.3).

For each shared-prefix length (default 2K, 8K, 32K tokens of held-out text, or random ids when no text is given)
it measures in ONE process, on one engine per path, with the prefill chunked at ``--chunk`` tokens:

- **cold**: prefix + suffix on an engine with prefix caching off;
- **hit, bounded replay**: a restarted engine over the same ``cache_dir`` (pages from disk, no snapshot): the
  default path after a restart;
- **hit, snapshot**: the same engine that served the prefix (device pages + SWA snapshot).

and prints TTFT in ms and each hit's ratio to cold (target: bounded-replay hit <= 1/20 of cold at 32K), then the
persistent bytes per token at the official config against V4's accounting (``dsv41 report``'s numbers).

    python bench/prefix.py --model checkpoints/v41-tiny/ [--lengths 2048 8192 32768] [--chunk 2048]
        [--text path/to/heldout.txt]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-tiny"


def prompt_tokens(llm, n: int, text: Path | None, seed: int) -> list[int]:
    """``n`` token ids: from the held-out text when given (cycled), else random ids of the vocabulary."""
    import random

    if text is not None and llm.tokenizer is not None:
        ids = llm.tokenizer.encode(text.read_text(encoding="utf-8"), add_special_tokens=False).ids
        start = random.Random(seed).randrange(max(1, len(ids) - n))
        ids = (ids * (n // max(1, len(ids)) + 2))[start: start + n]
        return ids
    rng = random.Random(seed)
    return [rng.randrange(3, llm.engine.config.vocab_size) for _ in range(n)]


def ttft(llm, prompt: list[int]) -> float:
    """Seconds from submission to the first generated token (one token generated)."""
    from deepseek_v41.engine import SamplingParams

    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (<= 2048 per the issue)")
    parser.add_argument("--suffix", type=int, default=32, help="new tokens after the shared prefix")
    parser.add_argument("--text", type=Path, default=None, help="held-out text to take prompts from")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: no model at {args.model} (train one, or pass --model)", file=sys.stderr)
        return 2

    import torch

    from deepseek_v41.analysis.report import kv_section
    from deepseek_v41.config import flash_config
    from deepseek_v41.engine import LLM

    torch.set_num_threads(1)  # steadier on a shared 2-core machine
    cache_dir = Path(tempfile.mkdtemp(prefix="dsv41-bench-"))
    rows = []
    try:
        for n in args.lengths:
            # fp32 as the README's table (LLM's default dtype is the checkpoint's, bf16 for the bundled one)
            common = dict(dtype="float32", max_model_len=n + args.suffix + 64, max_num_batched_tokens=args.chunk,
                          max_num_seqs=2)
            cold_llm = LLM(args.model, enable_prefix_caching=False, **common)
            prefix = prompt_tokens(cold_llm, n, args.text, seed=n)
            full = prefix + prompt_tokens(cold_llm, args.suffix, None, seed=n + 1)
            ttft(cold_llm, full[: args.chunk])  # warm-up
            cold = ttft(cold_llm, full)
            served = LLM(args.model, cache_dir=str(cache_dir), **common)
            ttft(served, prefix)
            snapshot_hit = ttft(served, full)
            restarted = LLM(args.model, cache_dir=str(cache_dir), swa_pool_bytes=0, **common)
            replay_hit = ttft(restarted, full)
            rows.append((n, cold, replay_hit, snapshot_hit))
            print(f"{n:>7} tokens: cold {cold * 1e3:9.1f} ms | bounded-replay hit {replay_hit * 1e3:8.1f} ms "
                  f"(1/{cold / replay_hit:5.1f}) | snapshot hit {snapshot_hit * 1e3:8.1f} ms "
                  f"(1/{cold / snapshot_hit:5.1f})", flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    kv = kv_section(flash_config())
    ratio = 1 / kv["persistent_ratio_vs_v4"]
    print(f"persistent bytes per token, official config: {kv['persistent_bytes_per_token']:.0f} (global KV only) "
          f"vs V4 {kv['persistent_bytes_per_token_v4']:.1f} (global + window) = 1/{ratio:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
