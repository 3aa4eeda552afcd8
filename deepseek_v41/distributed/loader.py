"""Loading one rank's shard straight from the checkpoint (issue 28): :func:`load_sharded`.

``shard_model(load_model(path), state)`` reads and decodes every tensor of the checkpoint in every rank before
slicing; :func:`load_sharded` builds the sharded model on ``meta`` and reads only the rank's rows / columns of each
tensor (``safe_open(...).get_slice``), so a rank's peak memory is its shard plus one tensor's slice. Quantized
tensors are sliced as bytes before they are decoded: FP4 experts (packed [out, in/2] + scales [out, in/32]) on
whole 1x32 blocks, FP8 dense weights (+ scales per 32x32 block) on whole blocks, FP8 Engram tables (and their
per-row scales) by rows. A slice that cuts an FP8 block (a layout whose split is not a multiple of 32) decodes the
whole tensor and slices it, so any layout :func:`~deepseek_v41.distributed.shard.shard_model` accepts loads.
The result equals ``shard_model(load_model(path, dtype), state)`` bit for bit (tests/distributed/test_loader.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepseek_v41.distributed.comm import ParallelState
from deepseek_v41.distributed.layers import ExpertParallelMoE, RowParallelEngramTable
from deepseek_v41.distributed.shard import shard_model
from deepseek_v41.model.checkpoint import (
    CheckpointError,
    _decode,
    _install_token_map,
    _Reader,
    skeleton,
)
from deepseek_v41.model.save import ENGRAM_TABLE, keeps_fp32
from deepseek_v41.model.vision import checkpoint_name_candidates
from deepseek_v41.quant import dequantize_fp4_expert_weight, dequantize_fp8_weight

BLOCK = 32  # FP4 expert scales per 32 input columns; FP8 weight scales per 32x32 block


def _global_name(model: torch.nn.Module, name: str) -> str:
    """The checkpoint name of local tensor ``name``: an expert-parallel rank's ``experts.i`` is global expert
    ``expert_start + i``."""
    head, sep, tail = name.partition(".ffn.experts.")
    if not sep:
        return name
    moe = model.get_submodule(head + ".ffn")
    if not isinstance(moe, ExpertParallelMoE):
        return name
    index, _, rest = tail.partition(".")
    return f"{head}.ffn.experts.{moe.expert_start + int(index)}.{rest}"


def _start(model: torch.nn.Module, name: str, state: ParallelState, length: int) -> int:
    """Where the rank's slice of ``name`` begins along its split dim (an Engram table's rows: its ``row_start``)."""
    owner = model.get_submodule(name.rpartition(".")[0])
    if isinstance(owner, RowParallelEngramTable):
        return owner.row_start
    return state.tp_rank * length


def read_slice(reader: _Reader, name: str, shape: tuple[int, ...], dim: int | None, start: int,
               dtype: torch.dtype, block: tuple[int, int]) -> torch.Tensor:
    """Checkpoint tensor ``name`` (decoded shape ``shape``) restricted to ``[start, start + n)`` along ``dim``
    (None: whole), decoded as the loader decodes it (:func:`deepseek_v41.model.checkpoint._decode`).

    ``n`` is ``shape[dim]`` of the local tensor: the caller passes the local shape. Quantized tensors are cut on
    their bytes where the cut falls on block edges (FP4: 32 input columns; FP8: the scale grid), else decoded whole
    and cut. Raises ValueError for an undecodable tensor (as the loader does)."""
    if dim is None:
        return _decode(name, reader, dtype, block)
    n = shape[dim]
    view = reader.slice(name)
    scale_name = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
    has_scale = scale_name is not None and scale_name in reader.files
    raw_dtype = view.get_dtype()

    def cut(sl, lo: int, hi: int):
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(lo, hi)
        return sl[tuple(index)]

    if ENGRAM_TABLE.match(name) or (name.endswith("engram.embed.scale")):
        return cut(view, start, start + n)  # raw FP8 codes / scales (or a float table), rows
    if not has_scale:
        raw = cut(view, start, start + n)
        if raw.dtype in (torch.int8, torch.uint8, torch.float8_e4m3fn):
            raise ValueError(f"is stored as {raw.dtype} without the .scale tensor that decodes it")
        return raw.to(torch.float32 if keeps_fp32(name) else dtype)
    scale_view = reader.slice(scale_name)
    if raw_dtype in ("I8", "U8"):  # FP4 experts: [out, in/2] codes, [out, in/32] scales
        if dim == 0:
            return dequantize_fp4_expert_weight(cut(view, start, start + n), cut(scale_view, start, start + n), dtype)
        if start % BLOCK == 0 and n % BLOCK == 0:
            return dequantize_fp4_expert_weight(cut(view, start // 2, (start + n) // 2),
                                                cut(scale_view, start // BLOCK, (start + n) // BLOCK), dtype)
    elif raw_dtype == "F8_E4M3":  # FP8 dense: scales per block[dim] along dim
        step = block[dim]
        if start % step == 0 and (n % step == 0 or start + n == view.get_shape()[dim]):
            return dequantize_fp8_weight(cut(view, start, start + n),
                                         cut(scale_view, start // step, -(-(start + n) // step)), block, dtype)
    whole = _decode(name, reader, dtype, block)  # a cut inside a block: decode all, then cut
    return whole.narrow(dim, start, n).clone()


def load_sharded(path: str | Path, state: ParallelState, dtype: torch.dtype | str = torch.float32,
                 device: torch.device | str = "cpu", fake_quant: bool = True, shard_engram: bool = False):
    """Load rank ``state.rank``'s shard of the model directory ``path``: the model of
    :func:`~deepseek_v41.distributed.shard.shard_model` (``shard_engram`` as there), reading only the rank's slice
    of each tensor (module docstring). ``dtype`` / ``device`` / ``fake_quant`` as
    :func:`~deepseek_v41.model.checkpoint.load_model`. A world of one rank is ``load_model``'s model.

    Raises FileNotFoundError (no config / weights), ConfigError, ValueError (a size the parallel layout does not
    divide, naming it; a bad dtype) and CheckpointError listing every missing, mis-shaped or undecodable tensor.
    Source: issue 28; MODEL_REFERENCE.md §4, §8 (formats).
    """
    path = Path(path)
    cfg, dtype, files, model, block = skeleton(path, dtype, device)
    whole = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    shard_model(model, state, shard_engram=shard_engram)
    reader = _Reader(files)
    problems, tensors = [], {}
    for name, like in model.state_dict().items():
        global_name = _global_name(model, name)
        stored = next((n for n in checkpoint_name_candidates(global_name) if n in files), None)
        if stored is None:
            problems.append(f"missing tensor {global_name} (expected shape {list(whole[global_name])})")
            continue
        local, full = tuple(like.shape), whole[global_name]
        split = [d for d, (a, b) in enumerate(zip(local, full, strict=True)) if a != b]
        dim = split[0] if split else None
        start = _start(model, name, state, local[dim]) if dim is not None else 0
        try:
            value = read_slice(reader, stored, local, dim, start, dtype, block)
        except ValueError as exc:
            problems.append(f"tensor {global_name} {exc}")
            continue
        if tuple(value.shape) != local:
            problems.append(f"tensor {global_name}: rank {state.rank}'s slice has shape {list(value.shape)}, the "
                            f"shard expects {list(local)} (the whole tensor: {list(full)})")
            continue
        tensors[name] = value.to(device)
    if problems:
        raise CheckpointError(path, problems)
    model.load_state_dict(tensors, assign=True, strict=True)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers(device)
    model.fake_quant = fake_quant
    model.name_or_path = str(path)
    _install_token_map(model, path)
    return model.eval()
