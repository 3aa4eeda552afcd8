"""bench/dtypes.py runs end to end on a tiny model: one ratio per measure and round (the long prefill every other
round), each a positive fp32 / bf16 time ratio, and the printed table has a row per measure."""


import torch
from bench_scripts import load_bench

from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer


def test_bench_pairs_every_measure(tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    Transformer(tiny_config()).save_pretrained(tmp_path / "m")
    bench = load_bench("dtypes", "bench_dtypes")
    monkeypatch.setattr(bench, "DECODE_STEPS", 2)
    monkeypatch.setattr(bench.engine, "_ids", lambda n, seed: [3 + (7 * seed + i) % 500 for i in range(n)])  # vocab 512
    ratios = bench.measure(tmp_path / "m", rounds=3, short=24, long=48, context=16)
    assert {k: len(v) for k, v in ratios.items()} == {"prefill 24": 3, "prefill 48": 2, "decode batch 1": 3,
                                                       "decode batch 8": 3}
    assert all(r > 0 for values in ratios.values() for r in values)
    monkeypatch.setattr(bench, "measure", lambda model_dir, rounds: ratios)
    assert bench.main(["--model-dir", str(tmp_path / "m"), "--rounds", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("prefill", "decode"))]
    assert [row.rsplit(None, 4)[0] for row in rows] == list(ratios)
