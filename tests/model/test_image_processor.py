"""The image processor's rules (model/image_processor.py module docstring, issue 27): grid and span length,
letterbox colour and placement, resizing only under the token cap, colour modes, normalisation, max_wh_ratio.

Oracles: every expected grid below is worked out by hand in the comment beside it (c = 14 * 3 = 42 px per token
cell; release config: min_pixels 295,936 -> n = ceil(295936 / 42**2) = ceil(167.76) = 168 cells, square side
q = ceil(sqrt(168)) = 13; max_image_tokens 1024 for the whole span h * (w + 1) + 2); pixel values are computed
from the input array with numpy; the resize is compared with Pillow's own bicubic resize of the input; the
property test re-derives rules 2-5 from the docstring in plain Python.
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from deepseek_v41.config import VisionConfig
from deepseek_v41.model.image_processor import (
    PAD_COLOR,
    check_vision_config,
    image_span_length,
    patches_to_pixels,
    pixels_to_patches,
    plan_image,
    plan_image_grid,
    preprocess_image,
)

RELEASE = VisionConfig()
GREY = (127 / 255 - 0.5) / 0.5


def norm(values) -> np.ndarray:
    """(x / 255 - 0.5) / 0.5 in float32, the documented normalisation."""
    return (np.asarray(values, dtype=np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)


def canvas_of(out) -> np.ndarray:
    """[H, W, 3] float canvas of a ProcessedImage."""
    g = out.grid
    return patches_to_pixels(out.patches, g.n_vit_h, g.n_vit_w, 14).permute(1, 2, 0).numpy()


# (W, H) -> (n_llm_h, n_llm_w, span, W', H', left, top, scaled), release config, worked by hand:
HAND = {
    # 1 cell each way; 1 < 168 and 1*1 < 168 -> the 13x13 square; span 13*14+2 = 184; left = (546-1)//2 = 272
    (1, 1): (13, 13, 184, 1, 1, 272, 272, False),
    # a = ceil(50/42) = 2, b = ceil(100/42) = 3; 6 < 168, 3*3 < 168 -> square 13; left (546-100)//2 = 223
    (100, 50): (13, 13, 184, 100, 50, 223, 248, False),
    # 13x13 cells (544/42 = 12.95); 169 >= 168 -> no padding cells; 1 px border: (546-544)//2 = 1
    (544, 544): (13, 13, 184, 544, 544, 1, 1, False),
    # a = 2, b = ceil(23.8) = 24; 48 < 168, 24*24 >= 168 -> short side ceil(168/24) = 7; span 7*25+2 = 177
    (1000, 50): (7, 24, 177, 1000, 50, 4, 122, False),
    # the transpose: 24 rows of 7, span 24*8+2 = 194
    (50, 1000): (24, 7, 194, 50, 1000, 122, 4, False),
    # extreme wide, within the cap: 1 x ceil(476.2) = 477 cells, 477 >= 168; span 478+2 = 480; no resize
    (20000, 10): (1, 477, 480, 20000, 10, 17, 16, False),
    # extreme tall: 477 x 1, span 477*2+2 = 956 <= 1024
    (10, 20000): (477, 1, 956, 10, 20000, 16, 17, False),
    # huge: 72 x 96 cells -> span 72*97+2 = 6986 > 1024. Width k: W' = 42k, H' = round(31.5k):
    # k = 36: H' = 1134 -> 27 rows, 27*37+2 = 1001 fits; k = 37: H' = 1166 -> 28 rows, 28*38+2 = 1066 does not.
    # Height k = 27 gives the same 1512 x 1134 (scale 0.378); k = 28: W' = 1568 -> 38 cols, 28*39+2 = 1094.
    (4000, 3000): (27, 36, 1001, 1512, 1134, 0, 0, True),
    # 48 x 24 cells over the cap; width k = 44: H' = 924 = 22 rows, 22*45+2 = 992; k = 45: H' = 945 -> 23 rows,
    # 23*46+2 = 1060
    (2000, 1000): (22, 44, 992, 1848, 924, 0, 0, True),
    # 1 x 1191 cells, span 1193 > 1024: width k with one row: k+3 <= 1024 -> k = 1021, W' = 42882,
    # H' = round(10 * 42882 / 50000) = round(8.58) = 9; height family: 42 > 10, no reduction
    (50000, 10): (1, 1021, 1024, 42882, 9, 0, 16, True),
    # 1191 x 1 cells: 2k+2 <= 1024 -> k = 511, H' = 21462, W' = round(4.29) = 4; left (42-4)//2 = 19
    (10, 50000): (511, 1, 1024, 4, 21462, 19, 0, True),
}


@pytest.mark.parametrize("size", list(HAND))
def test_grid_and_span_by_hand(size):
    n_h, n_w, span, w2, h2, left, top, scaled = HAND[size]
    plan = plan_image(*size, RELEASE)
    g = plan.grid
    assert (g.n_llm_h, g.n_llm_w, g.span_length) == (n_h, n_w, span)
    assert (g.height, g.width, g.n_vit_h, g.n_vit_w) == (42 * n_h, 42 * n_w, 3 * n_h, 3 * n_w)
    assert (plan.resized_width, plan.resized_height, plan.left, plan.top, plan.scaled) == (w2, h2, left, top, scaled)
    assert plan_image_grid(*size, RELEASE) == g


def test_max_wh_ratio_pads_the_short_side_by_hand():
    cfg = dataclasses.replace(RELEASE, max_wh_ratio=2)
    # 2 x 24 cells: rows >= ceil(24/2) = 12 -> 12 x 24 = 288 >= 168; span 12*25+2 = 302; top (504-50)//2 = 227
    p = plan_image(1000, 50, cfg)
    assert (p.grid.n_llm_h, p.grid.n_llm_w, p.grid.span_length, p.left, p.top, p.scaled) == (12, 24, 302, 4, 227, False)
    p = plan_image(50, 1000, cfg)
    assert (p.grid.n_llm_h, p.grid.n_llm_w, p.grid.span_length, p.left, p.top) == (24, 12, 314, 227, 4)
    # 544 x 544 is within any ratio: unchanged from the release rules
    assert plan_image(544, 544, cfg) == plan_image(544, 544, RELEASE)
    # over the cap with the padding counted: width k = 44 -> 1848 x 1 px, 1 x 44 cells padded to 22 x 44,
    # 22*45+2 = 992; k = 45 -> 23 x 45, 1060 > 1024
    p = plan_image(50000, 10, cfg)
    assert (p.grid.n_llm_h, p.grid.n_llm_w, p.grid.span_length, p.resized_width, p.resized_height) == (
        22, 44, 992, 1848, 1)
    # the pixels: blue letterboxed in grey above and below (padded, not stretched)
    blue = np.zeros((50, 1000, 3), dtype=np.uint8)
    blue[..., 2] = 255
    canvas = canvas_of(preprocess_image(blue, cfg))
    assert canvas.shape == (504, 1008, 3)
    assert np.all(canvas[:227] == norm(127)) and np.all(canvas[277:] == norm(127))
    assert np.array_equal(canvas[227:277, 4:1004], np.broadcast_to(norm([0, 0, 255]), (50, 1000, 3)))


def test_letterbox_colour_and_placement():
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, size=(50, 1000, 3), dtype=np.uint8)  # 1000 x 50 -> 294 x 1008 canvas
    out = preprocess_image(Image.fromarray(pixels), RELEASE)
    canvas = canvas_of(out)
    assert canvas.shape == (294, 1008, 3) and out.patches.dtype == torch.float32
    assert np.array_equal(canvas[122:172, 4:1004], norm(pixels))  # placed pixel for pixel, not resized
    pad = np.ones((294, 1008), dtype=bool)
    pad[122:172, 4:1004] = False
    assert np.all(canvas[pad] == norm(127)) and PAD_COLOR == (127, 127, 127)


@pytest.mark.parametrize("shape", [(546, 588), (336, 882), (42, 42 * 168)])
def test_aligned_image_goes_through_unchanged(shape):
    # 13 x 14 = 182, 8 x 21 = 168 (area 296,352 >= 295,936) and 1 x 168 cells: >= 168 cells, spans
    # 13*15+2 = 197, 8*22+2 = 178, 1*169+2 = 171 <= 1024 -> no resize, no padding
    rng = np.random.default_rng(2)
    pixels = rng.integers(0, 256, size=(*shape, 3), dtype=np.uint8)
    plan = plan_image(shape[1], shape[0], RELEASE)
    assert (plan.left, plan.top, plan.scaled) == (0, 0, False)
    assert (plan.grid.height, plan.grid.width) == shape
    out = preprocess_image(pixels, RELEASE)
    assert np.array_equal(canvas_of(out), norm(pixels))
    # patch (i, j), value ch * 196 + y * 14 + x is pixel (14 i + y, 14 j + x), channel ch
    n_w = shape[1] // 14
    for i, j, ch, y, x in [(0, 0, 0, 0, 0), (1, 7, 2, 13, 5), (shape[0] // 14 - 1, n_w - 1, 1, 6, 13)]:
        assert out.patches[i * n_w + j, ch * 196 + y * 14 + x].item() == norm(pixels[14 * i + y, 14 * j + x, ch])
    assert torch.equal(pixels_to_patches(patches_to_pixels(out.patches, *shape_in_patches(shape), 14), 14),
                       out.patches)


def shape_in_patches(shape):
    return shape[0] // 14, shape[1] // 14


def test_small_config_aligned_render_is_unchanged():
    # a tiny-VLM style config: 42-px multiples with area >= min_pixels go through as they are
    cfg = dataclasses.replace(RELEASE, min_pixels=84 * 252, max_image_tokens=64)
    pixels = np.random.default_rng(3).integers(0, 256, size=(84, 252, 3), dtype=np.uint8)  # 2 x 6 cells, 2*7+2=16
    out = preprocess_image(pixels, cfg)
    assert (out.grid.n_llm_h, out.grid.n_llm_w) == (2, 6) and np.array_equal(canvas_of(out), norm(pixels))


def test_scaled_image_is_pillow_bicubic_of_the_input():
    rng = np.random.default_rng(4)
    pixels = rng.integers(0, 256, size=(1000, 2000, 3), dtype=np.uint8)  # -> 1848 x 924, no padding (HAND)
    out = preprocess_image(pixels, RELEASE)
    want = np.asarray(Image.fromarray(pixels).resize((1848, 924), Image.Resampling.BICUBIC))
    assert canvas_of(out).shape == (924, 1848, 3)
    assert np.array_equal(canvas_of(out), norm(want))


def test_normalisation_values():
    pixels = np.array([[[0, 127, 255]]], dtype=np.uint8)  # 1x1: lands at (272, 272) of the 546 square
    canvas = canvas_of(preprocess_image(pixels, RELEASE))
    assert canvas[272, 272].tolist() == [-1.0, pytest.approx(-1 / 255, abs=1e-7), 1.0]
    assert canvas[0, 0].tolist() == [pytest.approx(-1 / 255, abs=1e-7)] * 3  # grey 127 padding
    assert canvas.shape == (546, 546, 3)


def test_modes_convert_without_compositing_or_transpose():
    # RGBA, fully transparent: the colour stays, alpha is dropped (no compositing on white or black)
    rgba = Image.new("RGBA", (3, 2), (200, 10, 20, 0))
    # palette: index 1 -> (1, 2, 3); grey 'L' 77 -> (77, 77, 77); 'LA' drops alpha too
    pal = Image.new("P", (3, 2), 1)
    pal.putpalette([0, 0, 0, 1, 2, 3] + [0] * 762)
    cases = [(rgba, (200, 10, 20)), (pal, (1, 2, 3)), (Image.new("L", (3, 2), 77), (77, 77, 77)),
             (Image.new("LA", (3, 2), (90, 0)), (90, 90, 90))]
    for image, rgb in cases:
        out = preprocess_image(image, RELEASE)
        assert (out.grid.n_llm_h, out.grid.n_llm_w, out.grid.span_length) == (13, 13, 184)  # tiny -> square 13
        canvas = canvas_of(out)
        # (546 - 3) // 2 = 271 left, (546 - 2) // 2 = 272 top
        assert np.array_equal(canvas[272:274, 271:274], np.broadcast_to(norm(rgb), (2, 3, 3))), image.mode
        assert canvas[271, 271].tolist() == [norm(127)] * 3
    # an EXIF orientation tag is ignored: the stored pixels are used as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW" for viewers
    tall = Image.new("RGB", (2, 5), (9, 9, 9))
    tall.info["exif"] = exif.tobytes()
    assert plan_image(2, 5, RELEASE).top == (546 - 5) // 2
    assert preprocess_image(tall, RELEASE).grid == plan_image_grid(2, 5, RELEASE)


def test_config_and_size_errors():
    with pytest.raises(ValueError, match="positive"):
        plan_image(0, 10, RELEASE)
    with pytest.raises(ValueError, match="max_wh_ratio=0.5 must be >= 1"):
        plan_image(10, 10, dataclasses.replace(RELEASE, max_wh_ratio=0.5))
    # 13 x 13 square needs 184 span positions
    with pytest.raises(ValueError, match="max_image_tokens=183 cannot hold the 13x13-token canvas.*184"):
        check_vision_config(dataclasses.replace(RELEASE, max_image_tokens=183))
    check_vision_config(dataclasses.replace(RELEASE, max_image_tokens=184))
    with pytest.raises(ValueError, match="uint8"):
        preprocess_image(np.zeros((4, 4), dtype=np.uint8), RELEASE)


# ---------------------------------------------------------------------------------------------- property
def oracle_cells(w_px, h_px, c, n, rho):
    """Rules 2-4 re-derived from the module docstring."""
    h, w = math.ceil(h_px / c), math.ceil(w_px / c)
    if rho is not None:
        h, w = max(h, math.ceil(w / rho)), max(w, math.ceil(h / rho))
    if h * w < n:
        long_side = max(h, w)
        if long_side ** 2 >= n:
            short = math.ceil(n / long_side)
            h, w = (long_side, short) if h >= w else (short, long_side)
        else:
            q = math.ceil(math.sqrt(n))
            h = w = q
    return h, w


@settings(max_examples=300, deadline=None)
@given(w=st.integers(1, 6000), h=st.integers(1, 6000), patch=st.sampled_from([2, 14]),
       min_side=st.integers(1, 12), budget_extra=st.integers(0, 600), rho=st.sampled_from([None, 1.0, 2.0, 3.5]))
def test_plan_follows_the_rules(w, h, patch, min_side, budget_extra, rho):
    c = patch * 3
    min_pixels = (min_side * c) ** 2 - c  # n = min_side**2 cells, just under
    n = math.ceil(min_pixels / c ** 2)
    q = math.ceil(math.sqrt(n))
    budget = q * (q + 1) + 2 + budget_extra
    cfg = VisionConfig(patch_size=patch, downsample_ratio=3, min_pixels=min_pixels, max_image_tokens=budget,
                       max_wh_ratio=rho)
    plan = plan_image(w, h, cfg)
    g = plan.grid

    def fits(w2, h2):
        return image_span_length(*oracle_cells(w2, h2, c, n, rho)) <= budget

    assert g.span_length <= budget
    assert (g.n_llm_h, g.n_llm_w) == oracle_cells(plan.resized_width, plan.resized_height, c, n, rho)
    assert g.height * g.width >= min_pixels and (rho is None or max(g.height, g.width) <= rho * min(g.height, g.width))
    assert plan.left >= 0 and plan.left + plan.resized_width <= g.width
    assert plan.top >= 0 and plan.top + plan.resized_height <= g.height
    assert (plan.left, plan.top) == ((g.width - plan.resized_width) // 2, (g.height - plan.resized_height) // 2)
    if fits(w, h):
        assert not plan.scaled and (plan.resized_width, plan.resized_height) == (w, h)
        return
    assert plan.scaled and plan.resized_width <= w and plan.resized_height <= h
    # the scale is the largest k * c / side (k * c < side) that fits: brute force over both families
    options = []  # (scale, W', H')
    for k in range(1, (w - 1) // c + 1):
        h2 = max(1, (2 * h * k * c + w) // (2 * w))  # round half up
        if fits(k * c, h2):
            options.append((k * c / w, k * c, h2))
    for k in range(1, (h - 1) // c + 1):
        w2 = max(1, (2 * w * k * c + h) // (2 * h))
        if fits(w2, k * c):
            options.append((k * c / h, w2, k * c))
    assert (plan.resized_width, plan.resized_height) == max(options)[1:]
