"""Rendered-text images for the tiny VLM (issue 27, VISION_DESIGN.md decision 10): image -> transcription.

A sample is a snippet of one to three consecutive words from one line of a corpus split (``dsv41 data prepare``:
``train.txt`` for training renders, ``heldout.txt`` for evaluation renders, never mixed), drawn with Pillow in a
TrueType font from Debian's font packages (``fonts-dejavu-core``, ``fonts-liberation``, ``fonts-freefont-ttf``;
:func:`find_fonts`), at a random size, text and background colour, position, a small rotation, Gaussian pixel
noise and a few stray strokes. The image's width and height are whole multiples of :data:`TOKEN_PIXELS` = 42
(patch 14 x the 3x3 merge) and its area is at least the checkpoint's ``min_pixels``, so the processor neither
resizes nor pads it, under any of its sizing rules.

The chat turn is the project's encoding (:func:`deepseek_v41.chat.encode_messages`): a user message with one
image part and the text "Transcribe the text.", then the assistant's answer, the snippet itself, in chat mode.
:func:`build_example` tokenizes it, expands the image placeholder into the image span in token-id space
(:func:`~deepseek_v41.model.image_processor.expand_image_placeholders`) and marks the answer tokens (and the end
token) as the targets. Everything is a pure function of its seed: the same seed gives the same pixels.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from deepseek_v41.chat import encode_messages
from deepseek_v41.config import VisionConfig
from deepseek_v41.model.image_processor import ProcessedImage, TokenType, expand_image_placeholders, preprocess_image
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


@dataclass(frozen=True)
class RenderSpec:
    """The ranges a render draws from: font size in pixels, image height in tokens, rotation in degrees, the
    Gaussian noise's standard deviation in 8-bit levels, and the widest image in tokens."""

    font_sizes: tuple[int, int] = (18, 30)  # per 42-pixel row of height
    rows: tuple[int, ...] = (1, 1, 2)  # image height in tokens, drawn uniformly from this tuple
    max_degrees: float = 3.0
    max_noise: float = 12.0
    max_tokens_w: int = 16


def render_text(text: str, rng: np.random.Generator, fonts: Sequence[str], spec: RenderSpec = RenderSpec()):
    """Draw ``text`` on one line of a fresh RGB image (PIL). Width and height are multiples of 42 pixels: the
    height is ``rows * 42`` for a random ``rows`` of ``spec.rows``, the font size scales with it, and the width is
    the text's plus margins rounded up to 42, at most ``spec.max_tokens_w * 42`` (the font shrinks until the
    text fits). ``fonts``: TrueType paths (:func:`find_fonts`); empty = Pillow's built-in font. Deterministic in
    ``rng``'s state. Returns ``(image, font name, centres)``: centres float32 [len(text)] is the horizontal
    centre in pixels of each character's advance (before the small rotation; kerning ignored)."""
    from PIL import Image, ImageDraw, ImageFilter

    rows = int(spec.rows[int(rng.integers(len(spec.rows)))])
    height = rows * TOKEN_PIXELS
    path = fonts[int(rng.integers(len(fonts)))] if fonts else None
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
    background = rng.integers(150, 256, size=3)
    ink = rng.integers(0, 90, size=3)
    if rng.random() < 0.2:  # light text on a dark ground
        background, ink = 255 - background, 255 - ink
    image = Image.new("RGB", (width, height), tuple(int(c) for c in background))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(0, 3))):  # stray strokes in a faint ink
        shade = tuple(int(c) for c in (background * 0.6 + ink * 0.4))
        xs, ys = rng.integers(0, width, size=2), rng.integers(0, height, size=2)
        draw.line([(int(xs[0]), int(ys[0])), (int(xs[1]), int(ys[1]))], fill=shade, width=1)
    x = int(rng.integers(4, max(5, width - text_w - 4))) - left
    y = int(rng.integers(2, max(3, height - text_h - 2))) - top
    draw.text((x, y), text, font=font, fill=tuple(int(c) for c in ink))
    advances = [font.getlength(text[:k]) for k in range(len(text) + 1)]
    centres = np.array([x + (a + b) / 2 for a, b in zip(advances[:-1], advances[1:], strict=True)], dtype=np.float32)
    degrees = float(rng.uniform(-spec.max_degrees, spec.max_degrees))
    image = image.rotate(degrees, resample=Image.Resampling.BICUBIC, fillcolor=tuple(int(c) for c in background))
    if rng.random() < 0.3:
        image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 0.8))))
    sigma = float(rng.uniform(0, spec.max_noise))
    pixels = np.asarray(image, dtype=np.float32) + rng.normal(0, sigma, size=(height, width, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="RGB")
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


def build_example(text: str, image, tokenizer: Tokenizer, vision: VisionConfig, image_token_id: int,
                  char_x: np.ndarray | None = None) -> VisionExample:
    """Tokenize the turn "image + PROMPT -> ``text``" and expand its placeholder for ``image`` (PIL, processed
    with ``vision``). Raises ValueError when the image would be resized or padded (its size is not a multiple
    of 42 pixels or its area is under ``min_pixels``), or when the prompt's tokens are not a prefix of the
    turn's."""
    if image.width % TOKEN_PIXELS or image.height % TOKEN_PIXELS or image.width * image.height < vision.min_pixels:
        raise ValueError(f"a {image.width}x{image.height} render must have sides that are multiples of "
                         f"{TOKEN_PIXELS} px and an area >= min_pixels {vision.min_pixels}")
    head = prompt_ids(tokenizer)
    whole = tokenizer.encode(encode_messages(prompt_messages(text), thinking=False), add_special_tokens=False).ids
    if whole[: len(head)] != head or len(whole) == len(head):
        raise ValueError(f"the prompt does not tokenize to a prefix of the turn for {text!r}")
    processed = preprocess_image(image, vision)
    ids, types = expand_image_placeholders(whole, [processed.grid], image_token_id)
    start = len(head) + processed.grid.span_length - 1
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
                 max_chars: int = 24) -> VisionExample:
    """The example of one seed (a list of ints, e.g. ``[seed, step, row]``): :func:`render_sample`, then
    :func:`build_example`."""
    text, image, _, centres = render_sample(lines, seed, fonts, spec, max_chars)
    return build_example(text, image, tokenizer, vision, image_token_id, centres)


def render_sample(lines: Sequence[str], seed: Sequence[int], fonts: Sequence[str], spec: RenderSpec = RenderSpec(),
                  max_chars: int = 24):
    """``(text, PIL image, font name, character centres)`` of one seed: :func:`pick_snippet` then
    :func:`render_text`, both from ``numpy.random.default_rng(seed)``."""
    rng = np.random.default_rng(list(seed))
    text = pick_snippet(lines, rng, max_chars)
    image, font, centres = render_text(text, rng, fonts, spec)
    return text, image, font, centres


CELL_CHARS = 94  # printable ASCII without the space: '!' (33) .. '~' (126)


def cell_labels(example: VisionExample) -> torch.Tensor:
    """Which characters lie in each 42-pixel column of a render: multi-hot float32 [n_llm_w, 94], column of a
    character = its centre // 42 (clamped to the grid), class = ``ord(c) - 33``; spaces carry no label. The
    target of the trainer's auxiliary per-column probe. Raises ValueError for an example without ``char_x``."""
    if example.char_x is None:
        raise ValueError("the example has no character positions (only renders carry them)")
    width = example.image.grid.n_llm_w
    labels = torch.zeros(width, CELL_CHARS)
    for ch, x in zip(example.text, example.char_x.tolist(), strict=True):
        if 33 <= ord(ch) <= 126:
            labels[min(max(int(x // TOKEN_PIXELS), 0), width - 1), ord(ch) - 33] = 1.0
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
