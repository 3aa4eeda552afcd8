"""One rank of the sharding tests (tests/distributed/test_shard*.py), and the one-process oracle they compare with.

``python shard_worker.py --rank R --port P --layout tp2|ep2|tp2ep|ep4 --out DIR --cases forward,fast,engine,...``
joins the layout's gloo group on 127.0.0.1:P, builds the tiny random model (the same seed as the oracle), shards it and
writes, per case, ``DIR/<case>.rank<R>.json`` (tokens, shapes) and ``DIR/<case>.rank<R>.bin`` (raw float64 logits):
JSON and raw bytes, no pickle. The test process runs :func:`run_case` with one rank for the oracle.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from deepseek_v41.config import tiny_config
from deepseek_v41.distributed.comm import ParallelState, init_distributed
from deepseek_v41.distributed.config import ParallelConfig
from deepseek_v41.distributed.loader import load_sharded
from deepseek_v41.distributed.shard import shard_bytes, shard_model
from deepseek_v41.engine import EngineArgs, LLMEngine, SamplingParams
from deepseek_v41.kernels import fast
from deepseek_v41.model.transformer import Transformer

LAYOUTS = {
    "tp2": ParallelConfig(tensor_parallel_size=2),
    "ep2": ParallelConfig(expert_parallel_size=2),
    "tp2ep": ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True),
}
EXTRA_LAYOUTS = {"ep4": ParallelConfig(expert_parallel_size=4)}  # 4 ranks on the test machine's 2 cores: slow

BUNDLED = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"

# Engine cases: EngineArgs of each (greedy requests below). Small max_num_batched_tokens: chunked prefill.
ENGINE_CASES = {
    "engine_exact": dict(prefill_mode="exact", max_num_batched_tokens=16, block_size=4),
    "engine_ced": dict(prefill_mode="ced", max_num_batched_tokens=16, block_size=4),
    "engine_fp32": dict(prefill_mode="ced", max_num_batched_tokens=16, block_size=4),
    "engine_dspark": dict(prefill_mode="exact", max_num_batched_tokens=16, block_size=4, speculative="dspark",
                          speculative_cost_table="fixed", window_slack_rows=16),
}


def tiny_model(dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> Transformer:
    """The tests' random tiny model (every layer role, a DSpark draft): the same weights in every process."""
    cfg = tiny_config().replace(max_position_embeddings=2048)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg)
    return model.eval().to(dtype)


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 511, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_case(case: str, state: ParallelState) -> tuple[dict, torch.Tensor | None]:
    """Run ``case`` on a model sharded for ``state``; returns (JSON-able result, float64 logits or None)."""
    if case == "forward":  # float64 exact forward of a batch of 2, then with some image positions
        model = shard_model(tiny_model(torch.float64), state)
        ids = torch.tensor([prompt_ids(37, 1), prompt_ids(37, 2)])
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        mask[0, 5:9] = mask[1, 30:] = True
        with torch.no_grad():
            logits, masked = model(ids), model(ids, image_mask=mask)
        return {"argmax": logits.argmax(-1).tolist(), "bytes": shard_bytes(model)}, torch.cat((logits, masked))
    if case == "bf16":  # bf16 weights: sums of bf16 partials (a tolerance, not bits)
        model = shard_model(tiny_model(torch.bfloat16), state)
        with torch.no_grad():
            return {}, model(torch.tensor([prompt_ids(37, 1)]))
    if case == "forward_engram":  # the same, the Engram tables split by rows
        model = shard_model(tiny_model(torch.float64), state, shard_engram=True)
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids(37, 1), prompt_ids(37, 2)]))
        return {"argmax": logits.argmax(-1).tolist(), "bytes": shard_bytes(model)}, logits
    if case == "fast":  # fp32, the fast backend installed, a few-token forward and a longer one in inference mode
        model = tiny_model(torch.float32)
        fast.install(model)
        model = shard_model(model, state)
        out = []
        with torch.inference_mode():
            for n, seed in ((3, 3), (21, 4)):
                out.append(model(torch.tensor([prompt_ids(n, seed)])).double().flatten())
        return {"installed": (fast.installed(model) or fast.Installed()).modules}, torch.cat(out)
    if case in ENGINE_CASES:  # float64 (engine_fp32: fp32, the fast backend's kernels serving decode)
        model = shard_model(tiny_model(torch.float32 if case == "engine_fp32" else torch.float64), state)
        engine = LLMEngine(model, EngineArgs(**ENGINE_CASES[case]))
        prompts = {"a": prompt_ids(29, 5), "b": prompt_ids(11, 6), "c": prompt_ids(29, 5)[:20] + prompt_ids(6, 7)}
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, params)
        tokens: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            steps += 1
        spec = engine.speculator.stats.as_dict() if engine.speculator is not None else {}
        return {"tokens": tokens, "steps": steps, "spec": spec}, None
    if case == "bundled":  # the bundled checkpoint, each rank reading its slices (fp32), DSpark on, CED
        model = load_sharded(BUNDLED, state, torch.float32)
        engine = LLMEngine(model, EngineArgs(block_size=16, max_num_batched_tokens=32, speculative="dspark",
                                             speculative_cost_table="fixed"))
        tokens = {}
        for rid, ids in (("a", prompt_ids(50, 10)), ("b", prompt_ids(23, 11))):
            engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        return {"tokens": tokens, "bytes": shard_bytes(model), "spec": engine.speculator.stats.as_dict()}, None
    if case == "engine_disk":  # KV pages written to this rank's cache_dir, read back by a new engine (replay)
        model = shard_model(tiny_model(torch.float64), state)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        with tempfile.TemporaryDirectory() as cache_dir:
            out = {}
            for name, prompt in (("writer", prompt_ids(40, 8)), ("reader", prompt_ids(40, 8) + prompt_ids(5, 9))):
                engine = LLMEngine(model, EngineArgs(block_size=4, cache_dir=cache_dir, swa_pool_bytes=0,
                                                     replay="exact"))
                engine.add_request(name, prompt, params)
                while engine.has_unfinished_requests():
                    for o in engine.step():
                        out[name] = (list(o.outputs[0].token_ids), o.num_cached_tokens)
                engine.prefix_cache.flush()
        return {"tokens": {k: v[0] for k, v in out.items()}, "cached": {k: v[1] for k, v in out.items()}}, None
    raise ValueError(f"unknown case {case!r}")


WORKER = Path(__file__).with_name("shard_worker.py")
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(layout: str, cases: list[str], out: Path, timeout: float = 120.0) -> list[dict]:
    """Run ``cases`` on the ranks of ``layout`` (one worker process each, killed if they outlive ``timeout``
    seconds); returns each rank's results by case: [{case: (json, float64 array or None)}]."""
    port, world = free_port(), EXTRA_LAYOUTS.get(layout, LAYOUTS.get(layout)).world_size
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--rank", str(r), "--port", str(port), "--layout", layout,
                               "--out", str(out), "--cases", ",".join(cases)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        tails = "\n".join(f"--- rank {r} exited {p.returncode}:\n{logs[r][-2500:] if r < len(logs) else ''}"
                          for r, p in enumerate(procs))
        raise AssertionError(f"{layout} ranks failed:\n{tails}")
    results = []
    for r in range(world):
        ranked = {}
        for case in cases:
            data = json.loads((out / f"{case}.rank{r}.json").read_text())
            raw = out / f"{case}.rank{r}.bin"
            ranked[case] = (data, np.frombuffer(raw.read_bytes(), dtype=np.float64) if raw.exists() else None)
        results.append(ranked)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--layout", choices=sorted({**LAYOUTS, **EXTRA_LAYOUTS}), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = {**LAYOUTS, **EXTRA_LAYOUTS}[args.layout]
    state = init_distributed(config, args.rank, f"tcp://127.0.0.1:{args.port}")
    for case in args.cases.split(","):
        result, logits = run_case(case, state)
        result["comm_calls"] = dict(state.comm_calls)
        state.reset_counts()
        (args.out / f"{case}.rank{args.rank}.json").write_text(json.dumps(result))
        if logits is not None:
            (args.out / f"{case}.rank{args.rank}.bin").write_bytes(logits.detach().double().contiguous().numpy()
                                                                   .tobytes())
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
