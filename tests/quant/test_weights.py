"""Checkpoint weight formats (MODEL_REFERENCE.md §4, §8): FP8 with 32x32 UE8M0 block scales and packed FP4
routed experts with 1x32 UE8M0 scales, against ml_dtypes; safetensors round trip of the scale dtypes."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from deepseek_v41.quant import (
    dequantize_fp4_expert_weight,
    dequantize_fp8_weight,
    quantize_fp4_expert_weight,
    quantize_fp8_weight,
)

from .oracle import e4m3_value, fp4_pack_ref, fp4_ref, fp4_value_ref, fp8_weight_ref, ue8m0_value
from .strategies import scaled_normal

F32 = np.float32


def _fp8_weight_values_ref(codes: np.ndarray, scale_bytes: np.ndarray, block=(32, 32)) -> np.ndarray:
    scale = np.kron(ue8m0_value(scale_bytes), np.ones(block, F32))[: codes.shape[0], : codes.shape[1]]
    return e4m3_value(codes) * scale


def assert_fp8_weight_matches(w: np.ndarray, block=(32, 32)) -> None:
    weight, scale = quantize_fp8_weight(torch.from_numpy(w), block)
    ref_codes, ref_scales = fp8_weight_ref(w, block)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    np.testing.assert_array_equal(weight.view(torch.uint8).numpy(), ref_codes)
    np.testing.assert_array_equal(scale.view(torch.uint8).numpy(), ref_scales)
    # Dequantized values lie exactly on the grid: E4M3 value times the block's power of two.
    decoded = dequantize_fp8_weight(weight, scale, block).numpy()
    np.testing.assert_array_equal(decoded, _fp8_weight_values_ref(ref_codes, ref_scales, block))


@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(st.integers(1, 80), st.integers(1, 80)), seed=st.integers(0, 2**16))
def test_fp8_weight_partial_edge_blocks(shape, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 10, size=shape))).astype(F32)
    assert_fp8_weight_matches(w)


@settings(max_examples=20, deadline=None)
@given(w=scaled_normal(64))
def test_fp8_weight_many_magnitudes(w):
    assert_fp8_weight_matches(w, (1, 32))


def test_fp8_weight_zero_nan_inf_blocks():
    w = np.ones((40, 70), F32)
    w[:32, :32] = 0.0  # all-zero block: scale byte 0 (2**-127), decodes to zeros
    w[:32, 32:64] = -0.0
    w[33, 5] = np.nan  # block (1, 0) -> NaN
    w[2, 66] = np.inf  # block (0, 2) -> NaN (UE8M0 cannot hold an infinite amax)
    assert_fp8_weight_matches(w)
    weight, scale = quantize_fp8_weight(torch.from_numpy(w))
    # Full blocks of ones: 1 / 448 lies in (2**-9, 2**-8], byte 119.
    assert scale.view(torch.uint8).tolist() == [[0, 0, 255], [255, 119, 119]]
    decoded = dequantize_fp8_weight(weight, scale)
    assert (decoded[:32, :64] == 0).all() and not decoded[:32, :64].signbit().any()
    assert decoded[32:, :32].isnan().all() and decoded[:32, 64:].isnan().all()
    assert (decoded[32:, 32:] == 1).all()


def test_fp8_weight_float32_scale_and_bf16_output():
    w = torch.randn(64, 96)
    weight, scale = quantize_fp8_weight(w)
    via_float = dequantize_fp8_weight(weight, scale.float(), dtype=torch.bfloat16)
    assert via_float.dtype == torch.bfloat16
    assert torch.equal(via_float, dequantize_fp8_weight(weight, scale).bfloat16())


def test_fp8_weight_checkpoint_shapes():
    # MODEL_REFERENCE.md §8: wq_a [1280, 5120] has scale [40, 160]; a partial grid rounds up.
    weight, scale = quantize_fp8_weight(torch.randn(1280, 5120, dtype=torch.bfloat16))
    assert weight.shape == (1280, 5120) and scale.shape == (40, 160)
    assert quantize_fp8_weight(torch.randn(33, 65))[1].shape == (2, 3)


def test_fp8_weight_errors():
    with pytest.raises(ValueError, match="2-D floating-point"):
        quantize_fp8_weight(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="two positive ints"):
        quantize_fp8_weight(torch.randn(4, 4), (32, 0))
    weight, scale = quantize_fp8_weight(torch.randn(64, 64))
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_fp8_weight(weight, scale[:1])
    with pytest.raises(ValueError, match="float8_e8m0fnu or float32"):
        dequantize_fp8_weight(weight, scale.view(torch.uint8))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8_weight(weight.float(), scale)


@settings(max_examples=30, deadline=None)
@given(w=scaled_normal(96))
def test_fp4_expert_weight_matches_ml_dtypes(w):
    packed, scale = quantize_fp4_expert_weight(torch.from_numpy(w))
    assert packed.dtype == torch.int8 and scale.dtype == torch.float8_e8m0fnu
    assert packed.shape == (w.shape[0], 48) and scale.shape == (w.shape[0], 3)
    ref_codes, ref_scales = fp4_ref(w, 32, "ue8m0")
    np.testing.assert_array_equal(packed.view(torch.uint8).numpy(), fp4_pack_ref(ref_codes))
    np.testing.assert_array_equal(scale.view(torch.uint8).numpy(), ref_scales)
    decoded = dequantize_fp4_expert_weight(packed, scale).numpy()
    np.testing.assert_array_equal(decoded, fp4_value_ref(ref_codes, ue8m0_value(ref_scales), 32))


def test_fp4_expert_weight_checkpoint_shapes_and_errors():
    # MODEL_REFERENCE.md §8: w2 (in = 2304) is stored as [5120, 1152] int8 + [5120, 72] scales.
    packed, scale = quantize_fp4_expert_weight(torch.randn(64, 2304, dtype=torch.bfloat16))
    assert packed.shape == (64, 1152) and scale.shape == (64, 72)
    assert dequantize_fp4_expert_weight(packed, scale, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of block_size 32"):
        quantize_fp4_expert_weight(torch.randn(4, 48))
    with pytest.raises(ValueError, match="int8 or uint8"):
        dequantize_fp4_expert_weight(packed.float(), scale)


def test_safetensors_stores_float8_e8m0fnu(tmp_path):
    weight, scale = quantize_fp8_weight(torch.randn(40, 70))
    packed, expert_scale = quantize_fp4_expert_weight(torch.randn(8, 64))
    special = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    tensors = {
        "w.weight": weight,
        "w.scale": scale,
        "e.weight": packed,
        "e.scale": expert_scale,
        "s": special,
    }
    path = tmp_path / "q.safetensors"
    save_file(tensors, str(path))
    loaded = load_file(str(path))
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8)), name
