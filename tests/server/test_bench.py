"""``bench/serve.py`` runs end to end on a tiny random model and refuses a missing model directory clearly."""


import pytest
from bench_scripts import load_bench


def test_bench_serve_table(model_dir, capsys):
    bench = load_bench("serve", "bench_serve")
    rows = bench.main(["--model", str(model_dir), "--clients", "1", "3", "--rounds", "1", "--prompt-len", "8",
                       "--max-tokens", "4"])
    assert [r["clients"] for r in rows] == [1, 3] and [r["requests"] for r in rows] == [1, 3]
    for row in rows:
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
        assert row["tokens_per_s"] > 0 and row["offline_tokens_per_s"] > 0
    assert "TTFT p50 ms" in capsys.readouterr().out


def test_bench_serve_missing_model(tmp_path):
    with pytest.raises(SystemExit, match="no model at"):
        load_bench("serve", "bench_serve").main(["--model", str(tmp_path / "missing")])


def test_percentile():
    bench = load_bench("serve", "bench_serve")
    assert bench.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bench.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
