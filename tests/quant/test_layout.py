"""KV-cache byte layouts against hand-derived hex goldens (MODEL_REFERENCE.md §4, §5).

The expected bytes below are worked out by hand from the format definitions, not saved from the code:
E2M1 codes are sign << 3 | index into {0, 0.5, 1, 1.5, 2, 3, 4, 6}; element 2i is the LOW nibble; E4M3FN
bytes are s eeee mmm with bias 7; UE8M0 bytes are log2(scale) + 127; each entry is codes then scales.
"""

import pytest
import torch

from deepseek_v41.quant import (
    dequantize_fp4,
    dequantize_fp8,
    pack_index_entry,
    pack_main_entry,
    pack_window_row,
    quantize_fp4,
    quantize_fp8,
    unpack_index_entry,
    unpack_main_entry,
    unpack_window_row,
)

# A 16-value pattern holding every E2M1 code once (its amax 6 pins the block scale):
#   value  6  -0.5  1  -1.5  2  -3  4  -6  0  0.5  -1  1.5  -2  3  -4  6
#   code   7   9    2   B    4   D  6   F  0   1    A   3    C  5   E  7
# Bytes pair (element 2i, element 2i+1) as high << 4 | low: 97 B2 D4 F6 10 3A 5C 7E.
PATTERN = [6, -0.5, 1, -1.5, 2, -3, 4, -6, 0, 0.5, -1, 1.5, -2, 3, -4, 6]
PATTERN_BYTES = "97b2d4f6103a5c7e"
# The negated pattern (element 8 becomes -0.0, stored as +0): codes F 1 A 3 C 5 E 7 0 9 2 B 4 D 6 F.
NEGATED_BYTES = "1f3a5c7e90b2d4f6"


def _hex(t: torch.Tensor) -> str:
    return bytes(t.flatten().tolist()).hex()


def test_main_entry_golden_288_bytes():
    # Block j (16 channels) has scale s_j = (1 + (j % 8) / 8) * 2**(j // 8 - 2): E4M3 exponent field
    # j // 8 + 5 and mantissa j % 8, so its byte is 0x28 + j. Even blocks hold s_j * PATTERN, odd blocks
    # -s_j * PATTERN. One marker: block 5, element 8 is +0.5 * s_5 (code 1), so byte 5 * 8 + 4 = 44 is 0x91.
    x = torch.zeros(512)
    for j in range(32):
        s = (1 + (j % 8) / 8) * 2.0 ** (j // 8 - 2)
        x[16 * j : 16 * j + 16] = torch.tensor(PATTERN) * (s if j % 2 == 0 else -s)
    x[16 * 5 + 8] = 0.5 * (1 + 5 / 8) * 2.0**-2
    codes_hex = list(bytes.fromhex((PATTERN_BYTES + NEGATED_BYTES) * 16))
    codes_hex[44] = 0x91
    expected = bytes(codes_hex).hex() + bytes(range(0x28, 0x48)).hex()
    assert len(expected) == 2 * 288

    entry = pack_main_entry(*quantize_fp4(x, 16, "e4m3"))
    assert entry.dtype == torch.uint8 and entry.shape == (288,)
    assert _hex(entry) == expected

    codes, scales = unpack_main_entry(torch.tensor(list(bytes.fromhex(expected)), dtype=torch.uint8))
    assert codes.shape == (256,) and scales.shape == (32,)
    assert torch.equal(dequantize_fp4(codes, scales, 16, "e4m3"), x)  # every value is on the grid


def test_index_entry_golden_68_bytes():
    # Block j (32 channels) has scale 2**(j - 1): UE8M0 bytes 7E 7F 80 81. Its first 16 values are
    # ±s_j * PATTERN (sign alternating by block), the next 16 are s_j times the ties and their negatives
    #   0.25 0.75 1.25 1.75 2.5 3.5 5 -0.25 -0.75 -1.25 -1.75 -2.5 -3.5 -5 -0.0 1e-30
    #   -> 0    2    2    4   4   6  6    0     A     A     C    C    E   E   0    0   (ties to even code)
    # i.e. bytes 20 42 64 06 AA CC EE 00.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0, 1e-30]
    x = torch.zeros(2, 128)
    for j in range(4):
        s = 2.0 ** (j - 1)
        x[:, 32 * j : 32 * j + 16] = torch.tensor(PATTERN) * (s if j % 2 == 0 else -s)
        x[:, 32 * j + 16 : 32 * j + 32] = torch.tensor(ties) * s
    tie_bytes = "20426406aaccee00"
    expected = (PATTERN_BYTES + tie_bytes + NEGATED_BYTES + tie_bytes) * 2 + "7e7f8081"
    assert len(expected) == 2 * 68

    entry = pack_index_entry(*quantize_fp4(x, 32, "ue8m0"))
    assert entry.shape == (2, 68)
    assert _hex(entry[0]) == expected and _hex(entry[1]) == expected
    codes, scales = unpack_index_entry(entry)
    assert codes.shape == (2, 64) and _hex(scales[1]) == "7e7f8081"


def _e4m3_value(b: int) -> float:
    """E4M3FN byte 0eeeemmm by hand: subnormal m * 2**-9 when e = 0, else 2**(e - 7) * (1 + m / 8)."""
    e, m = b >> 3, b & 7
    return m * 2.0**-9 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)


def test_window_row_golden_528_bytes():
    # Block j (32 channels) has scale 2**(j - 8), UE8M0 byte 0x77 + j. Element i is (-1)**i * s_j * value
    # of E4M3 byte 4i, so its code is 4i with the sign bit on odd i: 00 84 08 8C ... 78 FC. The amax
    # 384 * s_j gives 2**ceil(log2(384 / 448)) * s_j = s_j. Odd blocks start with -0.0, stored as 00.
    block_bytes = [4 * i | (0x80 if i % 2 else 0) for i in range(32)]
    assert bytes(block_bytes).hex() == ("0084088c1094189c20a428ac30b438bc40c448cc50d458dc60e468ec70f478fc")
    x = torch.zeros(512)
    for j in range(16):
        for i in range(32):
            x[32 * j + i] = (-1) ** i * 2.0 ** (j - 8) * _e4m3_value(4 * i)
        if j % 2:
            x[32 * j] = -0.0
    expected = bytes(block_bytes * 16).hex() + bytes(range(0x77, 0x87)).hex()
    assert len(expected) == 2 * 528

    row = pack_window_row(*quantize_fp8(x, 32))
    assert row.shape == (528,)
    assert _hex(row) == expected
    codes, scales = unpack_window_row(row)
    assert codes.shape == (512,) and scales.shape == (16,)
    assert torch.equal(dequantize_fp8(codes, scales), x)


@pytest.mark.parametrize(
    "pack,unpack,code_bytes,scale_bytes",
    [
        (pack_main_entry, unpack_main_entry, 32, 4),  # d = 64: 64/2 + 64/16
        (pack_index_entry, unpack_index_entry, 32, 2),  # d = 64: 64/2 + 64/32
        (pack_window_row, unpack_window_row, 64, 2),  # d = 64: 64 + 64/32
    ],
)
def test_layouts_are_generic_in_width_and_validate(pack, unpack, code_bytes, scale_bytes):
    codes = torch.randint(0, 256, (3, 5, code_bytes), dtype=torch.uint8)
    scales = torch.randint(0, 256, (3, 5, scale_bytes), dtype=torch.uint8)
    entry = pack(codes, scales)
    assert entry.shape == (3, 5, code_bytes + scale_bytes)
    got_codes, got_scales = unpack(entry)
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
    with pytest.raises(ValueError, match="do not fit"):
        pack(codes[..., :-1], scales)
    with pytest.raises(ValueError, match="uint8"):
        pack(codes.to(torch.int8), scales)
    with pytest.raises(ValueError, match="whole number"):
        unpack(entry[..., :-1])
