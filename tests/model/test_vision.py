"""The vision path: names and size on meta, span layout and placement, ViT attention and 2-D RoPE, one block
against a loop oracle, the aligner's merge order, preprocessing (MODEL_REFERENCE.md §3.18, §6, §8).

Oracles: the §8 name/shape table typed in from the spec, parameter arithmetic from the config, hand-built
token/feature tensors, ``oracle_block`` (a float64 loop re-derivation of §3.18 with the RoPE convention stated in
``vision.py``), ``torch.nn.functional.unfold`` for the merge order, and raw pixel indexing for the patch order.
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from deepseek_v41.config import VisionConfig, flash_config, tiny_config
from deepseek_v41.model.image_processor import (
    IMAGE_MEAN,
    IMAGE_STD,
    ImageGrid,
    ProcessedImage,
    TokenType,
    expand_image_placeholders,
    image_span_length,
    image_token_types,
    patches_to_pixels,
    pixels_to_patches,
    plan_image_grid,
    preprocess_image,
)
from deepseek_v41.model.vision import (
    Aligner,
    VisionAttention,
    VisionBlock,
    VisionModel,
    VisionTower,
    apply_vision_rope,
    checkpoint_name_candidates,
    grid_positions,
    place_image_embeddings,
    vision_rope_angles,
)

S, I, N, E, T = (int(t) for t in (TokenType.IMAGE_START, TokenType.IMAGE, TokenType.IMAGE_NEWLINE,
                                  TokenType.IMAGE_END, TokenType.TEXT))
SMALL = VisionConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=12, patch_size=2,
                     rope_theta=100.0, downsample_ratio=3, max_image_tokens=64, min_pixels=16)


def small_model(seed=0) -> VisionModel:
    cfg = dataclasses.replace(tiny_config(), vision_config=SMALL, image_token_id=509)
    torch.manual_seed(seed)
    model = VisionModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def random_image(n_h, n_w, seed, cfg=SMALL) -> ProcessedImage:
    g = torch.Generator().manual_seed(seed)
    patches = torch.randn(n_h * n_w, 3 * cfg.patch_size ** 2, generator=g)
    r = cfg.downsample_ratio
    grid = ImageGrid(n_h * cfg.patch_size, n_w * cfg.patch_size, n_h, n_w, math.ceil(n_h / r), math.ceil(n_w / r))
    return ProcessedImage(patches, grid)


# ---------------------------------------------------------------------------------------------- names and size
def spec_table() -> dict[str, tuple[int, ...]]:
    """MODEL_REFERENCE.md §8, vision rows, for the flash config."""
    t = {"vision.patch_embed.proj.weight": (1024, 588), "vision.patch_embed.proj.bias": (1024,),
         "vision.norm.weight": (1024,), "aligner.w1.weight": (5120, 9216), "aligner.w1.bias": (5120,),
         "aligner.w2.weight": (5120, 5120), "aligner.w2.bias": (5120,), "image_start": (5120,),
         "image_newline": (5120,), "image_end": (5120,)}
    for b in range(32):
        p = f"vision.blocks.{b}."
        t |= {p + "norm1.weight": (1024,), p + "norm2.weight": (1024,), p + "attn.wqkv.weight": (3072, 1024),
              p + "attn.wqkv.bias": (3072,), p + "attn.wo.weight": (1024, 1024), p + "attn.wo.bias": (1024,),
              p + "mlp.w1.weight": (5632, 1024), p + "mlp.w2.weight": (1024, 2816)}
    return t


def test_flash_names_shapes_and_count_on_meta():
    cfg = flash_config()
    with torch.device("meta"):
        model = VisionModel(cfg)
    got = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert got == spec_table()
    count = sum(p.numel() for p in model.parameters())
    v, D = cfg.vision_config, cfg.hidden_size
    c, i, p2 = v.hidden_size, v.intermediate_size, 3 * v.patch_size ** 2
    block = 2 * c + (3 * c * c + 3 * c) + (c * c + c) + 2 * i * c + c * i
    aligner = (v.downsample_ratio ** 2 * c * D + D) + (D * D + D)
    assert count == (p2 * c + c) + v.num_hidden_layers * block + c + aligner + 3 * D
    assert abs(count - 0.49e9) / 0.49e9 < 0.03  # §6: vision + aligner ~ 0.49B


def test_patch_embed_alias_loads():
    model = small_model()
    sd = model.state_dict()
    renamed = {("vision.patch_embed." + k.rsplit(".", 1)[1] if k.startswith("vision.patch_embed.proj.") else k): v
               for k, v in sd.items()}
    assert "vision.patch_embed.weight" in renamed
    fresh = small_model(seed=1)
    fresh.load_state_dict(renamed, strict=True)
    assert torch.equal(fresh.vision.patch_embed.proj.weight, model.vision.patch_embed.proj.weight)
    assert checkpoint_name_candidates("vision.patch_embed.proj.bias") == ["vision.patch_embed.proj.bias",
                                                                          "vision.patch_embed.bias"]
    assert checkpoint_name_candidates("aligner.w1.weight") == ["aligner.w1.weight"]


# ---------------------------------------------------------------------------------------------- span layout
def test_span_layout():
    assert image_token_types(1, 1) == [S, I, N, E]
    assert image_token_types(2, 3) == [S, I, I, I, N, I, I, I, N, E]
    for n_h, n_w in [(1, 1), (2, 3), (13, 13), (31, 31), (1, 1021)]:
        assert image_span_length(n_h, n_w) == len(image_token_types(n_h, n_w)) == n_h * (n_w + 1) + 2
    g = plan_image_grid(544, 544, VisionConfig())  # 39x39 patches -> 13x13 tokens
    assert (g.n_vit_h, g.n_vit_w, g.n_llm_h, g.n_llm_w, g.span_length) == (39, 39, 13, 13, 184)
    with pytest.raises(ValueError, match="1x1"):
        image_span_length(0, 3)


def test_expand_placeholders():
    P = 99
    ids, types = expand_image_placeholders([5, P, 7, P, 9], [(1, 2), ImageGrid(0, 0, 0, 0, 2, 1)], P)
    assert ids == [5, P, P, P, P, P, 7, P, P, P, P, P, P, 9]
    assert types == [T, S, I, I, N, E, T, S, I, N, I, N, E, T]
    with pytest.raises(ValueError, match="2 image placeholder.*1 image"):
        expand_image_placeholders([P, P], [(1, 1)], P)
    with pytest.raises(ValueError, match="0 image placeholder.*1 image"):
        expand_image_placeholders([1, 2], [(1, 1)], P)


def test_place_writes_rows_in_reading_order_and_delimiters():
    D = 3
    types = torch.tensor([[T, S, I, I, N, I, I, N, E, T],
                          [S, I, N, E, T, T, S, I, N, E]])
    h = torch.full((2, 10, D), -1.0)
    f1 = torch.arange(4 * D, dtype=torch.float32).view(4, D) + 100  # image 1: 2x2 grid
    f2 = torch.full((1, D), 200.0)
    f3 = torch.full((1, D), 300.0)
    start, newline, end = torch.full((D,), 7.0), torch.full((D,), 8.0), torch.full((D,), 9.0)
    out, mask = place_image_embeddings(h, types, [f1, f2, f3], start, newline, end)
    expect = h.clone()
    expect[0, 2], expect[0, 3], expect[0, 5], expect[0, 6] = f1[0], f1[1], f1[2], f1[3]
    expect[1, 1], expect[1, 7] = f2[0], f3[0]
    for b, t in [(0, 1), (1, 0), (1, 6)]:
        expect[b, t] = start
    for b, t in [(0, 4), (0, 7), (1, 2), (1, 8)]:
        expect[b, t] = newline
    for b, t in [(0, 8), (1, 3), (1, 9)]:
        expect[b, t] = end
    assert torch.equal(out, expect)
    assert torch.equal(mask, types != T)
    assert torch.equal(h, torch.full((2, 10, D), -1.0))  # input untouched
    # the same rows as one tensor (a chunk's view) place identically
    same, _ = place_image_embeddings(h, types, torch.cat([f1, f2, f3]), start, newline, end)
    assert torch.equal(same, expect)


def test_place_rejects_bad_input():
    types = torch.tensor([[S, I, I, N, E]])
    h, v = torch.zeros(1, 5, 2), torch.zeros(2)
    with pytest.raises(ValueError, match="2 IMAGE position"):
        place_image_embeddings(h, types, torch.zeros(3, 2), v, v, v)
    with pytest.raises(ValueError, match="1 complete image span.*2 image feature"):
        place_image_embeddings(h, types, [torch.zeros(2, 2), torch.zeros(0, 2)], v, v, v)
    with pytest.raises(ValueError, match="1x2 grid"):
        place_image_embeddings(h, types, [torch.zeros(3, 2)], v, v, v)
    with pytest.raises(ValueError, match="not closed"):
        place_image_embeddings(h, torch.tensor([[S, I, I, E, T]]), [torch.zeros(2, 2)], v, v, v)
    with pytest.raises(ValueError, match="outside TokenType"):
        place_image_embeddings(h, torch.tensor([[S, I, 7, N, E]]), torch.zeros(2, 2), v, v, v)
    with pytest.raises(ValueError, match=r"\[B, T, D\]"):
        place_image_embeddings(h, types[0], torch.zeros(2, 2), v, v, v)


def test_expand_then_embed_places_aligner_rows():
    model = small_model().eval()
    images = [random_image(4, 5, seed=1), random_image(3, 3, seed=2)]  # 2x2 and 1x1 token grids
    ids, types = expand_image_placeholders([3, 509, 4, 509], [im.grid for im in images], 509)
    types = torch.tensor([types])
    h = torch.randn(1, len(ids), 64)
    with torch.no_grad():
        out, mask = model(h, types, images)
        rows = [model.aligner(model.vision(im.patches, im.grid.n_vit_h, im.grid.n_vit_w), im.grid.n_vit_h,
                              im.grid.n_vit_w) for im in images]
    assert ids == [3] + [509] * 8 + [4] + [509] * 4
    assert torch.equal(out[0, [2, 3, 5, 6]], rows[0]) and torch.equal(out[0, [11]], rows[1])
    assert torch.equal(out[0, [1, 10]], model.image_start.expand(2, -1).detach())
    assert torch.equal(out[0, [4, 7, 12]], model.image_newline.expand(3, -1).detach())
    assert torch.equal(out[0, [8, 13]], model.image_end.expand(2, -1).detach())
    assert torch.equal(out[0, [0, 9]], h[0, [0, 9]]) and torch.equal(mask[0], types[0] != T)


# ---------------------------------------------------------------------------------------------- ViT attention
def test_vit_attention_is_bidirectional():
    tower = small_model().vision.eval()
    a = random_image(3, 4, seed=3).patches
    b = a.clone()
    b[-1] += 1.0  # the last patch in reading order
    with torch.no_grad():
        ya, yb = tower(a, 3, 4), tower(b, 3, 4)
    assert (ya[0] - yb[0]).abs().max() > 1e-3


def test_vit_images_do_not_attend_to_each_other():
    model = small_model().eval()
    one, two, other = random_image(3, 4, 4), random_image(3, 4, 5), random_image(3, 4, 6)
    with torch.no_grad():
        batch = model.vision(torch.stack([one.patches, two.patches]), 3, 4)
        changed = model.vision(torch.stack([one.patches, other.patches]), 3, 4)
        alone = model.vision(one.patches, 3, 4)
        mixed = model.encode([one, random_image(5, 2, 7), two])
    assert torch.equal(batch[0], changed[0]) and not torch.equal(batch[1], changed[1])
    # To rounding (other batch shapes: MKL's GEMM may add in another order, by a few 1e-7 on AMD EPYC here).
    torch.testing.assert_close(batch[0], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed[0], model.aligner(alone, 3, 4), rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed[2], model.aligner(batch[1], 3, 4), rtol=0, atol=1e-5)
    assert [tuple(m.shape) for m in mixed] == [(2, 64), (2, 64), (2, 64)]  # 1x2, 2x1, 1x2 token grids


def test_rope_translation_leaves_attention_unchanged():
    torch.manual_seed(0)
    attn = VisionAttention(16, 2)
    x = torch.randn(1, 12, 16)
    rows, cols = grid_positions(3, 4)
    base = attn(x, vision_rope_angles(rows, cols, 8, 100.0))
    shifted = attn(x, vision_rope_angles(rows + 17, cols - 5, 8, 100.0))
    torch.testing.assert_close(shifted, base, rtol=0, atol=1e-5)
    # positions matter: swapping the roles of rows and columns changes the output
    swapped = attn(x, vision_rope_angles(cols, rows, 8, 100.0))
    assert (swapped - base).abs().max() > 1e-3
    # the raw scores depend only on (d_row, d_col): check one pair of patches directly
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    def score(rq, cq, rk, ck):
        aq = vision_rope_angles(torch.tensor([rq]), torch.tensor([cq]), 8, 100.0)
        ak = vision_rope_angles(torch.tensor([rk]), torch.tensor([ck]), 8, 100.0)
        return (apply_vision_rope(q, aq) * apply_vision_rope(k, ak)).sum()

    torch.testing.assert_close(score(2, 5, 0, 1), score(12, 3, 10, -1), rtol=0, atol=1e-5)


def oracle_block(x, p, n_h, n_w, n_heads, theta, eps):
    """§3.18 one ViT block, float64 loops; RoPE: pair (j, j + d/2), angle row*f_j (j < d/4) or col*f_(j-d/4)."""
    x = x.double()
    p = {k: v.double() for k, v in p.items()}
    n, c = x.shape
    d = c // n_heads

    def rms(v, w):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * w

    def rope(v, pos):
        r, col = divmod(pos, n_w)
        out = v.clone()
        for j in range(d // 2):
            q = d // 4
            angle = (r if j < q else col) * theta ** (-2 * (j % q) / (d // 2))
            a, b, cos, sin = v[j], v[j + d // 2], math.cos(angle), math.sin(angle)
            out[j], out[j + d // 2] = a * cos - b * sin, b * cos + a * sin
        return out

    y = rms(x, p["norm1.weight"])
    qkv = y @ p["attn.wqkv.weight"].T + p["attn.wqkv.bias"]
    heads = []
    for hd in range(n_heads):
        q = [rope(qkv[t, hd * d:(hd + 1) * d], t) for t in range(n)]
        k = [rope(qkv[t, c + hd * d:c + (hd + 1) * d], t) for t in range(n)]
        v = qkv[:, 2 * c + hd * d:2 * c + (hd + 1) * d]
        o = torch.zeros(n, d, dtype=torch.float64)
        for t in range(n):
            s = torch.stack([q[t] @ k[u] for u in range(n)]) / math.sqrt(d)
            w = torch.exp(s - s.max())
            o[t] = (w / w.sum()) @ v
        heads.append(o)
    x = x + torch.cat(heads, -1) @ p["attn.wo.weight"].T + p["attn.wo.bias"]
    y = rms(x, p["norm2.weight"])
    inter = p["mlp.w2.weight"].shape[1]
    g, u = y @ p["mlp.w1.weight"][:inter].T, y @ p["mlp.w1.weight"][inter:].T
    return x + (g * torch.sigmoid(g) * u) @ p["mlp.w2.weight"].T


def test_block_matches_loop_oracle():
    torch.manual_seed(1)
    block = VisionBlock(SMALL)
    with torch.no_grad():
        for prm in block.parameters():
            prm.normal_(0.0, 0.4)
    x = torch.randn(12, 16)
    n_h, n_w = 3, 4
    angles = vision_rope_angles(*grid_positions(n_h, n_w), 8, SMALL.rope_theta)
    with torch.no_grad():
        got = block(x[None], angles)[0]
    want = oracle_block(x, dict(block.named_parameters()), n_h, n_w, 2, SMALL.rope_theta, 1e-6)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_tower_rejects_mismatched_patches():
    tower = small_model().vision
    with pytest.raises(ValueError, match=r"\[12, 12\]"):
        tower(torch.zeros(11, 12), 3, 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        VisionTower(dataclasses.replace(SMALL, hidden_size=12, num_attention_heads=2))


# ---------------------------------------------------------------------------------------------- aligner
def test_aligner_merge_order_and_padding():
    aligner = Aligner(dataclasses.replace(SMALL, hidden_size=2), out_dim=4)
    n_h, n_w, c = 4, 5, 2
    x = torch.arange(1, n_h * n_w * c + 1, dtype=torch.float32).view(n_h * n_w, c)
    merged = aligner.merge(x[None], n_h, n_w)[0]  # grid 2x2 tokens, 18 features each
    assert merged.shape == (4, 18)
    # token (0, 1), channel 1, offset (di, dj) = (2, 0): patch (2, 3) -> x[2 * 5 + 3, 1]
    assert merged[1, 1 * 9 + 2 * 3 + 0] == x[13, 1]
    # token (1, 1) reaches past the grid: rows 5, columns 5 are zero padding
    assert merged[3, 0 * 9 + 0 * 3 + 1] == x[3 * 5 + 4, 0] and merged[3, 0 * 9 + 0 * 3 + 2] == 0
    assert merged[3, 1 * 9 + 2 * 3 + 0] == 0
    # channel-major order is exactly F.unfold's on the zero-padded [C, H, W] map
    grid = F.pad(x.view(n_h, n_w, c).permute(2, 0, 1), (0, 1, 0, 2))
    torch.testing.assert_close(merged, F.unfold(grid[None], 3, stride=3)[0].T, rtol=0, atol=0)
    out = aligner(x, n_h, n_w)
    torch.testing.assert_close(out, aligner.w2(F.gelu(aligner.w1(merged))))


# ---------------------------------------------------------------------------------------------- preprocessing
def test_grid_rejects_bad_sizes():
    with pytest.raises(ValueError, match="positive"):
        plan_image_grid(0, 10, VisionConfig())
    with pytest.raises(ValueError, match="max_image_tokens"):
        plan_image_grid(10, 10, dataclasses.replace(VisionConfig(), max_image_tokens=3))


def test_patch_order_round_trips():
    cfg = VisionConfig()
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(546, 588, 3), dtype=np.uint8)  # already a 39x42-patch canvas
    out = preprocess_image(Image.fromarray(pixels), cfg)
    g = out.grid
    assert (g.height, g.width, g.n_vit_h, g.n_vit_w) == (546, 588, 39, 42)
    assert out.patches.shape == (39 * 42, 588) and out.patches.dtype == torch.float32
    # patch (i, j), value c * 196 + y * 14 + x is pixel (14 i + y, 14 j + x), channel c, normalised
    for i, j, c, y, x in [(0, 0, 0, 0, 0), (3, 7, 2, 13, 5), (38, 41, 1, 6, 13)]:
        want = (pixels[14 * i + y, 14 * j + x, c] / 255.0 - IMAGE_MEAN[c]) / IMAGE_STD[c]
        assert out.patches[i * 42 + j, c * 196 + y * 14 + x].item() == pytest.approx(want, abs=1e-6)
    back = patches_to_pixels(out.patches, 39, 42, 14)
    mean, std = torch.tensor(IMAGE_MEAN).view(3, 1, 1), torch.tensor(IMAGE_STD).view(3, 1, 1)
    restored = torch.round((back * std + mean) * 255).to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.array_equal(restored, pixels)
    assert torch.equal(pixels_to_patches(back, 14), out.patches)


def test_preprocess_letterboxes_with_grey():
    cfg = VisionConfig()
    red = np.zeros((300, 600, 3), dtype=np.uint8)
    red[..., 0] = 255
    out = preprocess_image(red, cfg)  # numpy input; placed unscaled, padded to whole cells and min_pixels
    g = out.grid
    assert g.height * g.width >= cfg.min_pixels and g.span_length <= cfg.max_image_tokens
    canvas = patches_to_pixels(out.patches, g.n_vit_h, g.n_vit_w, 14)
    grey = 127 / 255 * 2 - 1
    assert canvas[:, 0, 0].tolist() == pytest.approx([grey] * 3)  # top-left corner is padding
    centre = canvas[:, g.height // 2, g.width // 2].tolist()
    assert centre == pytest.approx([1.0, -1.0, -1.0], abs=1e-6)
    with pytest.raises(ValueError, match="uint8"):
        preprocess_image(np.zeros((4, 4), dtype=np.uint8), cfg)


def test_model_without_vision_config_is_an_error():
    with pytest.raises(ValueError, match="no vision_config"):
        VisionModel(tiny_config())
