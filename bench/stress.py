"""Stress test: concurrent streaming clients that hang up, then a fuzz round, against a ``dsv41 serve`` process.

The server runs as a subprocess on a small KV pool with prefix caching on (``--num-kv-pages 64 --max-model-len
512`` by default), so preemption, eviction of cached pages and prefix hits all happen. Two phases:

1. **load**: ``--clients`` concurrent clients, each sending ``--requests`` streaming requests one after another:
   chat and completions alternately, prompts sharing a few long prefixes (prefix-cache hits) with a random tail,
   some with ``n = 2``; every ``--disconnect-every``-th request hangs up after a few chunks. A request is ``ok``
   when it ends with a finish chunk per choice and ``[DONE]``.
2. **fuzz**: ``--fuzz`` malformed or hostile requests (seeded): valid bodies with one field set to junk, random
   JSON, bytes that are not JSON or not UTF-8, lone surrogates, too many or too long stop strings, huge ``n`` and
   ``max_tokens``, deep nesting, wrong content types, on the generation routes and ``/tokenize`` /
   ``/detokenize``. Any 4xx is fine; a 5xx, a broken connection or a hang is a failure.

Printed per phase: requests, ok, disconnected (on purpose), 4xx, 5xx, failures (everything not ok, not a 4xx in
the fuzz round and not a planned disconnect), hangs (no answer within ``--timeout`` s). Then the KV pages still in
use once every request ended (``dsv41:kv_pages_used`` from ``/metrics``: leaked pages), the server's peak RSS
(``VmHWM``), and whether it is still alive (else its exit status and the end of its log).

    python bench/stress.py [--model checkpoints/v41-tiny] [--clients 32] [--requests 4] [--num-kv-pages 64]

Source: issue 22 ("Must show"); the fuzz strategies of ``tests/server/test_fuzz.py``, as seeded random choices.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "v41-tiny"
MODEL_NAME = "stress"
WORDS = ["the", "city", "is", "Paris", "and", "river", "runs", "north", "past", "old", "stone", "bridges", "while",
         "people", "walk", "to", "work", "in", "morning", "light;", "numbers", "1", "2", "3", "names", "Anna", "Bruno",
         "Chen", "Dara", "follow"]


@dataclass
class Phase:
    """Counts of one phase. ``failures`` excludes planned disconnects and, in the fuzz round, 4xx answers."""

    name: str
    requests: int = 0
    ok: int = 0
    disconnected: int = 0
    client_errors: int = 0  # 4xx
    server_errors: int = 0  # 5xx (status or an error event in a stream)
    failures: int = 0
    hangs: int = 0
    examples: list[str] = field(default_factory=list)  # a few failure descriptions

    def fail(self, what: str) -> None:
        self.failures += 1
        if len(self.examples) < 5:
            self.examples.append(what[:300])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (``VmHWM`` in /proc), MiB; NaN where /proc is not available."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Server:
    """``dsv41 serve`` as a subprocess on a free loopback port, its output in ``log``."""

    def __init__(self, model: Path, workdir: Path, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "serve.log"
        command = [sys.executable, "-m", "deepseek_v41.cli", "serve", "--model", str(model), "--port", str(self.port),
                   "--served-model-name", MODEL_NAME, "--cache-dir", str(workdir / "cache"), "--log-stats-interval",
                   "0", "--log-level", "warning", *extra]
        with open(self.log, "wb") as out:
            # faulthandler: a crash in a C kernel leaves the Python stack in the log.
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONFAULTHANDLER": "1"}
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"dsv41 serve exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"dsv41 serve did not answer /health within {timeout_s:.0f}s:\n{self.tail()}")
            time.sleep(0.2)

    def answers(self) -> bool:
        """Whether the server still answers /health (any status)."""
        import httpx

        try:
            httpx.get(self.url + "/health", timeout=5)
            return True
        except httpx.HTTPError:
            return False

    def tail(self, lines: int = 15) -> str:
        """The end of the log, or from a crash report (faulthandler's, whose first stack is the crashing thread)."""
        text = self.log.read_text(errors="replace").splitlines()
        crash = next((i for i, line in enumerate(text) if line.startswith("Fatal Python error")), None)
        return "\n".join(text[crash:crash + 2 * lines] if crash is not None else text[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def gauge(text: str, name: str) -> float | None:
    """A gauge's value from a /metrics text (the first sample named ``name``)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


# ----------------------------------------------------------------------------------------------- the load phase
def load_body(rng: random.Random, prefixes: list[str], index: int, max_tokens: int) -> tuple[str, dict]:
    """A valid streaming request: a shared prefix plus a random tail; chat or completions; sometimes n = 2."""
    text = rng.choice(prefixes) + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, len(prefixes[0]))))
    body: dict = {"model": MODEL_NAME, "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens),
                  "stream": True, "stream_options": {"include_usage": True}, "temperature": rng.choice([0.0, 0.8]),
                  "ignore_eos": rng.random() < 0.5}
    if body["temperature"] > 0 and rng.random() < 0.3:
        body["n"] = 2
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    if index % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
    return "/v1/completions", {**body, "prompt": text}


async def load_request(client, server: Server, phase: Phase, path: str, body: dict, leave_after: int | None,
                       timeout_s: float) -> None:
    phase.requests += 1
    choices = body.get("n", 1)
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", server.url + path, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    if response.status_code >= 500:
                        phase.server_errors += 1
                    else:
                        phase.client_errors += 1
                    phase.fail(f"{path} {response.status_code}: {text}")
                    return
                events, finishes, errored = 0, 0, False
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events += 1
                    if leave_after is not None and events >= leave_after:
                        phase.disconnected += 1
                        return  # leaving the block closes the connection mid-stream
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        if finishes == choices:
                            phase.ok += 1
                        elif not errored:  # an error event was already counted
                            phase.fail(f"{path}: [DONE] after {finishes} of {choices} finish chunks")
                        return
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        errored = True
                        phase.server_errors += 1
                        phase.fail(f"{path}: error event {chunk['error']}")
                        continue
                    finishes += sum(c.get("finish_reason") is not None for c in chunk.get("choices", []))
                phase.fail(f"{path}: the stream ended without [DONE]")
    except TimeoutError:
        phase.hangs += 1
        phase.fail(f"{path}: no end within {timeout_s:.0f}s")
    except Exception as exc:  # a broken connection, a dead server: counted, and the run goes on
        phase.fail(f"{path}: {type(exc).__name__}: {exc}")


async def run_load(server: Server, args, rng: random.Random) -> Phase:
    import httpx

    phase = Phase("load")
    # Prefixes of 5% to 35% of max_model_len x prompt_scale words, and a tail of up to 5%.
    lengths = [max(1, round(share * args.max_model_len * args.prompt_scale)) for share in (0.05, 0.1, 0.2, 0.35)]
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(length)) for length in lengths]

    async def client_loop(client_index: int, client) -> None:
        local = random.Random(rng.random())
        for r in range(args.requests):
            number = client_index * args.requests + r
            path, body = load_body(local, prefixes, number, args.max_tokens)
            leave = local.randint(2, 6) if args.disconnect_every and number % args.disconnect_every == 0 else None
            await load_request(client, server, phase, path, body, leave, args.timeout)

    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        await asyncio.gather(*(client_loop(i, client) for i in range(args.clients)))
    return phase


# ----------------------------------------------------------------------------------------------- the fuzz phase
JUNK = [None, True, -1, 0, 2**70, -(2**70), 1.5, 1e308, "", "x", "\ud800", [], [1, "a"], {}, {"a": {"b": []}},
        "a" * 5000, [[1]] * 50]
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "stream",
          "stream_options", "tools", "tool_choice", "response_format", "chat_template_kwargs", "reasoning_effort",
          "thinking", "echo", "best_of", "min_tokens", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "suffix", "cache_salt", "return_token_ids", "continue_final_message",
          "add_generation_prompt", "ignore_eos", "unknown_field"]


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(JUNK[:10])
    if kind == 1:
        return rng.randint(-5, 5)
    if kind == 2:
        return "".join(rng.choice("ab \\\"{}\ud7ff\u00e9") for _ in range(rng.randint(0, 8)))
    if kind == 3:
        return rng.random() * 10 ** rng.randint(-3, 3)
    if kind == 4:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(FIELDS): random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def fuzz_request(rng: random.Random, max_tokens: int) -> tuple[str, bytes, str]:
    """(path, raw body, content type) of one hostile request."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base: dict = {"model": MODEL_NAME, "max_tokens": rng.randint(1, max_tokens), "stream": rng.random() < 0.5}
    base.update({"messages": [{"role": "user", "content": "Hello there"}]} if chat else {"prompt": "Hello there"})
    kind = rng.randrange(12)
    content_type = "application/json"
    if kind <= 3:  # one field set to junk
        base[rng.choice(FIELDS)] = rng.choice(JUNK) if rng.random() < 0.7 else random_json(rng)
        if not isinstance(base.get("max_tokens"), int) or base["max_tokens"] > max_tokens:
            base["max_tokens"] = max_tokens
        raw = json.dumps(base).encode()
    elif kind == 4:  # a random JSON value as the whole body
        raw = json.dumps(random_json(rng)).encode()
    elif kind == 5:  # not JSON, not UTF-8, truncated
        raw = rng.choice([b"\xff\xfe\x00garbage", b'{"model": "stress", "prompt": ', b"", b"null", b"[1,2,3]",
                          bytes(rng.randrange(256) for _ in range(64))])
    elif kind == 6:  # lone surrogates in the text
        text = json.dumps(base)
        raw = text.replace("Hello", "Hel\\ud800lo" if rng.random() < 0.5 else "\\udfff").encode()
    elif kind == 7:  # stop strings: too many, too long
        base["stop"] = rng.choice([["a"] * rng.randint(5, 50), "s" * rng.choice([1025, 60_000]), ["ok", "x" * 2000]])
        raw = json.dumps(base).encode()
    elif kind == 8:  # sizes: n, max_tokens, token ids, a long prompt
        key, value = rng.choice([("n", 10_000), ("max_tokens", 10**9), ("prompt", [10**9]),
                                 ("prompt", list(range(5, 3000))), ("prompt", "word " * 20_000),
                                 ("logprobs", 10_000), ("top_logprobs", 21)])
        if key == "prompt" and chat:
            key, value = "messages", [{"role": "user", "content": value if isinstance(value, str) else "x"}]
        base[key] = value
        raw = json.dumps(base).encode()
    elif kind == 9:  # deep nesting
        depth = rng.choice([100, 5_000, 100_000])
        raw = (b'{"model": "stress", "prompt": ' + b"[" * depth + b"]" * depth + b"}")
    elif kind == 10:  # the other routes
        path = rng.choice(["/tokenize", "/detokenize"])
        raw = json.dumps(rng.choice([
            {"prompt": rng.choice(["hi", "\ud800", "x" * 100_000])},
            {"messages": [{"role": rng.choice(["user", "tool", "nobody"]), "content": 1}]},
            {"tokens": rng.choice([[1, 2], [-1], [10**12], ["a"]])}, random_json(rng)])).encode()
    else:  # a wrong content type
        raw = json.dumps(base).encode()
        content_type = rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])
    return path, raw, content_type


async def run_fuzz(server: Server, args, rng: random.Random) -> Phase:
    import httpx

    phase = Phase("fuzz")
    queue = [fuzz_request(rng, args.max_tokens) for _ in range(args.fuzz)]
    if not server.answers():
        phase.examples.append("skipped: the server no longer answers")
        return phase

    async def one(client, path: str, raw: bytes, content_type: str) -> None:
        phase.requests += 1
        headers = {"content-type": content_type} if content_type else {}
        try:
            async with asyncio.timeout(args.timeout):
                async with client.stream("POST", server.url + path, content=raw, headers=headers) as response:
                    text = (await response.aread()).decode(errors="replace")
            if response.status_code >= 500:
                phase.server_errors += 1
                phase.fail(f"{path} {response.status_code}: {text} <- {raw[:120]!r}")
            elif response.status_code >= 400:
                phase.client_errors += 1
            elif '"error"' in text and "engine_dead" in text:
                phase.server_errors += 1
                phase.fail(f"{path}: {text[:200]} <- {raw[:120]!r}")
            else:
                phase.ok += 1
        except TimeoutError:
            phase.hangs += 1
            phase.fail(f"{path}: no answer within {args.timeout:.0f}s <- {raw[:120]!r}")
        except Exception as exc:
            phase.fail(f"{path}: {type(exc).__name__}: {exc} <- {raw[:120]!r}")

    async def worker(client) -> None:
        while queue:
            await one(client, *queue.pop())

    async with httpx.AsyncClient(timeout=args.timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(min(8, max(1, args.fuzz)))))
    return phase


# ----------------------------------------------------------------------------------------------- the report
def settle(server: Server, timeout_s: float) -> tuple[float | None, float | None]:
    """Wait until no request runs or waits; returns (kv_pages_used, kv_pages_total), None if unreadable."""
    import httpx

    deadline = time.monotonic() + timeout_s
    used = total = None
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            text = httpx.get(server.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            break
        used, total = gauge(text, "dsv41:kv_pages_used"), gauge(text, "dsv41:kv_pages_total")
        if not (gauge(text, "dsv41:num_requests_running") or gauge(text, "dsv41:num_requests_waiting")):
            break
        time.sleep(0.2)
    return used, total


def show(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--disconnect-every", type=int, default=4, help="every k-th request hangs up mid-stream "
                        "(0 = never)")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request at most")
    parser.add_argument("--fuzz", type=int, default=200, help="requests in the fuzz round")
    parser.add_argument("--num-kv-pages", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--prompt-scale", type=float, default=0.4, help="prompt words per max_model_len token: "
                        "the longest prompt has 0.4 x max_model_len x this words (~2.4 tokens a word with the "
                        "bundled tokenizer; lower it for one with shorter tokens)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before a request counts as a hang")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `dsv41 serve` argument "
                        "(repeatable), e.g. --serve-arg=--no-enable-prefix-caching")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        sys.exit(f"error: no model at {args.model} (config.json missing); pass --model DIR")

    rng = random.Random(args.seed)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dsv41-stress-") as tmp:
        server = Server(args.model, Path(tmp), ["--num-kv-pages", str(args.num_kv_pages), "--max-model-len",
                                                str(args.max_model_len), "--threads", "1", *args.serve_arg])
        try:
            server.wait_ready(300)
            load = asyncio.run(run_load(server, args, rng))
            used_after_load, total = settle(server, 60)
            fuzz = asyncio.run(run_fuzz(server, args, rng))
            used, total_after = settle(server, 60)
            total = total_after if total_after is not None else total
            if not server.answers():  # going down (an engine failure exits within seconds): report how it ended
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.process.wait(60)
            alive = server.process.poll() is None
            rss = peak_rss_mib(server.process.pid) if alive else float("nan")
            status = "alive" if alive else f"exited with {server.process.returncode}"
            tail = "" if alive else server.tail()
        finally:
            server.stop()
    result = {"phases": [load, fuzz], "leaked_pages": used, "leaked_pages_after_load": used_after_load,
              "kv_pages_total": total, "peak_rss_mib": rss, "server": status, "wall_s": time.monotonic() - start}
    print(f"model {args.model}  {args.clients} clients x {args.requests} requests (every "
          f"{args.disconnect_every or 'no'}th hangs up), fuzz {args.fuzz}, --num-kv-pages {args.num_kv_pages} "
          f"--max-model-len {args.max_model_len}, prefix caching on unless --serve-arg says otherwise")
    header = ("phase", "requests", "ok", "disconnected", "4xx", "5xx", "failures", "hangs")
    print(" | ".join(f"{h:>12}" for h in header))
    for p in (load, fuzz):
        cells = (p.name, p.requests, p.ok, p.disconnected, p.client_errors, p.server_errors, p.failures, p.hangs)
        print(" | ".join(f"{c:>12}" for c in cells))
    print(f"leaked KV pages: {show(used)} of {show(total)} (after the load phase: {show(used_after_load)});  "
          f"server peak RSS: {rss:.0f} MiB;  server {status};  wall {result['wall_s']:.0f} s")
    for p in (load, fuzz):
        for example in p.examples:
            print(f"  {p.name} failure: {example}")
    if tail:
        print("server log tail:\n" + tail)
    return result


if __name__ == "__main__":
    main()
