"""Model-level properties of the exact forward (issue 3)."""

import pytest
import torch

from deepseek_v41.config import tiny_config
from deepseek_v41.model.transformer import Transformer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(tiny_config()).eval()


def test_causal_at_every_position_including_open_pairs(model):
    # Compressed entries must become visible only once their last token is processed: changing token t must
    # leave every earlier position untouched (also at odd t, where t closes a ratio-2 pair).
    T = 3 * model.config.sliding_window + 5
    ids = torch.randint(0, 512, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(ids)
        for t in (1, 2, 7, 8, T // 2, T - 1):
            changed = ids.clone()
            changed[0, t] = (changed[0, t] + 1) % 512
            out = model(changed)
            # Not bit-equal: an expert's matmul over a different set of routed tokens rounds differently.
            assert (out[:, :t] - base[:, :t]).abs().max() < 1e-5, t
            assert (out[:, t] - base[:, t]).abs().max() > 1e-3, t


def test_fake_quant_is_switchable(model):
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        on = model(ids)
        model.fake_quant = False
        off = model(ids)
        model.fake_quant = True
    assert not torch.equal(on, off)
    assert (on - off).norm() < 0.3 * off.norm()  # the same model, seen through the quantizer


def test_runs_on_meta_and_in_bf16():
    with torch.device("meta"):
        meta = Transformer(tiny_config())
    assert meta(torch.zeros(2, 33, dtype=torch.long, device="meta")).shape == (2, 33, 512)
    torch.manual_seed(0)
    bf16 = Transformer(tiny_config()).to(torch.bfloat16)
    out = bf16(torch.randint(0, 512, (1, 20)))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_batch_rows_are_independent(model):
    ids = torch.randint(0, 512, (3, 50), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        together = model(ids)
        alone = torch.cat([model(ids[i: i + 1]) for i in range(3)])
    assert torch.allclose(together, alone, atol=1e-5, rtol=0)


def test_bad_input_is_refused(model):
    with pytest.raises(ValueError, match="token ids must be in"):
        model(torch.tensor([[0, 512]]))
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\]"):
        model(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="image_mask shape"):
        model(torch.tensor([[0, 1]]), image_mask=torch.tensor([[True]]))


def test_images_enter_through_the_vision_path(tmp_path):
    import numpy as np

    from deepseek_v41 import load_model
    from deepseek_v41.config import VisionConfig
    from deepseek_v41.model.image_processor import expand_image_placeholders, preprocess_image

    cfg = tiny_config().replace(image_token_id=500, vision_config=VisionConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48, min_pixels=28 * 28 * 4,
        max_image_tokens=64))
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.ffn.gate.bias_vl.normal_(0, 1.0)  # image tokens route differently from text
    rng = np.random.RandomState(0)
    images = [preprocess_image((rng.rand(60, 90, 3) * 255).astype(np.uint8), cfg.vision_config) for _ in range(2)]
    ids, types = expand_image_placeholders([0, 5, 500, 7, 8], [images[0].grid], 500)
    ids, types = torch.tensor([ids]), torch.tensor([types])
    with torch.no_grad():
        out = model(ids, token_types=types, images=[images[0]])
        other = model(ids, token_types=types, images=[images[1]])
        text_only = model(ids)
    span = (types[0] >= 0).nonzero()
    first = int(span[0])
    assert (out[:, :first] - other[:, :first]).abs().max() < 1e-5  # causal: text before the image is untouched
    assert (out[:, first:] - other[:, first:]).abs().max() > 1e-3  # the pixels matter
    assert (out[:, first:] - text_only[:, first:]).abs().max() > 1e-3
    model.save_pretrained(tmp_path)
    # To rounding: the loaded weights sit at other addresses, and MKL picks its GEMM kernels by alignment on some
    # CPUs (AMD EPYC here).
    torch.testing.assert_close(load_model(tmp_path)(ids, token_types=types, images=[images[0]]), out, rtol=0,
                               atol=1e-5)


def test_grouped_experts_equal_the_per_expert_loop_and_keep_one_copy_of_the_weights(tmp_path):
    """Inference groups every expert's rows into one torch._grouped_mm per projection (MoE.stacked_weights makes
    the expert parameters views of one tensor); the result is the per-expert loop's and nothing is duplicated."""
    import pytest

    from deepseek_v41.model.moe import MoE

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    torch.manual_seed(0)
    moe = MoE(32, 16, 6, 2, 1, 10.0, 1.5, True, False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 9, 32)
    loop = moe(x)  # grad mode on: the per-expert loop
    with torch.no_grad():
        grouped = moe(x)
    torch.testing.assert_close(grouped, loop, rtol=1e-6, atol=1e-6)
    w13, _ = moe.stacked_weights()
    assert moe.experts[3].w3.weight.data_ptr() == w13[3, 16:].data_ptr()  # a view, not a copy
    assert not w13.requires_grad and w13.grad_fn is None
    import copy

    torch.testing.assert_close(copy.deepcopy(moe)(x), loop)  # still an ordinary module
    with torch.no_grad():  # in-place updates reach the stack; model.to() re-stacks
        moe.experts[2].w2.weight.mul_(2)
        doubled = moe(x)
    moe.double()  # new parameter tensors; the module keeps no reference to the old stack
    assert not any(isinstance(v, torch.Tensor) for v in vars(moe).values())
    moe.float()  # the next inference call stacks them again
    with torch.no_grad():
        again = moe(x)
    assert moe.experts[3].w3.weight.data_ptr() == moe.stacked_weights()[0][3, 16:].data_ptr()
    assert not torch.allclose(doubled, grouped)
    torch.testing.assert_close(again, doubled, rtol=1e-6, atol=1e-6)


def test_expert_projections_keep_their_hooks_and_wrappers():
    """The fast expert paths call F.linear on the weights; a hooked or wrapped projection (LoRA, a probe) is called
    as a module instead, in training, in the grouped inference path and for a single token."""
    import copy

    from deepseek_v41.model.moe import MoE

    torch.manual_seed(0)
    moe = MoE(32, 16, 6, 2, 1, 10.0, 1.5, True, False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    doubled = copy.deepcopy(moe)
    with torch.no_grad():
        for e in (*doubled.experts, doubled.shared_experts):
            e.w3.weight.mul_(2)
    for e in (*moe.experts, moe.shared_experts):  # the same as doubling w3: a hook doubling its output
        e.w3.register_forward_hook(lambda module, args, out: out * 2)
    for x in (torch.randn(2, 9, 32), torch.randn(1, 1, 32)):
        torch.testing.assert_close(moe(x), doubled(x), rtol=1e-6, atol=1e-6)  # grad mode: the per-expert loop
        with torch.no_grad():
            torch.testing.assert_close(moe(x), doubled(x), rtol=1e-6, atol=1e-6)  # inference paths
    assert not moe.experts[0].plain() and doubled.experts[0].plain()

    class Wrapped(torch.nn.Module):  # a LoRA-style wrapper without a .weight of its own
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

        def forward(self, x):
            return self.base_layer(x) * 2

    wrapped, x = copy.deepcopy(doubled), torch.randn(2, 9, 32)
    for e in (*wrapped.experts, wrapped.shared_experts):
        e.w3.weight.data.div_(2)
        e.w3 = Wrapped(e.w3)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), doubled(x), rtol=1e-6, atol=1e-6)
    # Hooks on the expert itself, and backward hooks, also keep the experts off the fast paths.
    zeroed = copy.deepcopy(doubled)
    for e in zeroed.experts:
        e.register_forward_hook(lambda module, args, out: out * 0)
    with torch.no_grad():
        torch.testing.assert_close(zeroed(x), doubled.shared_experts(x.reshape(-1, 32)).reshape(x.shape))
    probed = copy.deepcopy(doubled)
    seen = []
    probed.experts[0].w1.register_full_backward_hook(lambda module, gin, gout: seen.append(1))
    assert not probed.experts[0].plain()
    probed(torch.randn(4, 32, 32, requires_grad=True)).sum().backward()
    assert seen


def test_a_model_with_stacked_experts_saves_and_loads(tmp_path):
    from deepseek_v41.config import tiny_config
    from deepseek_v41.model.checkpoint import load_model

    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    ids = torch.randint(3, 300, (1, 12))
    with torch.no_grad():
        before = model(ids)  # stacks every MoE's experts
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), before, rtol=0, atol=0)


def test_bf16_grouped_experts_pad_each_group_to_32_rows_without_changing_rows():
    """bf16 grouped matmuls pad each expert's rows with zero rows to a multiple of GROUP_ROWS (oneDNN compiles a
    kernel per new row count); the padding reaches no output: rows equal the per-expert loop's to bf16 rounding,
    and the grouped call saw only padded group sizes, including for experts with no rows."""
    import pytest

    from deepseek_v41.model import moe as moe_module
    from deepseek_v41.model.moe import GROUP_ROWS, MoE

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    torch.manual_seed(1)
    moe = MoE(64, 32, 6, 2, 1, 10.0, 1.5, True, False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe = moe.bfloat16()
    x = torch.randn(1, 45, 64).bfloat16()  # 90 picks over 6 experts: counts off the multiples of 32
    seen = []
    grouped = moe_module.MoE._grouped_experts

    def spy(self, sorted_x, offsets):
        seen.append((sorted_x.shape[0], offsets.tolist()))
        return grouped(self, sorted_x, offsets)

    loop = moe(x)  # grad mode on: the per-expert loop
    moe_module.MoE._grouped_experts = spy
    try:
        with torch.no_grad():
            padded = moe(x)
    finally:
        moe_module.MoE._grouped_experts = grouped
    (rows, offsets), = seen
    sizes = [b - a for a, b in zip([0, *offsets[:-1]], offsets, strict=True)]
    assert all(s % GROUP_ROWS == 0 for s in sizes) and rows == offsets[-1] > 90
    assert padded.shape == loop.shape and padded.dtype == torch.bfloat16
    torch.testing.assert_close(padded.float(), loop.float(), rtol=2e-2, atol=2e-2)
    flat = x.reshape(-1, 64)
    idx, w = moe.gate(flat)
    counts = torch.bincount(idx.reshape(-1), minlength=6)
    assert sizes == ((counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS).tolist()
