"""This tree's engine against another checkout of the project (a baseline commit), paired and alternating.

Both trees run the same measurements of ``bench/engine.py`` (its ``--child`` families: prefill, decode, long, rss)
on one saved bench model, each in its own process with its own code on ``PYTHONPATH``, in turns: round r runs
the baseline first when r is even and this tree first when it is odd, so a drift of the host's speed falls on both
alike. Each measure's ratio is taken per round (this tree over the baseline, inverted for milliseconds, ratios
and memory so that > 1 always means this tree is better) and the medians are printed with their range.

``--tokens`` first checks that both trees produce the same greedy tokens on the benchmark's workloads (a 1K
prompt at batch 1, eight 1K prompts at batch 8, an 8K prompt in 2K chunks; 64 tokens each) in each dtype; the
run stops with exit status 1 when they differ.

    git worktree add /tmp/base <commit>
    python bench/ab.py --base /tmp/base [--dtype fp32,bf16] [--rounds 5] [--repeat 3] [--only prefill,decode,long]
                       [--tokens] [--save-json ab.json]

Progress goes to stderr and to ``--log`` (default ``bench-ab.log``), one line per child run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "bench"))

from engine import FAMILIES, _lower_is_better, make_model_dir, parse_families  # noqa: E402

TOKENS_CHILD = r"""
import json, sys
sys.path.insert(0, "bench")
import torch
from engine import _ids, _llm
from deepseek_v41.engine import SamplingParams
model_dir, dtype = sys.argv[1], sys.argv[2]
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
out = {}
for name, batch, n, budget in (("b1_1k", 1, 1024, None), ("b8_1k", 8, 1024, None), ("b1_8k", 1, 8192, 2048)):
    llm = _llm(model_dir, dtype, n + 72, batch, budget)
    prompts = [{"prompt_token_ids": _ids(n, 7 * b + 1)} for b in range(batch)]
    out[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
print(json.dumps(out))
"""


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    return env


def _run(tree: Path, args: list[str], log) -> dict:
    """One child process in ``tree``; its last stdout line is JSON."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=tree, env=_env(tree), capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args[:3])} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    what = "greedy tokens" if args[0] == "-c" else " ".join(a for a in args if not a.startswith("/"))
    log(f"{tree.name}: {what[:60]} {time.perf_counter() - start:.0f}s")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratio(key: str, base: float, new: float) -> float:
    return base / new if _lower_is_better(key) else new / base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the baseline checkout (e.g. a git worktree)")
    parser.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32,bf16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="prefill,decode,long", help="families: " + ",".join(FAMILIES))
    parser.add_argument("--tokens", action="store_true", help="first check the greedy tokens are the same")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved bench model")
    parser.add_argument("--save-json", type=Path, default=None)
    parser.add_argument("--log", type=Path, default=Path("bench-ab.log"))
    args = parser.parse_args(argv)
    families = parse_families(parser, args.only)
    dtypes = args.dtype.split(",")
    if bad := [d for d in dtypes if d not in ("fp32", "bf16")]:
        parser.error(f"unknown --dtype {bad}; choose from fp32,bf16")
    base = args.base.resolve()
    if not (base / "bench" / "engine.py").is_file():
        parser.error(f"--base {base} is not a checkout of this project (no bench/engine.py)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    logfile = args.log.open("a")

    def log(line: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {line}"
        print(line, file=sys.stderr, flush=True)
        logfile.write(line + "\n")
        logfile.flush()

    with tempfile.TemporaryDirectory(prefix="dsv41-ab-") as tmp:
        model_dir = args.model_dir or make_model_dir(Path(tmp))
        trees = {"base": base, "new": HERE}
        if args.tokens:
            for dtype in dtypes:
                got = {k: _run(t, ["-c", TOKENS_CHILD, str(model_dir), dtype], log) for k, t in trees.items()}
                same = got["base"] == got["new"]
                print(f"greedy tokens {dtype}: {'identical' if same else 'DIFFERENT'} "
                      f"({sum(len(s) for v in got['new'].values() for s in v)} tokens)", flush=True)
                if not same:
                    return 1
        ratios: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")
            for dtype in dtypes:
                for family in families:
                    res = {k: _run(trees[k], ["bench/engine.py", "--child", family, "--model-dir", str(model_dir),
                                              "--dtype", dtype, "--repeat", str(args.repeat)], log) for k in order}
                    for key, value in res["new"].items():
                        ratios.setdefault((dtype, key), []).append(_ratio(key, res["base"][key], value))
            log(f"round {r + 1}/{args.rounds} done")
    print(f"\nthis tree / {base} (> 1: this tree better), median of {args.rounds} paired rounds [min, max]")
    print(f"{'dtype':5} {'measure':24} {'median':>7} {'min':>6} {'max':>6}")
    table = {}
    for (dtype, key), values in ratios.items():
        med = statistics.median(values)
        table[f"{dtype}/{key}"] = {"median": med, "min": min(values), "max": max(values), "rounds": values}
        print(f"{dtype:5} {key:24} {med:7.3f} {min(values):6.3f} {max(values):6.3f}")
    if args.save_json:
        args.save_json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
