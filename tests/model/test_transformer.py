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
