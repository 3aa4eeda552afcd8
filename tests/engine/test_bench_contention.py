"""bench/engine.py --contention runs end to end on a tiny model: every measure under every condition (quiet, quiet
with fixed threads, N spinners, a second engine in its own process) gives one positive ratio per round, quiet's
being 1; the table has a row per measure and one of thread counts; the flag's values are checked; no load process
outlives the measurement."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench

from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer


# Kept out of make test's 5 minutes (a fresh clone measured 5:04 on a slower 2-core host): with the slow tests.
@pytest.mark.slow
def test_contention_measures_every_condition_and_leaves_no_process(tmp_path, monkeypatch):
    torch.manual_seed(0)
    Transformer(tiny_config()).save_pretrained(tmp_path / "m")
    contention = load_bench("contention")
    monkeypatch.setattr(contention, "DECODE_STEPS", 2)
    monkeypatch.setattr(contention, "SETTLE", 0.05)
    started = []
    real = contention.Load.__init__

    def record(self, *args, **kwargs):
        real(self, *args, **kwargs)
        started.append(self.proc)

    monkeypatch.setattr(contention.Load, "__init__", record)
    ratios, speeds, threads = contention.measure(tmp_path / "m", "fp32", [1, 2], rounds=1, prefill=24, context=16)
    names = ["quiet", "quiet fixed", "busy 1", "busy 2", "engine"]
    assert list(ratios) == ["prefill 24", "decode batch 1", "decode batch 8"]
    for by in ratios.values():
        assert list(by) == names and all(len(v) == 1 and min(v) > 0 for v in by.values())
        assert by["quiet"] == [1.0]
    assert all(len(v) == 1 and min(v) > 0 for v in speeds.values())
    assert list(threads) == names and all(len(v) == 3 and min(v) >= 1 for v in threads.values())
    assert len(started) == 3 and all(p.poll() is not None for p in started)  # 2 spinners + the engine, all gone
    lines = contention.table(ratios, speeds, threads)
    assert [line.split()[0] for line in lines] == ["measure", "prefill", "decode", "decode", "threads"]


@pytest.mark.parametrize("bad", ["0", "x", "1,-2", ""])
def test_contention_flag_takes_counts_of_at_least_one(bad, capsys):
    engine = load_bench("engine")
    with pytest.raises(SystemExit):
        engine.main(["--contention", bad, "--model-dir", "unused"])
    assert "--contention" in capsys.readouterr().err


def test_contention_flag_prints_the_table(tmp_path, monkeypatch, capsys):
    engine = load_bench("engine")
    contention = load_bench("contention")
    ratios = {"prefill 1024": {"quiet": [1.0], "quiet fixed": [0.9], "busy 1": [0.6], "engine": [0.3]}}
    monkeypatch.setattr(contention, "measure", lambda model_dir, dtype, busy, rounds: (
        ratios, {"prefill 1024": [5000.0]}, {"quiet": [2], "quiet fixed": [2], "busy 1": [1], "engine": [1]}))
    assert engine.main(["--contention", "1", "--rounds", "1", "--model-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if line.startswith("prefill"))
    assert "5000.0" in row and "0.60 [0.60-0.60] ok" in row and "0.30 [0.30-0.30] MISS" in row
