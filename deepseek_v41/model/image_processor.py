"""Image preprocessing and image-span layout (MODEL_REFERENCE.md §3.18, CHAT_FORMAT.md §3 (h), issue 27).

An image of ``W x H`` pixels becomes

- a canvas of ``n_vit_h x n_vit_w`` patches of ``patch_size`` (14) pixels for the ViT, and
- a grid of ``n_llm_h x n_llm_w`` LLM tokens after the aligner's ``downsample_ratio`` (3x3) merge,
  ``n_llm = ceil(n_vit / 3)``; the canvas sides are whole token cells (``c = patch_size * downsample_ratio`` =
  42 px), so ``n_vit = 3 * n_llm`` and the aligner never pads a ragged edge.

In the prompt each ``<｜deepseek_image｜>`` placeholder expands to the span
``[IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEWLINE]) * n_llm_h + [IMAGE_END]`` of
``n_llm_h * (n_llm_w + 1) + 2`` positions; every span position carries ``image_token_id`` in ``input_ids`` and its
role travels in a separate ``token_types`` list (:class:`TokenType`).

Rules (issue 27, which agree with TensorRT-LLM's and SGLang's V4.1 processors; :func:`plan_image`):

1. **Colour.** ``PIL.Image.convert("RGB")``: no EXIF transpose, no alpha compositing (RGBA / LA / PA lose their
   alpha channel as Pillow's convert drops it; palette, grey and other modes convert through Pillow).
2. **Image cells.** The image covers ``a = ceil(H / c)`` rows and ``b = ceil(W / c)`` columns of cells.
3. **Aspect (``max_wh_ratio`` = rho, None in the release = no limit).** The short side is padded until
   long / short <= rho in cells: ``h = max(a, ceil(b / rho))``, ``w = max(b, ceil(a / rho))``.
4. **Area (``min_pixels``, 295,936 = 544**2 in the release).** The canvas must hold at least
   ``n = ceil(min_pixels / c**2)`` cells (so its area in pixels is >= min_pixels). When ``h * w < n``, padding
   grows the short side ``s`` to ``ceil(n / L)`` (L the long side) if ``L * L >= n``, else both sides to the
   square ``q = ceil(sqrt(n))``. Growing the short side never breaks rule 3.
5. **Token cap (``max_image_tokens``, 1024 in the release, counting the whole span).** When the canvas of rules
   2-4 has ``h * (w + 1) + 2 > max_image_tokens``, the image is scaled *down*, aspect kept, bicubic, and rules
   2-4 are applied again to the scaled size. The scale is the largest of the form ``k * c / W`` or
   ``k * c / H`` (integer k >= 1, scale < 1: one side becomes exactly k cells, the other
   ``round(side * scale)`` >= 1 px) whose canvas fits. This is the only resize: an image is never scaled up,
   and an image within the caps is placed pixel for pixel.
6. **Placement.** The (possibly scaled) image is pasted on a canvas of ``h * c x w * c`` pixels filled with grey
   (127, 127, 127), at offset ``((w * c - W') // 2, (h * c - H') // 2)`` (centred, extra pixel right/bottom).
7. **Normalisation.** ``(x / 255 - 0.5) / 0.5`` per channel, i.e. [-1, 1] (mean/std 0.5 as every public port
   and the timm remap of the ViT use; MODEL_REFERENCE.md §9 item 7 says the official values were not captured).

Consequence: an image whose sides are whole multiples of ``c`` (42 px), whose area is at least ``min_pixels``
and which is within ``max_wh_ratio`` and ``max_image_tokens`` goes through unchanged (no resize, no padding).
Why pad instead of resize: the issue asks to resize only when a cap applies; rendered text stays sharp at its
own scale. Earlier versions of this file scaled small images *up* to min_pixels and rounded to 14-pixel patches.

Config checks (:func:`check_vision_config`): ``max_image_tokens`` must hold the min_pixels square (rule 4),
``max_wh_ratio`` must be >= 1. Pillow does the converting and resizing (imported when an image is processed,
so the model imports without it).

Patch layout: patches are listed in reading order (row-major over the ``n_vit_h x n_vit_w`` grid) and each is
flattened channel-major to ``3 * 14 * 14 = 588`` values, index ``c * 196 + y * 14 + x`` for channel ``c`` (RGB)
and pixel ``(y, x)`` inside the patch — the order of the reference's ``[N, 3, 14, 14]`` patch tensor, which the
ViT's ``patch_embed`` weight [1024, 588] expects.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepseek_v41.config import VisionConfig

# Normalisation of the [0, 1] pixel values, per RGB channel [?] (see the module docstring).
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
# Grey of the letterbox padding around a fitted image (the reference pads with 127, not 128) [S].
PAD_COLOR = (127, 127, 127)


class TokenType(enum.IntEnum):
    """Role of a prompt position; the values are the reference's ``token_types`` codes [S]."""

    TEXT = -1
    IMAGE_START = 0
    IMAGE = 1
    IMAGE_NEWLINE = 2
    IMAGE_END = 3


@dataclass(frozen=True)
class ImageGrid:
    """The grid of one image: canvas size in pixels (whole token cells), ViT patch grid and LLM token grid."""

    height: int  # canvas height in pixels, n_vit_h * patch_size
    width: int  # canvas width in pixels, n_vit_w * patch_size
    n_vit_h: int  # ViT patch rows
    n_vit_w: int  # ViT patch columns
    n_llm_h: int  # LLM token rows, ceil(n_vit_h / downsample_ratio)
    n_llm_w: int  # LLM token columns, ceil(n_vit_w / downsample_ratio)

    @property
    def span_length(self) -> int:
        """Prompt positions the image takes (:func:`image_span_length`)."""
        return image_span_length(self.n_llm_h, self.n_llm_w)


@dataclass(frozen=True)
class ProcessedImage:
    """One preprocessed image: ``patches`` float32 [n_vit_h * n_vit_w, 588] in reading order, and its grid."""

    patches: torch.Tensor
    grid: ImageGrid


def image_span_length(n_llm_h: int, n_llm_w: int) -> int:
    """Prompt positions of an image with an ``n_llm_h x n_llm_w`` token grid: ``n_llm_h * (n_llm_w + 1) + 2``
    (start, one newline per row, end). Raises ValueError for a grid side below 1."""
    if n_llm_h < 1 or n_llm_w < 1:
        raise ValueError(f"an image token grid needs at least 1x1 tokens, got {n_llm_h}x{n_llm_w}")
    return n_llm_h * (n_llm_w + 1) + 2


def image_token_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """The span's roles: ``[IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEWLINE]) * n_llm_h + [IMAGE_END]``."""
    image_span_length(n_llm_h, n_llm_w)
    row = [int(TokenType.IMAGE)] * n_llm_w + [int(TokenType.IMAGE_NEWLINE)]
    return [int(TokenType.IMAGE_START)] + row * n_llm_h + [int(TokenType.IMAGE_END)]


def expand_image_placeholders(token_ids: Sequence[int], grids: Sequence[ImageGrid | tuple[int, int]],
                              image_token_id: int) -> tuple[list[int], list[int]]:
    """Expand each ``image_token_id`` placeholder in ``token_ids`` into its image span.

    ``grids`` holds one entry per placeholder, in prompt order: an :class:`ImageGrid` or ``(n_llm_h, n_llm_w)``.
    Returns ``(ids, token_types)``, two lists of equal length: every span position carries ``image_token_id``,
    text positions keep their id and have type ``TokenType.TEXT``. Raises ValueError when the number of
    placeholders and of images differ.
    """
    n_placeholders = sum(1 for t in token_ids if t == image_token_id)
    if n_placeholders != len(grids):
        raise ValueError(f"the prompt has {n_placeholders} image placeholder(s) (id {image_token_id}) but "
                         f"{len(grids)} image(s) were given; pass exactly one image per placeholder")
    ids: list[int] = []
    types: list[int] = []
    images = iter(grids)
    for t in token_ids:
        if t != image_token_id:
            ids.append(int(t))
            types.append(int(TokenType.TEXT))
            continue
        g = next(images)
        span = image_token_types(g.n_llm_h, g.n_llm_w) if isinstance(g, ImageGrid) else image_token_types(*g)
        ids += [image_token_id] * len(span)
        types += span
    return ids, types


@dataclass(frozen=True)
class ImagePlan:
    """How one image is laid out (module docstring, rules 2-6): its grid, the size it is pasted at and where."""

    grid: ImageGrid
    resized_width: int  # W' in pixels: the image's width on the canvas (W unless rule 5 scaled it)
    resized_height: int  # H' in pixels
    left: int  # x offset of the image on the canvas, pixels
    top: int  # y offset of the image on the canvas, pixels
    scaled: bool  # rule 5 (the token cap) scaled the image down to resized_width x resized_height


def check_vision_config(cfg: VisionConfig) -> None:
    """Raise ValueError unless ``cfg`` can plan every image: positive ``patch_size`` / ``downsample_ratio``,
    ``max_wh_ratio`` None or >= 1, and ``max_image_tokens`` at least the span of the min_pixels square
    ``q x q`` (rule 4), which is also >= 4 (a 1x1 grid)."""
    if cfg.patch_size < 1 or cfg.downsample_ratio < 1:
        raise ValueError(f"patch_size ({cfg.patch_size}) and downsample_ratio ({cfg.downsample_ratio}) must be >= 1")
    if cfg.max_wh_ratio is not None and not cfg.max_wh_ratio >= 1:
        raise ValueError(f"max_wh_ratio={cfg.max_wh_ratio} must be >= 1 (long side over short side) or None")
    q = _min_square(cfg)
    if image_span_length(q, q) > cfg.max_image_tokens:
        raise ValueError(f"max_image_tokens={cfg.max_image_tokens} cannot hold the {q}x{q}-token canvas that "
                         f"min_pixels={cfg.min_pixels} needs ({image_span_length(q, q)} span positions)")


def _min_cells(cfg: VisionConfig) -> int:
    cell = cfg.patch_size * cfg.downsample_ratio
    return max(1, -(-cfg.min_pixels // (cell * cell)))


def _min_square(cfg: VisionConfig) -> int:
    n = _min_cells(cfg)
    return math.isqrt(n - 1) + 1  # ceil(sqrt(n)) in integers


def _canvas_cells(width: int, height: int, cfg: VisionConfig) -> tuple[int, int]:
    """Rules 2-4: (rows, columns) of token cells of the canvas for an image of ``width x height`` pixels."""
    cell = cfg.patch_size * cfg.downsample_ratio
    a, b = -(-height // cell), -(-width // cell)
    h, w = a, b
    if cfg.max_wh_ratio is not None:
        h, w = max(a, math.ceil(b / cfg.max_wh_ratio)), max(b, math.ceil(a / cfg.max_wh_ratio))
    n = _min_cells(cfg)
    if h * w < n:
        long_side = max(h, w)
        if long_side * long_side >= n:
            short = -(-n // long_side)
            h, w = (long_side, short) if h >= w else (short, long_side)
        else:
            h = w = _min_square(cfg)
    return h, w


def _best_scale(side: int, other: int, cell: int, n: int, fits: Callable[[int, int], bool]
                ) -> tuple[int, int] | None:
    """Rule 5 for one family of scales ``k * cell / side``: the largest k (``k * cell < side``) for which
    ``fits(k * cell, round(other * k * cell / side))`` holds, as that (scaled side, scaled other) pair, or None.

    Exact: for k >= n (``_min_cells``) rule 4 is inactive and the span only grows with k, so bisection decides
    there; the k below n (fewer than n, a few hundred) are tried one by one.
    """
    def sizes(k: int) -> tuple[int, int]:
        return k * cell, max(1, (2 * other * k * cell + side) // (2 * side))  # round half up, >= 1 px

    k_max = (side - 1) // cell  # k * c < side: a real reduction
    if k_max < 1:
        return None
    lo = min(n, k_max)
    if fits(*sizes(lo)):
        hi = k_max
        while lo < hi:  # invariant: lo fits
            mid = (lo + hi + 1) // 2
            if fits(*sizes(mid)):
                lo = mid
            else:
                hi = mid - 1
        return sizes(lo)
    for k in range(lo - 1, 0, -1):
        if fits(*sizes(k)):
            return sizes(k)
    return None


def plan_image(width: int, height: int, cfg: VisionConfig) -> ImagePlan:
    """The layout of a ``width x height`` image (pixels) by the module docstring's rules 2-6.

    Guarantees: the span is at most ``cfg.max_image_tokens``; canvas sides are whole 42-px cells (patch_size *
    downsample_ratio); the canvas area is >= ``cfg.min_pixels`` and its long/short side ratio <= ``max_wh_ratio``;
    the image is resized only when the token cap requires it, and then by the largest admissible scale.
    Raises ValueError for a non-positive size and for a config :func:`check_vision_config` refuses.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height} pixels")
    check_vision_config(cfg)
    cell, budget = cfg.patch_size * cfg.downsample_ratio, cfg.max_image_tokens

    def span_of(w_px: int, h_px: int) -> int:
        return image_span_length(*_canvas_cells(w_px, h_px, cfg))

    w_px, h_px, scaled = width, height, False
    if span_of(width, height) > budget:
        n = _min_cells(cfg)
        by_width = _best_scale(width, height, cell, n, lambda w, h: span_of(w, h) <= budget)  # (W', H')
        by_height = _best_scale(height, width, cell, n, lambda h, w: span_of(w, h) <= budget)  # (H', W')
        options = []  # (scale, W', H')
        if by_width is not None:
            options.append((by_width[0] / width, *by_width))
        if by_height is not None:
            options.append((by_height[0] / height, by_height[1], by_height[0]))
        if not options:  # unreachable: a 1-cell side always fits once check_vision_config passed
            raise ValueError(f"image {width}x{height} cannot be fitted into max_image_tokens={budget}")
        _, w_px, h_px = max(options)
        scaled = True
    h, w = _canvas_cells(w_px, h_px, cfg)
    r = cfg.downsample_ratio
    grid = ImageGrid(h * cell, w * cell, h * r, w * r, h, w)
    if grid.span_length > budget:  # unreachable by the rules above; a loud guard against a silent overflow
        raise ValueError(f"image {width}x{height} needs {grid.span_length} span positions, budget {budget}")
    return ImagePlan(grid, w_px, h_px, (grid.width - w_px) // 2, (grid.height - h_px) // 2, scaled)


def plan_image_grid(width: int, height: int, cfg: VisionConfig) -> ImageGrid:
    """The canvas, patch grid and token grid of a ``width x height`` image: :func:`plan_image`'s grid."""
    return plan_image(width, height, cfg).grid


def _to_pil(image: Any):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"an image array must be uint8 [height, width, 3] (RGB), got {array.dtype} "
                         f"{list(array.shape)}")
    return Image.fromarray(array, mode="RGB")


def preprocess_image(image: Any, cfg: VisionConfig) -> ProcessedImage:
    """Convert, (only under the token cap) resize, letterbox, normalise and patchify one image for the ViT
    (module docstring, rules 1-7).

    ``image``: a PIL image (any mode; ``convert("RGB")``) or a uint8 RGB array [height, width, 3] (numpy or torch).
    Returns a :class:`ProcessedImage` with float32 patches [n_vit_h * n_vit_w, 3 * patch_size**2] in [-1, 1].
    Raises ValueError for an empty image, a malformed array or a config :func:`check_vision_config` refuses.
    """
    from PIL import Image

    pil = _to_pil(image)
    plan = plan_image(pil.width, pil.height, cfg)
    grid = plan.grid
    if plan.scaled:
        pil = pil.resize((plan.resized_width, plan.resized_height), resample=Image.Resampling.BICUBIC)
    if (plan.resized_width, plan.resized_height) != (grid.width, grid.height):
        canvas = Image.new("RGB", (grid.width, grid.height), PAD_COLOR)
        canvas.paste(pil, (plan.left, plan.top))
        pil = canvas
    pixels = torch.from_numpy(np.asarray(pil, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
    mean = torch.tensor(IMAGE_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(3, 1, 1)
    return ProcessedImage(pixels_to_patches((pixels - mean) / std, cfg.patch_size), grid)


def pixels_to_patches(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[3, H, W] -> [(H / p) * (W / p), 3 * p * p]: patches in reading order, each channel-major (c, y, x).

    Raises ValueError unless H and W are multiples of ``patch_size``.
    """
    c, h, w = pixels.shape
    if h % patch_size or w % patch_size:
        raise ValueError(f"image {h}x{w} is not a whole number of {patch_size}-pixel patches")
    p = patch_size
    return pixels.reshape(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape((h // p) * (w // p), c * p * p)


def patches_to_pixels(patches: torch.Tensor, n_vit_h: int, n_vit_w: int, patch_size: int) -> torch.Tensor:
    """Inverse of :func:`pixels_to_patches`: [n_vit_h * n_vit_w, 3 * p * p] -> [3, n_vit_h * p, n_vit_w * p].

    Raises ValueError when the patch count or width does not match the grid.
    """
    p = patch_size
    if patches.dim() != 2 or patches.shape[0] != n_vit_h * n_vit_w or patches.shape[1] % (p * p):
        raise ValueError(f"patches must be [{n_vit_h * n_vit_w}, C * {p * p}], got {list(patches.shape)}")
    c = patches.shape[1] // (p * p)
    return patches.reshape(n_vit_h, n_vit_w, c, p, p).permute(2, 0, 3, 1, 4).reshape(c, n_vit_h * p, n_vit_w * p)
