"""``dsv41 generate`` (typer's CliRunner, in this process): ``--json`` prints exactly one JSON object, with a
``turns`` list under ``--follow-up``; without ``--json`` the turns are separated on stderr; each turn's DSpark
mean accepted length is its own; bad options, unreadable prompt files and missing devices exit 2 with a message
instead of a traceback; ``--dtype`` takes serve's values."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from deepseek_v41.cli import app

# The tiny model directory with a tokenizer is built by the server tests' helper.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from serving_helpers import save_tiny_model  # noqa: E402

PROMPT = "Hello world! The city is Paris, 123. " * 4  # a few full pages: turn 2 hits the prefix cache


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-generate")
    save_tiny_model(path)
    return path


def generate(model_dir, *flags: str):
    return CliRunner().invoke(app, ["generate", "--model", str(model_dir), *flags])


def test_follow_up_json_is_one_object_with_turns(model_dir):
    result = generate(model_dir, "--prompt", PROMPT, "--max-tokens", "6", "--follow-up", " Again:", "--json",
                      "--speculative", "dspark")
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(result.stdout)  # exactly one object
    turns = data["turns"]
    assert [t["turn"] for t in turns] == [1, 2]
    assert {k: v for k, v in data.items() if k != "turns"} == {k: v for k, v in turns[1].items() if k != "turn"}
    first, second = turns
    for turn in turns:
        assert len(turn["token_ids"]) == turn["generated_tokens"] == 6
        # the turn's own DSpark statistics, from its RequestOutput
        steps = turn["spec_verify_steps"]
        assert 0 < steps <= turn["generated_tokens"]
        assert turn["spec_decode_mean_accepted_length"] == pytest.approx(1 + turn["spec_accepted_tokens"] / steps)
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["generated_tokens"] - 2
    assert second["cached_tokens"] > 0  # the second turn reused the first turn's prefix


def test_single_turn_json_keeps_its_shape(model_dir):
    result = generate(model_dir, "--prompt", "Hello world", "--max-tokens", "3", "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(result.stdout)
    for key in ("text", "token_ids", "prompt_tokens", "cached_tokens", "generated_tokens", "finish_reason",
                "ttft_s", "kv_bytes_per_token", "prefill_mode"):
        assert key in data, key
    assert "spec_decode_mean_accepted_length" not in data  # no speculative decoding asked for
    assert len(data["turns"]) == 1 and data["turns"][0]["token_ids"] == data["token_ids"]


def test_follow_up_text_separates_the_turns(model_dir):
    result = generate(model_dir, "--prompt", PROMPT, "--max-tokens", "4", "--follow-up", " Again:",
                      "--speculative", "dspark")
    assert result.exit_code == 0, (result.output, result.exception)
    stderr = result.stderr
    assert stderr.count("--- turn 2 (prompt = turn 1 + completion + follow-up) ---") == 1
    lines = re.findall(r"\[(\d+) prompt tokens, (\d+) cached.*DSpark mean accepted length ([\d.]+) over (\d+) "
                       r"steps\]", stderr)
    assert len(lines) == 2
    (before, _, _, _), (after, cached, _, _) = lines
    assert stderr.index("--- turn 2") > stderr.index(f"[{before} prompt tokens")
    assert int(after) > int(before) and int(cached) > 0


@pytest.mark.parametrize("dtype", ["auto", "float64"])
def test_generate_takes_the_dtypes_of_serve(model_dir, dtype):
    result = generate(model_dir, "--prompt", "Hello", "--max-tokens", "1", "--dtype", dtype, "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    assert json.loads(result.stdout)["generated_tokens"] == 1


def bad_device() -> str:
    return "cuda:99" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize(("flags", "message"), [
    (["--prompt-file", "{tmp}/missing.txt"], "missing.txt: no such file"),
    (["--prompt-file", "{tmp}"], "is a directory"),
    (["--prompt-file", "{tmp}/latin1.txt"], "is not UTF-8 text (byte 0xe9"),
    (["--prompt", "x", "--prompt-file", "{tmp}/latin1.txt"], "give exactly one of --prompt and --prompt-file"),
    ([], "give exactly one of --prompt and --prompt-file"),
    (["--prompt", "x", "--device", "foo"], "'foo' is not a torch device name; available here: cpu"),
    (["--prompt", "x", "--device", "meta"], "device type 'meta' is not supported"),
    (["--prompt", "x", "--device", bad_device()], "available here: cpu"),
    (["--prompt", "x", "--dtype", "int8"], "--dtype must be one of auto, float32, bfloat16, float16, float64"),
    (["--prompt", "x", "--max-tokens", "0"], "'--max-tokens'"),
    (["--prompt", "x", "--temperature", "-1"], "'--temperature'"),
    (["--prompt", "x", "--top-k", "-1"], "'--top-k'"),
    (["--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--prompt", "x", "--thinking"], "--thinking needs --chat"),
    (["--prompt", "x", "--speculative-max-len", "2"], "--speculative-max-len needs --speculative dspark"),
    (["--prompt", "x", "--prefill-mode", "fast"], "prefill_mode must be"),
])
def test_generate_refuses_bad_input_cleanly(model_dir, tmp_path, flags, message):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    result = generate(model_dir, *[f.format(tmp=tmp_path) for f in flags])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert message in " ".join(result.stderr.split()), result.stderr
    assert "Traceback" not in result.output


def test_generate_missing_model(tmp_path):
    result = generate(tmp_path / "none", "--prompt", "x")
    assert result.exit_code == 2 and "not found" in result.stderr


def test_generate_takes_sampling_defaults_from_the_generation_config(model_dir, tmp_path):
    """``--generation-config`` as ``dsv41 serve``: the file's max_new_tokens is the default --max-tokens (not 128);
    an option given wins; 'vllm' ignores the file."""
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 2}))

    def run(*flags):
        result = generate(model_dir, "--prompt", "Hello world", "--json", *flags)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    first = run("--generation-config", str(folder))
    assert (first["generated_tokens"], first["finish_reason"]) == (2, "length")
    assert run("--generation-config", str(folder), "--max-tokens", "3")["generated_tokens"] == 3
    assert run("--generation-config", "vllm", "--max-tokens", "4")["generated_tokens"] == 4
    missing = generate(model_dir, "--prompt", "x", "--generation-config", str(tmp_path / "none"))
    assert missing.exit_code == 2 and "no generation_config.json in that folder" in missing.stderr
