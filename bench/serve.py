"""Serving benchmark: 1, 8 and 32 concurrent streaming clients against ``dsv41 serve``'s app on loopback.

For each concurrency level every client sends ``--rounds`` streaming completions one after another (token-id
prompts of ``--prompt-len`` tokens, ``--max-tokens`` tokens with EOS ignored); per request the client records
the time to the first token (TTFT) and the gap between consecutive tokens (inter-token latency, ITL), using the
``token_ids`` that each chunk carries. Printed as a table: TTFT p50/p99 (ms), ITL p50/p99 (ms), output tokens/s
(all output tokens over the level's wall time), and the same prompts run through ``LLM.generate`` in the same
process (the offline engine, no HTTP) as the baseline.

    python bench/serve.py --model checkpoints/v41-tiny/ [--clients 1 8 32] [--max-tokens 64] [--prompt-len 64]

The model directory defaults to the bundled checkpoint; a missing directory is an error naming it.
Source: SPEC.md §4.6; vLLM ``benchmarks/benchmark_serving.py`` (the metrics and their names).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-tiny"


@dataclass
class RequestTiming:
    """Client-side timing of one streamed request: TTFT and inter-token gaps in seconds, tokens received."""

    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0


def record_tokens(timing, new: int, start: float, last: float) -> float:
    """``new`` tokens arrived now in a stream started at ``start`` whose previous tokens came at ``last``
    (perf_counter seconds): the first sets ``timing.ttft``, later ones add their gap, spread evenly over the tokens
    of the chunk, to ``timing.itl``. Returns now (the next ``last``). ``timing``: anything with ``ttft``, ``itl``,
    ``tokens`` (:class:`RequestTiming`, bench/disagg.py's ``Timing``)."""
    now = time.perf_counter()
    if timing.ttft is None:
        timing.ttft = now - start
    else:
        timing.itl.extend([(now - last) / new] * new)
    timing.tokens += new
    return now


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(client, url: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True}
    timing = RequestTiming()
    start = last = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            new = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
            if new:
                last = record_tokens(timing, new, start, last)
    return timing


async def run_level(url: str, prompts: list[list[int]], clients: int, rounds: int, max_tokens: int
                    ) -> tuple[list[RequestTiming], float]:
    """``clients`` concurrent clients, ``rounds`` requests each; returns the timings and the wall time."""
    import httpx

    async def client_loop(index: int, client) -> list[RequestTiming]:
        return [await one_request(client, url, prompts[(index * rounds + r) % len(prompts)], max_tokens)
                for r in range(rounds)]

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(client_loop(i, client) for i in range(clients)))
        wall = time.perf_counter() - start
    return [t for per_client in results for t in per_client], wall


def offline_tokens_per_s(llm, prompts: list[list[int]], clients: int, rounds: int, max_tokens: int) -> float:
    """The baseline: the same requests through ``LLM.generate``, ``clients`` at a time (no HTTP)."""
    from deepseek_v41.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    tokens = 0
    for r in range(rounds):
        batch = [{"prompt_token_ids": prompts[(i * rounds + r) % len(prompts)]} for i in range(clients)]
        tokens += sum(len(o.outputs[0].token_ids) for o in llm.generate(batch, params))
    return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory (default: %(default)s)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrency levels")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--dtype", default="float32", help="weights dtype")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        sys.exit(f"error: no model at {args.model} (config.json missing). The bundled checkpoint "
                 f"checkpoints/v41-tiny/ comes from the training issue; pass --model DIR for another model directory.")

    import torch

    from deepseek_v41.engine import LLM
    from deepseek_v41.engine.async_engine import AsyncLLMEngine
    try:
        from deepseek_v41.engine.async_engine import engine_thread
    except ImportError:  # a tree from before issue 25 (a paired run's baseline): the same one thread, set by hand
        from concurrent.futures import ThreadPoolExecutor

        def engine_thread():
            return ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv41-engine")
    from deepseek_v41.server.app import build_app
    from deepseek_v41.server.common import ServerConfig
    from deepseek_v41.server.launch import bound_port, make_server

    top = max(args.clients)
    # As `dsv41 serve` does: the engine is built, stepped and (for the offline baseline) run on one thread.
    thread = engine_thread()
    llm = thread.submit(LLM, args.model, dtype=getattr(torch, args.dtype), device=args.device,
                        max_num_seqs=max(top, 1), max_model_len=args.prompt_len + args.max_tokens + 1).result()
    vocab = llm.engine.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(2 * top * args.rounds)]
    try:
        engine = AsyncLLMEngine(llm.engine, executor=thread)
    except TypeError:  # (the baseline tree's engine makes its own executor: give it this one)
        engine = AsyncLLMEngine(llm.engine)
        engine._executor.shutdown()
        engine._executor = thread
    server = make_server(build_app(engine, ServerConfig(["bench"], log_stats_interval_s=0)), "127.0.0.1", 0, 5,
                         log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            sys.exit("error: the server did not start")
        time.sleep(0.02)
    url = f"http://127.0.0.1:{bound_port(server)}/v1/completions"
    rows = []
    try:
        asyncio.run(run_level(url, prompts[:1], 1, 1, 2))  # warm-up
        for clients in args.clients:
            timings, wall = asyncio.run(run_level(url, prompts, clients, args.rounds, args.max_tokens))
            ttft = [t.ttft for t in timings if t.ttft is not None]
            itl = [gap for t in timings for gap in t.itl]
            rows.append({"clients": clients, "requests": len(timings),
                         "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
                         "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
                         "tokens_per_s": sum(t.tokens for t in timings) / wall})
    finally:
        server.should_exit = True
        thread.join(30)
    offline = engine_thread()  # the server's executor is shut down with it; a new one runs the baseline
    for row in rows:
        row["offline_tokens_per_s"] = offline.submit(offline_tokens_per_s, llm, prompts, row["clients"], args.rounds,
                                                     args.max_tokens).result()
    print(f"model {args.model}  prompt {args.prompt_len} tokens  output {args.max_tokens} tokens  "
          f"rounds {args.rounds}  threads {torch.get_num_threads()}")
    header = ("clients", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "out tok/s",
              "offline tok/s", "server/offline")
    print(" | ".join(f"{h:>13}" for h in header))
    for row in rows:
        ratio = row["tokens_per_s"] / row["offline_tokens_per_s"] if row["offline_tokens_per_s"] else float("nan")
        cells = (row["clients"], row["requests"], row["ttft_p50_ms"], row["ttft_p99_ms"], row["itl_p50_ms"],
                 row["itl_p99_ms"], row["tokens_per_s"], row["offline_tokens_per_s"], ratio)
        print(" | ".join(f"{c:>13}" if isinstance(c, int) else f"{c:>13.2f}" for c in cells))
    return rows


if __name__ == "__main__":
    main()
