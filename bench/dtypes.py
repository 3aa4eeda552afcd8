"""bf16 against fp32 on the engine benchmark's model, paired in one process.

Usage: ``python bench/dtypes.py [--model-dir DIR] [--rounds N]``

Times, per round, two engines alternately, one fp32 and one bf16 (which goes first alternates too), on the
"bench-8m" model of ``bench/engine.py``: a 1K-token prefill (``prefill 1024``), an 8K one (``prefill 8192``,
every other round), and 16 steady-state decode steps at batch 1 and batch 8 after 1K-token prompts. Prints, per
measure, the median of the per-round ratios fp32 time / bf16 time (> 1: bf16 faster) and their range. Whole
benchmark processes differ by up to 1.4x on their own on these machines (bench/README.md), more than the two
dtypes differ; pairs in one process do not carry that.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine  # noqa: E402 (bench/engine.py: the model, engines and prompts of the benchmark)

DTYPES = ("fp32", "bf16")
DECODE_STEPS = 16


def _prefill(llm, n: int, seed: int) -> float:
    from deepseek_v41.engine import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": engine._ids(n, seed)}, one)
    return time.perf_counter() - start


def _decoding(model_dir: Path, dtype: str, batch: int, context: int, steps: int):
    """An engine with ``batch`` requests of ``context`` prompt tokens prefilled and a few steps decoded: each of
    the next ``steps`` ``step()`` calls is a steady-state decode step of the whole batch."""
    from deepseek_v41.engine import SamplingParams

    warm = 8
    llm = engine._llm(model_dir, dtype, context + warm + steps + 8, batch)
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 4, ignore_eos=True)
    eng = llm.engine
    for b in range(batch):
        eng.add_request(f"r{b}", engine._ids(context, 100 + b), params)
    for _ in range(warm):
        eng.step()
    return eng


def _steps(eng) -> float:
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        eng.step()
    return (time.perf_counter() - start) / DECODE_STEPS


def measure(model_dir: Path, rounds: int, short: int = 1024, long: int = 8192, context: int = 1024
            ) -> dict[str, list[float]]:
    """Per measure, the per-round ratios fp32 time / bf16 time: prefills of ``short`` and ``long`` tokens (the
    long one every other round), decode steps at batch 1 and 8 after ``context``-token prompts."""
    prefill = {dt: engine._llm(model_dir, dt, long + 8, budget=engine.PREFILL_CHUNK) for dt in DTYPES}
    for llm in prefill.values():
        _prefill(llm, short, 0)  # warm-up
    decoders = {(dt, b): _decoding(model_dir, dt, b, context, DECODE_STEPS * rounds) for dt in DTYPES for b in (1, 8)}
    keys = (f"prefill {short}", f"prefill {long}", "decode batch 1", "decode batch 8")
    ratios: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        order = DTYPES if r % 2 == 0 else DTYPES[::-1]
        times = {dt: _prefill(prefill[dt], short, r + 1) for dt in order}
        ratios[keys[0]].append(times["fp32"] / times["bf16"])
        if r % 2 == 0:
            times = {dt: _prefill(prefill[dt], long, r + 1) for dt in order}
            ratios[keys[1]].append(times["fp32"] / times["bf16"])
        for batch in (1, 8):
            times = {dt: _steps(decoders[dt, batch]) for dt in order}
            ratios[f"decode batch {batch}"].append(times["fp32"] / times["bf16"])
        print(f"round {r + 1}/{rounds}", file=sys.stderr)
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a saved bench model")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of alternating measurements")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.model_dir is None:
        with tempfile.TemporaryDirectory(prefix="dsv41-bench8m-") as tmp:
            ratios = measure(engine.make_model_dir(Path(tmp)), args.rounds)
    else:
        ratios = measure(args.model_dir, args.rounds)
    print(f"bench-8m, bf16 against fp32 in one process, {args.rounds} rounds (fp32 time / bf16 time: > 1 means "
          "bf16 is faster)")
    print(f"{'measure':<18}{'median':>8}{'min':>8}{'max':>8}{'pairs':>7}")
    for key, values in ratios.items():
        print(f"{key:<18}{statistics.median(values):>8.3f}{min(values):>8.3f}{max(values):>8.3f}{len(values):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
