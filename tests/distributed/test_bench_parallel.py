"""``bench/parallel.py`` runs its layouts in processes of their own and measures the bytes a tensor-parallel decode
step hands to the collectives: exactly what ``dsv41 report --tensor-parallel-size`` plans for it."""

import json
import subprocess

import pytest
from bench_scripts import load_bench


@pytest.mark.slow
def test_tp2_decode_step_moves_the_planned_bytes(tmp_path, capsys):
    bench = load_bench("parallel")
    before = subprocess.run(["pgrep", "-f", "deepseek_v41.distributed.worker"], capture_output=True, text=True)
    out = tmp_path / "parallel.json"
    assert bench.main(["--layouts", "tp1,tp2", "--rounds", "1", "--prompt-len", "48", "--context", "24", "--steps",
                       "3", "--batch", "1", "3", "--plot", str(tmp_path / "p.png"), "--json", str(out)]) == 0
    medians = json.loads(out.read_text())["medians"]
    for b in (1, 3):
        assert medians["tp2"][f"bytes/step b{b}"] == medians["tp2"][f"planned bytes/step b{b}"] > 0
        assert medians["tp1"][f"bytes/step b{b}"] == 0
    assert medians["tp2"]["decode b3 / tp1"] > 0 and (tmp_path / "p.png").stat().st_size > 0
    text = capsys.readouterr().out
    assert "decode b3 / tp1" in text and "planned bytes/step b1" in text
    after = subprocess.run(["pgrep", "-f", "deepseek_v41.distributed.worker"], capture_output=True, text=True)
    assert len(after.stdout.split()) <= len(before.stdout.split())  # no worker left behind
