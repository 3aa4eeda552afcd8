"""Loading the vision path alone (ViT + aligner + delimiters) for an encode server (issue 29, ``ec_producer``).

An encode server computes aligner rows and nothing else, so it reads only the checkpoint's ``vision.*``,
``aligner.*``, ``image_start``, ``image_newline`` and ``image_end`` tensors (MODEL_REFERENCE.md §3.18, §8): at the
official size 485,268,480 parameters (~0.97 GB in bf16) instead of the whole model. Tensors are decoded as
:func:`deepseek_v41.model.checkpoint.load_model` decodes them (FP8 blocks, plain tensors cast to the load dtype),
from the memory-mapped shards, one at a time.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from deepseek_v41.config import ModelConfig
from deepseek_v41.dtypes import resolve_dtype
from deepseek_v41.model.checkpoint import CheckpointError, _decode, _Reader, weight_files
from deepseek_v41.model.vision import VisionModel, checkpoint_name_candidates

log = logging.getLogger(__name__)


def load_vision_only(path: str | Path, dtype: torch.dtype | str = "auto", device: torch.device | str = "cpu"
                     ) -> VisionModel:
    """The :class:`~deepseek_v41.model.vision.VisionModel` of the model directory ``path`` with weights of ``dtype``
    on ``device``, in eval mode; ``model.config`` is the full :class:`~deepseek_v41.config.ModelConfig` (the LLM
    width sets the aligner's output) and ``model.name_or_path`` the directory.

    Only the vision tensors are read (module docstring); the others are not touched. ``dtype`` as
    :func:`~deepseek_v41.model.checkpoint.load_model` takes it (``"auto"``: the config's ``torch_dtype``, else bf16
    where the device computes it natively, else fp32). Raises FileNotFoundError (no config / weights),
    ConfigError, ValueError (a model without ``vision_config``, a bad dtype) and CheckpointError listing every
    missing, mis-shaped or undecodable vision tensor.
    """
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    if config.vision_config is None:
        raise ValueError(f"{path} has no vision_config: the model has no vision tower, so there is nothing for an "
                         f"encode server (ec_producer) to run")
    dtype = resolve_dtype(dtype, device, path)
    files = weight_files(path)
    block = tuple(config.quantization_config.weight_block_size) if (
        config.quantization_config and config.quantization_config.weight_block_size) else (32, 32)
    with torch.device("meta"):
        model = VisionModel(config)
    reader, problems, tensors = _Reader(files), [], {}
    for name, like in model.state_dict().items():
        stored = next((n for n in checkpoint_name_candidates(name) if n in files), None)
        if stored is None:
            problems.append(f"missing tensor {name} (expected shape {list(like.shape)})")
            continue
        try:
            value = _decode(stored, reader, dtype, block)
        except ValueError as exc:
            problems.append(f"tensor {name} {exc}")
            continue
        if tuple(value.shape) != tuple(like.shape):
            problems.append(f"tensor {name} has shape {list(value.shape)}, the model expects {list(like.shape)}")
            continue
        tensors[name] = value.to(device)
    if problems:
        raise CheckpointError(path, problems)
    model.load_state_dict(tensors, assign=True, strict=True)
    model.config, model.name_or_path = config, str(path)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    log.info("encode server: loaded the vision tower and aligner only: %d tensors, %d parameters, %.1f MB (%s, %s)",
             len(tensors), sum(t.numel() for t in tensors.values()), nbytes / 1e6, str(dtype).removeprefix("torch."),
             device)
    return model.eval()
