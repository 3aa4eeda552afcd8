"""Engine benchmark on the "bench-8m" config (issue 10): prefill and decode speed, long-context decode, memory.

Config (random weights, fixed seed): vocab 8192, hidden 256, 8 layers, ratios [0,2,2,2,1,1,1,1], kv sources [1,3,4],
index sources [1,3,4,6], candidate source 4, 4 heads x 64 (rope 16), q rank 128, 2 output groups of rank 128,
16 routed experts top-2 + 1 shared (inter 256), indexer 4 x 32, top-k 64, window 128, pool 32 blocks of 8,
4 mHC streams; no Engram, no DSpark; routed experts stored as packed FP4 (``expert_dtype: fp4``), the rest fp32.

Measured (median of ``--repeat`` runs after a warm-up, prefix caching off, eager):
prefill tokens/s at 1K and 8K prompts; decode tokens/s at batch 1 and 8 with 1K context; decode ms/token at 16K
context over the same at 1K (a ratio); peak RSS of an 8K prefill above the RSS right after imports (a child
process per measurement, so peaks do not mix). Prompts prefill in chunks of 2048 tokens
(``max_num_batched_tokens``, mlx-lm's prefill step too); for decode a batch prefills in one step, so decode
timings hold decode steps only. ``--dtype`` fp32 (default) or bf16. The table prints each number with the issue's
target, and each decode measure with its memory floor (``bench/floor.py``): the bytes a step reads, computed from
the loaded model in the formats the engine reads, over the host's copy bandwidth measured in the same process;
``x floor`` is how many times the measured step time is above it.

``--contention 1,2`` measures instead a 1K prefill and decode at batch 1 and 8 while 1 and then 2 busy processes,
and separately a second engine doing the same work, share the machine, as ratios to the quiet speed measured in
the same rounds (``bench/contention.py``).

``--peers mlx,transformers`` runs the same measurements with ``bench/peers.py`` (mlx-lm's ``deepseek_v41`` on the
same weights, transformers' ``DeepseekV4`` at the closest config; optional extras, never in CI), one peer at a time
in their own processes, and prints each peer's numbers with ``ours / peer`` (> 1 means ours is better; for
milliseconds, the long-context ratio and RSS the quotient is inverted so that > 1 still means better).

    python bench/engine.py [--dtype fp32|bf16] [--repeat 3] [--threads N] [--only prefill,decode,long,rss]
                           [--peers mlx,transformers | --peer-json mlx=FILE ...] [--model-dir DIR]
                           [--plot engine.png] [--save-json results.json] [--contention 1,2 [--rounds 5]]
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

import floor  # bench/floor.py (this script's folder is on sys.path)

FAMILIES = ("prefill", "decode", "long", "rss")
TARGETS = {"prefill_1k_tok_s": 4000, "prefill_8k_tok_s": 3000, "decode_b1_tok_s": 150, "decode_b8_tok_s": 800,
           "decode_16k_over_1k": 1.15, "prefill_8k_peak_rss_gb": 0.5}


def bench_config():
    from deepseek_v41.config import ModelConfig, QuantizationConfig

    return ModelConfig.from_dict(dict(
        model_type="deepseek_v41", vocab_size=8192, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=128, o_groups=2, o_lora_rank=128, moe_intermediate_size=256,
        n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1, compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1],
        kv_source_layer_ids=[1, 3, 4], index_source_layer_ids=[1, 3, 4, 6], candidate_source_layer_id=4,
        index_n_heads=4, index_head_dim=32, index_topk=64, sliding_window=128, candidate_topk_blocks=32,
        candidate_block_size=8, hc_mult=4, max_position_embeddings=32768,
        rope_scaling={"rope_type": "yarn", "factor": 8, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 4096},
    )).replace(quantization_config=QuantizationConfig(expert_dtype="fp4"))


def make_model_dir(path: Path) -> Path:
    """The bench model saved with routed experts in the official packed FP4 format."""
    import torch

    from deepseek_v41.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(bench_config())
    model.save_pretrained(path, quantization="official")
    return path


PREFILL_CHUNK = 2048  # tokens per prefill step (max_num_batched_tokens) in the prefill and rss families


def _llm(model_dir: Path, dtype: str, max_len: int, batch: int = 1, budget: int | None = None):
    """An eager engine, prefix caching off. Its step budget is ``budget`` tokens (chunked prefill), or else
    ``batch`` whole prompts, so that a batch prefills in one step and decodes together (decode timings then hold
    decode steps only)."""
    import torch

    from deepseek_v41.engine import LLM

    return LLM(model_dir, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype], max_model_len=max_len,
               max_num_batched_tokens=budget or batch * max_len, enable_prefix_caching=False, max_num_seqs=8)


def _ids(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def measure(model_dir: Path, what: str, dtype: str, repeat: int, with_floor: bool = False) -> dict[str, float]:
    """One family of measurements in this process; with ``with_floor``, decode measures add their memory floors
    under ``"_floor"`` (:func:`floor.floors`, with the copy bandwidth measured here after the timings)."""
    from deepseek_v41.engine import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out: dict[str, float] = {}
    if what == "prefill":
        for n, key in ((1024, "prefill_1k_tok_s"), (8192, "prefill_8k_tok_s")):
            llm = _llm(model_dir, dtype, n + 8, budget=PREFILL_CHUNK)
            llm.generate({"prompt_token_ids": _ids(n, 0)}, one)  # warm-up
            times = []
            for r in range(repeat):
                start = time.perf_counter()
                llm.generate({"prompt_token_ids": _ids(n, r + 1)}, one)
                times.append(time.perf_counter() - start)
            out[key] = n / statistics.median(times)
    elif what == "decode":
        steps = 64
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        for batch, key in ((1, "decode_b1_tok_s"), (8, "decode_b8_tok_s")):
            llm = _llm(model_dir, dtype, 1024 + steps + 8, batch)
            rates = []
            for r in range(repeat + 1):
                prompts = [{"prompt_token_ids": _ids(1024, 100 * r + b)} for b in range(batch)]
                outs = llm.generate(prompts, params)
                decode = max(o.metrics.finished_time for o in outs) - min(o.metrics.first_token_time for o in outs)
                rates.append(batch * steps / decode)
            out[key] = statistics.median(rates[1:])
            if not with_floor:
                continue
            out.setdefault("_floor", {"measures": {}})["measures"].update(
                floor.floors(llm.model, [key], floor.copy_bandwidth()))
    elif what == "long":
        # The two lengths alternate, so each 16K run has a 1K run beside it in time: the host's speed drifts by up
        # to 2x within minutes, and measuring all of one length first made the ratio follow the drift.
        steps = 64
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        lengths = (1024, 16384)
        llms = {n: _llm(model_dir, dtype, n + steps + 8, budget=PREFILL_CHUNK) for n in lengths}
        for llm in llms.values():
            llm.generate({"prompt_token_ids": _ids(256, 99)}, params)  # warm-up (both lengths alike)
        times: dict[int, list[float]] = {n: [] for n in lengths}
        for r in range(repeat):
            for n in lengths:
                o = llms[n].generate({"prompt_token_ids": _ids(n, r)}, params)[0]
                times[n].append((o.metrics.finished_time - o.metrics.first_token_time) / steps)
        out["decode_ms_1k"], out["decode_ms_16k"] = (statistics.median(times[n]) * 1e3 for n in lengths)
        out["decode_16k_over_1k"] = statistics.median(b / a for a, b in zip(times[1024], times[16384], strict=True))
        if with_floor:
            out["_floor"] = {"measures": floor.floors(llms[1024].model, ["decode_ms_1k", "decode_ms_16k"],
                                                      floor.copy_bandwidth())}
    elif what == "rss":
        import resource

        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        llm = _llm(model_dir, dtype, 8192 + 8, budget=PREFILL_CHUNK)
        llm.generate({"prompt_token_ids": _ids(8192, 0)}, one)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["prefill_8k_peak_rss_gb"] = (peak - base) * 1024 / 1e9
    return out


def parse_families(parser: argparse.ArgumentParser, only: str) -> list[str]:
    """The ``--only`` families, comma-separated; a parser error names the unknown ones and the valid ones."""
    families = only.split(",")
    if unknown := [f for f in families if f not in FAMILIES]:
        parser.error(f"unknown --only families {unknown}; choose from {','.join(FAMILIES)}")
    return families


def _lower_is_better(key: str) -> bool:
    return key.startswith("decode_ms") or "over" in key or "rss" in key


def _run_child(command: list[str], peer: bool = False) -> dict[str, float | None]:
    env = dict(os.environ)
    if peer:  # the peers run with their own defaults, not the spin count deepseek_v41 sets on import
        import deepseek_v41

        if deepseek_v41.GOMP_SPINCOUNT_SET is not None and env.get("GOMP_SPINCOUNT") == deepseek_v41.GOMP_SPINCOUNT_SET:
            del env["GOMP_SPINCOUNT"]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or f"{command} exited {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(results: dict[str, float | None], peers: dict[str, dict[str, float | None]], path: Path,
         title: str, floors: dict[str, dict] | None = None) -> None:
    """Bar chart of ``ours / peer`` per measure (log scale; > 1 means ours is better), with ours / target for the
    measures that have one and, for the decode measures with a memory floor (``floors``, :func:`floor.floors`),
    floor / ours (the share of the floor's speed reached: <= 1, 1 = at the floor) drawn as a marker, written to
    ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in results if results[k]]
    series = {f"vs {name}": [(p.get(k) / results[k] if _lower_is_better(k) else results[k] / p.get(k))
                             if p.get(k) else float("nan") for k in keys] for name, p in peers.items()}
    series["vs target"] = [(TARGETS[k] / results[k] if _lower_is_better(k) else results[k] / TARGETS[k])
                           if k in TARGETS else float("nan") for k in keys]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(keys))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    at_floor = [(x + 0.4 - width / 2, 1 / floor.times_floor(k, results[k], floors[k]["floor"]))
                for x, k in enumerate(keys) if k in (floors or {})]
    if at_floor:
        ax.scatter(*zip(*at_floor, strict=True), marker="v", s=60, color="black", zorder=3,
                   label="vs memory floor (1 = at the floor)")
        for x, share in at_floor:
            ax.annotate(f"{1 / share:.1f}x floor", (x, share), textcoords="offset points", xytext=(8, -3), fontsize=8)
    ax.set_yscale("log")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(keys))], keys, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("ours / other (> 1: ours better)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the bench model's weights")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per measure (the median is printed)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's]")
    parser.add_argument("--only", default=",".join(FAMILIES), help="measurement families, comma-separated: "
                        + ",".join(FAMILIES))
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved bench model")
    parser.add_argument("--peers", default="", help="also run bench/peers.py for these peers (mlx,transformers)")
    parser.add_argument("--peer-json", action="append", default=[], metavar="NAME=FILE",
                        help="a saved bench/peers.py result (its last stdout line) to compare with instead")
    parser.add_argument("--plot", type=Path, default=None, help="also draw ours / peer and ours / target (PNG)")
    parser.add_argument("--save-json", type=Path, default=None, help="also write ours and the peers' numbers")
    parser.add_argument("--contention", default=None, metavar="N[,N...]",
                        help="instead: speed beside N busy processes (and beside a second engine) over quiet speed")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --contention measurements")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--floor", action="store_true", help=argparse.SUPPRESS)  # a child also reports floors
    args = parser.parse_args(argv)
    families = parse_families(parser, args.only)
    busy = parse_contention(parser, args.contention, args.rounds) if args.contention is not None else None
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(measure(args.model_dir, args.child, args.dtype, args.repeat, args.floor)))
        return 0
    if args.model_dir is None:  # a temporary bench model, removed afterwards
        with tempfile.TemporaryDirectory(prefix="dsv41-bench8m-") as tmp:
            args.model_dir = make_model_dir(Path(tmp))
            return _contention(args, busy) if busy is not None else _compare(args, families)
    return _contention(args, busy) if busy is not None else _compare(args, families)


def parse_contention(parser: argparse.ArgumentParser, value: str, rounds: int) -> list[int]:
    """The ``--contention`` counts of busy processes, comma-separated, each >= 1; a parser error otherwise."""
    try:
        busy = [int(v) for v in value.split(",")]
    except ValueError:
        busy = []
    if not busy or min(busy) < 1:
        parser.error(f"--contention takes counts of busy processes >= 1, comma-separated (1,2), got {value!r}")
    if rounds < 1:
        parser.error(f"--rounds must be at least 1, got {rounds}")
    return sorted(set(busy))


def _contention(args: argparse.Namespace, busy: list[int]) -> int:
    import contention

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return contention.report(args.model_dir, args.dtype, busy, args.rounds)


def _compare(args: argparse.Namespace, families: list[str]) -> int:
    """Run our families (and the peers), print the table; see :func:`main`."""
    model_dir = args.model_dir
    common = ["--model-dir", str(model_dir), "--dtype", args.dtype, "--repeat", str(args.repeat)]
    common += ["--threads", str(args.threads)] if args.threads else []
    results: dict[str, float | None] = {}
    floors: dict[str, dict] = {}
    for what in families:
        try:
            measured = _run_child([sys.executable, __file__, "--child", what, "--floor", *common])
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        if "_floor" in measured:
            floors.update(measured.pop("_floor")["measures"])
        results.update(measured)
    peers: dict[str, dict[str, float | None]] = {}
    for item in args.peer_json:
        name, _, file = item.partition("=")
        peers[name] = json.loads(Path(file).read_text().strip().splitlines()[-1])
    for peer in filter(None, args.peers.split(",")):  # one peer at a time, each in its own processes
        try:
            peers[peer] = _run_child([sys.executable, str(Path(__file__).with_name("peers.py")), "--peer", peer,
                                      "--only", args.only, *common], peer=True)
        except RuntimeError as exc:
            print(f"peer {peer} failed: {exc}", file=sys.stderr)
            peers[peer] = {}
    print(f"bench-8m, {args.dtype}, threads={args.threads or 'default'}, median of {args.repeat}"
          + (" (ours / peer: > 1 means ours is better)" if peers else ""))
    header = (f"{'measure':<26}{'ours':>10}{'floor':>10}{'x floor':>9}"
              + "".join(f"{p:>14}{'ours/' + p[:5]:>12}" for p in peers))
    print(header + f"{'target':>10}")
    for key, value in results.items():
        line = f"{key:<26}{value:>10.2f}"
        f = floors.get(key)
        line += f"{f['floor']:>10.2f}{floor.times_floor(key, value, f['floor']):>8.2f}x" if f and value else " " * 19
        for peer in peers.values():
            theirs = peer.get(key)
            if theirs is None or value is None or not value or not theirs:
                line += f"{'n/a':>14}{'':>12}"
            else:
                ratio = theirs / value if _lower_is_better(key) else value / theirs
                line += f"{theirs:>14.2f}{ratio:>11.2f}x"
        target = TARGETS.get(key)
        if target is not None:
            met = value <= target if _lower_is_better(key) else value >= target
            line += f"{target:>10}{' ok' if met else ' MISS'}"
        print(line)
    if floors:
        print("\n".join(floor.breakdown(floors)))
    if args.save_json:
        args.save_json.write_text(json.dumps({"dtype": args.dtype, "ours": results, "peers": peers,
                                              "floor": floors}, indent=1))
    if args.plot:
        plot(results, peers, args.plot, f"bench-8m, {args.dtype}, median of {args.repeat}", floors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
