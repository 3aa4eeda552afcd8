"""Tensor and expert parallelism on this machine (issue 28): ``python bench/parallel.py``.

For each layout — ``tp1`` (one process, the baseline measured in the same run), ``tp2`` (tensor parallel over 2
processes, gloo), ``ep2`` (experts split over 2 processes, attention replicated), ``tp2ep`` (both) and
``tp2-whole-engram`` (``tp2`` with the Engram tables whole on every rank instead of split by rows: the measured
side of that choice) — one ``LLM`` is built on the bundled checkpoint, in a process of its own, and kept for the
whole run; the rounds then alternate between the layouts (which goes first rotates) so that every layout meets
the same machine. Per round and layout:

- ``prefill``: one prompt of ``--prompt-len`` tokens (prefix caching off), tokens/s of the prompt;
- ``decode bB``: B requests of ``--context`` prompt tokens in steady-state decode, ``--steps`` timed engine steps,
  tokens/s (B tokens a step), and the bytes rank 0 handed to the collectives per decode step (its
  ``ParallelState`` counters), beside the figure ``dsv41 report --tensor-parallel-size`` plans for that batch
  (:func:`deepseek_v41.analysis.parallel.parallel_plan`, the model sharded on meta).

``--busy 1`` repeats every measurement beside one busy process (a CPU spinner in its own session, stopped while
quiet rounds run), printing loaded / quiet speed per layout.

Prints medians over rounds (and every round's values with ``--verbose``), each layout's speed over ``tp1``'s, and
writes a bar chart (``--plot``, default ``bench/parallel.png``). On a 2-core machine parallelism is slower: the
ranks split the same two cores that one process uses whole, and every layer adds collectives (gloo over loopback
TCP) that one process does not pay; what the layouts buy is memory per rank (``dsv41 report``), which a tiny
checkpoint does not need. See bench/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "checkpoints" / "v41-tiny"
LAYOUTS = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "ep2": {"expert_parallel_size": 2},
    "tp2ep": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "tp2-whole-engram": {"tensor_parallel_size": 2, "shard_engram": False},
}
SPINNER = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def build(model: Path, layout: str, dtype: str, max_len: int, batch: int):
    """The ``LLM`` of ``layout`` (prefix caching off, room for ``batch`` sequences of ``max_len`` tokens)."""
    from deepseek_v41.engine import LLM

    return LLM(str(model), dtype=dtype, max_model_len=max_len, max_num_seqs=batch, enable_prefix_caching=False,
               max_num_batched_tokens=max_len, **LAYOUTS[layout])


def ids(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` prompt token ids in [3, vocab) from ``seed`` (no special ids)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def prefill_speed(llm, prompt_len: int, seed: int) -> float:
    """Tokens/s of one prompt's prefill (to its first token)."""
    from deepseek_v41.engine import SamplingParams

    engine = llm.engine
    prompt = ids(prompt_len, seed, engine.config.vocab_size)
    rid = f"prefill-{seed}-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    engine.release(rid)
    return prompt_len / elapsed


def decode_speed(llm, batch: int, context: int, steps: int, seed: int) -> tuple[float, float]:
    """(tokens/s, bytes rank 0 handed to collectives per step) of ``steps`` decode steps of ``batch`` requests of
    ``context`` prompt tokens (their prefill untimed; every request decodes through the timed steps: their
    ``max_tokens`` leaves room for the tokens the first ones make while the last ones still prefill)."""
    from deepseek_v41.engine import SamplingParams

    engine = llm.engine
    vocab = engine.config.vocab_size
    rids = [f"decode-{seed}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for i, rid in enumerate(rids):
        engine.add_request(rid, ids(context, seed * 1000 + i, vocab),
                           SamplingParams(temperature=0, max_tokens=context + steps + 2, ignore_eos=True))
    seqs = [engine.requests[rid][0] for rid in rids]
    while any(not s.output_token_ids for s in seqs):  # prefill (and the first token), untimed
        engine.step()
    state = getattr(llm.model, "parallel_state", None)
    if state is not None:
        state.reset_counts()
    made = sum(len(s.output_token_ids) for s in seqs)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    made = sum(len(s.output_token_ids) for s in seqs) - made
    if made != batch * steps:
        raise RuntimeError(f"decode b{batch}: {made} tokens in {steps} steps, expected {batch * steps}")
    moved = sum(state.comm_bytes.values()) / steps if state is not None else 0.0
    for rid in rids:
        engine.abort_request(rid)
        engine.release(rid)
    return made / elapsed, moved


def planned_bytes(model: Path, layout: str, dtype: str, batches: list[int]) -> dict[int, tuple[int, int]]:
    """``dsv41 report``'s decode-step (bytes, collective calls) of ``layout`` per batch (0s for one process)."""
    import torch

    from deepseek_v41.analysis.parallel import parallel_plan
    from deepseek_v41.config import load_config
    from deepseek_v41.distributed.config import ParallelConfig

    config = ParallelConfig(**LAYOUTS[layout], distributed_executor_backend="mp")
    if config.world_size == 1:
        return dict.fromkeys(batches, (0, 0))
    plan = parallel_plan(load_config(model), config, dtype=getattr(torch, dtype), batches=tuple(batches),
                         model_path=model)
    return {b: (plan["decode_step_comm"][b]["total"], sum(plan["decode_step_comm"][b]["calls"].values()))
            for b in batches}


def _latency_rank(rank: int, port: int, sizes: list[int], out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for n in sizes:
        t = torch.zeros(n // 4)
        for _ in range(20):
            dist.all_reduce(t)
        start = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(t)
        times[n] = (time.perf_counter() - start) / 200
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def collective_latency(sizes: list[int]) -> dict[str, float]:
    """Seconds one gloo all-reduce of each size (bytes, fp32) takes between 2 processes on 127.0.0.1 here: the
    price of each of a parallel step's collectives."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "latency.json")
        mp.spawn(_latency_rank, args=(port, sizes, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


@contextlib.contextmanager
def spinners(count: int):
    """``count`` busy processes, each in a session of its own, stopped until :func:`running` lets them run; they
    leave when this process is gone."""
    procs = [subprocess.Popen([sys.executable, "-c", SPINNER], start_new_session=True) for _ in range(count)]
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


@contextlib.contextmanager
def running(procs: list, settle: float = 0.3):
    for p in procs:
        p.send_signal(signal.SIGCONT)
    time.sleep(settle if procs else 0)
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGSTOP)


class Child:
    """One layout's ``LLM`` in a process of its own (one process holds one torch.distributed world, so each
    parallel layout needs its own driver process), answering JSON commands on stdin with JSON lines on stdout."""

    def __init__(self, layout: str, args):
        command = [sys.executable, __file__, "--child", layout, "--model", str(args.model), "--dtype", args.dtype,
                   "--max-len", str(max(args.prompt_len, args.context + args.steps + 4) + 8),
                   "--max-seqs", str(max(args.batch))]
        self.layout = layout
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ask({"what": "ready"})

    def ask(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.layout} process ended (exit {self.proc.wait()}); its error is above")
        return json.loads(line)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def child_main(args) -> int:
    """``--child LAYOUT``: build the layout's LLM, then answer commands until stdin closes."""
    llm = build(args.model, args.child, args.dtype, args.max_len, args.max_seqs)
    try:
        for line in sys.stdin:
            c = json.loads(line)
            if c["what"] == "ready":
                out = {"ok": True}
            elif c["what"] == "prefill":
                out = {"speed": prefill_speed(llm, c["prompt_len"], c["seed"])}
            else:
                speed, moved = decode_speed(llm, c["batch"], c["context"], c["steps"], c["seed"])
                out = {"speed": speed, "bytes": moved}
            print(json.dumps(out), flush=True)
    finally:
        llm.shutdown()
    return 0


def measure(children: dict, args, conditions: dict[str, list]) -> dict:
    """Every round's values: results[condition][layout][measure] -> list over rounds."""
    results = {c: {name: {} for name in children} for c in conditions}
    names = list(children)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for condition, procs in conditions.items():
            with running(procs):
                for name in order:
                    row, child = results[condition][name], children[name]
                    speed = child.ask({"what": "prefill", "prompt_len": args.prompt_len, "seed": r})["speed"]
                    row.setdefault("prefill", []).append(speed)
                    for b in args.batch:
                        out = child.ask({"what": "decode", "batch": b, "context": args.context, "steps": args.steps,
                                         "seed": r})
                        row.setdefault(f"decode b{b}", []).append(out["speed"])
                        row.setdefault(f"bytes/step b{b}", []).append(out["bytes"])
            print(f"round {r + 1}/{args.rounds} {condition} done", file=sys.stderr, flush=True)
    return results


def summarize(results: dict, planned: dict, args) -> dict:
    quiet = results["quiet"]
    table = {}
    for name, row in quiet.items():
        out = {}
        for key, values in row.items():
            out[key] = statistics.median(values)
            if not key.startswith("bytes") and "tp1" in quiet:
                out[f"{key} / tp1"] = out[key] / statistics.median(quiet["tp1"][key])
        for b in args.batch:
            out[f"planned bytes/step b{b}"] = planned[name][b][0]
        out["collectives/step"] = planned[name][args.batch[0]][1]
        for condition, rows in results.items():
            if condition == "quiet":
                continue
            for key, values in rows[name].items():
                if not key.startswith("bytes"):
                    out[f"{key} {condition} / quiet"] = statistics.median(values) / out[key]
        table[name] = out
    return table


def plot(table: dict, batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = ["prefill"] + [f"decode b{b}" for b in batches]
    names = list(table)
    fig, axes = plt.subplots(1, len(measures), figsize=(4 * len(measures), 3.5))
    for ax, key in zip(axes, measures, strict=True):
        ax.bar(names, [table[n][key] for n in names], color=["#555"] + ["#4c72b0"] * (len(names) - 1))
        ax.set_title(f"{key} (tokens/s)")
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle("bench/parallel.py: layouts on this machine (tp1 = one process)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from " + ", ".join(LAYOUTS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="also measure beside this many busy processes")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "parallel.png")
    parser.add_argument("--json", type=Path, default=None, help="write every round's values here")
    parser.add_argument("--verbose", action="store_true", help="print every round's values")
    parser.add_argument("--child", choices=list(LAYOUTS), help=argparse.SUPPRESS)  # one layout's process
    parser.add_argument("--max-len", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max-seqs", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there")
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; allowed: {', '.join(LAYOUTS)}")
    children = {}
    try:
        for name in layouts:
            print(f"building {name} ...", file=sys.stderr, flush=True)
            children[name] = Child(name, args)
        planned = {name: planned_bytes(args.model, name, args.dtype, args.batch) for name in layouts}
        with spinners(args.busy) as procs:
            conditions = {"quiet": []}
            if args.busy:
                conditions[f"busy {args.busy}"] = procs
            results = measure(children, args, conditions)
    finally:
        for child in children.values():
            child.close()
    latency = collective_latency([768, 6144, 262144])
    table = summarize(results, planned, args)
    cores = os.cpu_count()
    print(f"bench/parallel.py on {args.model.name}, {args.dtype}, {cores} cores, medians of {args.rounds} rounds "
          f"(prefill {args.prompt_len} tokens; decode after {args.context}-token prompts, {args.steps} steps)")
    keys = list(next(iter(table.values())))
    width = max(len(k) for k in keys)
    print(f"{'':{width}}  " + "  ".join(f"{n:>12}" for n in table))
    for key in keys:
        cells = []
        for name in table:
            value = table[name].get(key)
            cells.append(f"{value:>12,.2f}" if isinstance(value, float) and value < 100 else f"{value:>12,.0f}")
        print(f"{key:{width}}  " + "  ".join(cells))
    print("one gloo all-reduce between 2 processes here: " + ", ".join(
        f"{int(n):,} B {t * 1e6:,.0f} us" for n, t in latency.items()))
    if args.verbose:
        print(json.dumps(results, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds": results, "medians": table, "all_reduce_seconds": latency},
                                        indent=1))
    if args.plot:
        plot(table, args.batch, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
