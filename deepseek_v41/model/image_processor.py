"""Image preprocessing and image-span layout (MODEL_REFERENCE.md §3.18, CHAT_FORMAT.md §3 (h)).

An image of ``width x height`` pixels becomes

- a canvas of ``n_vit_h x n_vit_w`` patches of ``patch_size`` (14) pixels for the ViT, and
- a grid of ``n_llm_h x n_llm_w`` LLM tokens after the aligner's ``downsample_ratio`` (3x3) merge, where
  ``n_llm = ceil(n_vit / 3)`` (the aligner pads a ragged edge, see :class:`~deepseek_v41.model.vision.Aligner`).

In the prompt each ``<｜deepseek_image｜>`` placeholder expands to the span
``[IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEWLINE]) * n_llm_h + [IMAGE_END]``; every span position carries
``image_token_id`` in ``input_ids`` and its role travels in a separate ``token_types`` list (:class:`TokenType`).

Sizing (:func:`plan_image_grid`) follows the release's ``image_processor.py`` as public ports describe it [S]:
an image under ``min_pixels`` is scaled up (aspect kept) to about ``min_pixels``; each side is rounded *up* to a
whole number of patches; if the span would then exceed ``max_image_tokens`` the image is scaled down, aspect
kept, to the largest grid whose span fits. Note that the budget counts the whole span (delimiters and one
newline per row), not just the ``n_llm_h * n_llm_w`` IMAGE tokens.

Pixels (:func:`preprocess_image`): the image is fitted into the canvas with its aspect ratio kept (bicubic) and
centred on grey 127 padding, scaled to [0, 1] and normalised with mean 0.5 and std 0.5 per channel, i.e. to
[-1, 1]. The mean/std are **[?]**: MODEL_REFERENCE.md §9 item 7 says the official values were not captured;
0.5/0.5 is what every public port of the release and the timm remap of its ViT use. Pillow does the resizing
(imported when an image is processed, so the model imports without it).

Patch layout: patches are listed in reading order (row-major over the ``n_vit_h x n_vit_w`` grid) and each is
flattened channel-major to ``3 * 14 * 14 = 588`` values, index ``c * 196 + y * 14 + x`` for channel ``c`` (RGB)
and pixel ``(y, x)`` inside the patch — the order of the reference's ``[N, 3, 14, 14]`` patch tensor, which the
ViT's ``patch_embed`` weight [1024, 588] expects.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
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
    """The resize plan of one image: canvas size in pixels, ViT patch grid and LLM token grid."""

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


def _llm_side(pixels: int, patch_size: int, ratio: int) -> int:
    return math.ceil((pixels // patch_size) / ratio)


def _shrink_to_budget(height: float, width: float, patch_size: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-kept canvas (h, w) in pixels whose span fits ``max_tokens``.

    With ``a = height / width`` and an LLM grid of ``a * n x n``, the span ``a n (n + 1) + 2 <= max_tokens``
    gives ``n = sqrt((max_tokens - 2) / a + 1/4) - 1/2``. Both grid sides are floored to whole tokens and the
    canvas is scaled so neither is exceeded; a side below one token collapses to a single row or column.
    """
    aspect = height / width
    n_w = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    n_h = n_w * aspect
    cell = patch_size * ratio
    if n_w < 1.0:  # very tall: one column of (max_tokens - 2) // 2 rows
        return (max_tokens - 2) // 2 * cell, cell
    if n_h < 1.0:  # very wide: one row of max_tokens - 3 tokens
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(n_w) * cell / width, math.floor(n_h) * cell / height)
    return (math.floor(height * scale / patch_size) * patch_size,
            math.floor(width * scale / patch_size) * patch_size)


def plan_image_grid(width: int, height: int, cfg: VisionConfig) -> ImageGrid:
    """The canvas, patch grid and token grid of a ``width x height`` image (pixels), per the module docstring.

    Guarantees: the span is at most ``cfg.max_image_tokens``; the canvas is at least the image scaled up to
    ``cfg.min_pixels`` whenever that fits the budget — up to the reference's truncation of the scaled-up size to
    whole pixels (under one pixel per side) before rounding up to patches. ``cfg.max_wh_ratio`` (None in the
    release) first clamps the width to ``height * max_wh_ratio``.
    Raises ValueError for a non-positive size or a budget below the 4 positions of a 1x1 grid.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height} pixels")
    p, r, budget = cfg.patch_size, cfg.downsample_ratio, cfg.max_image_tokens
    if budget < image_span_length(1, 1):
        raise ValueError(f"max_image_tokens={budget} cannot hold even a 1x1 image (4 span positions)")
    w, h = float(width), float(height)
    if cfg.max_wh_ratio is not None and w > h * cfg.max_wh_ratio:
        w = h * cfg.max_wh_ratio
    if w * h < cfg.min_pixels:
        scale = math.sqrt(cfg.min_pixels / (w * h))
        w, h = float(int(w * scale)), float(int(h * scale))
    canvas_h, canvas_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    if image_span_length(_llm_side(canvas_h, p, r), _llm_side(canvas_w, p, r)) > budget:
        canvas_h, canvas_w = _shrink_to_budget(h, w, p, r, budget)
    grid = ImageGrid(canvas_h, canvas_w, canvas_h // p, canvas_w // p, _llm_side(canvas_h, p, r),
                     _llm_side(canvas_w, p, r))
    if grid.span_length > budget:  # unreachable by the algebra above; a loud guard against a silent overflow
        raise ValueError(f"image {width}x{height} needs {grid.span_length} span positions, budget {budget}")
    return grid


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
    """Resize, pad, normalise and patchify one image for the ViT (module docstring).

    ``image``: a PIL image (any mode; converted to RGB) or a uint8 RGB array [height, width, 3] (numpy or torch).
    Returns a :class:`ProcessedImage` with float32 patches [n_vit_h * n_vit_w, 3 * patch_size**2] in [-1, 1].
    Raises ValueError for an empty image or a malformed array.
    """
    from PIL import Image, ImageOps

    pil = _to_pil(image)
    grid = plan_image_grid(pil.width, pil.height, cfg)
    size = (grid.width, grid.height)
    if cfg.max_wh_ratio is not None and pil.width >= cfg.max_wh_ratio * pil.height:
        # The width was clamped in the plan, so the image is squeezed to the canvas instead of letterboxed.
        pil = pil.resize(size, resample=Image.Resampling.BICUBIC)
    else:
        pil = ImageOps.pad(pil, size, color=PAD_COLOR)
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
