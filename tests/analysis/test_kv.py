"""KV byte accounting (issue 2, MODEL_REFERENCE.md §5): the paper's numbers computed from the code."""

import json
from fractions import Fraction

from typer.testing import CliRunner

from deepseek_v41.analysis.kv import generation_records, generations_bytes_per_token
from deepseek_v41.cache.layout import KVLayout
from deepseek_v41.cli import app
from deepseek_v41.config import flash_config, tiny_config


def test_report_json_gives_the_papers_numbers(tmp_path):
    result = CliRunner().invoke(app, ["report", "--config", "flash", "--json", "--no-flops", "--plot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    kv = json.loads(result.stdout)["kv"]
    assert (kv["main_entry_bytes"], kv["index_entry_bytes"], kv["window_row_bytes"]) == (288, 68, 528)
    assert kv["global_bytes_per_token"] == 890
    assert kv["allocated_bytes_per_token"] == 890  # read off the engine's pool tensors (on meta)
    assert kv["window_bytes_per_sequence"] == 2_703_360
    assert kv["generations"] == {"deepseek-llm-67b": 389_120, "deepseek-v3.2": 48_068,
                                 "deepseek-v4-flash": 3514.25, "deepseek-v4.1-flash": 890}
    assert abs(1 / kv["persistent_ratio_vs_v4"] - 7.9) < 0.05
    assert (tmp_path / "kv_bytes_by_generation.png").stat().st_size > 1000
    # Not a terminal: progress goes to stderr as plain lines, stdout stays the JSON object (parsed above).
    log = result.stderr.splitlines()
    assert log[0] == "dsv41 report flash: started"
    assert any(line.startswith("dsv41 report flash: done, 1/1 steps (100%)") for line in log)


def test_v41_record_agrees_with_the_cache_layout():
    for cfg in (flash_config(), tiny_config()):
        layout = KVLayout.from_config(cfg)
        record = sum(c.bytes_per_token for c in generation_records(cfg)["deepseek-v4.1-flash"])
        assert record == layout.entries_per_token * (layout.main_entry_bytes + layout.index_entry_bytes)


def test_tiny_layout_follows_its_config():
    cfg = tiny_config()  # head_dim 32, index_head_dim 32, kv sources: layer 2 (m=2) and layer 4 (m=1)
    layout = KVLayout.from_config(cfg)
    assert layout.main_entry_bytes == 32 // 2 + 32 // 16
    assert layout.index_entry_bytes == 32 // 2 + 32 // 32
    assert layout.entries_per_token == Fraction(3, 2)
    assert generations_bytes_per_token(cfg)["deepseek-v4.1-flash"] == 1.5 * (18 + 17)


def test_report_text_and_bad_config(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["report", "--config", "tiny"])
    assert "decode at 1M context" in ok.stdout
    assert ok.exit_code == 0 and "global KV per token" in ok.stdout
    bad = runner.invoke(app, ["report", "--config", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "no config.json" in bad.output
