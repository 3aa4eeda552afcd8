"""Loading and saving checkpoints in the official layout (issue 3; MODEL_REFERENCE.md §4, §8)."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepseek_v41 import load_model
from deepseek_v41.config import tiny_config
from deepseek_v41.model.checkpoint import CheckpointError
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.quant import dequantize_fp4_expert_weight, dequantize_fp8, dequantize_fp8_weight


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(tiny_config()).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (2, 37), generator=torch.Generator().manual_seed(1))


def read_all(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                out[name] = f.get_tensor(name)
    return out


def test_plain_round_trip_is_exact(model, ids, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert_same_model(loaded, model, ids)
    assert loaded.config == model.config


def assert_same_model(loaded, model, ids):
    """The same weights bit for bit; outputs to rounding: the loaded weights sit at other addresses, and MKL picks
    its GEMM kernels by alignment on some CPUs (AMD EPYC here), so a forward may add in another order."""
    want = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(t, want[name]) for name, t in got.items())
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=1e-5)


def test_sharded_save_writes_an_index_and_loads(model, ids, tmp_path):
    files = model.save_pretrained(tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json") in files and len(files) > 3
    assert_same_model(load_model(tmp_path), model, ids)


def test_official_format_equals_its_dequantized_twin(model, ids, tmp_path):
    quantized, twin = tmp_path / "fp8", tmp_path / "twin"
    model.save_pretrained(quantized, quantization="official")
    stored = read_all(quantized)
    # The release's formats, by dtype: FP8 dense weights, packed FP4 experts, an FP8 Engram table.
    assert stored["layers.2.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.2.attn.wq_b.scale"].shape == (-(-4 * 32 // 32), -(-32 // 32))
    assert stored["layers.3.ffn.experts.5.w1.weight"].dtype == torch.int8
    assert stored["layers.3.ffn.experts.5.w1.weight"].shape == (32, 32)
    assert stored["layers.1.engram.embed.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.2.attn.compressor.wkv.weight"].dtype == torch.float32  # unquantized in the release
    # The twin: every quantized tensor decoded by hand with the codecs, stored as plain fp32.
    plain = {}
    for name, value in stored.items():
        if name.endswith(".scale"):
            continue
        scale = stored.get(name[: -len("weight")] + "scale")
        if scale is None:
            plain[name] = value
        elif "engram.embed" in name:
            plain[name] = dequantize_fp8(value.view(torch.uint8), scale.view(torch.uint8), 32, "ue8m0")
        elif value.dtype == torch.int8:
            plain[name] = dequantize_fp4_expert_weight(value, scale)
        else:
            plain[name] = dequantize_fp8_weight(value, scale)
    twin.mkdir()
    save_file(plain, twin / "model.safetensors")
    model.config.save(twin)
    fp8_model, twin_model = load_model(quantized), load_model(twin)
    assert fp8_model.layers[1].engram.embed.table_format == "fp8"
    assert torch.allclose(fp8_model(ids), twin_model(ids), atol=1e-5, rtol=0)
    # Quantization really happened: the weights moved, yet the model still works.
    assert not torch.equal(fp8_model.layers[2].attn.wq_b.weight, model.layers[2].attn.wq_b.weight)


def test_broken_checkpoint_lists_every_problem(model, tmp_path):
    model.save_pretrained(tmp_path, quantization="official")
    tensors = read_all(tmp_path)
    del tensors["layers.0.attn.wkv.weight"]
    del tensors["layers.3.ffn.experts.1.w2.scale"]
    tensors["layers.4.attn.attn_sink"] = torch.zeros(7)
    tensors["layers.9.attn.wkv.weight"] = torch.zeros(2, 2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path)
    text = "\n".join(info.value.problems)
    assert "missing tensor layers.0.attn.wkv.weight" in text
    assert "layers.3.ffn.experts.1.w2.weight is stored as torch.int8 without the .scale" in text
    assert "layers.4.attn.attn_sink has shape [7], the model expects [4]" in text
    assert "unexpected tensor layers.9.attn.wkv.weight" in text
    assert len(info.value.problems) == 4


def test_a_second_file_with_the_same_name_is_refused(model, tmp_path):
    model.save_pretrained(tmp_path)
    save_file({"norm.weight": torch.ones(64)}, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match="norm.weight is in both"):
        load_model(tmp_path)


def test_bf16_load_keeps_fp32_parameters(model, ids, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    assert loaded.layers[2].attn.wq_a.weight.dtype == torch.bfloat16
    for name in ("hc_attn_fn", "hc_ffn_base", "hc_attn_scale"):
        assert getattr(loaded.layers[2], name).dtype == torch.float32
    assert loaded.layers[2].attn.attn_sink.dtype == torch.float32
    assert loaded.layers[2].ffn.gate.bias.dtype == torch.float32
    out = loaded(ids)
    assert torch.isfinite(out).all()
    ref = model(ids)
    # bf16 rounding (and the MoE routing flips it causes in a random model) moves logits by a few percent; an
    # unrelated model would be ~140% away.
    assert (out - ref).norm() / ref.norm() < 0.15


def test_missing_weights_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    tiny_config().save(tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(CheckpointError, match="missing tensor embed.weight"):
        load_model(tmp_path)


def test_a_loaded_model_saves_a_directory_that_serves(tmp_path):
    """save_pretrained of a loaded model copies its tokenizer / generation files, so the saved directory loads
    (Engram token map from tokenizer.json) and generates like the source directory; files already there stay."""
    from pathlib import Path

    from deepseek_v41.engine import LLM, SamplingParams

    bundled = Path(__file__).resolve().parents[2] / "checkpoints" / "v41-tiny"
    source = load_model(bundled)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "generation_config.json").write_text("{}")
    source.save_pretrained(tmp_path / "plain")
    source.save_pretrained(tmp_path / "official", quantization="official")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "plain" / name).read_bytes() == (bundled / name).read_bytes()
    assert (tmp_path / "plain" / "generation_config.json").read_text() == "{}"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = "The io module provides"
    # ``source`` is the bundled bf16 weights in fp32 and "plain" records torch_dtype float32: compare in fp32.
    expected = LLM(bundled, dtype="float32", max_model_len=64).generate(prompt, params)[0].outputs[0].token_ids
    assert LLM(tmp_path / "plain", max_model_len=64).generate(prompt, params)[0].outputs[0].token_ids == expected
    assert len(LLM(tmp_path / "official", max_model_len=64).generate(prompt, params)[0].outputs[0].token_ids) == 6


def test_named_weights_is_named_parameters():
    """save.named_weights (which the model package uses instead of a torch-internals read) lists what
    Module.named_parameters does, in the same order, for a model whose draft shares the embedding and head."""
    from deepseek_v41.config import tiny_config
    from deepseek_v41.model.save import named_weights
    from deepseek_v41.model.transformer import Transformer

    model = Transformer(tiny_config())
    got = named_weights(model)
    want = list(model.named_parameters())
    assert [n for n, _ in got] == [n for n, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(got, want, strict=True))
