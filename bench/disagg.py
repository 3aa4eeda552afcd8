"""Prefill / decode disaggregation (1P1D) against one colocated server (issue 29): ``python bench/disagg.py``.

Two setups serve the bundled checkpoint, every process a ``dsv41`` subprocess on a free port of 127.0.0.1 with
``--threads 1`` and ``OMP_NUM_THREADS=1``, each server with its own cache directory under one temporary directory:

- ``colocated``: one ``dsv41 serve`` (prefill and decode in the same engine);
- ``1P1D``: a prefill server (``kv_role: kv_producer``: encoder-only load, answers prefill-only), a decode server
  (``kv_role: kv_consumer``: reads the pages, replays at most one window) sharing a ``SharedStorageConnector``
  directory, and ``dsv41 router --prefill URL --decode URL`` in front, the one URL the clients use.

Traffic: long shared-prefix multi-turn agent conversations. In each measurement ``--clients`` concurrent clients
each hold one conversation of ``--turns`` turns: a system prompt of about ``--prefix-words`` words shared by every
client (new text every round, so every round starts cold), the client's own task, and then per turn the assistant's
previous answer with a ``read_file`` tool call and that call's tool result (``--tool-words`` words: a few hundred
tokens) appended to the previous context; each turn asks for ``--max-tokens`` tokens (greedy, EOS ignored) through
streaming chat completions (``stream_options.include_usage``). Per request the client records the time to the first
token (TTFT) and the gaps between tokens (ITL), from the arrival times of the SSE chunks: with
``continuous_usage_stats`` every chunk says how many tokens exist so far, and a chunk's gap is shared among the
tokens it brings (more than one when the chat stream held text back); ``usage`` gives prompt and cached tokens. From
the servers' ``/metrics`` (deltas over the measurement): KV bytes and prompt tokens the decode server received (their
quotient is the KV bytes per prompt token, to compare with ``dsv41 report``), the tokens it replayed, and the
router's mean prefill / decode stage times.

``--pin`` pins the prefill server to the first CPU and the decode server and the router to the others (an
approximation of separate machines that leaves the clients and the colocated server free).

Rounds alternate the setups (colocated first in even rounds, 1P1D first in odd ones), each round once quiet and once
beside a busy neighbour (a CPU spinner in its own session, stopped while the quiet measurements run, as in
``bench/parallel.py``). Printed: every round's values, medians over the rounds, and 1P1D / colocated ratios (the
median of the per-round ratios, [min-max]). Written: ``--json`` (every request's timings, every round's values,
medians, ratios), ``--log`` (what the terminal showed), ``--plot`` (TTFT and ITL CDFs, output tokens/s bars).

    python bench/disagg.py [--rounds 5] [--clients 8] [--turns 5] [--max-tokens 48] [--no-busy] [--quick]

On this machine (2 CPU cores shared by every process) the setups do not get what a real deployment gives them: see
bench/README.md for what the numbers can and cannot show. Every process this script starts is killed and reaped
when it ends, also on Ctrl-C, SIGTERM or an error (and dies with it if it is killed: ``PR_SET_PDEATHSIG``).
Source: issue 29 ("Must show"); the metric names of vLLM's ``benchmarks/benchmark_serving.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from parallel import running, spinners  # noqa: E402 (bench/parallel.py: the busy neighbour)
from serve import percentile, record_tokens  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "checkpoints" / "v41-tiny"
SETUPS = ("colocated", "1P1D")
SUMMARY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens_per_s")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Log:
    """Progress lines on stderr and in the log file; the result table on stdout and in the log file."""

    def __init__(self, path: Path):
        self.file = open(path, "w")  # noqa: SIM115 (closed by close())

    def progress(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def result(self, line: str) -> None:
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def free_port() -> int:
    """A port of 127.0.0.1 nobody listens on now (bind port 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when this script dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so that not even
    a SIGKILL of the benchmark leaves a server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class Fleet:
    """The subprocesses of a run: each in a session (process group) of its own, its output in ``dir/NAME.log``.
    :meth:`close` stops every group (SIGTERM, then SIGKILL after ``grace`` s) and reaps every process."""

    def __init__(self, log_dir: Path, progress):
        self.log_dir, self.progress = log_dir, progress
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], cpus: set[int] | None = None) -> None:
        """Start ``argv`` as ``name``; ``cpus``: the CPUs it (and every thread it makes) may run on."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

        def setup() -> None:
            _die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(self.log_dir / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                                start_new_session=True, preexec_fn=setup)
        pinned = f" on CPU {sorted(cpus)}" if cpus else ""
        self.progress(f"started {name}: pid {self.procs[name].pid}{pinned}")

    def log_tail(self, name: str, lines: int = 25) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_healthy(self, urls: dict[str, str], timeout_s: float) -> None:
        """Until every ``name -> base URL`` answers GET /health with 200; RuntimeError (with the log's end) when a
        process exits or ``timeout_s`` passes."""
        import httpx

        deadline = time.monotonic() + timeout_s
        waiting = dict(urls)
        while waiting:
            for name, url in list(waiting.items()):
                code = self.procs[name].poll()
                if code is not None:
                    raise RuntimeError(f"{name} exited with status {code} while starting; its log:\n"
                                       f"{self.log_tail(name)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        del waiting[name]
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {', '.join(waiting)}; the log of "
                                   f"{next(iter(waiting))}:\n{self.log_tail(next(iter(waiting)))}")
            time.sleep(0.2)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with status {proc.returncode}; its log:\n{self.log_tail(name)}")

    def close(self, grace: float = 10.0) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):  # the group's stragglers, and a leader that hung
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_argv(args, port: int, cache_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "deepseek_v41.cli", "serve", str(args.model), "--host", "127.0.0.1", "--port",
            str(port), "--threads", "1", "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--cache-dir", str(cache_dir), "--served-model-name", "bench", "--log-stats-interval", "0",
            "--uvicorn-log-level", "warning", "--drain-timeout", "1", *extra]


def start_setups(fleet: Fleet, args, tmp: Path) -> dict[str, dict[str, str]]:
    """Start the colocated server, the prefill and decode servers and the router; returns each setup's URLs:
    ``{"colocated": {"client": url, "colocated": url}, "1P1D": {"client": router, "prefill": .., "decode": ..,
    "router": ..}}`` (each setup's server URLs by process name; "client" is where requests go)."""
    ports = {name: free_port() for name in ("colocated", "prefill", "decode", "router")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    storage = tmp / "shared-kv"

    def kv(role: str) -> list[str]:
        return ["--kv-transfer-config", json.dumps({
            "kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}})]

    fleet.start("colocated", serve_argv(args, ports["colocated"], tmp / "cache-colocated", []))
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin and len(cpus) >= 2
    fleet.start("prefill", serve_argv(args, ports["prefill"], tmp / "cache-prefill", kv("kv_producer")),
                {cpus[0]} if pin else None)
    fleet.start("decode", serve_argv(args, ports["decode"], tmp / "cache-decode", kv("kv_consumer")),
                set(cpus[1:]) if pin else None)
    fleet.wait_healthy({name: url[name] for name in ("colocated", "prefill", "decode")}, args.start_timeout)
    fleet.start("router", [sys.executable, "-m", "deepseek_v41.cli", "router", "--prefill", url["prefill"],
                           "--decode", url["decode"], "--host", "127.0.0.1", "--port", str(ports["router"]),
                           "--health-interval-s", "1", "--log-level", "warning"], set(cpus[1:]) if pin else None)
    fleet.wait_healthy({"router": url["router"]}, args.start_timeout)
    return {"colocated": {"client": url["colocated"], "colocated": url["colocated"]},
            "1P1D": {"client": url["router"], "prefill": url["prefill"], "decode": url["decode"],
                     "router": url["router"]}}


def scrape(url: str) -> dict[str, float]:
    """The samples of ``url``/metrics summed over ``model_name``: ``name`` or ``name{label=value,...}`` -> value."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        pairs = sorted((k, v) for k, v in _LABEL.findall(labels or "") if k != "model_name")
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in pairs) + "}" if pairs else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def scrape_all(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    return {name: scrape(url) for name, url in urls.items() if name != "client"}


def server_counters(before: dict, after: dict, setup: str) -> dict[str, float]:
    """The measurement's server-side counts (deltas of /metrics): see the module docstring."""
    def delta(server: str, key: str) -> float:
        return after[server].get(key, 0.0) - before[server].get(key, 0.0)

    if setup == "colocated":
        return {"replayed_tokens": delta("colocated", "dsv41:prompt_tokens_replayed_total"),
                "server_cached_tokens": delta("colocated", "dsv41:prompt_tokens_cached_total")}
    received = "{direction=received}"
    out = {"kv_received_bytes": delta("decode", "dsv41:kv_transfer_bytes_total" + received),
           "kv_received_prompt_tokens": delta("decode", "dsv41:kv_transfer_prompt_tokens_total" + received),
           "kv_received_pages": delta("decode", "dsv41:kv_transfer_pages_total" + received),
           "kv_received_seconds": delta("decode", "dsv41:kv_transfer_seconds_total" + received),
           "kv_sent_bytes": delta("prefill", "dsv41:kv_transfer_bytes_total{direction=sent}"),
           "kv_sent_seconds": delta("prefill", "dsv41:kv_transfer_seconds_total{direction=sent}"),
           "prefill_server_cached_tokens": delta("prefill", "dsv41:prompt_tokens_cached_total"),
           "prefill_server_prompt_tokens": delta("prefill", "dsv41:prompt_tokens_total"),
           "replayed_tokens": delta("decode", "dsv41:prompt_tokens_replayed_total"),
           "server_cached_tokens": delta("decode", "dsv41:prompt_tokens_cached_total"),
           "router_fallbacks": sum(after["router"].get(k, 0.0) - before["router"].get(k, 0.0)
                                   for k in after["router"] if k.startswith("dsv41:router_fallbacks_total"))}
    for stage in ("prefill", "decode"):
        count = delta("router", f"dsv41:router_stage_seconds_count{{stage={stage}}}")
        seconds = delta("router", f"dsv41:router_stage_seconds_sum{{stage={stage}}}")
        out[f"router_{stage}_stage_mean_ms"] = 1e3 * seconds / count if count else float("nan")
    tokens = out["kv_received_prompt_tokens"]
    out["kv_bytes_per_prompt_token"] = out["kv_received_bytes"] / tokens if tokens else float("nan")
    return out


class Text:
    """Seeded pseudo-text from the words of the repository's README and model cards (real words, so that the
    tokenizer splits them as it splits prose)."""

    def __init__(self):
        words: list[str] = []
        for path in [ROOT / "README.md", *sorted((ROOT / "checkpoints").glob("*/MODEL_CARD.md"))]:
            if path.is_file():
                words += re.findall(r"[A-Za-z][A-Za-z'-]{1,14}", path.read_text(errors="replace"))
        self.words = words or ["the", "cache", "holds", "pages", "of", "tokens", "and", "a", "window"]

    def words_of(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(self.words) for _ in range(n))

    def tool_result(self, rng: random.Random, n: int) -> str:
        """``n`` words as the output of a ``read_file`` call: numbered source-like lines of 8-14 words."""
        lines, made = [], 0
        while made < n:
            k = min(n - made, rng.randint(8, 14))
            lines.append(f"{len(lines) + 1:4d}  {self.words_of(rng, k)}")
            made += k
        return "\n".join(lines)


@dataclass
class Timing:
    """One streamed request as the client saw it: seconds, tokens; ``start`` from the measurement's start."""

    client: int
    turn: int
    start: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def _clean(text: str) -> str:
    """The model's answer as the next turn's assistant content: without the fullwidth bar of special tokens."""
    return text.replace("\uff5c", "|")


async def stream_turn(client, url: str, messages: list[dict], max_tokens: int, timing: Timing, t0: float) -> str:
    """One streaming chat completion; fills ``timing``; returns the answer's text."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    pieces = []
    start = last = time.perf_counter()
    timing.start = start - t0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"{url}: error event {chunk['error']}")
            for choice in chunk["choices"]:
                pieces.append(choice.get("delta", {}).get("content") or "")
            usage = chunk.get("usage")
            if not usage:
                continue
            timing.prompt_tokens = usage["prompt_tokens"]
            timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            new = usage["completion_tokens"] - timing.tokens
            if new > 0:
                last = record_tokens(timing, new, start, last)
    return "".join(pieces)


async def conversation(client, url: str, index: int, args, seed: int, system: str, text: Text, t0: float
                       ) -> list[Timing]:
    """Client ``index``'s agent conversation: ``args.turns`` turns, each appending the last answer, a tool call and
    its result to the context."""
    rng = random.Random(seed * 1000 + index)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Task {index}: {text.words_of(rng, 40)}. Read the files you need "
                                            f"with read_file and fix it."}]
    timings = []
    for turn in range(args.turns):
        timing = Timing(index, turn)
        answer = await stream_turn(client, url, messages, args.max_tokens, timing, t0)
        timings.append(timing)
        call = {"id": f"call_{index}_{turn}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/module_{turn}.py"})}}
        messages += [{"role": "assistant", "content": _clean(answer), "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": text.tool_result(rng, args.tool_words)}]
    return timings


def system_prompt(text: Text, seed: int, words: int) -> str:
    rng = random.Random(seed)
    return (f"You are coding agent {seed}. Tools: read_file(path) returns a file's lines; answer with a plan, "
            f"then call a tool. Project notes follow.\n{text.words_of(rng, words)}")


def measure(urls: dict[str, str], setup: str, args, seed: int, text: Text) -> dict:
    """One measurement of ``setup``: every client's conversation at once; the round's summary and its requests."""
    import httpx

    system = system_prompt(text, seed, args.prefix_words)

    async def run() -> tuple[list[Timing], float]:
        limits = httpx.Limits(max_connections=args.clients + 4)
        async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
            t0 = time.perf_counter()
            per_client = await asyncio.gather(*(conversation(client, urls["client"], i, args, seed, system, text, t0)
                                                for i in range(args.clients)))
            return [t for timings in per_client for t in timings], time.perf_counter() - t0

    before = scrape_all(urls)
    timings, wall = asyncio.run(run())
    after = scrape_all(urls)
    ttft = [t.ttft for t in timings if t.ttft is not None]
    itl = [gap for t in timings for gap in t.itl]
    summary = {"requests": len(timings), "wall_s": wall,
               "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
               "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
               "output_tokens": sum(t.tokens for t in timings),
               "output_tokens_per_s": sum(t.tokens for t in timings) / wall,
               "prompt_tokens": sum(t.prompt_tokens for t in timings),
               "cached_tokens": sum(t.cached_tokens for t in timings),
               **server_counters(before, after, setup)}
    return {"summary": summary, "requests": [_rounded(asdict(t)) for t in timings]}


def _rounded(request: dict) -> dict:
    """A request's times to the microsecond (the JSON keeps every gap of every request)."""
    ttft = request["ttft"]
    return {**request, "start": round(request["start"], 6), "ttft": None if ttft is None else round(ttft, 6),
            "itl": [round(gap, 6) for gap in request["itl"]]}


def warm_up(urls: dict[str, dict[str, str]], text: Text) -> None:
    """One short two-turn conversation per setup (the first requests of a process are slow), not measured."""
    import httpx

    args = argparse.Namespace(turns=2, max_tokens=4, tool_words=20)

    async def run(url: str) -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            await conversation(client, url, 0, args, -1, system_prompt(text, -1, 50), text, time.perf_counter())

    for setup in SETUPS:
        asyncio.run(run(urls[setup]["client"]))


def ratios(rounds: dict, condition: str) -> dict[str, dict[str, float]]:
    """1P1D / colocated per summary key: the median of the per-round ratios and their range."""
    out = {}
    for key in SUMMARY_KEYS:
        values = [d["summary"][key] / c["summary"][key]
                  for c, d in zip(rounds[condition]["colocated"], rounds[condition]["1P1D"], strict=True)
                  if c["summary"][key]]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def medians(rounds: dict, condition: str, setup: str) -> dict[str, float]:
    rows = [r["summary"] for r in rounds[condition][setup]]
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def _cell(value: float) -> str:
    if value != value:  # NaN
        return f"{'-':>10}"
    return f"{value:>10.2f}" if abs(value) < 1000 else f"{value:>10,.0f}"


def report(log: Log, rounds: dict, result: dict, args) -> None:
    keys = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens_per_s", "prompt_tokens",
            "cached_tokens", "replayed_tokens", "kv_received_bytes", "kv_bytes_per_prompt_token",
            "router_prefill_stage_mean_ms", "router_decode_stage_mean_ms", "router_fallbacks")
    short = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "out tok/s", "prompt tok", "cached tok", "replayed",
             "KV bytes", "KV B/tok", "rt prefill", "rt decode", "fallbacks")
    log.result(f"bench/disagg.py on {args.model.name}, {args.dtype}, {os.cpu_count()} CPU cores shared by every "
               f"process (each server and the router: --threads 1, OMP_NUM_THREADS=1); {args.clients} clients x "
               f"{args.turns} turns, shared prefix ~{args.prefix_words} words, tool results ~{args.tool_words} words, "
               f"{args.max_tokens} output tokens per turn; {args.rounds} rounds; load average "
               f"{result['settings']['load_average_start']:.2f} at the start, "
               f"{result['settings']['load_average_end']:.2f} at the end")
    log.result("times in ms (rt = the router's mean stage time); KV = received by the decode server; every round:")
    log.result(f"{'condition':<9} {'setup':<9} {'round':>5} " + " ".join(f"{s:>10}" for s in short))
    for condition, setups in rounds.items():
        for setup, values in setups.items():
            for r, row in enumerate(values):
                cells = " ".join(_cell(row["summary"].get(k, float("nan"))) for k in keys)
                log.result(f"{condition:<9} {setup:<9} {r + 1:>5} {cells}")
    log.result("medians over the rounds:")
    for condition, per_setup in result["medians"].items():
        for setup, row in per_setup.items():
            cells = " ".join(_cell(row.get(k, float("nan"))) for k in keys)
            log.result(f"{condition:<9} {setup:<9} {'med':>5} {cells}")
    log.result("1P1D / colocated (median of the per-round ratios [min-max]; TTFT and ITL: lower is better, "
               "tokens/s: higher is better):")
    for condition, per_key in result["ratios"].items():
        cells = "  ".join(f"{key} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]" for key, v in per_key.items())
        log.result(f"  {condition:<9} {cells}")
    log.result("1P1D per request (medians over the rounds): the router's prefill stage (to the prefill server's "
               "answer) and decode stage (to the decode server's first byte); the prefill server's page writes; the "
               "decode server's page reads, replayed and cached tokens; the prefill server's own prefix-cache hits:")
    for condition, per_setup in result["medians"].items():
        row = per_setup["1P1D"]
        n = row["requests"]
        log.result(f"  {condition:<9} prefill stage {row['router_prefill_stage_mean_ms']:.0f} ms (page writes "
                   f"{1e3 * row['kv_sent_seconds'] / n:.0f} ms), decode stage {row['router_decode_stage_mean_ms']:.0f} "
                   f"ms (page reads {1e3 * row['kv_received_seconds'] / n:.1f} ms, {row['kv_received_pages'] / n:.1f} "
                   f"pages); replayed {row['replayed_tokens'] / n:.0f}, cached {row['cached_tokens'] / n:.0f} of "
                   f"{row['prompt_tokens'] / n:.0f} prompt tokens; prefill server cached "
                   f"{row['prefill_server_cached_tokens'] / n:.0f} (colocated: "
                   f"{per_setup['colocated']['cached_tokens'] / n:.0f})")
    kv = result["kv_bytes_per_prompt_token"]
    log.result(f"KV bytes per prompt token received by the decode server: {kv['measured']:.1f}; dsv41 report "
               f"(global KV, deepseek-v4.1-flash rows, this config): {kv['report']:.1f}")


def plot(rounds: dict, result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"colocated": "#555555", "1P1D": "#4c72b0"}
    for condition, style in zip(rounds, ("-", "--"), strict=False):
        for setup in SETUPS:
            requests = [q for r in rounds[condition][setup] for q in r["requests"]]
            for ax, values in ((axes[0], [1e3 * q["ttft"] for q in requests if q["ttft"] is not None]),
                               (axes[1], [1e3 * g for q in requests for g in q["itl"]])):
                if values:
                    ordered = sorted(values)
                    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], style,
                            color=colors[setup], label=f"{setup}, {condition}")
    axes[1].set_xscale("log")  # ITL spans ~0 (chunks that arrive together) to stalls of hundreds of ms
    for ax, title in ((axes[0], "TTFT (ms)"), (axes[1], "inter-token latency (ms)")):
        ax.set_title(f"{title}, CDF over every round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    names = [f"{setup}\n{condition}" for condition in result["medians"] for setup in SETUPS]
    speeds = [result["medians"][condition][setup]["output_tokens_per_s"] for condition in result["medians"]
              for setup in SETUPS]
    axes[2].bar(names, speeds, color=[colors[s] for _ in result["medians"] for s in SETUPS])
    axes[2].set_title("output tokens/s (median over rounds)")
    fig.suptitle("bench/disagg.py: 1 prefill + 1 decode server + router vs one colocated server (2 shared CPU cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(args, log: Log) -> dict:
    from deepseek_v41.analysis.kv import generations_bytes_per_token
    from deepseek_v41.config import load_config

    text = Text()
    load_start = os.getloadavg()[0]
    log.progress(f"load average at the start: {load_start:.2f} ({os.cpu_count()} CPU cores)")
    with tempfile.TemporaryDirectory(prefix="bench-disagg-") as tmp:
        fleet = Fleet(Path(tmp), log.progress)
        try:
            with spinners(1 if args.busy else 0) as procs:
                start = time.monotonic()
                log.progress(f"starting the colocated server, the prefill and decode servers and the router "
                             f"(logs in {tmp}) ...")
                urls = start_setups(fleet, args, Path(tmp))
                processes = {name: proc.pid for name, proc in fleet.procs.items()}
                processes.update({f"busy neighbour {i}": proc.pid for i, proc in enumerate(procs)})
                if procs:
                    log.progress(f"busy neighbour: pid {procs[0].pid}")
                log.progress(f"all healthy after {time.monotonic() - start:.1f} s; warming up ...")
                warm_up(urls, text)
                conditions = {"quiet": []}
                if args.busy:
                    conditions["busy"] = procs
                rounds: dict = {c: {s: [] for s in SETUPS} for c in conditions}
                for r in range(args.rounds):
                    order = SETUPS if r % 2 == 0 else SETUPS[::-1]
                    for c, (condition, busy) in enumerate(conditions.items()):
                        with running(busy):
                            for setup in order:
                                seed = 1 + 2 * r + c  # new text every round and condition: every round starts cold
                                began = time.monotonic()
                                out = measure(urls[setup], setup, args, seed, text)
                                fleet.check_alive()
                                rounds[condition][setup].append(out)
                                s = out["summary"]
                                log.progress(f"round {r + 1}/{args.rounds} {condition:<5} {setup:<9} "
                                             f"{time.monotonic() - began:5.1f} s: TTFT p50 {s['ttft_p50_ms']:.0f} ms "
                                             f"p99 {s['ttft_p99_ms']:.0f} ms, ITL p50 {s['itl_p50_ms']:.1f} ms p99 "
                                             f"{s['itl_p99_ms']:.1f} ms, {s['output_tokens_per_s']:.1f} tok/s, "
                                             f"cached {s['cached_tokens']} of {s['prompt_tokens']} prompt tokens")
        except Exception:
            for name in fleet.procs:  # before the temporary directory and the servers' logs go
                log.progress(f"--- the end of {name}'s log:\n{fleet.log_tail(name, 10)}")
            raise
        finally:
            fleet.close()
    measured = [row["summary"]["kv_received_bytes"] for c in rounds.values() for row in c["1P1D"]]
    tokens = [row["summary"]["kv_received_prompt_tokens"] for c in rounds.values() for row in c["1P1D"]]
    config = load_config(args.model)
    result = {
        "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "cpu_count": os.cpu_count(), "threads_per_process": 1,
                     "load_average_start": load_start, "load_average_end": os.getloadavg()[0]},
        "processes": processes,  # pid of every process this run started (all ended when it returns)
        "rounds": rounds,
        "medians": {c: {s: medians(rounds, c, s) for s in SETUPS} for c in rounds},
        "ratios": {c: ratios(rounds, c) for c in rounds},
        "kv_bytes_per_prompt_token": {
            "measured": sum(measured) / sum(tokens) if sum(tokens) else float("nan"),
            "report": generations_bytes_per_token(config)["deepseek-v4.1-flash"]},
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", help="weights dtype of every server")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per condition (>= 1)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent conversations")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=48, help="output tokens per turn")
    parser.add_argument("--prefix-words", type=int, default=1200, help="words of the shared system prompt")
    parser.add_argument("--tool-words", type=int, default=250, help="words of each tool result")
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--pin", action="store_true",
                        help="pin the prefill server to the first CPU, the decode server and the router to the others "
                             "(the colocated server and the clients are not pinned)")
    parser.add_argument("--no-busy", dest="busy", action="store_false",
                        help="skip the measurements beside a busy neighbour")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of under a minute: 1 round, 2 clients x 2 turns, short texts")
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds for the servers to start")
    parser.add_argument("--request-timeout", type=float, default=600, help="seconds per request at most")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "disagg.json")
    parser.add_argument("--log", type=Path, default=ROOT / "bench" / "disagg.log")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "disagg.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.clients, args.turns, args.max_tokens = 1, 2, 2, 8
        args.prefix_words, args.tool_words = 200, 60
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there (the bundled checkpoint is checkpoints/v41-tiny)")
    for name in ("rounds", "clients", "turns", "max_tokens", "prefix_words", "tool_words"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    def stop(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through run()'s finally: every process stopped and reaped

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    log = Log(args.log)
    try:
        result = run(args, log)
        report(log, result["rounds"], result, args)
        args.json.write_text(json.dumps(result))  # one line: every gap of every request (~0.5 MB by default)
        plot(result["rounds"], result, args.plot)
        log.progress(f"wrote {args.json}, {args.log}, {args.plot}")
    finally:
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
