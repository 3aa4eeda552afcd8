"""``dsv41 generate`` (typer's CliRunner, in this process): the text is streamed as it is produced and the stats
follow in mlx-lm's words; ``--prompt -`` reads stdin; ``--system-prompt`` goes into the chat prompt; the chat format
is the default exactly when the checkpoint has a chat template; ``--json`` prints exactly one JSON object with every
token id once (a ``turns`` list under ``--follow-up``); without ``--json`` the turns are separated on stderr; each
turn's DSpark mean accepted length is its own; bad options, unreadable prompt files and missing devices exit 2 with
a message instead of a traceback; ``--dtype`` takes serve's values."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from typer.testing import CliRunner

from deepseek_v41.chat import encode_messages
from deepseek_v41.cli import app
from deepseek_v41.cli import generate as generate_cli
from deepseek_v41.engine.engine import LLMEngine

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
    assert list(data) == ["turns"]  # each turn once: no copy of the last one at the top level
    turns = data["turns"]
    assert [t["turn"] for t in turns] == [1, 2]
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
    assert "turns" not in data and len(data["token_ids"]) == data["generated_tokens"] == 3


def test_follow_up_text_separates_the_turns(model_dir):
    result = generate(model_dir, "--prompt", PROMPT, "--max-tokens", "4", "--follow-up", " Again:",
                      "--speculative", "dspark")
    assert result.exit_code == 0, (result.output, result.exception)
    stderr = result.stderr
    assert stderr.count("--- turn 2 (prompt = turn 1 + completion + follow-up) ---") == 1
    lines = re.findall(r"==========\nPrompt: (\d+) tokens, [\d.]+ tokens-per-sec \((\d+) cached, .*\)\n"
                       r"Generation: 4 tokens, .*DSpark mean accepted length ([\d.]+) over (\d+) steps\)\n"
                       r"Peak memory: [\d.]+ GB", stderr)
    assert len(lines) == 2, stderr
    (before, _, _, _), (after, cached, _, _) = lines
    assert stderr.index("--- turn 2") > stderr.index(f"Prompt: {before} tokens")
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
    (["--prompt", "x", "--system-prompt", "Be brief."], "--system-prompt needs --chat (a system message is part of "
                                                        "the chat format): the checkpoint has no chat template"),
    (["--prompt", "x", "--system-prompt", "Be brief.", "--no-chat"], "--system-prompt needs --chat"),
    (["--prompt", "x", "--system-prompt", "Be brief.", "--ignore-chat-template"], "drop --no-chat"),
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


def test_text_is_streamed_as_it_is_produced(model_dir, monkeypatch):
    """The text reaches stdout in pieces while the engine still steps (not once at the end), and the pieces add up to
    the completion --json reports for the same greedy request."""
    steps, writes = [], []
    step = LLMEngine.step

    def counting_step(self):
        steps.append(1)
        return step(self)

    def recording_write(text):
        writes.append((text, len(steps)))
        write(text)

    write = generate_cli.write_text
    monkeypatch.setattr(LLMEngine, "step", counting_step)
    monkeypatch.setattr(generate_cli, "write_text", recording_write)
    result = generate(model_dir, "--prompt", PROMPT, "--max-tokens", "12")
    assert result.exit_code == 0, (result.output, result.exception)
    pieces = [text for text, _ in writes]
    assert len(pieces) >= 4 and all(pieces)
    assert writes[0][1] < len(steps) - 5  # the first piece was out before the last steps ran
    assert "".join(pieces) == result.stdout and result.stdout.endswith("\n")
    assert "==========\nPrompt: " in result.stderr and "Generation: 12 tokens" in result.stderr
    expected = json.loads(generate(model_dir, "--prompt", PROMPT, "--max-tokens", "12", "--json").stdout)["text"]
    assert result.stdout == expected + "\n"


def test_prompt_dash_reads_stdin(model_dir):
    text = "Hello world! Über naïve façades."
    from_stdin = CliRunner().invoke(app, ["generate", "--model", str(model_dir), "--prompt", "-", "--max-tokens", "3",
                                          "--json"], input=text.encode("utf-8"))
    assert from_stdin.exit_code == 0, (from_stdin.output, from_stdin.exception)
    given = json.loads(generate(model_dir, "-p", text, "--max-tokens", "3", "--json").stdout)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    data = json.loads(from_stdin.stdout)
    assert data["prompt_tokens"] == len(tokenizer.encode(text).ids) > 2
    assert data["token_ids"] == given["token_ids"]
    bad = CliRunner().invoke(app, ["generate", "--model", str(model_dir), "--prompt", "-"], input=b"caf\xe9")
    assert bad.exit_code == 2 and "stdin is not UTF-8 text (byte 0xe9 at offset 3)" in bad.stderr


@pytest.fixture
def prompts_sent(monkeypatch):
    """The prompt texts the engine receives (``LLMEngine.add_request``'s ``prompt``), in order."""
    sent = []
    add_request = LLMEngine.add_request

    def spy(self, request_id, prompt_token_ids, params, prompt=None, **kwargs):
        sent.append(prompt)
        return add_request(self, request_id, prompt_token_ids, params, prompt=prompt, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    return sent


def test_system_prompt_is_rendered_into_the_chat_prompt(model_dir, prompts_sent):
    result = generate(model_dir, "--prompt", "What is a file?", "--chat", "--system-prompt", "Answer briefly.",
                      "--max-tokens", "3", "--follow-up", "And a pipe?")
    assert result.exit_code == 0, (result.output, result.exception)
    system = {"role": "system", "content": "Answer briefly."}
    first = [system, {"role": "user", "content": "What is a file?"}]
    assert prompts_sent[0] == encode_messages(first)
    assert prompts_sent[0].startswith("<｜begin▁of▁sentence｜><｜System｜>Answer briefly.<｜User｜>What is a file?")
    reply = prompts_sent[1][len(prompts_sent[0]):].split("<｜end▁of▁sentence｜>")[0]
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And a pipe?"}]
    assert prompts_sent[1] == encode_messages(second)  # the system message stays in the conversation


def copy_model(model_dir, to, files: dict[str, str]):
    """``model_dir``'s files (linked) in ``to``, plus ``files`` (relative path -> text)."""
    to.mkdir()
    for path in model_dir.iterdir():
        (to / path.name).symlink_to(path)
    for name, text in files.items():
        (to / name).parent.mkdir(parents=True, exist_ok=True)
        (to / name).write_text(text)
    return to


TEMPLATE = json.dumps({"chat_template": "{{ messages }}", "bos_token": "<｜begin▁of▁sentence｜>"})


RAW, CHAT = "Hello world", encode_messages([{"role": "user", "content": "Hello world"}])


@pytest.mark.parametrize(("files", "chat"), [
    ({}, False),
    ({"tokenizer_config.json": json.dumps({"bos_token": "<｜begin▁of▁sentence｜>"})}, False),
    ({"tokenizer_config.json": TEMPLATE}, True),
    ({"tokenizer/tokenizer_config.json": TEMPLATE}, True),  # the official layout
    ({"chat_template.jinja": "{{ messages }}"}, True),
    ({"encoding/encoding.py": "IS_DSV41 = True\n"}, True),  # the official release: its encoder, no Jinja
])
def test_chat_is_the_default_when_the_checkpoint_has_a_chat_template(model_dir, tmp_path, prompts_sent, files,
                                                                       chat):
    folder = copy_model(model_dir, tmp_path / "model", files)
    result = generate(folder, "--prompt", "Hello world", "--max-tokens", "1", "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    assert prompts_sent == [CHAT if chat else RAW]


def test_chat_flags_override_the_checkpoint(model_dir, tmp_path, prompts_sent):
    """--chat / --use-default-chat-template force the chat format on a checkpoint without a template,
    --no-chat / --ignore-chat-template turn it off on one with a template (mlx-lm's names); --system-prompt
    needs no --chat where the chat format is the default."""
    templated = copy_model(model_dir, tmp_path / "model", {"tokenizer_config.json": TEMPLATE})
    for folder, flag, expected in [(model_dir, "--chat", CHAT), (model_dir, "--use-default-chat-template", CHAT),
                                   (templated, "--no-chat", RAW), (templated, "--ignore-chat-template", RAW)]:
        result = generate(folder, "--prompt", "Hello world", "--max-tokens", "1", "--json", flag)
        assert result.exit_code == 0, (flag, result.output, result.exception)
        assert prompts_sent.pop() == expected, flag
    result = generate(templated, "--prompt", "Hello world", "--system-prompt", "Be brief.", "--max-tokens", "1")
    assert result.exit_code == 0, (result.output, result.exception)
    assert prompts_sent.pop() == encode_messages([{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hello world"}])


def test_the_bundled_checkpoint_is_not_chat_by_default():
    """v41-tiny is a plain language model (its MODEL_CARD): `make run` and the README's examples continue raw
    text unless --chat is given."""
    bundled = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
    assert (bundled / "tokenizer_config.json").is_file()
    assert generate_cli.chat_template_source(bundled) is None


def test_broken_tokenizer_config_is_a_clear_error(model_dir, tmp_path):
    folder = copy_model(model_dir, tmp_path / "model", {"tokenizer_config.json": "{not json"})
    result = generate(folder, "--prompt", "x")
    assert result.exit_code == 2 and "tokenizer_config.json is not valid JSON" in result.stderr
    assert generate(folder, "--prompt", "x", "--no-chat", "--max-tokens", "1").exit_code == 0


@pytest.mark.parametrize("follow_up", [[], ["--follow-up", " Again:"]])
def test_json_lists_each_token_id_once(model_dir, follow_up):
    result = generate(model_dir, "--prompt", PROMPT, "--max-tokens", "5", "--json", *follow_up)
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(result.stdout)
    turns = data.get("turns", [data])
    assert len(turns) == (2 if follow_up else 1)
    assert result.stdout.count('"token_ids"') == len(turns)
    assert all(len(t["token_ids"]) == t["generated_tokens"] == 5 for t in turns)


def test_mlx_lm_names_and_positional_model(model_dir, tmp_path):
    """``dsv41 generate MODEL --prompt hi`` (the model positionally, as ``dsv41 serve MODEL``; ``--model`` still
    works), mlx-lm's ``-m`` for ``--max-tokens`` and ``--temp`` for ``--temperature``."""
    def run(*args):
        result = CliRunner().invoke(app, ["generate", *args])
        assert result.exit_code == 0, (result.output, result.exception)
        return json.loads(result.stdout)

    long_names = run("--model", str(model_dir), "--prompt", "Hello", "--json", "--max-tokens", "3",
                     "--temperature", "0")
    short_names = run(str(model_dir), "--prompt", "Hello", "--json", "-m", "3", "--temp", "0")
    assert short_names["generated_tokens"] == 3 and short_names["token_ids"] == long_names["token_ids"]
    both = run(str(model_dir), "--model", str(model_dir), "--prompt", "Hello", "--json", "-m", "1")
    assert both["generated_tokens"] == 1
    differs = CliRunner().invoke(app, ["generate", str(model_dir), "--model", str(tmp_path), "--prompt", "x"])
    assert differs.exit_code == 2 and "the model is given twice and differently" in differs.stderr
    missing = CliRunner().invoke(app, ["generate", "--prompt", "x"])
    assert missing.exit_code == 2 and "give the model directory: dsv41 generate MODEL" in missing.stderr
    negative = CliRunner().invoke(app, ["generate", str(model_dir), "--prompt", "x", "--temp", "-1"])
    assert negative.exit_code == 2 and "'--temperature' / '--temp'" in negative.stderr, negative.stderr


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tools_named_choice_prints_a_schema_valid_call(tmp_path):
    """The bundled chat checkpoint under a named tool_choice: the call is that function with schema-valid JSON."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    chat_model = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny-chat"
    result = generate(chat_model, "--chat", "--prompt", "Weather in Paris?", "--tools", str(tools),
                      "--tool-choice", "get_weather", "--max-tokens", "160", "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(result.stdout)
    assert data["finish_reason"] == "stop"
    assert [c["name"] for c in data["tool_calls"]] == ["get_weather"]
    assert isinstance(json.loads(data["tool_calls"][0]["arguments"])["city"], str)


@pytest.mark.parametrize("flags, message", [
    (["--tool-choice", "auto"], "--tool-choice needs --tools"),
    (["--no-chat", "--tools", "TOOLS"], "--tools needs --chat"),
    (["--chat", "--tools", "TOOLS", "--tool-choice", "nope"], "nope"),
    (["--chat", "--tools", "BAD"], "cannot read a JSON tools list"),
])
def test_tools_refuse_bad_input_cleanly(model_dir, tmp_path, flags, message):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    (tmp_path / "bad.json").write_text("[{")
    flags = [str(tmp_path / "tools.json") if f == "TOOLS" else str(tmp_path / "bad.json") if f == "BAD" else f
             for f in flags]
    result = generate(model_dir, "--prompt", "hi", *flags)
    assert result.exit_code == 2
    assert message in result.output
