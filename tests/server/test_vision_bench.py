"""bench/vision.py runs end to end on a tiny random VLM: one encode row per size, the three TTFT arms with the
encoder cache counting one hit and one miss per round, the JSON written; bad arguments and text-only models are
refused."""

import json

import pytest
from bench_scripts import load_bench
from vision_helpers import save_tiny_vlm


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-vlm")
    save_tiny_vlm(path)
    return path


def test_bench_prints_both_tables(vlm_dir, tmp_path, capsys):
    bench = load_bench("vision", "bench_vision")
    out = tmp_path / "vision.json"
    assert bench.main(["--model", str(vlm_dir), "--sizes", "42x42", "126x84", "--ttft-size", "84x42",
                       "--rounds", "1", "--save-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "encoder cache over the rounds: hits 1, misses 1" in text
    saved = json.loads(out.read_text())
    assert [(r["size"], r["llm_grid"], r["span"]) for r in saved["encode"]] == [("42x42", "1x1", 4),
                                                                               ("126x84", "3x2", 10)]
    assert set(saved["ttft"]) == set(bench.ARMS) and all(len(a["ttft_ms"]) == 1 for a in saved["ttft"].values())
    positions = {a["prompt_positions"] for a in saved["ttft"].values()}
    assert len(positions) == 1  # the text arm has as many positions as the image prompts


@pytest.mark.parametrize(("args", "message"), [
    (["--sizes", "12"], "is not an image size WxH"),
    (["--ttft-size", "0x5"], "is not an image size WxH"),
    (["--rounds", "0"], "--rounds 0: must be >= 1"),
])
def test_bench_refuses_bad_arguments(vlm_dir, capsys, args, message):
    assert load_bench("vision", "bench_vision").main(["--model", str(vlm_dir), *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_a_missing_or_text_only_model(tmp_path, capsys):
    bench = load_bench("vision", "bench_vision")
    assert bench.main(["--model", str(tmp_path / "none")]) == 2
    assert "no model at" in capsys.readouterr().err
    assert bench.main(["--model", "checkpoints/v41-tiny", "--rounds", "1"]) == 2
    assert "has no vision tower" in capsys.readouterr().err
