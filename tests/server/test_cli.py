"""``dsv41 serve`` as a process: it serves, logs throughput, and drains on SIGTERM (a running stream finishes,
then the process exits)."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from serving_helpers import run_serve, serve_process, serve_setting
from typer.testing import CliRunner

from deepseek_v41.cli import app


def test_serve_drains_on_sigterm(model_dir, tmp_path):
    log = tmp_path / "serve.log"
    generation = tmp_path / "generation"
    generation.mkdir()
    (generation / "generation_config.json").write_text('{"temperature": 0.0, "max_new_tokens": 7}')
    # The vLLM flags a script may pass are accepted (positional MODEL as `vllm serve MODEL`).
    command = [str(model_dir),
               "--api-key", "k1", "--api-key", "k2", "--served-model-name", "tiny", "--max-model-len", "256",
               "--max-num-seqs", "4", "--log-stats-interval", "0.3", "--cache-dir", str(tmp_path / "cache"),
               "--threads", "1", "--generation-config", str(generation), "--enforce-eager", "--disable-log-requests",
               "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v41", "--kv-cache-dtype", "auto",
               "--gpu-memory-utilization", "0.01", "--uvicorn-log-level", "warning",
               "--allowed-origins", '["http://localhost:3000"]', "--trust-remote-code", "--tensor-parallel-size", "1"]
    with serve_process(command, log) as (process, url):
        preflight = httpx.options(url + "/v1/chat/completions", timeout=10, headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        client = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0, timeout=60)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 7  # max_new_tokens of --generation-config, not the context
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": "Bearer k2"},
                          timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) == 2:
                        process.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]" and sum('"finish_reason":"length"' in x for x in lines) == 1
        # uvicorn re-raises the signal once the drain is done, so the process ends "killed by SIGTERM".
        assert process.wait(60) in (0, -signal.SIGTERM)
    text = log.read_text()
    assert "draining" in text and "Avg generation throughput" in text
    assert "sampling defaults temperature=0.0, max_tokens=7 (from" in text
    assert "gpu_memory_utilization 0.01: KV pool budget" in text and "MiB at most" in text
    # The prompt's full pages went to the persistent prefix cache under --cache-dir.
    assert list((tmp_path / "cache").rglob("*.page"))


@pytest.mark.slow  # (an interpreter start: make test's 5-minute budget)
def test_serve_missing_model_dir(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deepseek_v41.cli", "serve", "--model", str(tmp_path / "none")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "not found" in result.stderr


# Three interpreters that load the engine (~15 s on 2 cores): with the slow tests, to keep make test under 5 minutes.
@pytest.mark.slow
def test_serve_rejects_bad_engine_settings(model_dir, tmp_path):
    for flags, message in ((["--replay", "sometimes"], "replay must be"),
                           (["--speculative", "medusa"], "speculative must be one of"),
                           (["--speculative", "dspark", "--speculative-max-len", "99"], "speculative_max_len")):
        result = subprocess.run([sys.executable, "-m", "deepseek_v41.cli", "serve", "--model", str(model_dir),
                                 "--cache-dir", str(tmp_path / "cache"), *flags],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr, (flags, result.stderr[-500:])


def bad_device() -> str:
    import torch

    return "cuda:99" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize(("flags", "message"), [
    (["--port", "99999"], "'--port'"),
    (["--port", "0"], "'--port'"),
    (["--max-model-len", "0"], "'--max-model-len'"),
    (["--max-num-seqs", "-1"], "'--max-num-seqs'"),
    (["--max-num-batched-tokens", "0"], "'--max-num-batched-tokens'"),
    (["--block-size", "0"], "'--block-size'"),
    (["--num-kv-pages", "0"], "'--num-kv-pages'"),
    (["--kv-cache-memory-bytes", "0"], "'--kv-cache-memory-bytes'"),
    (["--swa-pool-bytes", "-1"], "'--swa-pool-bytes'"),
    (["--threads", "0"], "'--threads'"),
    (["--speculative-max-len", "0"], "'--speculative-max-len'"),
    (["--drain-timeout", "-1"], "'--drain-timeout'"),
    (["--max-body-mb", "0"], "--max-body-mb must be > 0"),
    (["--timeout-header", "0"], "--timeout-header must be > 0 seconds"),
    (["--timeout-body", "-1"], "--timeout-body must be > 0 seconds"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive must be > 0 seconds"),
    (["--timeout-write", "0"], "--timeout-write must be > 0 seconds"),
    (["--limit-concurrency", "0"], "'--limit-concurrency'"),
    (["--log-level", "loud"], "--log-level must be one of critical, error"),
    (["--replay", "sometimes"], "--replay must be one of bounded, exact"),
    (["--dtype", "int8"], "--dtype must be one of auto, float32, bfloat16, float16, float64"),
    (["--device", "foo"], "'foo' is not a torch device name; available here: cpu"),
    (["--device", "meta"], "device type 'meta' is not supported"),
    (["--device", bad_device()], "available here: cpu"),
    (["--speculative-max-len", "2"], "--speculative-max-len needs --speculative dspark"),
    (["--num-kv-pages", "1"], "cannot hold one sequence"),  # an engine check, after the model is loaded
    (["--uvicorn-log-level", "loud"], "--uvicorn-log-level must be one of critical, error"),
    (["--chat-template", "t.jinja"], "DeepSeek-V4.1 has no Jinja chat template"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser 'hermes' is not available"),
    (["--kv-cache-dtype", "fp8"], "the KV cache format is fixed by the model"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--gpu-memory-utilization", "1e-12"], "(the budget of gpu_memory_utilization 1e-12"),
    (["--allowed-origins", '{"a": 1}'], "--allowed-origins takes a JSON list of strings"),
    (["--allowed-origins", "[bad"], "--allowed-origins '[bad' starts with '[' but is not a JSON list"),
    (["--allowed-methods", '["GET",'], "--allowed-methods '[\"GET\",' starts with '[' but is not a JSON list"),
    (["--allowed-headers", " [x]"], "--allowed-headers ' [x]' starts with '[' but is not a JSON list"),
    (["--generation-config", "/nonexistent-dir"], "no generation_config.json in that folder"),
    (["--override-generation-config", "[1]"], "--override-generation-config must be a JSON object"),
    (["--override-generation-config", '{"temp": 1}'], "--override-generation-config: unknown keys ['temp']"),
    (["--structured-outputs-config", "[1]"], "--structured-outputs-config must be a JSON object"),
    (["--structured-outputs-config", "{bad"], "--structured-outputs-config must be a JSON object"),
    (["--structured-outputs-config", '{"backend": "outlines"}'], "structured_outputs_config backend must be one of"),
    (["--structured-outputs-config", '{"whitespace": 1}'], "structured_outputs_config has unknown keys"),
    (["-tp", "2", "--distributed-executor-backend", "uni"],
     "--distributed-executor-backend 'uni' runs one process; 2 ranks need 'mp' or 'ray'"),
    (["-tp", "3", "--expert-parallel-size", "2"],
     "--tensor-parallel-size 3 and --expert-parallel-size 2: each must be"),
    (["--headless"], "--headless is for worker nodes (--node-rank > 0)"),
    (["-pp", "2"], "--pipeline-parallel-size 2: no pipeline parallelism"),
    (["--max-model-len", "4x"], "'4x' is not an integer"),
    (["--max-model-len", "1.5K"], "a decimal number takes a decimal suffix"),
    (["--max-model-len", "1m"], "(max_position_embeddings), got 1000000"),
    (["--enable-log-requests", "--disable-log-requests"], "contradict each other"),
])
def test_serve_refuses_bad_settings_cleanly(model_dir, tmp_path, monkeypatch, flags, message):
    """Exit 2 with the message on stderr (no traceback, no silent default), and no cache directory created."""
    import deepseek_v41.cli.serve as serve_cli

    monkeypatch.setattr(serve_cli, "DEFAULT_CACHE_DIR", tmp_path / "home" / ".cache" / "prefix-cache")
    result = run_serve("--model", str(model_dir), *flags)
    assert result.exit_code == 2, (result.output, result.exception)
    assert message in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "home").exists()
    explicit = run_serve("--model", str(model_dir), "--cache-dir", str(tmp_path / "a" / "b"), *flags)
    assert explicit.exit_code == 2 and not (tmp_path / "a").exists()


def test_serve_model_positional_or_option(model_dir, tmp_path):
    """``dsv41 serve MODEL`` as ``vllm serve MODEL``; ``--model`` too; both must agree; neither is an error."""
    differs = run_serve(str(model_dir), "--model", str(tmp_path))
    assert differs.exit_code == 2 and "the model is given twice and differently" in differs.stderr
    missing = run_serve("--port", "8001")
    assert missing.exit_code == 2 and "give the model directory: dsv41 serve MODEL" in missing.stderr
    for flags in ([str(tmp_path / "none")], ["--model", str(tmp_path / "none")],
                  [str(tmp_path / "none"), "--model", str(tmp_path / "none" / ".")]):  # the same directory
        result = run_serve(*flags)
        assert result.exit_code == 2 and "not found" in result.stderr, flags


def test_version_and_short_help():
    from deepseek_v41 import __version__

    for args in (["--version"], ["serve", "--version"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0 and result.stdout.strip() == __version__, args
    for args in (["-h"], ["serve", "-h"], ["generate", "-h"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0 and "Usage:" in result.stdout, args


@pytest.mark.parametrize("command", ["serve", "generate", "router"])
def test_help_at_80_columns_shows_every_flag_whole(command):
    """No flag name is cut (rich's panels cut them: '--max-num-batch…'), no line is wider than the terminal."""
    import re

    import typer

    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0
    text = result.stdout
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text
    params = typer.main.get_command(app).commands[command].params
    flags = [opt for p in params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("-")]
    assert "--max-num-batched-tokens" in flags or command in ("generate", "router")
    joined = re.sub(r"-\n\s+", "-", text)  # a flag named in a help text must not be split at a line end either
    for flag in flags:
        pattern = rf"(?<![\w-]){re.escape(flag)}(?![\w-])"
        assert re.search(pattern, text), flag
        assert len(re.findall(pattern, joined)) == len(re.findall(pattern, text)), f"{flag} split across lines"


def test_default_served_model_name_is_the_directory_name(tmp_path):
    from deepseek_v41.cli.serve import default_model_name

    (tmp_path / "v41-tiny").mkdir()
    assert default_model_name(tmp_path / "v41-tiny") == "v41-tiny"
    assert default_model_name(Path(str(tmp_path / "v41-tiny") + "/")) == "v41-tiny"
    assert default_model_name(tmp_path / "v41-tiny" / ".") == "v41-tiny"


@pytest.mark.slow  # (an engine-loading interpreter: make test's 5-minute budget)
def test_serve_failed_start_removes_the_cache_dir_it_created(model_dir, tmp_path):
    """A start that fails after the engine made its cache directory (here: the port is taken) removes it again;
    the startup line names the cache directory and the speculative mode."""
    home = tmp_path / "home"
    home.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "deepseek_v41.cli", "serve", "--model", str(model_dir),
                                 "--port", str(port), "--threads", "1", "--speculative", "dspark"],
                                capture_output=True, text=True, timeout=300,
                                env={**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0 and "address already in use" in result.stderr, result.stderr[-2000:]
    cache = home / ".cache" / "deepseek_v41" / "prefix-cache"
    assert f"prefix caching on, cache dir {cache}" in result.stderr
    # The served name is the directory's name, not its path; the defaults in force are logged.
    assert f"as ['{model_dir.name}'] on http" in result.stderr
    assert "sampling defaults: vLLM's defaults (no generation_config.json in the model directory)" in result.stderr
    assert "speculative decoding dspark (up to" in result.stderr
    # The prefix-cache directory it made is gone; what may stay is the remembered weight digest of the checkpoint
    # (cache/fingerprint.py: kept so the next start does not rehash the weights), and nothing else.
    assert not cache.exists()
    left = sorted(p.relative_to(home).as_posix() for p in home.rglob("*"))
    assert all(p == ".cache" or p.startswith(".cache/deepseek_v41") and (p.count("/") < 2 or "/weight-digests" in p)
               for p in left), left
    assert not [p for p in left if p.startswith(".cache/deepseek_v41/") and "weight-digests" not in p], left


@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("4k", 4000), ("32K", 32768), ("1m", 1_000_000),
                                             ("1M", 2**20), ("25.6k", 25600), (" 8k ", 8000)])
def test_human_readable_int_as_vllm(text, value):
    from deepseek_v41.server.options import human_readable_int

    assert human_readable_int(text) == value


def test_serve_accepts_vllm_sizes_and_parallel_one(tmp_path):
    """``-pp 1`` / ``--pipeline-parallel-size 1`` as ``-tp 1``, ``--max-model-len 4k``: accepted (the start then
    fails only on the missing model directory)."""
    for flags in (["-pp", "1"], ["--pipeline-parallel-size", "1", "-tp", "1"], ["--max-model-len", "4k"],
                  ["--max-model-len", "32K"]):
        result = run_serve(str(tmp_path / "none"), *flags)
        assert result.exit_code == 2 and "model directory" in result.stderr and "not found" in result.stderr, \
            (flags, result.stderr)


@pytest.mark.parametrize(("env", "flags", "keys"), [
    ({"VLLM_API_KEY": "v"}, [], ["v"]),
    ({"DSV41_API_KEY": "d", "VLLM_API_KEY": "v"}, [], ["d"]),
    ({"DSV41_API_KEY": "", "VLLM_API_KEY": "v"}, [], ["v"]),
    ({"VLLM_API_KEY": "v"}, ["--api-key", "a", "--api-key", "b"], ["a", "b"]),  # the flag wins
    ({}, [], []),
])
def test_serve_takes_the_api_key_from_the_environment(model_dir, tmp_path, monkeypatch, env, flags, keys):
    """``VLLM_API_KEY`` (vLLM's) and ``DSV41_API_KEY`` guard the server when ``--api-key`` is not given."""
    for name in ("DSV41_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert serve_setting(monkeypatch, "api_keys", str(model_dir), "--cache-dir", str(tmp_path / "cache"),
                         "--max-model-len", "64", *flags) == keys


def test_gpu_memory_utilization_logs_the_pool_allocated(model_dir, tmp_path, monkeypatch, caplog):
    """The budget of ``--gpu-memory-utilization`` is an upper bound: the log says so and gives the pool actually
    allocated (capped at max_num_seqs x max_model_len), which is what the engine holds."""
    import logging

    import deepseek_v41.cli.serve as serve_cli
    import deepseek_v41.engine.options as engine_options

    monkeypatch.setattr(engine_options, "free_memory_bytes", lambda device: 64 * 2**30)  # a large budget

    def stop(**settings):
        raise ValueError("stopped at the server config")

    monkeypatch.setattr(serve_cli, "ServerConfig", stop)  # where `dsv41 serve` looks it up
    caplog.set_level(logging.INFO, logger="deepseek_v41")
    result = run_serve(str(model_dir), "--cache-dir", str(tmp_path / "cache"), "--max-model-len", "64",
                       "--max-num-seqs", "2", "--block-size", "16", "--gpu-memory-utilization", "0.9")
    assert "stopped at the server config" in str(result.exception), (result.output, result.exception)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpu_memory_utilization 0.9")]
    assert len(lines) == 1, caplog.text
    assert "KV pool budget" in lines[0] and "MiB at most" in lines[0]
    assert "allocated 8 KV pages" in lines[0] and "max_num_seqs 2 x max_model_len 64 tokens = 8 pages" in lines[0]


def test_serve_passes_structured_outputs_config_to_the_engine(model_dir, tmp_path, monkeypatch):
    """``--structured-outputs-config`` (vLLM's flag) reaches the engine as the dict it parses to."""
    import deepseek_v41.cli.serve as serve_cli

    seen = {}

    def fake_llm(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(serve_cli, "LLM", fake_llm)
    result = run_serve("--model", str(model_dir), "--cache-dir", str(tmp_path / "c"), "--structured-outputs-config",
                       '{"backend": "guidance", "disable_any_whitespace": false}')
    assert result.exit_code == 2 and "stop here" in result.stderr
    assert seen["structured_outputs_config"] == {"backend": "guidance", "disable_any_whitespace": False}
