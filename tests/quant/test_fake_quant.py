"""Fake-quant for training: equals dequantize(quantize(x)), keeps dtype, straight-through gradient, runs on
``meta`` (MODEL_REFERENCE.md §4: the reference keeps caches as values on the FP4/FP8 grid)."""

import pytest
import torch

from deepseek_v41.quant import (
    dequantize_fp4,
    dequantize_fp8,
    fake_quant_fp4,
    fake_quant_fp8,
    quantize_fp4,
    quantize_fp8,
)


def _fp4_round_trip(block: int, fmt: str):
    return lambda x, dtype: dequantize_fp4(*quantize_fp4(x, block, fmt), block, fmt, dtype)


def _fp8_round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8(*quantize_fp8(x, 32), 32, "ue8m0", dtype)


# (id, fake-quant, dequantize(quantize(.)) in a dtype): main KV FP4, indexer FP4, window / activation FP8.
CASES = [
    ("fp4-e4m3-16", lambda x: fake_quant_fp4(x, 16, "e4m3"), _fp4_round_trip(16, "e4m3")),
    ("fp4-ue8m0-32", lambda x: fake_quant_fp4(x, 32, "ue8m0"), _fp4_round_trip(32, "ue8m0")),
    ("fp8-ue8m0-32", lambda x: fake_quant_fp8(x, 32), _fp8_round_trip),
]
IDS = [c[0] for c in CASES]


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 128, generator=g) * torch.exp2(
        torch.randint(-30, 30, (3, 5, 1), generator=g).float()
    )
    x[0, 0, :32] = 0.0
    x[0, 1, :32] = -0.0
    x[0, 2, 5] = float("nan")
    x[0, 3, 40] = float("inf")
    x[0, 4, 70] = -float("inf")
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_equals_dequantize_of_quantize_bit_for_bit(case, dtype):
    _, fake, reference = case
    x = _inputs(dtype)
    out = fake(x)
    assert out.dtype == dtype and out.shape == x.shape
    # Bitwise, so signed zeros and the NaN blocks count too.
    assert torch.equal(_bits(out), _bits(reference(x, dtype)))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradient_is_identity(case):
    _, fake, _ = case
    x = _inputs(torch.float32).requires_grad_()
    grad = torch.randn_like(x)
    fake(x).backward(grad)
    assert torch.equal(x.grad, grad)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_runs_on_meta_with_autograd(case):
    _, fake, _ = case
    x = torch.empty(2, 7, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = fake(x)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == x.shape
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_errors_reach_the_caller():
    with pytest.raises(ValueError, match="not a multiple of block_size 16"):
        fake_quant_fp4(torch.zeros(24), 16, "e4m3")
    with pytest.raises(ValueError, match="unknown scale_format"):
        fake_quant_fp4(torch.zeros(32), 32, "e8m0")
    with pytest.raises(ValueError, match="not a multiple of block_size 32"):
        fake_quant_fp8(torch.zeros(48, requires_grad=True))
