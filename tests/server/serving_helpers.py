"""Helpers of the server tests: a tiny random model with a small byte-level BPE (vocab 512, the chat format's
tokens at their ids, special as in the V4.1 table), a real uvicorn server on a free loopback port started in a
thread of this process, raw SSE reads, /metrics parsing, and a scripted-output sampler (a test backend that makes
the real engine emit a fixed text, for tool-call and thinking round trips). A uniquely named module: conftest
modules of different test folders collide under ``from conftest import``."""

import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from deepseek_v41.chat import tokens as T
from deepseek_v41.cli import app
from deepseek_v41.config import tiny_config
from deepseek_v41.engine import LLM
from deepseek_v41.engine.async_engine import AsyncLLMEngine
from deepseek_v41.engine.sampler import SampleOutput
from deepseek_v41.model.engram_hash import build_token_map
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.server.app import build_app
from deepseek_v41.server.common import ServerConfig
from deepseek_v41.server.launch import bound_port, make_server

MODEL = "tiny"
KEYS = ("key-a", "key-b")
MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 1 << 20
# BOS = 0, EOS = 1, pad = 2 as in tiny_config; then every other special string of the chat format.
SPECIALS = [T.BOS, T.EOS, "<｜pad｜>", T.SYSTEM, T.USER, T.ASSISTANT, T.LATEST_REMINDER, T.THINK_START, T.THINK_END,
            T.DSML, T.IMAGE, *T.TASK_TOKENS.values()]


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE of exactly ``vocab_size`` ids trained on seeded pseudo-words (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "te", "vo", "wi", "zu", "th", "er", "in", "on", "an", "re", "he",
                 "st", "ch", "qu"]
    corpus = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(30))
              + ". Hello world! The city is Paris, 123." for _ in range(300)]
    # The chat markup too, so that tool prompts and DSML calls take a few hundred tokens, not a thousand.
    from deepseek_v41.chat import encode_messages

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
    markup = encode_messages([{"role": "user", "content": "Weather?"}, call, {"role": "user", "content": "ok"}],
                             tools=tools)
    corpus += [markup] * 40
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    assert tokenizer.get_vocab_size() == vocab_size
    # As in the V4.1 table, only BOS, EOS and pad are special; the chat markers (<think>, ｜DSML｜, ...) are ordinary
    # added tokens, which a structured-output grammar may emit (grammars never allow a special token).
    data = json.loads(tokenizer.to_str())
    for added in data["added_tokens"]:
        added["special"] = added["id"] < 3
    return Tokenizer.from_str(json.dumps(data))


def save_tiny_model(path, with_tokenizer: bool = True) -> None:
    """A random tiny model directory; the Engram compressed vocabulary matches the tokenizer's token map."""
    path.mkdir(parents=True, exist_ok=True)
    changes = {"max_position_embeddings": 4096}
    if with_tokenizer:
        train_tokenizer().save(str(path / "tokenizer.json"))
        changes["engram_compressed_vocab_size"] = int(build_token_map(path / "tokenizer.json").max()) + 1
    torch.manual_seed(0)
    Transformer(tiny_config().replace(**changes)).save_pretrained(path)


@dataclass
class LiveServer:
    """A running server: its URL, the engines behind it and the uvicorn server (``stop()`` drains it)."""

    url: str
    engine: AsyncLLMEngine
    llm: LLM
    uvicorn_server: object
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 30.0) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(timeout)


def start_server(model_dir, api_keys=KEYS, drain_timeout_s: float = 10.0, limits=None, config_args=None,
                 **engine_args) -> LiveServer:
    """Load ``model_dir`` and serve it on a free loopback port from a daemon thread (``limits``: the server's
    ``ConnectionLimits``, default its defaults; ``config_args``: more ``ServerConfig`` fields, e.g. ``media``)."""
    args = dict(max_num_seqs=40, max_model_len=MAX_MODEL_LEN)
    args.update(engine_args)
    llm = LLM(model_dir, **args)
    engine = AsyncLLMEngine(llm.engine)
    config = ServerConfig(served_model_names=[MODEL], model_path=str(model_dir), api_keys=list(api_keys),
                          max_body_bytes=MAX_BODY_BYTES, log_stats_interval_s=0, drain_timeout_s=drain_timeout_s,
                          **(config_args or {}))
    server = make_server(build_app(engine, config), "127.0.0.1", 0, drain_timeout_s, log_level="warning",
                         limits=limits)
    thread = threading.Thread(target=server.run, name="dsv41-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{bound_port(server)}", engine, llm, server, thread)

def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def sse(url: str, body: dict, key: str, timeout: float = 60.0) -> list[str]:
    """POST ``body`` with ``stream: true`` and return the raw ``data:`` payloads in order (``[DONE]`` included)."""
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth(key), timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line[len("data: "):])
    return events


def chunks(events: list[str]) -> list[dict]:
    """The JSON chunks of an SSE stream, checking that it ends with exactly one ``[DONE]``."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(sample name, sorted label items without model_name): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


class ScriptedSampler:
    """Stands in for the engine's sampler: every sequence emits the token ids of ``script`` in order, then EOS."""

    def __init__(self, token_ids: list[int], eos_token_id: int):
        self.token_ids, self.eos = list(token_ids), eos_token_id

    def sample(self, logits, rows) -> SampleOutput:
        picked = [self.token_ids[len(r.output_token_ids)] if len(r.output_token_ids) < len(self.token_ids)
                  else self.eos for r in rows]
        return SampleOutput(torch.tensor(picked, dtype=torch.int64))


@contextlib.contextmanager
def scripted(live, text: str):
    """Make ``live``'s engine answer every request with ``text`` (then EOS) inside the block."""
    engine = live.llm.engine
    ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
    assert engine.tokenizer.decode(ids, skip_special_tokens=False) == text, "the script must round-trip"
    original = engine.sampler
    engine.sampler = ScriptedSampler(ids, engine.config.eos_token_id)
    try:
        yield
    finally:
        engine.sampler = original


class ScriptedEachSampler:
    """Like :class:`ScriptedSampler`, with one script per sequence: the k-th sequence the sampler sees (in order of
    first appearance) emits ``scripts[k % len(scripts)]`` and then EOS, so the choices of one ``n > 1`` request
    can finish in different steps."""

    def __init__(self, scripts: list[list[int]], eos_token_id: int):
        self.scripts, self.eos, self.assigned = scripts, eos_token_id, {}

    def sample(self, logits, rows) -> SampleOutput:
        picked = []
        for row in rows:
            ids = self.scripts[self.assigned.setdefault(id(row), len(self.assigned) % len(self.scripts))]
            done = len(row.output_token_ids)
            picked.append(ids[done] if done < len(ids) else self.eos)
        return SampleOutput(torch.tensor(picked, dtype=torch.int64))


@contextlib.contextmanager
def scripted_each(live, texts: list[str]):
    """Make ``live``'s engine answer with one of ``texts`` per sequence (then EOS) inside the block; use it for
    one request at a time (sequences are matched to texts in the order the sampler first sees them)."""
    engine = live.llm.engine
    scripts = [engine.tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    for text, ids in zip(texts, scripts, strict=True):
        assert engine.tokenizer.decode(ids, skip_special_tokens=False) == text, "the script must round-trip"
    original = engine.sampler
    engine.sampler = ScriptedEachSampler(scripts, engine.config.eos_token_id)
    try:
        yield
    finally:
        engine.sampler = original


def wait_until_healthy(process, url: str, log, timeout: float = 120.0) -> None:
    """Poll ``url``/health of a ``dsv41 serve`` subprocess until it answers 200; fails the test (with the
    server's ``log`` file) when the process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "dsv41 serve did not come up"
        time.sleep(0.2)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_serve(*flags: str):
    """``dsv41 serve FLAGS`` in this process (for settings refused or read before the server starts)."""
    return CliRunner().invoke(app, ["serve", *flags])


def serve_setting(monkeypatch, name: str, *flags: str):
    """The value of ``ServerConfig``'s field ``name`` that ``dsv41 serve FLAGS`` (in this process) builds; the
    command stops there, before any server starts."""
    import deepseek_v41.cli.serve as serve_cli

    seen = []

    def stop(**settings):
        seen.append(settings[name])
        raise ValueError("stopped at the server config")

    monkeypatch.setattr(serve_cli, "ServerConfig", stop)  # where `dsv41 serve` looks it up
    result = run_serve(*flags)
    assert "stopped at the server config" in str(result.exception), (result.output, result.exception)
    assert len(seen) == 1
    return seen[0]


@contextlib.contextmanager
def serve_process(args: list[str], log, launcher: list[str] | None = None, wait: bool = True,
                  command: str = "serve"):
    """``dsv41 serve ARGS --port P`` as a subprocess on a free port with one OpenMP thread, its output in the file
    ``log``; yields ``(process, url)`` once it answers /health (``wait``); kills and reaps it on leaving.
    ``launcher``: the command before ``serve`` (default ``python -m deepseek_v41.cli``); ``command``: the
    subcommand (``router`` for ``dsv41 router``)."""
    port = free_port()
    command = [*(launcher or [sys.executable, "-m", "deepseek_v41.cli"]), command, *args, "--port", str(port)]
    with open(log, "wb") as out:
        # One OpenMP thread: on a shared 2-core machine spinning OpenMP workers slow a tiny model 10x.
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_until_healthy(process, url, log)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
