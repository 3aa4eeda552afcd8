"""bench/structured.py runs end to end on the bundled checkpoint: a row per mode and batch size, the constrained
rows valid, and a missing model refused."""

from bench_scripts import load_bench


def test_bench_prints_free_and_schema_rows(grammar_engines, capsys):
    bench = load_bench("structured", "bench_structured")
    assert bench.main(["--batch-sizes", "1", "2", "--max-tokens", "32"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("1", "free"), ("1", "json"), ("2", "free"), ("2", "json")]
    assert rows[0][-1] == "-"
    for row, size in ((rows[1], 1), (rows[3], 2)):  # every output the grammar ended is valid
        valid, ended, requests = map(int, row[-1].split("/"))
        assert valid == ended and requests == size
    assert float(rows[1][-2]) > 0  # the mask cost per token was measured


def test_bench_refuses_a_missing_model(tmp_path, capsys):
    assert load_bench("structured", "bench_structured").main(["--model", str(tmp_path)]) == 2
    assert "no model at" in capsys.readouterr().err
