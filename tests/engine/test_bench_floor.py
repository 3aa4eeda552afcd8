"""bench/engine.py's memory floor (issue 25): each decode measure's floor is the bytes its step reads over the
measured copy bandwidth, in the measure's unit; the table prints it and how many times above it we are, the
breakdown names the parts, --save-json keeps them and --plot draws them."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import load_bench

from deepseek_v41.analysis.decode_bytes import decode_step_bytes
from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer


def test_floors_of_the_engines_model_are_its_bytes_over_the_bandwidth(tmp_path, kernel_library):
    from deepseek_v41.engine import LLM

    torch.manual_seed(0)
    Transformer(tiny_config().replace(engram_layer_ids=[], engram_num_embeddings=[])).save_pretrained(
        tmp_path / "m", quantization="official")
    llm = LLM(tmp_path / "m", dtype=torch.float32, max_model_len=64, enable_prefix_caching=False)
    floor = load_bench("floor")
    keys = ["decode_b1_tok_s", "decode_b8_tok_s", "decode_ms_1k", "decode_ms_16k", "prefill_1k_tok_s"]
    info = floor.floors(llm.model, keys, 10.0)
    assert set(info) == set(keys[:-1])  # prefill has no memory floor
    for key, batch, context in (("decode_b1_tok_s", 1, 1024), ("decode_b8_tok_s", 8, 1024),
                                ("decode_ms_1k", 1, 1024), ("decode_ms_16k", 1, 16384)):
        total = decode_step_bytes(llm.model, batch, context)["total"]
        assert info[key]["experts"] == "packed FP4"  # the engine installed the FP4 copies
        assert info[key]["floor_ms"] == pytest.approx(total / 10e9 * 1e3)
        expected = info[key]["floor_ms"] if key.startswith("decode_ms") else batch * 1e3 / info[key]["floor_ms"]
        assert info[key]["floor"] == pytest.approx(expected)
    assert floor.times_floor("decode_b1_tok_s", 50.0, 200.0) == 4.0
    assert floor.times_floor("decode_ms_1k", 6.0, 2.0) == 3.0
    assert floor.copy_bandwidth(nbytes=4 << 20, repeat=3) > 0


def test_table_json_and_plot_show_the_floor(tmp_path, monkeypatch, capsys):
    engine = load_bench("engine")
    floor_info = {"batch": 1, "context": 1024, "experts": "packed FP4", "bandwidth_gb_s": 12.5, "floor_ms": 2.0,
                  "floor": 500.0, "bytes": {"dense": 1.5e7, "lm_head": 8e6, "embedding": 1e3, "routed_experts": 1.7e6,
                                            "kv": 2e5, "total": 2.5e7}}
    children = {"decode": {"decode_b1_tok_s": 125.0, "decode_b8_tok_s": 800.0,
                           "_floor": {"measures": {"decode_b1_tok_s": floor_info}}},
                "prefill": {"prefill_1k_tok_s": 5000.0}}
    commands = []

    def child(command, peer=False):
        commands.append(command)
        return json.loads(json.dumps(children[command[command.index("--child") + 1]]))

    monkeypatch.setattr(engine, "_run_child", child)
    out = tmp_path / "r.json"
    assert engine.main(["--model-dir", str(tmp_path), "--only", "prefill,decode", "--save-json", str(out),
                        "--plot", str(tmp_path / "p.png")]) == 0
    assert all("--floor" in c for c in commands)
    text = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("decode", "prefill"))}
    assert rows["decode_b1_tok_s"][1:4] == ["125.00", "500.00", "4.00x"]  # 4x above the floor
    assert rows["decode_b8_tok_s"][2] == "800"  # no floor measured: the target follows
    assert "floor" in text.splitlines()[1] and "x floor" in text.splitlines()[1]
    assert "decode_b1_tok_s: batch 1, 1024 context: 25.00 MB" in text and "12.5 GB/s = 2.00 ms/step" in text
    assert "prefill is bound by compute" in text
    saved = json.loads(out.read_text())
    assert saved["floor"]["decode_b1_tok_s"]["bytes"]["total"] == 2.5e7
    assert "_floor" not in saved["ours"]
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_children_report_floors_only_when_asked(tmp_path, monkeypatch, capsys):
    engine = load_bench("engine")  # bench/ab.py reads the children's output as measures only
    monkeypatch.setattr(engine, "measure", lambda model_dir, what, dtype, repeat, with_floor=False:
                        {"with_floor": with_floor})
    assert engine.main(["--child", "decode", "--model-dir", str(tmp_path)]) == 0
    assert engine.main(["--child", "decode", "--floor", "--model-dir", str(tmp_path)]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [{"with_floor": False},
                                                                                 {"with_floor": True}]
