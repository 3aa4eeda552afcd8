"""bench/speculative.py runs end to end on a tiny model: every mode of every batch size prints a row, the greedy
output of both DSpark modes equals plain decoding, and a model without a draft is refused."""


import torch
from bench_scripts import load_bench

from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer


def test_bench_prints_every_mode(tmp_path, capsys):
    torch.manual_seed(0)
    Transformer(tiny_config()).save_pretrained(tmp_path / "m")
    bench = load_bench("speculative", "bench_speculative")
    assert bench.main(["--model", str(tmp_path / "m"), "--batch-sizes", "1", "3", "--max-tokens", "6",
                       "--prompt-tokens", "20", "--rounds", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2 * len(bench.MODES)
    assert all(" yes " in row for row in rows), rows
    assert [row.split()[0] for row in rows] == ["1"] * 3 + ["3"] * 3


def test_bench_refuses_a_model_without_draft(tmp_path, capsys):
    cfg = tiny_config().replace(num_nextn_predict_layers=0, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1])
    Transformer(cfg).save_pretrained(tmp_path / "m")
    assert load_bench("speculative", "bench_speculative").main(["--model", str(tmp_path / "m")]) == 2
    assert "no DSpark draft" in capsys.readouterr().err


def test_bench_refuses_counts_below_one(tmp_path, capsys):
    bench = load_bench("speculative", "bench_speculative")
    assert bench.main(["--model", str(tmp_path / "none"), "--rounds", "0", "--batch-sizes", "1", "0"]) == 2
    assert "--rounds 0, --batch-sizes 0: must be >= 1" in capsys.readouterr().err


def test_bench_refuses_a_missing_or_empty_text(tmp_path, capsys):
    bench = load_bench("speculative", "bench_speculative")
    (tmp_path / "empty.txt").write_text("")
    for text in (tmp_path / "none.txt", tmp_path, tmp_path / "empty.txt"):
        assert bench.main(["--model", str(tmp_path), "--text", str(text)]) == 2
        assert "not a non-empty file" in capsys.readouterr().err
