"""``dsv41 model-card`` with missing or unreadable inputs: exit code 2 and one clear line, no traceback, no card
written."""

from pathlib import Path

from typer.testing import CliRunner

from deepseek_v41.cli import app

BUNDLED = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"


def test_missing_inputs_are_clean_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [["--prompt-file", str(tmp_path / "none.txt")],
             ["--prompt-file", str(BUNDLED / "prompt.txt"), "--extra", str(bad)]]
    for extra in cases:
        result = CliRunner().invoke(app, ["model-card", "--model", str(tmp_path), "--run", str(tmp_path / "run"),
                                          "--data", str(tmp_path / "data"), *extra])
        assert result.exit_code == 2, result.output
        assert "error:" in result.output and "Traceback" not in result.output
        assert not (tmp_path / "MODEL_CARD.md").exists()
