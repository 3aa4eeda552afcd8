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


def test_card_says_what_the_corpus_is_and_that_the_model_is_not_chat_tuned():
    import json

    from deepseek_v41.train.model_card import render

    facts = json.loads((BUNDLED / "metrics.json").read_text(encoding="utf-8"))
    facts["config"] = json.loads((BUNDLED / "config.json").read_text(encoding="utf-8"))
    card = render(facts)
    assert "**A plain language model, not chat-tuned.**" in card
    assert "installs nothing" in card and "`apt-get download`" in card and "| kernel-docs |" in card
    facts["manifest"] = {"sources": {"user-files": facts["manifest"]["sources"]["python-docs"]}}
    assert "Text files supplied by the user (`dsv41 data prepare --from DIR`" in render(facts)


def test_an_existing_card_is_kept_without_overwrite(tmp_path):
    card = tmp_path / "MODEL_CARD.md"
    card.write_text("hand-written\n")
    result = CliRunner().invoke(app, ["model-card", "--model", str(tmp_path), "--run", str(tmp_path / "run"),
                                      "--data", str(tmp_path / "data"), "--prompt-file", str(BUNDLED / "prompt.txt")])
    assert result.exit_code == 2 and "--overwrite" in result.output and "Traceback" not in result.output
    assert card.read_text() == "hand-written\n"
    # with --overwrite it goes on, and fails on the missing run as before, leaving the card
    result = CliRunner().invoke(app, ["model-card", "--model", str(tmp_path), "--run", str(tmp_path / "run"),
                                      "--data", str(tmp_path / "data"), "--prompt-file", str(BUNDLED / "prompt.txt"),
                                      "--overwrite"])
    assert result.exit_code == 2 and "--overwrite" not in result.output and card.read_text() == "hand-written\n"
