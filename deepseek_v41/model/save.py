"""Writing a model as a checkpoint in the Hugging Face layout with the official tensor names (MODEL_REFERENCE.md
§4, §8), and which tensors take which stored format; :mod:`deepseek_v41.model.checkpoint` reads them back.

It imports no model class (``save_pretrained`` takes the model), so that
:meth:`~deepseek_v41.model.transformer.Transformer.save_pretrained` can call it while the loader builds a
``Transformer``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepseek_v41.config import QuantizationConfig
from deepseek_v41.quant import quantize_fp4_expert_weight, quantize_fp8, quantize_fp8_weight

# Parameters the reference keeps in fp32 whatever the model dtype (MODEL_REFERENCE.md §4, last table row).
_FP32_SUFFIXES = ("_fn", "_base", "_scale", "attn_sink", "gate.bias", "gate.bias_vl")
# Dense weights the release stores as FP8 32x32 blocks, and routed experts stored as packed FP4 (§4, §8).
_FP8_WEIGHTS = re.compile(
    r".*(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123]|engram\.wkv|main_proj)\.weight$")
_FP4_EXPERTS = re.compile(r".*ffn\.experts\.\d+\.w[123]\.weight$")
ENGRAM_TABLE = re.compile(r".*engram\.embed\.weight$")
_PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``model``'s parameters with their state-dict names, in the order ``Module.parameters()`` yields them, each
    once (a parameter shared by two modules under its first name); buffers left out."""
    seen: set[int] = set()
    out = []
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter) and id(value) not in seen:
            seen.add(id(value))
            out.append((name, value))
    return out


def keeps_fp32(name: str) -> bool:
    """True for parameters stored and used in fp32 in every model dtype."""
    return name.endswith(_FP32_SUFFIXES) and not name.endswith(".scale")


def _official_tensors(name: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors the official format stores for one parameter: FP8 / FP4 weights with their scales."""
    if _FP4_EXPERTS.match(name):
        packed, scale = quantize_fp4_expert_weight(value)
        yield name, packed
        yield name[: -len("weight")] + "scale", scale
    elif _FP8_WEIGHTS.match(name):
        weight, scale = quantize_fp8_weight(value)
        yield name, weight
        yield name[: -len("weight")] + "scale", scale
    elif ENGRAM_TABLE.match(name) and value.dtype != torch.float8_e4m3fn:
        codes, scales = quantize_fp8(value.float(), 32, "ue8m0")
        yield name, codes.view(torch.float8_e4m3fn)
        yield name[: -len("weight")] + "scale", scales.view(torch.float8_e8m0fnu)
    else:
        yield name, value


def save_pretrained(model, path: str | Path, quantization: str = "none",
                    max_shard_bytes: int = 4 * 1024**3, dtype: torch.dtype | None = None) -> list[Path]:
    """Write ``config.json`` and the weights under the official names into directory ``path``.

    ``quantization="none"`` stores every tensor as it is in memory; ``"official"`` stores the release's
    formats: FP8 32x32-block dense weights, packed FP4 routed experts, FP8 Engram tables (the config then
    records a ``quantization_config``). Shards above ``max_shard_bytes`` bytes split into several files with a
    ``model.safetensors.index.json``. ``dtype`` (e.g. bf16) casts the parameters on the way out, except those
    :func:`keeps_fp32` names (mHC, sinks, router biases); the model itself is not changed. The config records
    the dtype the weights are stored in as ``torch_dtype`` (as Hugging Face does), which ``dtype="auto"`` loads
    them in again. A model loaded by :func:`~deepseek_v41.model.checkpoint.load_model` also gets its directory's
    ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` copied over (files already in
    ``path`` are kept). Returns the files written.
    Raises ValueError for an unknown quantization.
    """
    if quantization not in ("none", "official"):
        raise ValueError(f"quantization must be 'none' or 'official', got {quantization!r}")
    path = Path(path)
    cfg = model.config
    if quantization == "official":
        cfg = cfg.replace(quantization_config=QuantizationConfig(
            quant_method="fp8", activation_scheme="dynamic", weight_block_size=(32, 32), scale_fmt="ue8m0",
            expert_dtype="fp4"))
    cfg.save(path, torch_dtype=_stored_dtype(model, dtype))
    # A previous save's shards or index would shadow (or mix with) the new weights.
    for stale in [*path.glob("model-*-of-*.safetensors"), path / "model.safetensors",
                  path / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    parameters = {name for name, _ in named_weights(model)}
    for name, value in model.state_dict().items():
        if dtype is not None and name in parameters and not keeps_fp32(name):
            value = value.to(dtype)
        items = _official_tensors(name, value) if quantization == "official" else [(name, value)]
        for key, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            tensor = tensor.detach().contiguous().cpu()
            if tensor.untyped_storage().nbytes() != nbytes:  # a view into a larger storage (stacked experts):
                tensor = tensor.clone()  # safetensors stores each tensor on its own
            shards[-1][key] = tensor
            size += nbytes
    written = []
    if len(shards) == 1:
        written.append(path / "model.safetensors")
        save_file(shards[0], written[0], metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = path / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file.name))
            written.append(file)
        index = path / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        written.append(index)
    written += _copy_companions(model, path)
    return written


def _stored_dtype(model, dtype: torch.dtype | None) -> str | None:
    """The ``torch_dtype`` a saved config records, as Hugging Face's ``save_pretrained`` does: ``dtype`` when the
    weights are cast to it, else the dtype of the model's floating parameters outside :func:`keeps_fp32` (the
    dtype ``LLM(dtype="auto")`` then loads them in again); None for a model without such parameters."""
    if dtype is None:
        dtype = next((p.dtype for name, p in named_weights(model)
                      if p.dtype in _PLAIN_DTYPES and not keeps_fp32(name)), None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _copy_companions(model, path: Path) -> list[Path]:
    """Copy the tokenizer and generation files of the directory ``model`` was loaded from (``name_or_path``)
    into ``path`` when ``path`` lacks them, so the saved directory loads and serves on its own (the Engram token
    map is built from ``tokenizer.json``)."""
    source = getattr(model, "name_or_path", None)
    if not source or not Path(source).is_dir() or Path(source).resolve() == path.resolve():
        return []
    copied = []
    for name in COMPANION_FILES:
        if (Path(source) / name).is_file() and not (path / name).exists():
            shutil.copyfile(Path(source) / name, path / name)
            copied.append(path / name)
    return copied
