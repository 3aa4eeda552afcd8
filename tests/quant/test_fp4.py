"""FP4 E2M1 block codec, bit-exact against ml_dtypes and numpy scales (MODEL_REFERENCE.md §4).

Expected values use the package policy (module docstring of ``deepseek_v41.quant``): -0 and values rounding
to zero are code 0; a NaN block has a NaN scale (E4M3 0x7F / UE8M0 255) and codes 0; inf saturates under E4M3
scales and gives scale 255 (NaN) under UE8M0 scales. The oracle maps ml_dtypes through that policy.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from deepseek_v41.quant import dequantize_fp4, quantize_fp4

from .oracle import e4m3_value, fp4_pack_ref, fp4_ref, fp4_value_ref, mld, ue8m0_value
from .strategies import codec_inputs

# (scale_format, block size used by the model): main KV entries and indexer keys / queries.
FORMATS = [("e4m3", 16), ("ue8m0", 32)]
NAN_SCALE = {"e4m3": 0x7F, "ue8m0": 255}
F32 = np.float32


def _scale_values(scale_bytes: np.ndarray, fmt: str) -> np.ndarray:
    return e4m3_value(scale_bytes) if fmt == "e4m3" else ue8m0_value(scale_bytes)


def assert_matches_oracle(x: np.ndarray, fmt: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize_fp4 == oracle byte for byte and dequantize_fp4 == oracle values; returns the oracle's
    (unpacked codes, scale bytes)."""
    codes, scales = quantize_fp4(torch.from_numpy(x), block, fmt)
    ref_codes, ref_scales = fp4_ref(x, block, fmt)
    np.testing.assert_array_equal(scales.numpy(), ref_scales)
    np.testing.assert_array_equal(codes.numpy(), fp4_pack_ref(ref_codes))
    decoded = dequantize_fp4(codes, scales, block, fmt).numpy()
    ref_values = fp4_value_ref(ref_codes, _scale_values(ref_scales, fmt), block)
    np.testing.assert_array_equal(decoded, ref_values)
    assert not np.signbit(decoded[decoded == 0]).any(), "a zero decoded as -0"
    return ref_codes, ref_scales


@pytest.mark.parametrize("fmt,block", FORMATS)
@settings(max_examples=80, deadline=None)
@given(x=codec_inputs(64))
def test_random_blocks_match_ml_dtypes(fmt, block, x):
    assert_matches_oracle(x, fmt, block)


@pytest.mark.parametrize("fmt,block", FORMATS)
def test_all_zero_and_negative_zero_blocks(fmt, block):
    x = np.zeros((2, block), F32)
    x[1] = -0.0
    codes, scales = assert_matches_oracle(x, fmt, block)
    assert not codes.any()
    # e4m3: clamp(0 / 6, 2**-9, 448) = 2**-9, the smallest subnormal, byte 0x01.
    # ue8m0: max(0, 6 * 2**-126) / 6 = 2**-126, byte 1.
    assert scales.tolist() == [[1], [1]]


@pytest.mark.parametrize("fmt,block", FORMATS)
@pytest.mark.parametrize("nan_bits", [0x7FC00000, 0xFFC00000, 0x7F800001])
def test_nan_poisons_its_block_only(fmt, block, nan_bits):
    x = np.linspace(-3, 3, 2 * block, dtype=F32).reshape(1, 2 * block)
    x[0, block + 3] = np.array([nan_bits], np.uint32).view(F32)[0]
    codes, scales = quantize_fp4(torch.from_numpy(x), block, fmt)
    assert scales[0, 1].item() == NAN_SCALE[fmt]
    assert not codes[0, block // 2 :].any(), "codes of a NaN block must be 0"
    decoded = dequantize_fp4(codes, scales, block, fmt)
    assert decoded[0, block:].isnan().all() and decoded[0, :block].isfinite().all()
    assert_matches_oracle(x, fmt, block)


@pytest.mark.parametrize("fmt,block", FORMATS)
def test_inf(fmt, block):
    x = np.zeros((1, block), F32)
    x[0, :4] = [np.inf, -np.inf, 1.0, 1000.0]
    codes, scales = assert_matches_oracle(x, fmt, block)
    decoded = dequantize_fp4(*quantize_fp4(torch.from_numpy(x), block, fmt), block, fmt)
    if fmt == "e4m3":
        # The scale clamps to 448 (0x7E); inf saturates to ±6 (codes 0x7, 0xF), 1 rounds to 0, 1000/448 to 2.
        assert scales.tolist() == [[0x7E]]
        assert codes[0, :4].tolist() == [0x7, 0xF, 0x0, 0x4]
        assert decoded[0, :4].tolist() == [2688.0, -2688.0, 0.0, 896.0]
    else:
        assert scales.tolist() == [[255]] and not codes.any()
        assert decoded.isnan().all()


def test_ue8m0_scale_at_and_just_above_six_times_powers_of_two():
    k = np.arange(-126, 121)
    amax = (6 * np.exp2(k.astype(np.float64))).astype(F32)
    above = np.nextafter(amax, F32(np.inf))
    x = np.zeros((2 * k.size, 32), F32)
    x[: k.size, 5] = amax
    x[k.size :, 7] = -above
    _, scales = assert_matches_oracle(x, "ue8m0", 32)
    # amax = 6 * 2**k gives exactly 2**k (byte k + 127); one ulp above needs the next power of two.
    np.testing.assert_array_equal(scales[:, 0], np.concatenate([k + 127, k + 128]))


def test_e4m3_scale_at_and_just_above_six_times_e4m3_values():
    s = e4m3_value(np.arange(1, 0x7F, dtype=np.uint8))  # every positive finite E4M3 value
    amax = (F32(6) * s).astype(F32)
    x = np.zeros((2 * s.size, 16), F32)
    x[: s.size, 0] = amax
    x[s.size :, 15] = np.nextafter(amax, F32(np.inf))
    codes, scales = assert_matches_oracle(x, "e4m3", 16)
    # amax / 6 lands on the E4M3 value itself, and one ulp above still rounds to it: amax codes to 6.
    np.testing.assert_array_equal(scales[:, 0], np.tile(np.arange(1, 0x7F), 2))
    assert (codes[: s.size, 0] == 7).all() and (codes[s.size :, 15] == 7).all()


# Each tie between neighbouring E2M1 values and the code it must round to (ties to the even code).
MIDPOINTS = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}


@pytest.mark.parametrize(
    "fmt,block,scale", [("e4m3", 16, 0.75), ("e4m3", 16, 3 * 2.0**-9), ("ue8m0", 32, 2.0**-5)]
)
def test_every_midpoint_rounds_to_even(fmt, block, scale):
    ties = np.array(list(MIDPOINTS), F32)
    x = np.zeros((2, block), F32)
    for row, sign in enumerate((1, -1)):
        x[row, 0] = 6 * scale  # pins the scale: amax / 6 = scale exactly
        x[row, 1 : 1 + ties.size] = sign * ties * F32(scale)
    codes, _ = assert_matches_oracle(x, fmt, block)
    expected = np.array(list(MIDPOINTS.values()))
    assert codes[0, 1 : 1 + ties.size].tolist() == expected.tolist()
    # Negative ties carry the sign bit, except -0.25 which rounds to zero and is stored as +0.
    assert codes[1, 1 : 1 + ties.size].tolist() == np.where(expected == 0, 0, expected | 8).tolist()


@pytest.mark.parametrize("fmt,block", FORMATS)
def test_values_below_the_smallest_subnormal(fmt, block):
    tiny = np.array([1e-45, -1e-45, 1e-40, -(2.0**-130), 2.0**-149], F32)
    x = np.zeros((2, block), F32)
    x[0, : tiny.size] = tiny  # a block of fp32 subnormals only
    x[1, 0] = 6.0  # scale 1: 0.2499 rounds to 0, 0.2501 to 0.5, and tiny values vanish
    x[1, 1:5] = [0.2499, -0.2499, 0.2501, 1e-30]
    codes, scales = assert_matches_oracle(x, fmt, block)
    assert not codes[0].any() and scales[0, 0] == 1  # 2**-9 (E4M3 0x01) / 2**-126 (UE8M0 1)
    assert codes[1, :5].tolist() == [7, 0, 0, 1, 0]


def test_subnormal_e4m3_scales():
    # amax / 6 = k * 2**-9 are the E4M3 subnormals (bytes k = 1..7); 2.5 and 3.5 * 2**-9 are ties going to the
    # even byte (2 and 4); 0.4 * 2**-9 is below the smallest subnormal and clamps to 2**-9.
    multiples = np.array([1, 2, 3, 4, 5, 6, 7, 2.5, 3.5, 0.4, 8], np.float64)
    x = np.zeros((multiples.size, 16), F32)
    x[:, 3] = (6 * multiples * 2.0**-9).astype(F32)
    x[:, 4] = -x[:, 3] / 3
    _, scales = assert_matches_oracle(x, "e4m3", 16)
    assert scales[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 2, 4, 1, 8]


@pytest.mark.parametrize("fmt,block,scale_byte", [("e4m3", 16, 0x38), ("ue8m0", 32, 127)])
def test_all_sixteen_codes_round_trip(fmt, block, scale_byte):
    ml = mld()
    unpacked = np.zeros(block, np.uint8)
    unpacked[:16] = np.arange(16)
    codes = torch.from_numpy(fp4_pack_ref(unpacked)[None])
    scales = torch.tensor([[scale_byte]], dtype=torch.uint8)  # scale 1.0
    decoded = dequantize_fp4(codes, scales, block, fmt).numpy()
    np.testing.assert_array_equal(
        decoded[0, :16], np.arange(16, dtype=np.uint8).view(ml.float4_e2m1fn).astype(F32)
    )
    assert np.signbit(decoded[0, 8]), "code 8 decodes to -0 (the policy only forbids encoding it)"
    again, again_scales = quantize_fp4(torch.from_numpy(decoded), block, fmt)
    assert again_scales.tolist() == [[scale_byte]]
    expected = np.where(unpacked == 8, 0, unpacked)  # -0 re-encodes as +0
    np.testing.assert_array_equal(again.numpy()[0], fp4_pack_ref(expected))


def test_ue8m0_scale_byte_255_decodes_to_nan():
    codes = torch.zeros(2, 16, dtype=torch.uint8)
    scales = torch.tensor([[255], [127]], dtype=torch.uint8)
    decoded = dequantize_fp4(codes, scales, 32, "ue8m0")
    assert decoded[0].isnan().all() and (decoded[1] == 0).all()


def test_nibble_order_and_leading_dims():
    # Element 2i goes to the low nibble: [0.5, 1] -> codes (1, 2) -> byte 0x21.
    x = torch.zeros(2, 3, 32)
    x[..., 0], x[..., 1], x[..., 31] = 0.5, 1.0, 6.0
    codes, scales = quantize_fp4(x, 32, "ue8m0")
    assert codes.shape == (2, 3, 16) and scales.shape == (2, 3, 1)
    assert codes[..., 0].unique().tolist() == [0x21] and codes[..., 15].unique().tolist() == [0x70]


def test_input_dtypes_and_empty_batch():
    x = torch.randn(4, 32)
    reference = quantize_fp4(x.bfloat16().float(), 16, "e4m3")
    for got, want in zip(quantize_fp4(x.bfloat16(), 16, "e4m3"), reference, strict=True):
        assert torch.equal(got, want)
    codes, scales = quantize_fp4(torch.empty(0, 32), 16, "e4m3")
    assert codes.shape == (0, 16) and scales.shape == (0, 2)


def test_errors():
    with pytest.raises(ValueError, match="not a multiple of block_size 16"):
        quantize_fp4(torch.zeros(4, 24), 16, "e4m3")
    with pytest.raises(ValueError, match="odd"):
        quantize_fp4(torch.zeros(9), 3, "e4m3")
    with pytest.raises(ValueError, match="unknown scale_format"):
        quantize_fp4(torch.zeros(32), 32, "mx")
    with pytest.raises(ValueError, match="floating-point"):
        quantize_fp4(torch.zeros(32, dtype=torch.int32), 32, "ue8m0")
    with pytest.raises(ValueError, match="positive int"):
        quantize_fp4(torch.zeros(32), 0, "ue8m0")
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_fp4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), 16, "e4m3")
    with pytest.raises(ValueError, match="uint8"):
        dequantize_fp4(torch.zeros(4, 8, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8), 16, "e4m3")
