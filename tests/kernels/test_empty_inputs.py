"""Every kernel wrapper that hands a tensor's data pointer to C refuses an empty input (a dimension of size 0) with a
ValueError naming the kernel and the input, before any C runs (issue 22: a zero-length prefill chunk reached
``window_step``, whose C code read through a NULL pointer). The other arguments are 1-element placeholders: the
check comes first, so they are never read."""

from __future__ import annotations

import inspect

import pytest
import torch

from deepseek_v41 import kernels

# wrapper -> the inputs it checks (the activations and tables a caller builds per call; weights are the model's).
CHECKED = {
    "fp8_quantize_values": ["x"],
    "fp8_dequantize": ["codes", "scales"],
    "fp4_quantize": ["x"],
    "fp4_dequantize": ["codes", "scales"],
    "fp4_gather": ["tables", "idx"],
    "fp4_scatter": ["tables", "group", "write_from", "x"],
    "window_step": ["slots", "positions", "kv"],
    "index_scores": ["tables", "q", "w", "visible"],
    "index_select": ["q", "w", "keys", "visible"],
    "rope": ["x", "cos", "sin"],
    "rms_norm": ["x"],
    "hc_mix": ["streams"],
    "hc_collapse": ["streams", "weights"],
    "hc_expand": ["streams", "y", "post", "comb"],
    "attend_few": ["q", "q_pos", "keys", "key_pos", "selected", "topk"],
    "band_logits": ["q", "q_pos", "keys", "key_pos", "sink"],
    "band_output": ["probs", "keys"],
    "gate": ["x"],
    "swiglu": ["gate", "up"],
    "moe_bf16": ["x", "indices", "weights"],
    "moe_fp4": ["x", "indices", "weights"],
    "linear": ["x", "weight"],
    "attn_prologue": ["x", "cos", "sin"],
    "attn_epilogue": ["o", "cos", "sin"],
    "compress": ["x", "positions"],
    "indexer_queries": ["q_lat", "x", "cos", "sin"],
    "topk_set": ["scores"],
    "argmax": ["x"],
    "candidate_blocks": ["scores", "visible"],
    "pool_select": ["tables", "q", "w", "blocks", "visible"],
}
KERNEL_NAMES = {"fp8_quantize_values": "fp8_quantize", "moe_bf16": "moe", "moe_fp4": "moe"}
# Placeholders read before the check: the MoE wrappers take sizes from x and the expert weights.
SHAPED = {("moe_fp4", "x"): (1, 32), ("moe_fp4", "codes2"): (1, 1, 16), ("moe_bf16", "w2"): (1, 1, 1)}


def placeholder(fn: str, name: str, annotation: str):
    if name in ("pending", "phases"):
        return torch.ones(1), torch.ones(1)
    if name == "shared":
        return None
    if name == "fmt":
        return "ue8m0"
    if "Tensor" in annotation:
        return torch.ones(SHAPED.get((fn, name), (1,)))
    if annotation == "bool":
        return False
    if annotation == "float":
        return 1.0
    if annotation == "int":
        return 1
    return torch.float32 if "dtype" in annotation else None


def arguments(fn: str) -> dict:
    params = inspect.signature(getattr(kernels, fn)).parameters.values()
    return {p.name: placeholder(fn, p.name, str(p.annotation)) for p in params}


@pytest.mark.parametrize(("fn", "name"), [(fn, name) for fn, names in CHECKED.items() for name in names],
                         ids=lambda v: v)
def test_every_wrapper_refuses_an_empty_input(fn, name):
    args = arguments(fn)
    args[name] = torch.empty((*SHAPED.get((fn, name), (1,))[:-1], 0))
    if fn == "moe_fp4" and name == "x":
        args[name] = torch.empty(0, 32)
    with pytest.raises(ValueError, match=rf"^{KERNEL_NAMES.get(fn, fn)} kernel: empty input {name} \("):
        getattr(kernels, fn)(**args)


def test_every_wrapper_calling_c_is_checked():
    """Each public function of the module that passes a data pointer to the library (itself or through _moe) is in
    CHECKED, but prefetch: its C code reads nothing (hints only), so no addresses are no hints (kernels/fast/warm.py
    passes what it found)."""
    sources = {name: inspect.getsource(f) for name, f in vars(kernels).items()
               if inspect.isfunction(f) and not name.startswith("_")}
    calls_c = {name for name, src in sources.items() if ("data_ptr()" in src and "library()" in src) or "_moe(" in src}
    assert calls_c == set(CHECKED) | {"prefetch"}
    kernels.prefetch(torch.zeros(0, dtype=torch.int64))


def test_a_zero_length_chunk_never_reaches_window_step():
    """The reported crash: a prefill chunk of 0 tokens (kv [1, 0, d], positions [1, 0]) over real rings."""
    S, L, R, d = 2, 1, 8, 32
    codes, scales = torch.zeros(S, L, R, d, dtype=torch.uint8), torch.zeros(S, L, R, d // 32, dtype=torch.uint8)
    pos = torch.full((S, L, R), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"window_step kernel: empty input positions \(1, 0\), kv \(1, 0, 32\)"):
        kernels.window_step(codes, scales, pos, 0, torch.tensor([1]), torch.empty(1, 0, dtype=torch.int64),
                            torch.empty(1, 0, d))
    assert (pos == -1).all()  # nothing written
