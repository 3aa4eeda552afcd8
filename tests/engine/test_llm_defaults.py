"""``LLM`` as vLLM users expect it (issue 23): string dtypes and ``auto`` (the checkpoint's recorded dtype), the
"Processed prompts" bar only on a terminal, and sampling defaults from ``generation_config.json``."""

import io
import json

import pytest
import torch
from engine_oracles import tiny_model

from deepseek_v41 import LLM, SamplingParams, dtypes, load_model
from deepseek_v41.config import ModelConfig

PROMPT = {"prompt_token_ids": [5, 9, 17, 3, 11, 4]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny model saved in float64 (its config records torch_dtype float64) and a bf16 copy."""
    root = tmp_path_factory.mktemp("llm-defaults")
    model = tiny_model(torch.float64)
    model.save_pretrained(root / "f64")
    model.save_pretrained(root / "bf16", dtype=torch.bfloat16)
    return root


def weights_dtype(llm):
    return llm.model.embed.weight.dtype


def test_dtype_names_load_and_auto_takes_the_recorded_dtype(saved, monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: False)
    assert json.loads((saved / "f64" / "config.json").read_text())["torch_dtype"] == "float64"
    assert json.loads((saved / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert weights_dtype(LLM(saved / "f64", max_model_len=64)) == torch.float64  # float32 before: not "auto"
    assert weights_dtype(LLM(saved / "bf16", max_model_len=64)) == torch.bfloat16
    assert weights_dtype(LLM(saved / "f64", dtype="bfloat16", max_model_len=64)) == torch.bfloat16
    half = LLM(str(saved / "f64"), dtype="float16", max_model_len=64)
    assert weights_dtype(half) == torch.float16
    out = half.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3  # float16 runs on the CPU, so it is accepted there
    assert weights_dtype(LLM(saved / "f64", dtype=torch.float32, max_model_len=64)) == torch.float32
    assert load_model(saved / "bf16", dtype="auto").embed.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, .*, got 'bfloat'"):
        LLM(saved / "f64", dtype="bfloat")


def test_a_checkpoint_without_a_recorded_dtype_follows_the_machine(saved, tmp_path, monkeypatch):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(saved / "f64" / "model.safetensors")
    ModelConfig.from_pretrained(saved / "f64").save(folder)  # no torch_dtype: a checkpoint written before
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda native=native: native)
        assert weights_dtype(LLM(folder, max_model_len=64)) == expected


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(scope="module")
def llm(saved):
    return LLM(saved / "f64", max_model_len=64)


def test_progress_bar_only_on_a_terminal(llm, monkeypatch):
    params = SamplingParams(max_tokens=2)
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    llm.generate([PROMPT, PROMPT], params)  # the default: use_tqdm=True
    assert "Processed prompts" in terminal.getvalue() and "2/2" in terminal.getvalue()
    assert "est. speed input:" in terminal.getvalue()
    quiet = FakeTerminal()
    monkeypatch.setattr("sys.stderr", quiet)
    llm.generate(PROMPT, params, use_tqdm=False)
    assert quiet.getvalue() == ""
    log = io.StringIO()  # not a terminal: a log or a pipe stays clean
    monkeypatch.setattr("sys.stderr", log)
    llm.generate([PROMPT, PROMPT], params)
    assert log.getvalue() == ""


def test_use_tqdm_takes_a_callable(llm):
    from tqdm import tqdm

    made = []

    def factory(**kwargs):
        made.append(kwargs)
        return tqdm(**kwargs, file=io.StringIO())

    llm.generate([PROMPT] * 3, SamplingParams(max_tokens=1), use_tqdm=factory)
    assert made[0]["total"] == 3 and made[0]["desc"] == "Processed prompts"


def test_default_sampling_params_come_from_generation_config(saved, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to(saved / "f64" / name)
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "max_new_tokens": 3, "do_sample": False}))
    llm = LLM(folder, max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.0, 0.9, 5, 3)
    assert llm.get_default_sampling_params() is not defaults  # a fresh object: changing one changes no default
    out = llm.generate(PROMPT)[0].outputs[0]
    assert len(out.token_ids) == 3 or out.finish_reason == "stop"
    given = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert len(llm.generate(PROMPT, given)[0].outputs[0].token_ids) == 5  # an explicit params is used as given
    assert given.max_tokens == 5 and given.top_k == 0
    plain = LLM(folder, max_model_len=64, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, 0, 16)
    assert LLM(saved / "f64", max_model_len=64).get_default_sampling_params().max_tokens == 16  # no file
