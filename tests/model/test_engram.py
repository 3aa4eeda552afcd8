"""The Engram module: table lookup and dequantisation, key/value split, gate, masking (ENGRAM.md §1, §8–§10).

Oracle: ``oracle_forward``, a float64 numpy re-derivation of ENGRAM.md §8–§10 written from the spec's formulas,
and ml_dtypes for the E4M3 / bf16 roundings.
"""

import dataclasses

import numpy as np
import pytest
import torch
from optional_deps import require

from deepseek_v41.config import flash_config, tiny_config
from deepseek_v41.model.engram import Engram, EngramHasher, EngramTable, engram_gate


def oracle_forward(streams, table, rows, wkv, q, k, eps, mask=None, round_kv=None):
    """ENGRAM.md §8–§10 in float64: streams [B,S,hc,D], table [R,hd], rows [B,S,C], wkv [(hc+1)D, C*hd],
    q/k [hc,D], mask [B,S] (True = image). ``round_kv`` rounds the wkv output (bf16 compute)."""
    b, s, hc, d = streams.shape
    e = table[rows].reshape(b, s, -1).astype(np.float64)
    kv = e @ wkv.astype(np.float64).T
    if round_kv is not None:
        kv = round_kv(kv)
    key = kv[..., : hc * d].reshape(b, s, hc, d)
    value = kv[..., hc * d:]
    h = streams.astype(np.float64)
    w = q.astype(np.float64) * k.astype(np.float64)
    dot = (h * w * key).sum(-1) / np.sqrt((h**2).mean(-1) + eps) / np.sqrt((key**2).mean(-1) + eps) / np.sqrt(d)
    g = 1 / (1 + np.exp(-np.copysign(np.sqrt(np.maximum(np.abs(dot), 1e-6)), dot)))
    if mask is not None:
        g = np.where(mask[..., None], 0.0, g)
    return h + g[..., None] * value[:, :, None, :]


def make(cfg, table_format="float", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    module = Engram(cfg, cfg.engram_layer_ids[0], table_format, dtype=dtype)
    with torch.no_grad():
        module.wkv.weight.normal_(0, module.wkv.in_features**-0.5)
        module.q_weight.uniform_(-2, 2)
        module.k_weight.uniform_(-2, 2)
    return module


def random_rows(cfg, module, batch=2, seq=7, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    return EngramHasher(cfg)(ids)[module.layer_id]


def random_fp8_table(rows, head_dim, seed=2):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, head_dim), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes).to(torch.uint8)  # no NaN codes
    scales = torch.randint(118, 136, (rows, head_dim // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return codes, scales


def numpy_dequant(codes, scales):
    """E4M3FN bits times 2^(byte - 127), by ml_dtypes (ENGRAM.md §8)."""
    ml_dtypes = require("ml_dtypes")
    values = codes.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return values * np.repeat(np.exp2(scales.numpy().astype(np.float32) - 127), 32, axis=-1)


def params(module):
    return [t.detach().float().numpy() for t in (module.wkv.weight, module.q_weight, module.k_weight)]


# ---------------------------------------------------------------------------------------------- forward
def test_fp32_forward_matches_the_oracle():
    cfg = tiny_config()
    module = make(cfg)
    rows = random_rows(cfg, module)
    streams = torch.randn(2, 7, cfg.hc_mult, cfg.hidden_size) * torch.logspace(-3, 3, 7)[None, :, None, None]
    out = module(streams, rows)
    want = oracle_forward(streams.numpy(), module.embed.weight.detach().numpy(), rows.numpy(), *params(module),
                          eps=cfg.rms_norm_eps)
    assert out.dtype == torch.float32 and out.shape == streams.shape
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=1e-5, atol=1e-5)


def test_bf16_forward_matches_the_oracle():
    ml_dtypes = require("ml_dtypes")
    cfg = tiny_config()
    module = make(cfg, dtype=torch.bfloat16)
    rows = random_rows(cfg, module)
    streams = torch.randn(2, 7, cfg.hc_mult, cfg.hidden_size).to(torch.bfloat16)
    out = module(streams, rows)
    assert out.dtype == torch.bfloat16

    def round_bf16(x):
        return x.astype(ml_dtypes.bfloat16).astype(np.float64)

    want = oracle_forward(streams.float().numpy(), module.embed.weight.detach().float().numpy(), rows.numpy(),
                          *params(module), eps=cfg.rms_norm_eps, round_kv=round_bf16)
    # One bf16 rounding of the output, plus at most an ulp of kv where the GEMM sums in another order.
    np.testing.assert_allclose(out.detach().float().numpy(), round_bf16(want), rtol=2**-7, atol=2**-7)


def test_gate_clamps_inside_the_sqrt():
    d = 64
    ones = torch.ones(1, 4, d)
    for target in (1e-8, -1e-8, 4.0, -0.25):
        # dot = sum(1 * w * 1) / sqrt(d) with constant w = target / sqrt(d).
        gate = engram_gate(ones, ones, torch.full((4, d), target / d**0.5), eps=1e-20)
        root = np.copysign(np.sqrt(max(abs(target), 1e-6)), target)
        np.testing.assert_allclose(gate.numpy(), np.full((1, 4), 1 / (1 + np.exp(-root))), rtol=1e-6)


def test_masked_positions_pass_through_bit_identical():
    cfg = tiny_config()
    for dtype in (torch.float32, torch.bfloat16):
        module = make(cfg, dtype=dtype)
        rows = random_rows(cfg, module)
        streams = torch.randn(2, 7, cfg.hc_mult, cfg.hidden_size).to(dtype)
        streams[0, 2, 1, :5] = -0.0
        mask = torch.zeros(2, 7, dtype=torch.bool)
        mask[0, 1:4] = True
        mask[1, 6] = True
        out = module(streams, rows, mask)
        assert torch.equal(out[mask].view(torch.uint8), streams[mask].view(torch.uint8))
        assert torch.equal(out[~mask], module(streams, rows)[~mask])
        assert not torch.equal(out[~mask], streams[~mask])


def test_value_is_shared_and_keys_are_per_stream():
    # Streams that are equal get equal updates; the update is g_i * value with value = the last D kv columns.
    cfg = tiny_config()
    module = make(cfg)
    rows = random_rows(cfg, module, batch=1, seq=3)
    streams = torch.randn(1, 3, 1, cfg.hidden_size).expand(1, 3, cfg.hc_mult, cfg.hidden_size).clone()
    with torch.no_grad():
        module.q_weight.copy_(module.q_weight[:1].expand_as(module.q_weight))
        module.k_weight.copy_(module.k_weight[:1].expand_as(module.k_weight))
        kv = module.wkv(module.embed(rows).flatten(-2))
        d = cfg.hidden_size
        for i in range(1, cfg.hc_mult):  # make every key block equal to stream 0's
            module.wkv.weight[i * d:(i + 1) * d] = module.wkv.weight[:d]
    update = module(streams, rows) - streams
    assert torch.allclose(update, update[:, :, :1].expand_as(update), rtol=0, atol=0)
    value = kv[..., cfg.hc_mult * d:]
    gate = (update[:, :, 0] * value).sum(-1, keepdim=True) / value.square().sum(-1, keepdim=True)
    assert torch.allclose(update[:, :, 0], gate * value, atol=1e-5)
    assert bool(((gate > 0) & (gate < 1)).all())


# ---------------------------------------------------------------------------------------------- FP8 table
def test_fp8_lookup_dequantizes_the_gathered_rows():
    table = EngramTable(50, 64, "fp8")
    codes, scales = random_fp8_table(50, 64)
    table.load_state_dict({"weight": codes, "scale": scales})  # raw bytes are reinterpreted, not converted
    assert table.weight.dtype == torch.float8_e4m3fn and table.scale.dtype == torch.float8_e8m0fnu
    rows = torch.tensor([[3, 49, 3], [0, 17, 8]])
    got = table(rows)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 64)
    np.testing.assert_array_equal(got.numpy(), numpy_dequant(codes, scales)[rows.numpy()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_table_equals_the_float_path_fed_the_dequantized_table(dtype):
    cfg = dataclasses.replace(tiny_config(), engram_head_dim=32)  # FP8 scales cover 32 columns
    fp8 = make(cfg, "fp8", dtype=dtype)
    codes, scales = random_fp8_table(fp8.embed.num_rows, cfg.engram_head_dim)
    fp8.embed.load_state_dict({"weight": codes.view(torch.float8_e4m3fn), "scale": scales})
    plain = make(cfg, dtype=dtype)
    plain.load_state_dict({**fp8.state_dict(), "embed.weight": torch.from_numpy(numpy_dequant(codes, scales))},
                          strict=False)
    rows = random_rows(cfg, fp8)
    streams = torch.randn(2, 7, cfg.hc_mult, cfg.hidden_size).to(dtype)
    assert torch.equal(fp8(streams, rows), plain(streams, rows))


# ---------------------------------------------------------------------------------------------- names, meta
def test_official_names_and_shapes_on_meta():
    cfg = flash_config()
    float_names = {"embed.weight", "wkv.weight", "q_weight", "k_weight"}
    assert set(Engram(cfg, 1, device="meta").state_dict()) == float_names
    state = Engram(cfg, 14, "fp8", device="meta", dtype=torch.bfloat16).state_dict()
    assert {k: (tuple(v.shape), v.dtype) for k, v in state.items()} == {
        "embed.weight": ((384016682, 256), torch.float8_e4m3fn),
        "embed.scale": ((384016682, 8), torch.float8_e8m0fnu),
        "wkv.weight": ((25600, 6144), torch.bfloat16),
        "q_weight": ((4, 5120), torch.bfloat16),
        "k_weight": ((4, 5120), torch.bfloat16),
    }


@pytest.mark.parametrize("table_format", ["float", "fp8"])
def test_forward_runs_on_meta(table_format):
    cfg = flash_config()
    module = Engram(cfg, 1, table_format, device="meta", dtype=torch.bfloat16)
    streams = torch.empty(2, 5, 4, 5120, dtype=torch.bfloat16, device="meta")
    rows = torch.empty(2, 5, 24, dtype=torch.int64, device="meta")
    out = module(streams, rows, torch.empty(2, 5, dtype=torch.bool, device="meta"))
    assert out.device.type == "meta" and out.shape == streams.shape and out.dtype == torch.bfloat16


def test_float_table_trains_only_the_gathered_rows():
    cfg = tiny_config()
    module = make(cfg)
    rows = random_rows(cfg, module, batch=1, seq=4)
    module(torch.randn(1, 4, cfg.hc_mult, cfg.hidden_size), rows).square().sum().backward()
    touched = module.embed.weight.grad.abs().sum(-1) > 0
    assert set(torch.nonzero(touched).flatten().tolist()) <= set(rows.flatten().tolist())
    assert touched.any() and module.q_weight.grad is not None and module.wkv.weight.grad is not None


def test_bad_input_raises_value_error():
    cfg = tiny_config()
    module = make(cfg)
    streams = torch.randn(1, 3, cfg.hc_mult, cfg.hidden_size)
    rows = torch.zeros(1, 3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="streams"):
        module(streams[:, :, :2], rows)
    with pytest.raises(ValueError, match="row_ids"):
        module(streams, rows[..., :3])
    with pytest.raises(ValueError, match="row_ids"):
        module(streams, rows.int())
    with pytest.raises(ValueError, match="mask"):
        module(streams, rows, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="table_format"):
        Engram(cfg, 1, "fp4")
    with pytest.raises(ValueError, match="has no Engram"):
        Engram(cfg, 0)
    with pytest.raises(ValueError, match="divisible by 32"):
        EngramTable(10, 16, "fp8")
