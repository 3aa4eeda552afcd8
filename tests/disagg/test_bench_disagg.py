"""``bench/disagg.py --quick`` (issue 29): the JSON it writes has every round's values, medians and ratios for both
setups and both conditions; the KV bytes per prompt token the decode server received equal ``dsv41 report``'s global
KV bytes per token of the bundled config; the decode server replayed at most one window per request; and no process
it started outlives it, also when it is interrupted (SIGINT) while its servers run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_helpers import alive

from deepseek_v41.analysis.kv import generations_bytes_per_token
from deepseek_v41.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "checkpoints" / "v41-tiny"
BENCH = ROOT / "bench" / "disagg.py"
SETUPS = ("colocated", "1P1D")
SUMMARY = ("requests", "wall_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens",
           "output_tokens_per_s", "prompt_tokens", "cached_tokens", "replayed_tokens")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="no bundled checkpoint")]


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The pids still there after ``timeout_s`` (orphans are reaped by init, which takes a moment)."""
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def bench(tmp_path: Path, *extra: str, quick: bool = True) -> subprocess.Popen:
    out = tmp_path / "out"
    return subprocess.Popen([sys.executable, str(BENCH), *(["--quick"] if quick else []),
                             "--json", str(tmp_path / "disagg.json"),
                             "--log", str(tmp_path / "disagg.log"), "--plot", str(tmp_path / "disagg.png"), *extra],
                            stdout=open(out, "wb"), stderr=subprocess.STDOUT, cwd=ROOT,  # noqa: SIM115
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})


def test_quick_run_writes_the_results_and_leaves_no_process(tmp_path):
    proc = bench(tmp_path)
    assert proc.wait(400) == 0, (tmp_path / "out").read_text()
    result = json.loads((tmp_path / "disagg.json").read_text())
    assert (tmp_path / "disagg.png").stat().st_size > 0
    log = (tmp_path / "disagg.log").read_text()
    assert "1P1D / colocated" in log and "KV bytes per prompt token" in log

    settings = result["settings"]
    assert settings["rounds"] == 1 and settings["threads_per_process"] == 1
    per_conversation = settings["clients"] * settings["turns"]
    assert set(result["rounds"]) == {"quiet", "busy"}
    for condition, setups in result["rounds"].items():
        assert set(setups) == set(SETUPS)
        for setup, rounds in setups.items():
            assert len(rounds) == 1
            summary, requests = rounds[0]["summary"], rounds[0]["requests"]
            assert set(SUMMARY) <= set(summary), (condition, setup)
            assert summary["requests"] == len(requests) == per_conversation
            for request in requests:  # ignore_eos: every turn streams max_tokens tokens, a gap for each after the first
                assert request["tokens"] == settings["max_tokens"] and request["ttft"] > 0
                assert 0 < len(request["itl"]) <= settings["max_tokens"] - 1 and min(request["itl"]) >= 0
                assert request["prompt_tokens"] >= request["cached_tokens"] >= 0
            assert summary["output_tokens"] == per_conversation * settings["max_tokens"]
            assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
            assert 0 < summary["itl_p50_ms"] <= summary["itl_p99_ms"]
            assert summary["output_tokens_per_s"] > 0
        split = setups["1P1D"][0]["summary"]
        assert split["router_fallbacks"] == 0 and split["kv_received_prompt_tokens"] > 0
        assert split["kv_sent_bytes"] >= split["kv_received_bytes"] > 0
        # The decode side prefills at most one window per request: bounded replay of the pages it received.
        window = load_config(MODEL).sliding_window
        assert 0 < split["replayed_tokens"] <= window * per_conversation
        assert split["cached_tokens"] > 0
    for condition in ("quiet", "busy"):
        assert set(result["medians"][condition]) == set(SETUPS)
        ratios = result["ratios"][condition]
        assert set(ratios) == {"ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens_per_s"}
        for key, value in ratios.items():
            assert value["min"] <= value["median"] <= value["max"], key
            colocated = result["medians"][condition]["colocated"][key]
            assert value["median"] == pytest.approx(result["medians"][condition]["1P1D"][key] / colocated)

    # Bytes: what moved per prompt token is the global KV per token that `dsv41 report` counts for this config.
    per_token = generations_bytes_per_token(load_config(MODEL))["deepseek-v4.1-flash"]
    moved = result["kv_bytes_per_prompt_token"]
    assert moved["report"] == per_token
    assert moved["measured"] == pytest.approx(per_token, rel=1e-12)
    for condition in ("quiet", "busy"):
        split = result["rounds"][condition]["1P1D"][0]["summary"]
        assert split["kv_bytes_per_prompt_token"] == pytest.approx(per_token, rel=1e-12)

    pids = list(result["processes"].values())
    assert {"colocated", "prefill", "decode", "router", "busy neighbour 0"} <= set(result["processes"])
    assert wait_gone(pids) == [], f"left behind: {result['processes']}"


def test_interrupted_run_leaves_no_process(tmp_path):
    # Short texts but many rounds and tokens: the run is surely still measuring when the interrupt comes (a --quick
    # run could end within the poll after its warm-up, exiting 0 before the signal).
    proc = bench(tmp_path, "--no-busy", "--rounds", "20", "--clients", "2", "--turns", "2", "--max-tokens", "256",
                 "--prefix-words", "200", "--tool-words", "60", quick=False)
    log = tmp_path / "disagg.log"
    deadline = time.monotonic() + 300
    while "warming up" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, (tmp_path / "out").read_text()
        assert time.monotonic() < deadline, (tmp_path / "out").read_text()
        time.sleep(0.2)
    pids = [int(p) for p in re.findall(r"started \S+: pid (\d+)", log.read_text())]
    assert len(pids) == 4 and all(alive(p) for p in pids)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(60) != 0
    assert wait_gone(pids) == [], log.read_text()
    assert not (tmp_path / "disagg.json").exists()
