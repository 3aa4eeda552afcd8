"""E4M3 / UE8M0 byte codecs against ml_dtypes and exact numpy arithmetic (MODEL_REFERENCE.md §4)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from deepseek_v41.quant.formats import (
    check_scale_format,
    e4m3_decode,
    e4m3_encode,
    ue8m0_decode,
    ue8m0_decode_bits,
    ue8m0_encode_ceil,
)

from .oracle import mld, ue8m0_ref


def _e4m3_midpoints() -> np.ndarray:
    """Every midpoint between neighbouring E4M3FN magnitudes (subnormals included), one fp32 ulp either side,
    and the tie 464 between 448 and the next E4M3 step (which rounds down to 448), all with both signs; values
    above 464 are out of range and left to the saturation test."""
    ml = mld()
    magnitudes = np.arange(0x7F, dtype=np.uint8).view(ml.float8_e4m3fn).astype(np.float64)
    mids = np.append((magnitudes[:-1] + magnitudes[1:]) / 2, 464.0).astype(np.float32)
    around = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    around = around[around <= 464]
    return np.concatenate([around, -around])


def test_torch_e4m3_cast_is_rne_with_subnormals():
    """The product relies on torch's cast for E4M3 rounding: check it is RNE on every midpoint and on every
    bf16 value in range. (Out of range torch saturates to ±448 where ml_dtypes gives NaN; the codecs clamp
    to ±448 before casting, so that difference never shows.)"""
    ml = mld()
    bf16 = (
        torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().numpy()
    )
    values = np.concatenate([_e4m3_midpoints(), bf16[np.abs(bf16) <= 448]])
    ours = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(ours, values.astype(ml.float8_e4m3fn).view(np.uint8))


def test_torch_e4m3_cast_saturates_where_ml_dtypes_gives_nan():
    big = torch.tensor([465.0, 1e6, float("inf"), -float("inf")])
    assert big.to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x7E, 0x7E, 0x7E, 0xFE]


def test_e4m3_encode_policy_zero_and_nan():
    y = torch.tensor([0.0, -0.0, -1e-30, 2.0**-10, -(2.0**-10), float("nan"), -float("nan"), 1.0])
    # ±2**-10 is the tie between 0 and the smallest subnormal 2**-9: ties to even gives (+/-)0 -> +0.
    assert e4m3_encode(y).tolist() == [0, 0, 0, 0, 0, 0, 0, 0x38]


def test_e4m3_decode_matches_ml_dtypes_for_all_bytes():
    ml = mld()
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = every.numpy().view(ml.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(e4m3_decode(every).numpy(), ref)


def test_ue8m0_decode_matches_ml_dtypes_for_all_bytes():
    ml = mld()
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ref = every.numpy().view(ml.float8_e8m0fnu).astype(np.float32)
    # The native float8_e8m0fnu conversion (CPU / CUDA) and the bit construction (other devices) both agree.
    for decode in (ue8m0_decode, ue8m0_decode_bits):
        ours = decode(every).numpy()
        np.testing.assert_array_equal(ours, ref)
        assert np.isnan(ours[255]) and ours[0] == 2.0**-127 and ours[127] == 1.0 and ours[254] == 2.0**127


def _powers_of_two_and_neighbours() -> np.ndarray:
    p = np.exp2(np.arange(-149, 128, dtype=np.float64)).astype(np.float32)
    return np.concatenate([p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf))])


def test_ue8m0_ceil_at_powers_of_two():
    v = _powers_of_two_and_neighbours()
    np.testing.assert_array_equal(ue8m0_encode_ceil(torch.from_numpy(v)).numpy(), ue8m0_ref(v))
    # Spot values by hand: 1 -> 127, just above 1 -> 128, 2**-127 -> 0, just above 2**-127 -> 1.
    hand = torch.tensor([1.0, float(np.nextafter(np.float32(1), np.float32(2))), 2.0**-127, 0.0])
    assert ue8m0_encode_ceil(hand).tolist() == [127, 128, 0, 0]
    assert ue8m0_encode_ceil(torch.tensor([2.0**-127 * 1.5])).tolist() == [1]


def test_ue8m0_ceil_specials():
    v = torch.tensor([0.0, float("inf"), float("nan"), 3e38])
    # 3e38 needs 2**128, which UE8M0 cannot hold: NaN (255) rather than a finite scale that overflows.
    assert ue8m0_encode_ceil(v).tolist() == [0, 255, 255, 255]


@settings(max_examples=60, deadline=None)
@given(arrays(np.float32, st.integers(1, 64), elements=st.floats(0, width=32, allow_subnormal=True)))
def test_ue8m0_ceil_matches_frexp(v):
    np.testing.assert_array_equal(ue8m0_encode_ceil(torch.from_numpy(v)).numpy(), ue8m0_ref(v))


def test_ue8m0_ceil_rejects_other_dtypes():
    with pytest.raises(ValueError, match="float32"):
        ue8m0_encode_ceil(torch.ones(2, dtype=torch.float64))


def test_unknown_scale_format():
    with pytest.raises(ValueError, match="unknown scale_format 'e5m2'"):
        check_scale_format("e5m2")
