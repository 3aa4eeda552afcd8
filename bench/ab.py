"""This tree's engine against another checkout of the project (a baseline commit), paired and alternating.

Both trees run the same measurements of ``bench/engine.py`` (its ``--child`` families: prefill, decode, long, rss)
on one saved bench model, each in its own process with its own code on ``PYTHONPATH``, in turns: round r runs
the baseline first when r is even and this tree first when it is odd, so a drift of the host's speed falls on both
alike. Each measure's ratio is taken per round (this tree over the baseline, inverted for milliseconds, ratios
and memory so that > 1 always means this tree is better) and the medians are printed with their range.

Every run's values of both trees are printed too, with each measure's median per tree, the targets of issue 25
(``ISSUE25_TARGETS``) and, for the decode measures, the memory floor this tree's children measure beside their
timings (``bench/floor.py``); ``--plot`` draws the medians against the targets and floors (PNG).

``--tokens`` first checks that both trees produce the same greedy tokens on the benchmark's workloads (a 1K
prompt at batch 1, eight 1K prompts at batch 8, an 8K prompt in 2K chunks; 64 tokens each) in each dtype; the
run stops with exit status 1 when they differ.

    git worktree add /tmp/base <commit>
    python bench/ab.py --base /tmp/base [--dtype fp32,bf16] [--rounds 5] [--repeat 3] [--only prefill,decode,long]
                       [--tokens] [--save-json ab.json] [--plot ab.png]

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

import floor  # noqa: E402
from engine import FAMILIES, _lower_is_better, make_model_dir, parse_families  # noqa: E402

# Issue 25's targets on bench-8m (2 cores, quiet machine): (dtype, measure) -> value in the measure's unit.
ISSUE25_TARGETS = {("fp32", "decode_b1_tok_s"): 380, ("fp32", "decode_b8_tok_s"): 2000,
                   ("bf16", "decode_b1_tok_s"): 500, ("bf16", "prefill_8k_tok_s"): 10000}

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
    parser.add_argument("--plot", type=Path, default=None, help="also draw both trees' medians, targets and floors")
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
        runs: dict[tuple[str, str], dict[str, list[float]]] = {}  # every run's value per tree
        floors: dict[tuple[str, str], list[dict]] = {}  # this tree's floor measurements
        for r in range(args.rounds):
            order = ("base", "new") if r % 2 == 0 else ("new", "base")
            for dtype in dtypes:
                for family in families:
                    res = {k: _run(trees[k], ["bench/engine.py", "--child", family, "--model-dir", str(model_dir),
                                              "--dtype", dtype, "--repeat", str(args.repeat),
                                              *(["--floor"] if k == "new" else [])], log) for k in order}
                    for key, info in res["new"].pop("_floor", {"measures": {}})["measures"].items():
                        floors.setdefault((dtype, key), []).append(info)
                    res["base"].pop("_floor", None)
                    for key, value in res["new"].items():
                        ratios.setdefault((dtype, key), []).append(_ratio(key, res["base"][key], value))
                        for tree in ("base", "new"):
                            runs.setdefault((dtype, key), {"base": [], "new": []})[tree].append(res[tree][key])
            log(f"round {r + 1}/{args.rounds} done")
    print(f"\nthis tree / {base} (> 1: this tree better), median of {args.rounds} paired rounds [min, max]")
    print(f"{'dtype':5} {'measure':24} {'median':>7} {'min':>6} {'max':>6} {'base':>9} {'new':>9} {'target':>7} "
          f"{'floor':>8} {'x floor':>7}")
    table = {}
    for (dtype, key), values in ratios.items():
        med = statistics.median(values)
        base_med, new_med = (statistics.median(runs[(dtype, key)][t]) for t in ("base", "new"))
        target = ISSUE25_TARGETS.get((dtype, key))
        floor_value = statistics.median(f["floor"] for f in floors[(dtype, key)]) if (dtype, key) in floors else None
        table[f"{dtype}/{key}"] = {"median": med, "min": min(values), "max": max(values), "rounds": values,
                                   "base": runs[(dtype, key)]["base"], "new": runs[(dtype, key)]["new"],
                                   "base_median": base_med, "new_median": new_med, "target": target,
                                   "floor": floor_value, "floor_runs": floors.get((dtype, key))}
        line = (f"{dtype:5} {key:24} {med:7.3f} {min(values):6.3f} {max(values):6.3f} {base_med:9.2f} "
                f"{new_med:9.2f} {target if target else '':>7}")
        if floor_value:
            line += f" {floor_value:8.2f} {floor.times_floor(key, new_med, floor_value):6.2f}x"
        print(line)
    print("\nevery run (base / this tree, in round order):")
    for (dtype, key), both in runs.items():
        print(f"{dtype:5} {key:24} base " + " / ".join(f"{v:.2f}" for v in both["base"]))
        print(f"{'':5} {'':24} new  " + " / ".join(f"{v:.2f}" for v in both["new"]))
    if args.save_json:
        args.save_json.write_text(json.dumps(table, indent=1))
    if args.plot:
        commits = [subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, check=False).stdout.strip() or t.name for t in (base, HERE)]
        plot(table, args.plot, f"bench-8m, {args.rounds} paired rounds: {commits[0]} (before) and {commits[1]}")
    return 0


def plot(table: dict[str, dict], path: Path, title: str) -> None:
    """Per dtype, the tokens/s measures' medians of both trees as bars (log scale), each measure's issue-25
    target as a dash and its memory floor (the decode measures) as a triangle, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({k.split("/")[0] for k in table}, key=["fp32", "bf16"].index)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 5.2), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        keys = [k.split("/")[1] for k in table if k.startswith(dtype + "/") and k.endswith("_tok_s")]
        rows = [table[f"{dtype}/{k}"] for k in keys]
        xs = range(len(keys))
        ax.bar([x - 0.2 for x in xs], [r["base_median"] for r in rows], 0.4, label="before (median)")
        ax.bar([x + 0.2 for x in xs], [r["new_median"] for r in rows], 0.4, label="this tree (median)")
        for x, r in zip(xs, rows, strict=True):
            ax.annotate(f"{r['median']:.2f}x", (x + 0.2, r["new_median"]), textcoords="offset points",
                        xytext=(0, 3), ha="center", fontsize=8)
        targets = [(x, r["target"]) for x, r in zip(xs, rows, strict=True) if r["target"]]
        if targets:
            ax.scatter(*zip(*targets, strict=True), marker="_", s=900, color="red", zorder=3, label="issue 25 target")
        floors = [(x + 0.2, r["floor"]) for x, r in zip(xs, rows, strict=True) if r["floor"]]
        if floors:
            ax.scatter(*zip(*floors, strict=True), marker="v", s=60, color="black", zorder=3,
                       label="memory floor (ceiling on tok/s)")
        ax.set_yscale("log")
        ax.set_xticks(list(xs), keys, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{dtype}", fontsize=10)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
