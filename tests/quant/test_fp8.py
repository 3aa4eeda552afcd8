"""FP8 E4M3FN block codec with UE8M0 scales, bit-exact against ml_dtypes and numpy scales
(MODEL_REFERENCE.md §4). Expected values follow the package NaN / inf / -0 policy (see test_fp4.py)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from deepseek_v41.quant import dequantize_fp8, quantize_fp8

from .oracle import e4m3_value, fp8_ref, ue8m0_value
from .strategies import codec_inputs

F32 = np.float32


def assert_matches_oracle(x: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    codes, scales = quantize_fp8(torch.from_numpy(x), block)
    ref_codes, ref_scales = fp8_ref(x, block)
    np.testing.assert_array_equal(scales.numpy(), ref_scales)
    np.testing.assert_array_equal(codes.numpy(), ref_codes)
    decoded = dequantize_fp8(codes, scales, block).numpy()
    with np.errstate(over="ignore", invalid="ignore"):  # 256 * 2**120 is inf in fp32, as in the product
        ref_values = (
            e4m3_value(ref_codes).reshape(*x.shape[:-1], -1, block) * ue8m0_value(ref_scales)[..., None]
        )
    np.testing.assert_array_equal(decoded, ref_values.reshape(x.shape))
    assert not np.signbit(decoded[decoded == 0]).any(), "a zero decoded as -0"
    return ref_codes, ref_scales


@settings(max_examples=100, deadline=None)
@given(x=codec_inputs(64))
def test_random_blocks_match_ml_dtypes(x):
    assert_matches_oracle(x)


def test_zero_blocks():
    x = np.zeros((2, 32), F32)
    x[1] = -0.0
    codes, scales = assert_matches_oracle(x)
    # max(0, 1e-4) / 448 = 2.23e-7 lies in (2**-23, 2**-22]: byte -22 + 127 = 105.
    assert not codes.any() and scales.tolist() == [[105], [105]]


def test_nan_and_inf_blocks_decode_to_nan():
    x = np.ones((1, 96), F32)
    x[0, 40] = np.nan
    x[0, 70] = -np.inf
    codes, scales = assert_matches_oracle(x)
    assert scales[0].tolist() == [119, 255, 255]  # 1 / 448 lies in (2**-9, 2**-8]: byte 119; then NaN, NaN
    assert not codes[0, 32:].any()
    decoded = dequantize_fp8(*quantize_fp8(torch.from_numpy(x)))
    assert decoded[0, 32:].isnan().all() and (decoded[0, :32] == 1).all()


def test_scale_at_and_just_above_448_times_powers_of_two():
    k = np.arange(-21, 119)  # 448 * 2**-21 is above the 1e-4 amax floor; 448 * 2**119 near the fp32 maximum
    amax = (448 * np.exp2(k.astype(np.float64))).astype(F32)
    x = np.zeros((2 * k.size, 32), F32)
    x[: k.size, 0] = amax
    x[k.size :, 31] = -np.nextafter(amax, F32(np.inf))
    codes, scales = assert_matches_oracle(x)
    # amax = 448 * 2**k gives 2**k and codes to 448 (0x7E); one ulp above gives 2**(k+1), and the amax
    # element, just above -224, rounds to -224 = -1.75 * 2**7 (sign 1, exponent 14, mantissa 110: 0xF6).
    np.testing.assert_array_equal(scales[:, 0], np.concatenate([k + 127, k + 128]))
    assert (codes[: k.size, 0] == 0x7E).all()
    assert (codes[k.size :, 31] == 0xF6).all()


def test_every_e4m3_midpoint_times_the_scale():
    magnitudes = e4m3_value(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)
    mids = ((magnitudes[:-1] + magnitudes[1:]) / 2).astype(F32)  # mids[b]: between bytes b and b + 1
    # A tie goes to the even byte; mids[0] = 2**-10 is below the smallest subnormal and goes to 0.
    expected = np.arange(mids.size) + np.arange(mids.size) % 2
    scale = F32(2.0**-3)
    rows = -(-mids.size // 31)
    body = np.zeros((2, rows * 31), F32)
    body[0, : mids.size], body[1, : mids.size] = mids * scale, -mids * scale
    # Column 0 holds 448 * scale in every block, which pins the scale at 2**-3 (byte 124).
    x = np.concatenate([np.full((2 * rows, 1), 448 * scale, F32), body.reshape(2 * rows, 31)], axis=1)
    codes, scales = assert_matches_oracle(x)
    assert (scales == 124).all()
    got = codes[:, 1:].reshape(2, -1)[:, : mids.size]
    assert got[0].tolist() == expected.tolist()
    assert got[1].tolist() == np.where(expected == 0, 0, expected | 0x80).tolist()  # -0 stored as +0


def test_errors():
    with pytest.raises(ValueError, match="not a multiple of block_size 32"):
        quantize_fp8(torch.zeros(48))
    with pytest.raises(ValueError, match="UE8M0 scales only"):
        quantize_fp8(torch.zeros(32), 32, "e4m3")
    with pytest.raises(ValueError, match="floating-point"):
        quantize_fp8(torch.zeros(32, dtype=torch.int64))
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_fp8(torch.zeros(64, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8))
