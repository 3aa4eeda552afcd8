"""bench/dspark_acceptance.py on the bundled checkpoint: per-position counts add up to the mean accepted length,
the conditional acceptance is the ratio of consecutive counts, greedy output equals plain decoding, and
``--block-size`` runs the draft at another block size without touching the checkpoint."""

import json
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = ROOT / "checkpoints" / "v41-tiny"


@pytest.mark.parametrize("block", [3, 5])
def test_per_position_counts_add_up(tmp_path, capsys, block):
    text = tmp_path / "heldout.txt"
    text.write_text((BUNDLED / "prompt.txt").read_text(encoding="utf-8") * 2, encoding="utf-8")
    config_before = (BUNDLED / "config.json").read_bytes()
    bench = load_bench("dspark_acceptance", "bench_dspark_acceptance")
    assert bench.main(["--model", str(BUNDLED), "--text", str(text), "--prompts", "2", "--prompt-tokens", "24",
                       "--max-tokens", "10", "--batch-sizes", "1", "2", "--block-size", str(block), "--check",
                       "--json", str(tmp_path / "out.json")]) == 0
    assert (BUNDLED / "config.json").read_bytes() == config_before
    results = json.loads((tmp_path / "out.json").read_text())
    assert [r["batch"] for r in results] == [1, 2] and all(r["block_size"] == block for r in results)
    for r in results:
        accepted, drafts = r["accepted_per_position"], r["drafts"]
        assert len(accepted) == block and drafts > 0 and r["equal_plain"] == 2
        assert r["mean_accepted_length"] == pytest.approx(1 + sum(accepted) / drafts)
        reached = [drafts, *accepted[:-1]]
        assert r["conditional_acceptance_per_position"] == pytest.approx(
            [a / n if n else 0.0 for a, n in zip(accepted, reached, strict=True)])
    assert "mean accepted length" in capsys.readouterr().out
