"""Rendered-text images for the tiny VLM (issue 27, VISION_DESIGN.md decision 10): image -> transcription.

A sample is a snippet of one to three consecutive words from one line of a corpus split (``dsv41 data prepare``:
``train.txt`` for training renders, ``heldout.txt`` for evaluation renders, never mixed), drawn with Pillow in a
TrueType font from Debian's font packages (``fonts-dejavu-core``, ``fonts-liberation``, ``fonts-freefont-ttf``;
:func:`find_fonts`), at a random size, text and background colour, a small rotation, Gaussian pixel noise, a light
blur on some and a few stray strokes. Two layouts (:class:`RenderSpec`): ``"cells"``, what the tiny VLM trains on,
puts one character in each 42-pixel cell of one row (fixed pitch: image token k holds character k); ``"line"``
draws a proportional line, one or two rows high. The image's width and height are whole multiples of
:data:`TOKEN_PIXELS` = 42 (patch 14 x the 3x3 merge) and its area is at least the checkpoint's ``min_pixels``, so
the processor neither resizes nor pads it, under any of its sizing rules.

The chat turn is the project's encoding (:func:`deepseek_v41.chat.encode_messages`): a user message with one
image part and the text "Transcribe the text.", then the assistant's answer, the snippet itself, in chat mode,
spelled one token per character by default (:func:`build_example`). :func:`build_example` tokenizes it, expands
the image placeholder into the image span in token-id space
(:func:`~deepseek_v41.model.image_processor.expand_image_placeholders`) and marks the answer tokens (and the end
token) as the targets. Everything is a pure function of its seed: the same seed gives the same pixels.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from deepseek_v41.chat import encode_messages
from deepseek_v41.config import VisionConfig
from deepseek_v41.model.image_processor import (
    ProcessedImage,
    TokenType,
    expand_image_placeholders,
    image_span_length,
    preprocess_image,
)
from deepseek_v41.train.data import read_documents

TOKEN_PIXELS = 42  # one LLM token's side in pixels: patch 14 x downsample 3
PROMPT = "Transcribe the text."
FONT_ROOT = Path("/usr/share/fonts")
# Regular, bold and italic faces of the Debian packages named in the module docstring, in this order.
FONT_FILES = (
    "truetype/dejavu/DejaVuSans.ttf", "truetype/dejavu/DejaVuSans-Bold.ttf", "truetype/dejavu/DejaVuSerif.ttf",
    "truetype/dejavu/DejaVuSerif-Italic.ttf", "truetype/dejavu/DejaVuSansMono.ttf",
    "truetype/dejavu/DejaVuSansCondensed.ttf",
    "truetype/liberation/LiberationSans-Regular.ttf", "truetype/liberation/LiberationSans-Bold.ttf",
    "truetype/liberation/LiberationSerif-Regular.ttf", "truetype/liberation/LiberationSerif-Italic.ttf",
    "truetype/liberation/LiberationMono-Regular.ttf",
    "truetype/freefont/FreeSans.ttf", "truetype/freefont/FreeSerif.ttf", "truetype/freefont/FreeMono.ttf",
    "truetype/freefont/FreeSansBold.ttf",
)
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9.,;:'\"()!?_-]*$")


def find_fonts(root: Path = FONT_ROOT) -> list[str]:
    """Paths of the :data:`FONT_FILES` present under ``root``, in that order (an empty list when none is: then
    :func:`load_font` falls back to Pillow's built-in font)."""
    return [str(root / name) for name in FONT_FILES if (root / name).is_file()]


def load_font(path: str | None, size: int):
    """The TrueType font at ``path`` in ``size`` pixels, or Pillow's built-in scalable font when ``path`` is
    None (Pillow >= 10.1 ships one; ``ImageFont.load_default(size)``)."""
    from PIL import ImageFont

    return ImageFont.truetype(path, size) if path else ImageFont.load_default(size)


def corpus_lines(path: str | Path) -> list[str]:
    """The lines of a corpus split (``train.txt`` / ``heldout.txt``, :func:`~deepseek_v41.train.data.
    read_documents`) reduced to their renderable words joined by single spaces: printable-ASCII words that start
    with a letter or digit (punctuation may follow); lines without one are dropped. Order is the file's."""
    lines = []
    for doc in read_documents(path):
        for line in doc.splitlines():
            words = [w for w in line.split() if w.isascii() and _WORD.match(w)]
            if words:
                lines.append(" ".join(words))
    return lines


def pick_snippet(lines: Sequence[str], rng: np.random.Generator, max_chars: int) -> str:
    """One to three consecutive words of a random line of ``lines`` (:func:`corpus_lines`), joined by single
    spaces, at most ``max_chars`` long (a longer first word is cut to ``max_chars``). Raises ValueError when
    ``lines`` is empty."""
    if not lines:
        raise ValueError("no corpus lines to draw text from")
    words = lines[int(rng.integers(len(lines)))].split(" ")
    start = int(rng.integers(len(words)))
    want = int(rng.integers(1, 4))
    text = words[start][:max_chars]
    for w in words[start + 1: start + want]:
        if len(text) + 1 + len(w) > max_chars:
            break
        text += " " + w
    return text


LAYOUTS = ("cells", "line")


@dataclass(frozen=True)
class RenderSpec:
    """The ranges a render draws from. ``layout``: ``"cells"`` (the default, what the tiny VLM trains and is scored
    on) draws one character per 42-pixel cell of a single 42-pixel row, each glyph centred in its cell with up to
    ``cell_jitter`` pixels of offset, at a font size from ``cell_font_sizes``, followed by up to
    ``max_blank_cells`` empty cells; ``"line"`` draws the text as one proportional line at a size from
    ``font_sizes`` (per 42-pixel row of height) on ``rows`` rows. Both: rotation up to ``max_degrees``, Gaussian
    noise up to ``max_noise`` 8-bit levels, the widest image ``max_tokens_w`` tokens."""

    layout: str = "cells"
    font_sizes: tuple[int, int] = (18, 30)  # line layout, per 42-pixel row of height
    rows: tuple[int, ...] = (1, 1, 2)  # line layout: image height in tokens, drawn uniformly from this tuple
    cell_font_sizes: tuple[int, int] = (22, 34)  # cells layout
    max_blank_cells: int = 2  # cells layout
    cell_jitter: int = 3  # cells layout, pixels
    max_degrees: float = 3.0
    max_noise: float = 12.0
    max_tokens_w: int = 16


def _colours(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(background, ink) RGB int arrays: dark ink on a light ground, or (a fifth of the time) the reverse."""
    background = rng.integers(150, 256, size=3)
    ink = rng.integers(0, 90, size=3)
    if rng.random() < 0.2:  # light text on a dark ground
        background, ink = 255 - background, 255 - ink
    return background, ink


def _canvas(width: int, height: int, background: np.ndarray, ink: np.ndarray, rng: np.random.Generator):
    """A fresh RGB image in ``background`` with 0-2 stray strokes in a faint ink; returns (image, draw)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), tuple(int(c) for c in background))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(0, 3))):
        shade = tuple(int(c) for c in (background * 0.6 + ink * 0.4))
        xs, ys = rng.integers(0, width, size=2), rng.integers(0, height, size=2)
        draw.line([(int(xs[0]), int(ys[0])), (int(xs[1]), int(ys[1]))], fill=shade, width=1)
    return image, draw


def _degrade(image, background: np.ndarray, rng: np.random.Generator, spec: RenderSpec):
    """The small rotation, a light blur on some renders, and Gaussian pixel noise."""
    from PIL import Image, ImageFilter

    degrees = float(rng.uniform(-spec.max_degrees, spec.max_degrees))
    image = image.rotate(degrees, resample=Image.Resampling.BICUBIC, fillcolor=tuple(int(c) for c in background))
    if rng.random() < 0.3:
        image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 0.8))))
    sigma = float(rng.uniform(0, spec.max_noise))
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0, sigma, size=(image.height, image.width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="RGB")


def _render_cells(text: str, rng: np.random.Generator, path: str | None, spec: RenderSpec):
    """The ``"cells"`` layout of :func:`render_text` (``path``: the font already drawn)."""
    if len(text) > spec.max_tokens_w:
        raise ValueError(f"{len(text)} characters do not fit {spec.max_tokens_w} cells: the cells layout draws "
                         f"at most max_tokens_w characters")
    cells = min(spec.max_tokens_w, len(text) + int(rng.integers(0, spec.max_blank_cells + 1)))
    width, height = max(cells, 1) * TOKEN_PIXELS, TOKEN_PIXELS
    size = int(rng.integers(spec.cell_font_sizes[0], spec.cell_font_sizes[1] + 1))
    glyphs = [c for c in text if c != " "]
    while True:  # every glyph of this text fits its cell
        font = load_font(path, size)
        boxes = [font.getbbox(c) for c in glyphs]
        if size <= 8 or all(r - l <= TOKEN_PIXELS - 4 and b - t <= TOKEN_PIXELS - 4 for l, t, r, b in boxes):
            break
        size -= 1
    _, top, _, bottom = font.getbbox("Ag(|")  # one baseline for the whole line
    background, ink = _colours(rng)
    image, draw = _canvas(width, height, background, ink, rng)
    y = (TOKEN_PIXELS - (bottom - top)) / 2 - top + float(rng.uniform(-2, 2))
    for j, c in enumerate(text):
        if c == " ":
            continue
        left, _, right, _ = font.getbbox(c)
        dx, dy = rng.integers(-spec.cell_jitter, spec.cell_jitter + 1, size=2)
        x = TOKEN_PIXELS * j + TOKEN_PIXELS / 2 - (left + right) / 2 + int(dx)
        draw.text((int(round(x)), int(round(y + int(dy) / 2))), c, font=font, fill=tuple(int(v) for v in ink))
    centres = (np.arange(len(text), dtype=np.float32) + 0.5) * TOKEN_PIXELS
    return _degrade(image, background, rng, spec), centres


def _render_line(text: str, rng: np.random.Generator, path: str | None, spec: RenderSpec):
    """The ``"line"`` layout of :func:`render_text`."""
    rows = int(spec.rows[int(rng.integers(len(spec.rows)))])
    height = rows * TOKEN_PIXELS
    size = int(rng.integers(spec.font_sizes[0], spec.font_sizes[1] + 1)) * rows
    max_width = spec.max_tokens_w * TOKEN_PIXELS
    while True:
        font = load_font(path, size)
        left, top, right, bottom = font.getbbox(text)
        if (right - left + 8 <= max_width and bottom - top + 4 <= height) or size <= 8:
            break
        size -= 1
    text_w, text_h = right - left, bottom - top
    width = min(max_width, -(-(text_w + 8 + int(rng.integers(0, 2 * TOKEN_PIXELS))) // TOKEN_PIXELS) * TOKEN_PIXELS)
    background, ink = _colours(rng)
    image, draw = _canvas(width, height, background, ink, rng)
    x = int(rng.integers(4, max(5, width - text_w - 4))) - left
    y = int(rng.integers(2, max(3, height - text_h - 2))) - top
    draw.text((x, y), text, font=font, fill=tuple(int(c) for c in ink))
    advances = [font.getlength(text[:k]) for k in range(len(text) + 1)]
    centres = np.array([x + (a + b) / 2 for a, b in zip(advances[:-1], advances[1:], strict=True)], dtype=np.float32)
    return _degrade(image, background, rng, spec), centres


def render_text(text: str, rng: np.random.Generator, fonts: Sequence[str], spec: RenderSpec = RenderSpec()):
    """Draw ``text`` on a fresh RGB image (PIL) in a random font of ``fonts`` (TrueType paths, :func:`find_fonts`;
    empty = Pillow's built-in font), laid out as ``spec.layout`` says (:class:`RenderSpec`). Width and height
    are multiples of 42 pixels, the width at most ``spec.max_tokens_w * 42`` (a line's font shrinks until the
    text fits; the cells layout raises ValueError for more characters than cells; an empty text or one with
    control characters such as tabs and newlines is a ValueError, a missing font file a FileNotFoundError).
    Deterministic in ``rng``'s state. Returns ``(image, font name, centres)``: centres float32 [len(text)] is the
    horizontal centre in pixels of each character (its cell, or its advance in a line; before the small
    rotation)."""
    if spec.layout not in LAYOUTS:
        raise ValueError(f"unknown render layout {spec.layout!r}: use one of {LAYOUTS}")
    if not text or not text.isprintable():
        raise ValueError(f"render_text draws one non-empty line of printable characters, not {text!r}")
    path = fonts[int(rng.integers(len(fonts)))] if fonts else None
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"font file {path} not found (find_fonts() lists the installed faces)")
    draw = _render_cells if spec.layout == "cells" else _render_line
    image, centres = draw(text, rng, path, spec)
    return image, Path(path).stem if path else "pillow-default", centres


@dataclass(frozen=True)
class VisionExample:
    """One tokenized image chat turn: ``ids`` int64 [n] with the image span expanded, ``token_types`` int64 [n]
    (:class:`~deepseek_v41.model.image_processor.TokenType`), ``start``: the first target position (ids[start:]
    is the answer and the end token), the ``image`` (processed), the reference ``text`` and, for renders,
    ``char_x``: each character's horizontal centre in pixels (float32 [len(text)]; :func:`cell_labels`)."""

    ids: np.ndarray
    token_types: np.ndarray
    start: int
    image: ProcessedImage
    text: str
    char_x: np.ndarray | None = None


def prompt_messages(text: str | None, with_image: bool = True) -> list[dict]:
    """The chat messages: the user's image part (when ``with_image``) and :data:`PROMPT`, then the assistant's
    ``text`` (omitted when None)."""
    parts = ([{"type": "image_url", "image_url": {"url": "rendered"}}] if with_image else []) + [
        {"type": "text", "text": PROMPT}]
    messages = [{"role": "user", "content": parts}]
    if text is not None:
        messages.append({"role": "assistant", "content": text})
    return messages


def prompt_ids(tokenizer: Tokenizer, with_image: bool = True) -> list[int]:
    """Token ids of the prompt (chat mode, ending with the generation header), image placeholder unexpanded."""
    return tokenizer.encode(encode_messages(prompt_messages(None, with_image), thinking=False),
                            add_special_tokens=False).ids


@functools.lru_cache(maxsize=8)
def char_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The token id of each printable ASCII character ``' '`` (32) .. ``'~'`` (126), in that order (95 ids): a
    spelled answer's tokens (computed once per tokenizer). Raises ValueError when a character is not a single
    token of ``tokenizer``."""
    ids = []
    for code in range(32, 127):
        encoded = tokenizer.encode(chr(code), add_special_tokens=False).ids
        if len(encoded) != 1:
            raise ValueError(f"{chr(code)!r} is {len(encoded)} tokens of this tokenizer; spelled answers need one")
        ids.append(encoded[0])
    return tuple(ids)


@functools.lru_cache(maxsize=8)
def _answer_tail(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens that close the assistant's answer in the chat turn (the end token), once per tokenizer."""
    head = prompt_ids(tokenizer)
    return tuple(tokenizer.encode(encode_messages(prompt_messages(""), thinking=False),
                                  add_special_tokens=False).ids[len(head):])


def build_example(text: str, image, tokenizer: Tokenizer, vision: VisionConfig, image_token_id: int,
                  char_x: np.ndarray | None = None, spell: bool = True) -> VisionExample:
    """Tokenize the turn "image + PROMPT -> ``text``" and expand its placeholder for ``image`` (PIL, processed
    with ``vision``). ``spell``: the answer is one token per character (:func:`char_token_ids`; it decodes to
    the same text), so that each answer token matches one cell of a ``"cells"`` render; otherwise the
    tokenizer's own encoding of the turn. Raises ValueError when the image would be resized or padded (its size
    is not a multiple of 42 pixels, its area is under ``min_pixels`` or its span over ``max_image_tokens``),
    when the prompt's tokens are not a prefix of the turn's, or when a spelled character is not printable ASCII."""
    if image.width % TOKEN_PIXELS or image.height % TOKEN_PIXELS or image.width * image.height < vision.min_pixels:
        raise ValueError(f"a {image.width}x{image.height} render must have sides that are multiples of "
                         f"{TOKEN_PIXELS} px and an area >= min_pixels {vision.min_pixels}")
    head = prompt_ids(tokenizer)
    whole = tokenizer.encode(encode_messages(prompt_messages(text), thinking=False), add_special_tokens=False).ids
    if whole[: len(head)] != head or len(whole) == len(head):
        raise ValueError(f"the prompt does not tokenize to a prefix of the turn for {text!r}")
    if spell:
        if not all(32 <= ord(c) <= 126 for c in text):
            raise ValueError(f"a spelled answer takes printable ASCII only, not {text!r}")
        table = char_token_ids(tokenizer)
        whole = head + [table[ord(c) - 32] for c in text] + list(_answer_tail(tokenizer))
    processed = preprocess_image(image, vision)
    g = processed.grid
    if (g.n_llm_h * TOKEN_PIXELS, g.n_llm_w * TOKEN_PIXELS) != (image.height, image.width):
        span = image_span_length(image.height // TOKEN_PIXELS, image.width // TOKEN_PIXELS)
        raise ValueError(f"a {image.width}x{image.height} render would be scaled to {g.n_llm_w}x{g.n_llm_h} tokens: "
                         f"its span {span} exceeds max_image_tokens {vision.max_image_tokens}")
    ids, types = expand_image_placeholders(whole, [g], image_token_id)
    start = len(head) + g.span_length - 1
    return VisionExample(np.asarray(ids, dtype=np.int64), np.asarray(types, dtype=np.int64), start, processed, text,
                         char_x)


def prompt_example(image, tokenizer: Tokenizer, vision: VisionConfig, image_token_id: int) -> VisionExample:
    """The prompt alone (no answer: ``text`` is empty and ``start`` is its length) for an image of any size,
    processed with ``vision`` (resized or padded as the processor's rules say) — what reading a new image needs."""
    processed = preprocess_image(image, vision)
    ids, types = expand_image_placeholders(prompt_ids(tokenizer), [processed.grid], image_token_id)
    return VisionExample(np.asarray(ids, dtype=np.int64), np.asarray(types, dtype=np.int64), len(ids), processed, "")


def make_example(lines: Sequence[str], seed: Sequence[int], fonts: Sequence[str], tokenizer: Tokenizer,
                 vision: VisionConfig, image_token_id: int, spec: RenderSpec = RenderSpec(),
                 max_chars: int = 16, spell: bool = True) -> VisionExample:
    """The example of one seed (a list of ints, e.g. ``[seed, step, row]``): :func:`render_sample`, then
    :func:`build_example` (``spell`` as there)."""
    text, image, _, centres = render_sample(lines, seed, fonts, spec, max_chars)
    return build_example(text, image, tokenizer, vision, image_token_id, centres, spell)


def render_sample(lines: Sequence[str], seed: Sequence[int], fonts: Sequence[str], spec: RenderSpec = RenderSpec(),
                  max_chars: int = 16):
    """``(text, PIL image, font name, character centres)`` of one seed: :func:`pick_snippet` then
    :func:`render_text`, both from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(list(seed))
    text = pick_snippet(lines, rng, max_chars)
    image, font, centres = render_text(text, rng, fonts, spec)
    return text, image, font, centres


CELL_CLASSES = 96  # a cell's class: printable ASCII ' ' (32) .. '~' (126) as 0 .. 94, and BLANK
BLANK = 95  # a cell with no character in it


def cell_labels(example: VisionExample) -> torch.Tensor:
    """The class of each 42-pixel column of a render: int64 [n_llm_w], ``ord(c) - 32`` for the character whose
    centre lies in the column (centre // 42, clamped to the grid; the last one when several do, as in a
    ``"line"`` render), :data:`BLANK` for a column with none. The target of the trainer's auxiliary per-column
    probe. Raises ValueError for an example without ``char_x``."""
    if example.char_x is None:
        raise ValueError("the example has no character positions (only renders carry them)")
    width = example.image.grid.n_llm_w
    labels = torch.full((width,), BLANK, dtype=torch.int64)
    for ch, x in zip(example.text, example.char_x.tolist(), strict=True):
        if 32 <= ord(ch) <= 126:
            labels[min(max(int(x // TOKEN_PIXELS), 0), width - 1)] = ord(ch) - 32
    return labels


def collate(examples: Sequence[VisionExample], pad_id: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[ProcessedImage]]:
    """Right-padded batch: ``ids`` int64 [B, L], ``token_types`` int64 [B, L] (padding is text), the loss mask
    bool [B, L - 1] over the targets ``ids[:, 1:]`` (True exactly at the answer and its end token: target j
    predicts token j + 1), and the images in batch order (one per row)."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.int64)
    types = torch.full((len(examples), width), int(TokenType.TEXT), dtype=torch.int64)
    mask = torch.zeros((len(examples), width - 1), dtype=torch.bool)
    for row, e in enumerate(examples):
        ids[row, : len(e.ids)] = torch.from_numpy(e.ids)
        types[row, : len(e.ids)] = torch.from_numpy(e.token_types)
        mask[row, e.start - 1: len(e.ids) - 1] = True
    return ids, types, mask, [e.image for e in examples]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions, each cost 1) between two strings."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def char_accuracy(references: Sequence[str], hypotheses: Sequence[str]) -> dict[str, float]:
    """Corpus-level character accuracy ``1 - CER`` with ``CER = sum(edit distance) / sum(reference chars)``
    (floored at 0), exact-match rate and the counts. Raises ValueError for lists of different lengths or no
    reference characters."""
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    chars = sum(len(r) for r in references)
    if not chars:
        raise ValueError("the references hold no characters")
    edits = sum(edit_distance(r, h) for r, h in zip(references, hypotheses, strict=True))
    exact = sum(r == h for r, h in zip(references, hypotheses, strict=True))
    return {"char_accuracy": max(0.0, 1 - edits / chars), "cer": edits / chars,
            "exact_match": exact / len(references), "edits": edits, "chars": chars, "samples": len(references)}
