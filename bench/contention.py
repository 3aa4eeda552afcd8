"""Speed while other processes share the machine (issue 22): ``python bench/engine.py --contention 1,2``.

Per round, on the bench-8m model of ``bench/engine.py``: a prefill of 1K tokens (``prefill 1024``) and 16
steady-state decode steps at batch 1 and batch 8 after 1K-token prompts, each measured under every condition in
turn (which condition goes first rotates by round): ``quiet``; ``quiet fixed``, quiet with the thread count fixed
at torch's whatever the load (as before kernels/cpu_share.py: the paired cost of adapting); ``busy N``, N pure
CPU spinners, for each N given; ``engine``, a second engine in its own process doing the same work in a loop. The
load processes are started once, before the rounds, and kept stopped (SIGSTOP) except while their condition is
measured: then they run (SIGCONT). Under every condition this engine first works untimed for a settling time, so
that both sides' thread counts have adapted (to the load, or back to a quiet machine) before the timed run. Each
load is started in a session of its own, as a program launched on its own would be (with the kernel's autogroups
the scheduler shares the cores between sessions); a load process leaves when this one is gone.

Prints, per measure and condition, the median over rounds of quiet time / time under the condition (the share of
its quiet speed a run keeps: 1.0 = unaffected, 0.5 = half of it, a fair share of 2 cores beside one busy
process), their range, and the quiet speed in tokens/s; ``ok`` marks the issue's target of at least 0.4 for
``busy 1``, ``busy 2`` and ``engine``. The last row gives the threads the engine ran on under each condition.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine  # noqa: E402 (bench/engine.py: the model, engines and prompts of the benchmark)

TARGET = 0.4  # loaded speed / quiet speed the issue asks for with one or two busy processes
DECODE_STEPS = 16  # timed decode steps per measurement
SETTLE = 0.6  # seconds this engine works untimed under a condition (a load running) before its timed run
# A spinner that leaves when its parent is gone (getppid changes), so no spinner outlives the benchmark.
SPINNER = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def _now() -> float:
    return time.perf_counter()


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    """``engine._ids`` within the model's vocabulary (the bench model's 8192, a test model's fewer)."""
    return [3 + i % (vocab - 3) for i in engine._ids(n, seed)] if vocab < 8192 else engine._ids(n, seed)


class Decoder:
    """An engine holding ``batch`` requests of ``context`` prompt tokens in steady-state decode; :meth:`steps`
    times decode steps of the whole batch. A batch near its last token is replaced (untimed) by a fresh one."""

    def __init__(self, model_dir: Path, dtype: str, batch: int, context: int, budget: int = 256):
        from deepseek_v41.engine import SamplingParams

        self.batch, self.context, self.budget = batch, context, budget
        self.llm = engine._llm(model_dir, dtype, context + budget + 8, batch)
        self.vocab = self.llm.engine.config.vocab_size
        self.params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
        self.left, self.fresh = 0, 0

    def _refill(self, need: int) -> None:
        eng = self.llm.engine
        if self.left >= need + 2:
            return
        for b in range(self.batch):
            eng.abort_request(f"d{self.fresh - 1}-{b}")
        while eng.has_unfinished_requests():  # the aborted ones leave at the next step
            eng.step()
        for b in range(self.batch):
            eng.add_request(f"d{self.fresh}-{b}", _ids(self.context, 1000 * self.fresh + b, self.vocab),
                            self.params)
        self.fresh += 1
        for _ in range(4):  # the prefill step and the first decode steps
            eng.step()
        self.left = self.budget - 4

    def steps(self, n: int) -> float:
        """Seconds for ``n`` decode steps of the whole batch."""
        if n > self.budget - 8:
            raise ValueError(f"at most {self.budget - 8} steps at a time, got {n}")
        self._refill(n)
        eng = self.llm.engine
        start = _now()
        for _ in range(n):
            eng.step()
        self.left -= n
        return _now() - start


class Work:
    """The measured work: a prefill engine and two decoders, warmed up."""

    def __init__(self, model_dir: Path, dtype: str, prefill: int, context: int):
        self.prefill_len = prefill
        self.prefiller = engine._llm(model_dir, dtype, prefill + 8, budget=engine.PREFILL_CHUNK)
        self.decoders = {b: Decoder(model_dir, dtype, b, context) for b in (1, 8)}
        self.runs = 0
        self.prefill()  # warm-up
        for d in self.decoders.values():
            d.steps(4)

    def prefill(self) -> float:
        from deepseek_v41.engine import SamplingParams

        self.runs += 1
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        start = _now()
        ids = _ids(self.prefill_len, self.runs, self.prefiller.engine.config.vocab_size)
        self.prefiller.generate({"prompt_token_ids": ids}, one)
        return _now() - start

    def measures(self) -> dict[str, tuple]:
        """Name -> (timed run, tokens it handles)."""
        return {f"prefill {self.prefill_len}": (self.prefill, self.prefill_len),
                "decode batch 1": (lambda: self.decoders[1].steps(DECODE_STEPS), DECODE_STEPS),
                "decode batch 8": (lambda: self.decoders[8].steps(DECODE_STEPS), 8 * DECODE_STEPS)}


class Load:
    """A stopped load process: ``run()`` lets it go, ``stop()`` stops it again, ``close()`` ends it."""

    def __init__(self, command: list[str], ready: bool = False):
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if ready else None,
                                     start_new_session=True)
        if ready and self.proc.stdout.readline().strip() != b"ready":  # an engine: wait until it is built
            self.close()
            raise RuntimeError(f"{command} did not start")
        self.stop()

    def run(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies once it runs
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def conditions(busy: list[int]) -> list[str]:
    return ["quiet", "quiet fixed", *(f"busy {n}" for n in busy), "engine"]


@contextlib.contextmanager
def _fixed_threads():
    """Engine steps at torch's thread count whatever the machine's load (as before kernels/cpu_share.py)."""
    from deepseek_v41.kernels import cpu_share

    cpu_share.SHARE.threads = lambda ceiling: ceiling
    try:
        yield
    finally:
        del cpu_share.SHARE.threads


def _threads_now() -> int:
    """The threads the last engine step ran on."""
    import torch

    from deepseek_v41.kernels import cpu_share

    ceiling = torch.get_num_threads()
    return 1 if ceiling == 1 else cpu_share.SHARE.threads(ceiling)


def measure(model_dir: Path, dtype: str, busy: list[int], rounds: int, prefill: int = 1024, context: int = 1024
            ) -> tuple[dict[str, dict[str, list[float]]], dict[str, list[float]], dict[str, list[int]]]:
    """Per measure and condition, the per-round ratios quiet time / time under the condition (quiet: 1.0); per
    measure the quiet speeds in tokens/s; per condition the threads the engine chose after each timed run.
    ``busy``: the spinner counts. Every load process is gone when this returns."""
    work = Work(model_dir, dtype, prefill, context)
    names = conditions(busy)
    loads: dict[str, list[Load]] = {}
    ratios = {m: {c: [] for c in names} for m in work.measures()}
    speeds: dict[str, list[float]] = {m: [] for m in work.measures()}
    threads: dict[str, list[int]] = {c: [] for c in names}
    try:
        spinners = [Load([sys.executable, "-c", SPINNER]) for _ in range(max(busy, default=0))]
        loads.update({f"busy {n}": spinners[:n] for n in busy})
        loads["engine"] = [Load([sys.executable, __file__, "--load", str(model_dir), dtype, str(prefill),
                                 str(context)], ready=True)]
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            times: dict[str, dict[str, float]] = {m: {} for m in work.measures()}
            for name in order:
                for load in loads.get(name, []):
                    load.run()
                try:
                    with _fixed_threads() if name == "quiet fixed" else contextlib.nullcontext():
                        for measure_name, (run, _) in work.measures().items():
                            settle_until = _now() + SETTLE
                            while _now() < settle_until:
                                run()
                            times[measure_name][name] = run()
                            threads[name].append(_threads_now())
                finally:
                    for load in loads.get(name, []):
                        load.stop()
            for measure_name, (_, tokens) in work.measures().items():
                quiet = times[measure_name]["quiet"]
                speeds[measure_name].append(tokens / quiet)
                for name in names:
                    ratios[measure_name][name].append(quiet / times[measure_name][name])
            print(f"round {r + 1}/{rounds}", file=sys.stderr)
    finally:
        for group in {id(g): g for g in loads.values()}.values():
            for load in group:
                load.close()
    return ratios, speeds, threads


def table(ratios: dict[str, dict[str, list[float]]], speeds: dict[str, list[float]],
          threads: dict[str, list[int]]) -> list[str]:
    """The printed rows: per measure, its quiet speed and per other condition the median ratio [min-max]; then the
    threads the engine ran on under each condition (the most frequent count)."""
    names = [c for c in next(iter(ratios.values())) if c != "quiet"]
    lines = [f"{'measure':<16}{'quiet tok/s':>12}" + "".join(f"{c:>22}" for c in names)]
    for measure_name, by in ratios.items():
        line = f"{measure_name:<16}{statistics.median(speeds[measure_name]):>12.1f}"
        for c in names:
            values = by[c]
            med = statistics.median(values)
            mark = (" ok" if med >= TARGET else " MISS") if c in ("busy 1", "busy 2", "engine") else ""
            cell = f"{med:.2f} [{min(values):.2f}-{max(values):.2f}]{mark}"
            line += f"{cell:>22}"
        lines.append(line)
    lines.append(f"{'threads':<16}{statistics.mode(threads['quiet']):>12}"
                 + "".join(f"{statistics.mode(threads[c]):>22}" for c in names))
    return lines


def report(model_dir: Path, dtype: str, busy: list[int], rounds: int) -> int:
    """Measure and print the table (bench/engine.py --contention)."""
    ratios, speeds, threads = measure(model_dir, dtype, busy, rounds)
    print(f"bench-8m, {dtype}, {rounds} rounds, {os.cpu_count()} CPUs: loaded speed / quiet speed (median "
          f"[min-max] of the rounds; target >= {TARGET} with 1-2 busy processes and beside a second engine)")
    for line in table(ratios, speeds, threads):
        print(line)
    return 0


def _load_main(model_dir: str, dtype: str, prefill: str, context: str) -> None:
    """A second engine's process: build the work, say ready, run it until the parent is gone."""
    parent = os.getppid()
    work = Work(Path(model_dir), dtype, int(prefill), int(context))
    print("ready", flush=True)
    while os.getppid() == parent:
        for run, _ in work.measures().values():
            run()


if __name__ == "__main__" and sys.argv[1:2] == ["--load"]:
    _load_main(*sys.argv[2:6])
