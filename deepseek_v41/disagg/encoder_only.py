"""The encoder-only prefill model of a ``kv_producer`` (issue 29; MODEL_REFERENCE.md §3.16).

Under CED a prefill server computes only the global KV of the prompt: :meth:`~deepseek_v41.model.transformer.
Transformer.ced_encode` runs the embedding, the encoder layers (``plan.encoder_layers``, Engram included) and then,
of the first decoder layer (``plan.decoder_layers[0]``, the *boundary*), only
``boundary.attn.compress(boundary.attention_input(streams, pre), ctx)``: the attention norm over the streams
collapsed with the encoder's last ``pre`` (no mHC mixing of the boundary itself), the compressor, the entry RoPE and
the indexer's key path (``wk``, ``k_norm``). Every kv-source layer is in the encoder or is the boundary (the CED
layout checks), so that is all the global KV needs. The window rows of the decoder, its queries, output
projections, sinks, FFNs, the final norm, the LM head and the DSpark draft are never run.

:func:`encoder_only_names` lists the state-dict names such a model holds, from the layer plan (no layer number is
written here); :func:`prune_to_encoder` replaces everything else by :class:`Dropped` placeholders (no parameters;
calling one raises a RuntimeError naming it), the boundary block by an :class:`EncoderBoundary` holding only its
KV path, and removes the DSpark draft (``model.mtp = None``: a producer samples nothing). The vision tower and
aligner stay (a producer may get images). ``load_model(..., encoder_only=True)``
(:mod:`deepseek_v41.model.checkpoint`) prunes the skeleton before reading, so only the needed tensors are read;
:func:`describe_load` is the line a server prints at start.
"""

from __future__ import annotations

import torch
from torch import nn

from deepseek_v41.model.block import Block
from deepseek_v41.model.hyper import collapse
from deepseek_v41.model.save import keeps_fp32

PRODUCER = "this is an encoder-only prefill model (kv_producer)"
# Top-level modules of the output side: the final norm, the LM head, the DSpark draft.
OUTPUT_SIDE = ("norm", "head", "mtp")
# What a producer keeps of the boundary block (paths inside it): the KV path of Attention.compress.
BOUNDARY_KEEP = ("attn_norm", "attn.compressor", "attn.rope", "attn.indexer.wk", "attn.indexer.k_norm")


class Dropped(nn.Module):
    """Placeholder for module ``name`` (its state-dict path), which an encoder-only prefill model does not load: no
    parameters or buffers; calling it raises RuntimeError, reading an attribute it lacks raises AttributeError,
    both naming the module and saying this is an encoder-only prefill model (issue 29)."""

    def __init__(self, name: str):
        super().__init__()
        self.dropped_name = name

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.dropped_name} is not loaded: {PRODUCER}, which computes the global KV only "
                           f"(load the full model to run the decoder, the LM head or the DSpark draft)")

    def __getattr__(self, attr: str):
        try:
            return super().__getattr__(attr)
        except AttributeError:
            name = self.__dict__.get("dropped_name", "?")
            raise AttributeError(f"{name}.{attr}: {name} is not loaded: {PRODUCER}") from None

    def extra_repr(self) -> str:
        return repr(self.dropped_name)


class EncoderBoundary(nn.Module):
    """What a producer keeps of the first decoder layer: ``attn_norm`` and the attention's KV path
    (``attn.compressor``, ``attn.rope``, ``attn.indexer.wk`` / ``k_norm``; the rest of ``attn`` is
    :class:`Dropped`). State-dict names are the block's (``layers.<j>.attn_norm.weight``, ...).

    ``attention_input(streams [B, T, hc, D], pre [B, T, hc], wide=None) -> [B, T, D]``: the block's
    (:meth:`~deepseek_v41.model.block.Block.attention_input`; the fast backend installs the same fused kernel on
    it). ``forward`` raises RuntimeError: the decoder does not run on a producer."""

    def __init__(self, block: Block, name: str):
        super().__init__()
        self.dropped_name = name
        self.spec, self.layer_id, self.hc = block.spec, block.layer_id, block.hc
        self.engram = None  # (the CED layout puts every Engram layer in the encoder)
        self.attn_norm = block.attn_norm
        self.attn = block.attn

    def attention_input(self, streams: torch.Tensor, pre: torch.Tensor, wide: torch.Tensor | None = None
                        ) -> torch.Tensor:
        return self.attn_norm(collapse(streams, pre, wide))

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.dropped_name} (the first decoder layer) holds only its compressor and index-key "
                           f"path: {PRODUCER}; its decoder does not run here")


def _check_ced(model: nn.Module) -> None:
    plan = model.plan
    if not plan.ced:
        raise ValueError(f"an encoder-only prefill model (kv_producer) needs the CED layout (MODEL_REFERENCE.md "
                         f"§3.16); this model has {plan.ced_reason}")


def _needed(name: str, encoder: set[int], boundary: int) -> bool:
    """Whether state-dict name ``name`` of the full model belongs to the encoder-only model."""
    head, _, rest = name.partition(".")
    if head in OUTPUT_SIDE:
        return False
    if head != "layers":
        return True  # embedding, vision tower, aligner, image delimiters, Engram hasher
    index, _, inner = rest.partition(".")
    if int(index) in encoder:
        return True
    return int(index) == boundary and inner.startswith(tuple(k + "." for k in BOUNDARY_KEEP))


def encoder_only_names(model: nn.Module) -> set[str]:
    """The state-dict names of ``model`` (a full :class:`~deepseek_v41.model.transformer.Transformer`, on any
    device, ``meta`` included) that an encoder-only prefill model holds: everything but the output side
    (:data:`OUTPUT_SIDE`) and the decoder layers, plus the boundary's :data:`BOUNDARY_KEEP` (module docstring).
    Derived from ``model.plan``. Raises ValueError (with the plan's ``ced_reason``) without a CED layout."""
    _check_ced(model)
    plan = model.plan
    encoder, boundary = set(plan.encoder_layers), plan.decoder_layers[0]
    return {name for name in model.state_dict() if _needed(name, encoder, boundary)}


def _keep_only(module: nn.Module, path: str, keep: tuple[str, ...], prefix: str = "") -> None:
    """Inside ``module`` (state-dict path ``path``), replace every child not on a path of ``keep`` (relative to
    the boundary block, ``prefix`` = where ``module`` is inside it) by :class:`Dropped` and delete its own
    parameters and buffers that are not kept."""
    for name, child in list(module.named_children()):
        rel = prefix + name
        if rel in keep:
            continue
        if any(k.startswith(rel + ".") for k in keep):
            _keep_only(child, f"{path}.{name}", keep, rel + ".")
        else:
            setattr(module, name, Dropped(f"{path}.{name}"))
    for name in [*module._parameters, *module._buffers]:
        if prefix + name not in keep:
            delattr(module, name)


def _tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]]:
    """name -> (shape, dtype, is a parameter) of every parameter and buffer (non-persistent ones included)."""
    out = {name: (tuple(t.shape), t.dtype, True) for name, t in model.named_parameters()}
    out.update((name, (tuple(t.shape), t.dtype, False)) for name, t in model.named_buffers())
    return out


def prune_to_encoder(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype, bool]]:
    """Turn the full ``model`` (in place; any device, ``meta`` included) into the encoder-only prefill model of a
    ``kv_producer``: the output side and the decoder layers after the boundary become :class:`Dropped`, the boundary
    an :class:`EncoderBoundary`, the DSpark draft ``None``; afterwards ``model.state_dict()`` holds exactly
    :func:`encoder_only_names`. Sets ``model.encoder_only = True`` and ``model.dropped_weights``. Returns the
    dropped parameters and buffers (non-persistent ones included), name -> (shape, dtype as held before pruning,
    is a parameter). Raises ValueError (with the plan's ``ced_reason``) without a CED layout, and for a model pruned
    already. Source: issue 29."""
    _check_ced(model)
    if getattr(model, "encoder_only", False):
        raise ValueError("this model is an encoder-only prefill model already")
    before = _tensors(model)
    plan = model.plan
    boundary = plan.decoder_layers[0]
    model.norm, model.head = Dropped("norm"), Dropped("head")
    model.mtp = None  # no draft: a producer samples nothing (the engine then offers no speculative decoding)
    for j in plan.decoder_layers[1:]:
        model.layers[j] = Dropped(f"layers.{j}")
    path = f"layers.{boundary}"
    kept = EncoderBoundary(model.layers[boundary], path)
    _keep_only(kept, path, BOUNDARY_KEEP)
    model.layers[boundary] = kept
    after = _tensors(model)
    dropped = {name: meta for name, meta in before.items() if name not in after}
    model.encoder_only = True
    model.dropped_weights = dropped
    return dropped


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers as they are held (each tensor at its own dtype)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def dropped_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes the parameters and buffers :func:`prune_to_encoder` dropped would take loaded: floating parameters
    at ``dtype`` (the load dtype; fp32 where the loader keeps fp32: mHC, sinks, router biases) when given, the rest
    (buffers, FP8 tables) at the dtype they had. 0 for a model that was not pruned."""
    total = 0
    for name, (shape, held, param) in getattr(model, "dropped_weights", {}).items():
        numel = int(torch.Size(shape).numel())
        if dtype is not None and param and held.is_floating_point and held.itemsize >= 2:
            held = torch.float32 if keeps_fp32(name) else dtype
        total += numel * held.itemsize
    return total


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def describe_load(model: nn.Module) -> str:
    """One line for the server's start: what weights ``model`` holds, e.g. ``"encoder-only prefill model: loaded
    12.3 MB of weights in 1,234 tensors (of 45.6 MB, 27%): embedding, layers 0-19, layer 20's compressor and index
    keys"``, or ``"full model: loaded 45.6 MB of weights in 2,345 tensors"``. Reads ``loaded_weight_bytes`` /
    ``full_weight_bytes`` set by :func:`~deepseek_v41.model.checkpoint.load_model` when present, else counts the
    tensors held (and the dropped ones at their own dtype)."""
    loaded = getattr(model, "loaded_weight_bytes", None)
    loaded = weight_bytes(model) if loaded is None else loaded
    tensors = len(model.state_dict())
    if not getattr(model, "encoder_only", False):
        return f"full model: loaded {_mb(loaded)} of weights in {tensors:,} tensors"
    full = getattr(model, "full_weight_bytes", None)
    full = loaded + dropped_bytes(model) if full is None else full
    plan = model.plan
    enc, boundary = plan.encoder_layers, plan.decoder_layers[0]
    layers = f"layers {enc.start}-{enc.stop - 1}" if len(enc) > 1 else f"layer {enc.start}"
    parts = ["embedding", layers, f"layer {boundary}'s compressor and index keys"]
    if getattr(model, "vision", None) is not None:
        parts.append("vision tower and aligner")
    share = 100 * loaded / full if full else 100.0
    return (f"encoder-only prefill model: loaded {_mb(loaded)} of weights in {tensors:,} tensors (of {_mb(full)}, "
            f"{share:.0f}%): {', '.join(parts)}")
