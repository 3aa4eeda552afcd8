"""The load dtype (issue 23): vLLM's dtype names, ``auto`` from the checkpoint's ``torch_dtype`` / ``dtype`` or
the device's native bf16 support, the CLI's ``--dtype``, and the dtype a saved checkpoint records."""

import json
from pathlib import Path

import pytest
import torch
import typer
from safetensors import safe_open

from deepseek_v41 import dtypes
from deepseek_v41.dtypes import config_dtype, cpu_has_native_bf16, resolve_dtype
from deepseek_v41.model.checkpoint import keeps_fp32

BUNDLED = Path(__file__).resolve().parents[1] / "checkpoints" / "v41-tiny"


def write_config(folder: Path, top: dict | None = None, text: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"model_type": "deepseek_v41", **(top or {}), "text_config": {"vocab_size": 64, **(text or {})}}
    (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.fixture
def native_bf16(monkeypatch):
    """Set what the CPU bf16 probe answers: ``native_bf16(True)`` / ``native_bf16(False)``."""
    return lambda value: monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: value)


@pytest.mark.parametrize(("name", "expected"), [
    ("bfloat16", torch.bfloat16), ("float32", torch.float32), ("float16", torch.float16), ("float64", torch.float64),
    ("half", torch.float16), ("float", torch.float32), ("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16),
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    ("torch.float32", torch.float32), ("torch.bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
    ("torch.float64", torch.float64)])
def test_names_and_torch_dtypes(name, expected):
    assert resolve_dtype(name, "cpu") == expected


def test_auto_without_a_recorded_dtype_follows_native_bf16_support(tmp_path, native_bf16):
    folder = write_config(tmp_path / "m")
    native_bf16(True)
    assert resolve_dtype("auto", "cpu", folder) == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    native_bf16(False)
    assert resolve_dtype("auto", "cpu", folder) == torch.float32
    assert resolve_dtype("auto", "cpu") == torch.float32


@pytest.mark.parametrize(("top", "text", "expected"), [
    ({"torch_dtype": "float32"}, {}, torch.float32),
    ({"dtype": "bfloat16"}, {}, torch.bfloat16),  # newer transformers write "dtype"
    ({}, {"torch_dtype": "float16"}, torch.float16),
    ({"torch_dtype": "float64"}, {"torch_dtype": "bfloat16"}, torch.float64)])  # top level first
def test_auto_takes_the_checkpoint_dtype_whatever_the_machine(tmp_path, native_bf16, top, text, expected):
    folder = write_config(tmp_path / "m", top, text)
    for native in (True, False):
        native_bf16(native)
        assert resolve_dtype("auto", "cpu", folder) == expected
    assert resolve_dtype("float32", "cpu", folder) == torch.float32  # an explicit dtype wins over the config


ALLOWED = "dtype must be one of auto, float32, bfloat16, float16, float64 (aliases: half, fp16, float, fp32, bf16, "


@pytest.mark.parametrize(("dtype", "got"), [
    ("bf17", "got 'bf17'"),
    ("cuda", "got 'cuda'"),  # torch took this for a device before: "Invalid device string"
    (torch.int8, "got torch.int8"),
    (32, "got int 32"),
])
def test_bad_dtypes_name_what_is_allowed(dtype, got):
    with pytest.raises(ValueError) as info:
        resolve_dtype(dtype, "cpu")
    assert str(info.value).startswith(ALLOWED) and str(info.value).endswith(
        f"or a torch.dtype (torch.bfloat16, torch.float16, torch.float32, torch.float64), {got}")


def test_cli_dtype_messages_offer_no_torch_dtype():
    """A flag takes a name only: the message of ``--dtype`` does not offer a torch.dtype (``LLM`` alone takes one);
    ``torch.int8`` as a string is refused with the names."""
    for bad in ("int8", "torch.int8"):
        with pytest.raises(ValueError) as info:
            resolve_dtype(bad, "cpu", option="--dtype")
        assert str(info.value).startswith(f"--{ALLOWED}") and "torch.dtype" not in str(info.value), info.value
        assert str(info.value).endswith(f"bf16, double), got {bad!r}")


def test_an_unloadable_recorded_dtype_is_refused_with_the_way_out(tmp_path):
    folder = write_config(tmp_path / "m", {"torch_dtype": "float8_e4m3fn"})
    with pytest.raises(ValueError, match="records torch_dtype 'float8_e4m3fn', which this model does not load in; "
                                         "pass an explicit dtype \\(one of bfloat16, float16, float32, float64\\)"):
        resolve_dtype("auto", "cpu", folder)
    assert resolve_dtype("bfloat16", "cpu", folder) == torch.bfloat16


def test_config_loader_accepts_the_dtype_keys(tmp_path):
    from deepseek_v41.config import ModelConfig, tiny_config

    tiny_config().save(tmp_path, torch_dtype="bfloat16")
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["torch_dtype"] == "bfloat16" and config_dtype(tmp_path) == "bfloat16"
    data["text_config"]["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert ModelConfig.from_pretrained(tmp_path) == tiny_config()
    assert "torch_dtype" not in tiny_config().to_dict()  # metadata only when a save gives it


@pytest.mark.parametrize(("cpuinfo", "native"), [
    ("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n", True),
    ("processor\t: 0\nflags\t\t: fpu sse avx2 amx_bf16\n", True),
    ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", True),  # Arm
    ("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n", False),  # bf16 only emulated
    ("processor\t: 0\nFeatures\t: fp asimd\n", False)])
def test_cpu_probe_reads_the_cpuinfo_flags(tmp_path, monkeypatch, cpuinfo, native):
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    monkeypatch.setattr(dtypes, "CPUINFO", tmp_path / "cpuinfo")
    assert cpu_has_native_bf16() is native


def test_serve_cli_resolution(tmp_path, native_bf16, capsys):
    from deepseek_v41.cli.serve import resolve_dtype as cli_resolve

    cpu = torch.device("cpu")
    native_bf16(False)
    assert cli_resolve("auto", cpu, write_config(tmp_path / "a", {"torch_dtype": "bfloat16"})) == torch.bfloat16
    assert cli_resolve("auto", cpu, write_config(tmp_path / "b")) == torch.float32
    native_bf16(True)
    assert cli_resolve("auto", cpu, write_config(tmp_path / "b")) == torch.bfloat16
    assert cli_resolve("float16", cpu, tmp_path / "b") == torch.float16
    with pytest.raises(typer.Exit) as exit_info:
        cli_resolve("bf17", cpu, tmp_path / "b")
    assert exit_info.value.exit_code == 2
    assert f"error: --{ALLOWED}" in capsys.readouterr().err


def test_generate_cli_defaults_to_auto(tmp_path, monkeypatch, native_bf16):
    """``dsv41 generate`` without --dtype loads the checkpoint's recorded dtype (it loaded float32 before)."""
    from typer.testing import CliRunner

    import deepseek_v41.cli.generate
    from deepseek_v41.cli import app

    seen = []

    def fake_llm(model, dtype, **_):
        seen.append(dtype)
        raise ValueError("stopped after the dtype")

    monkeypatch.setattr(deepseek_v41.cli.generate, "LLM", fake_llm)
    native_bf16(False)
    folder = write_config(tmp_path / "m", {"torch_dtype": "float64"})
    for flags, expected in (([], torch.float64), (["--dtype", "auto"], torch.float64),
                            (["--dtype", "bfloat16"], torch.bfloat16)):
        result = CliRunner().invoke(app, ["generate", "--model", str(folder), "--prompt", "hi", *flags])
        assert result.exit_code == 2 and "stopped after the dtype" in result.output, result.output
        assert seen.pop() == expected
    bad = CliRunner().invoke(app, ["generate", "--model", str(folder), "--prompt", "hi", "--dtype", "int8"])
    assert bad.exit_code == 2 and f"--{ALLOWED}" in bad.output and "got 'int8'" in bad.output and not seen


def test_the_bundled_checkpoint_records_the_dtype_its_weights_are_stored_in():
    """``auto`` on the bundled model is the same on every machine: its config names its stored dtype."""
    stored = set()
    with safe_open(BUNDLED / "model.safetensors", "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if not keeps_fp32(name):
                stored.add(str(f.get_slice(name).get_dtype()))
    assert stored == {"BF16"} and config_dtype(BUNDLED) == "bfloat16"
