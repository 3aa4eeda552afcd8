"""Loading checkpoints in the Hugging Face layout with the official tensor names (MODEL_REFERENCE.md §4, §8);
writing them: :mod:`deepseek_v41.model.save`.

A model directory holds ``config.json`` (the multimodal wrapper or a flat text config) and the weights: the
shards named by ``model.safetensors.index.json`` when present, else every ``*.safetensors`` file in the
directory. Each tensor is decoded by what it is, so plain and quantized tensors mix freely:

- ``float8_e4m3fn`` weight + ``.scale`` (UE8M0 or fp32) per 32x32 block: dense FP8 weights;
- packed ``int8``/``uint8`` weight [out, in/2] + ``.scale`` [out, in/32]: routed experts in FP4 (E2M1, 1x32 UE8M0);
- Engram tables stored FP8 with per-row 1x32 scales stay FP8 in memory (a lookup dequantizes only its rows);
- anything else (bf16, fp16, fp32): used as stored, cast to the load dtype.

Loading is lazy: the model is built on ``meta``, each tensor is read from the memory-mapped file, decoded and
assigned, so the peak is about one model plus the largest tensor — not twice the file. ``mHC`` parameters,
attention sinks and router biases stay fp32 in every dtype (the reference keeps them fp32).

Memory as loaded: every decoded weight takes ``dtype`` bytes per parameter, Engram FP8 tables 1 byte per value
plus 1 scale byte per 32. ``dsv41 report`` prints the total for the official config (``memory.*``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from deepseek_v41.config import ModelConfig
from deepseek_v41.disagg.encoder_only import dropped_bytes, prune_to_encoder, weight_bytes
from deepseek_v41.dtypes import resolve_dtype
from deepseek_v41.model.engram import EngramTable
from deepseek_v41.model.engram_hash import build_token_map
from deepseek_v41.model.save import ENGRAM_TABLE, keeps_fp32
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.model.vision import checkpoint_name_candidates
from deepseek_v41.quant import dequantize_fp4_expert_weight, dequantize_fp8_weight

log = logging.getLogger(__name__)

class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: ``problems`` lists every missing, unexpected, mis-shaped or
    undecodable tensor at once."""

    def __init__(self, path: Path, problems: list[str]):
        self.problems = problems
        shown = problems[:50] + ([f"... and {len(problems) - 50} more"] if len(problems) > 50 else [])
        super().__init__(f"checkpoint {path} does not fit the model:\n" + "\n".join(f"  - {p}" for p in shown))


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file: from ``model.safetensors.index.json`` when present, else every ``*.safetensors``.

    Raises FileNotFoundError when the directory has no weights, CheckpointError when a name is in two files.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files (and no model.safetensors.index.json) in {path}")
    out: dict[str, Path] = {}
    twice = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in out:
                    twice.append(f"tensor {name} is in both {out[name].name} and {file.name}")
                out[name] = file
    if twice:
        raise CheckpointError(path, twice)
    return out


class _Reader:
    """Lazily opened safetensors files; reads one tensor at a time from the memory map."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._open: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_tensor(name)

    def slice(self, name: str):
        """The lazily sliceable view of one tensor (``safe_open(...).get_slice``): nothing read until indexed
        (tensor-parallel loading reads a rank's rows / columns only, deepseek_v41/distributed/loader.py)."""
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> list[int]:
        return self.slice(name).get_shape()


def _decode(name: str, reader: _Reader, dtype: torch.dtype, block: tuple[int, int]) -> torch.Tensor:
    """Decode one stored tensor (with its ``.scale`` companion when it has one) to the load dtype."""
    raw = reader.get(name)
    scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
    if scale_name is not None and scale_name in reader.files and not ENGRAM_TABLE.match(name):
        scale = reader.get(scale_name)
        if raw.dtype == torch.float8_e4m3fn:
            return dequantize_fp8_weight(raw, scale, block, dtype)
        if raw.dtype in (torch.int8, torch.uint8):
            return dequantize_fp4_expert_weight(raw, scale, dtype)
        raise ValueError(f"has a .scale tensor but dtype {raw.dtype} (expected float8_e4m3fn or packed int8)")
    if raw.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn) and not ENGRAM_TABLE.match(name):
        raise ValueError(f"is stored as {raw.dtype} without the .scale tensor that decodes it")
    if ENGRAM_TABLE.match(name) or name.endswith("engram.embed.scale"):
        return raw
    return raw.to(torch.float32 if keeps_fp32(name) else dtype)


def _engram_fp8_layers(model: torch.nn.Module, files: dict[str, Path]) -> None:
    """Switch the Engram tables that the checkpoint stores in FP8 to the FP8 table format before loading."""
    for name, module in model.named_modules():
        if isinstance(module, EngramTable) and f"{name}.scale" in files and module.table_format == "float":
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, leaf, EngramTable(module.num_rows, module.head_dim, "fp8", device="meta"))


def skeleton(path: Path, dtype: torch.dtype | str, device: torch.device | str
             ) -> tuple[ModelConfig, torch.dtype, dict[str, Path], Transformer, tuple[int, int]]:
    """What loading the directory ``path`` starts from: its config, ``dtype`` resolved, its tensor files by name,
    the model on ``meta`` (Engram tables in the format the checkpoint stores) and the FP8 weight block size.
    Raises what :func:`load_model` raises for a missing or bad config / weights / dtype."""
    cfg = ModelConfig.from_pretrained(path)
    dtype = resolve_dtype(dtype, device, path)
    files = weight_files(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    _engram_fp8_layers(model, files)
    block = tuple(cfg.quantization_config.weight_block_size) if (
        cfg.quantization_config and cfg.quantization_config.weight_block_size) else (32, 32)
    return cfg, dtype, files, model, block


def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
               fake_quant: bool = True, encoder_only: bool = False):
    """Load a model directory (``config.json`` + safetensors) into a :class:`~deepseek_v41.model.transformer.
    Transformer` with weights of ``dtype`` on ``device`` (see the module docstring for the formats).

    ``dtype``: a torch dtype or a name (``"auto"``, ``"bfloat16"``, ``"float32"``, ``"float16"``, ``"float64"``),
    resolved by :func:`deepseek_v41.dtypes.resolve_dtype` (``auto``: the config's ``torch_dtype``, else bf16 where
    the device computes it natively, else fp32). The default stays float32, the exact compute dtype that
    training and evaluation load in; ``LLM`` defaults to ``auto``. The Engram token map comes from the
    directory's ``tokenizer.json`` (or ``tokenizer/tokenizer.json``) when present. Raises FileNotFoundError (no
    config / weights), ConfigError (bad config), ValueError (a dtype that is none of those, naming the allowed
    ones) and CheckpointError listing every missing, unexpected, mis-shaped or undecodable tensor.

    ``encoder_only``: the encoder-only prefill model of a ``kv_producer`` (issue 29,
    :mod:`deepseek_v41.disagg.encoder_only`): the skeleton is pruned before reading, only the tensors it keeps are
    read (the checkpoint's tensors of the dropped modules are expected, not "unexpected"); ValueError with the
    plan's ``ced_reason`` for a config without a CED layout. Either way the model records ``encoder_only``,
    ``loaded_weight_bytes`` (bytes of its parameters and buffers as held in memory) and ``full_weight_bytes``
    (what the full model takes loaded: the same for a full load), which
    :func:`~deepseek_v41.disagg.encoder_only.describe_load` prints.
    """
    path = Path(path)
    cfg, dtype, files, model, block = skeleton(path, dtype, device)
    known = list(model.state_dict())  # every tensor name of the full model: none of them is "unexpected"
    if encoder_only:
        prune_to_encoder(model)
    expected = model.state_dict()
    reader = _Reader(files)
    problems, tensors = [], {}
    aliases = {}
    for name, like in expected.items():
        stored = next((n for n in checkpoint_name_candidates(name) if n in files), None)
        if stored is None:
            problems.append(f"missing tensor {name} (expected shape {list(like.shape)})")
            continue
        aliases[stored] = name
        try:
            value = _decode(stored, reader, dtype, block)
        except ValueError as exc:
            problems.append(f"tensor {name} {exc}")
            continue
        if tuple(value.shape) != tuple(like.shape):
            problems.append(f"tensor {name} has shape {list(value.shape)}, the model expects {list(like.shape)}")
            continue
        tensors[name] = value.to(device)
    # The .scale of a weight that is missing or mis-shaped is not "unexpected": the weight's problem says it all.
    named = set(aliases) | {c for name in known for c in checkpoint_name_candidates(name)}
    consumed = named | {n[: -len("weight")] + "scale" for n in named if n.endswith(".weight")}
    for name in sorted(set(files) - consumed):
        problems.append(f"unexpected tensor {name} in {files[name].name}")
    if problems:
        raise CheckpointError(path, problems)
    model.load_state_dict(tensors, assign=True, strict=True)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device)
    model.fake_quant = fake_quant
    model.encoder_only = encoder_only
    model.loaded_weight_bytes = weight_bytes(model)
    model.full_weight_bytes = model.loaded_weight_bytes + dropped_bytes(model, dtype)
    model.name_or_path = str(path)  # Hugging Face's name: save_pretrained copies the tokenizer files from here
    _install_token_map(model, path)
    return model.eval()


def _install_token_map(model, path: Path) -> None:
    if model.hasher is None:
        return
    for candidate in (path / "tokenizer.json", path / "tokenizer" / "tokenizer.json"):
        if candidate.is_file():
            model.hasher.set_token_map(build_token_map(candidate))
            return


