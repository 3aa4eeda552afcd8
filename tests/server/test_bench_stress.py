"""``bench/stress.py`` runs end to end (a tiny configuration of it): streaming clients with disconnects, then a
fuzz round, against a real ``dsv41 serve`` subprocess; its report adds up."""


import pytest
from bench_scripts import load_bench


# Kept out of make test's 5 minutes (a fresh clone measured 5:04 on a slower 2-core host): with the slow tests.
@pytest.mark.slow
def test_stress_smoke(model_dir, capsys):
    bench = load_bench("stress", "bench_stress")
    result = bench.main(["--model", str(model_dir), "--clients", "3", "--requests", "2", "--disconnect-every",
                         "3", "--max-tokens", "6", "--fuzz", "24", "--num-kv-pages", "128", "--max-model-len",
                         "256", "--prompt-scale", "0.1", "--timeout", "120"])
    load, fuzz = result["phases"]
    assert load.requests == 6 and load.disconnected == 2 and load.ok == 4, load
    assert (load.failures, load.hangs, load.server_errors) == (0, 0, 0), load.examples
    assert fuzz.requests == 24 and fuzz.ok + fuzz.client_errors == 24, fuzz
    assert (fuzz.failures, fuzz.hangs, fuzz.server_errors) == (0, 0, 0), fuzz.examples
    assert result["leaked_pages"] == 0 and result["kv_pages_total"] == 128
    assert result["server"] == "alive" and result["peak_rss_mib"] > 0
    out = capsys.readouterr().out
    assert "leaked KV pages: 0 of 128" in out and "| disconnected |" in out


def test_stress_missing_model(tmp_path):
    with pytest.raises(SystemExit, match="no model at"):
        load_bench("stress", "bench_stress").main(["--model", str(tmp_path / "missing")])
