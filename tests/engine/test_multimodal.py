"""The multimodal frontend (engine/multimodal.py): span records, content hash, image decoding and its limits,
placeholder expansion and its errors, the two spellings of the image placeholder.

Oracles: offsets and lengths counted by hand from the span formula h * (w + 1) + 2, a sha256 re-derived from
the documented byte layout with ``struct`` (and the same hash computed in a fresh process), PNG files written
byte by byte with ``zlib`` (a header that claims more pixels than its data holds), and tokenizers built here.
"""

import dataclasses
import io
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from deepseek_v41.chat import encode_messages
from deepseek_v41.chat.errors import ChatFormatError
from deepseek_v41.chat.tokens import IMAGE, IMAGE_ALIAS
from deepseek_v41.config import VisionConfig, tiny_config
from deepseek_v41.engine.multimodal import (
    MAX_IMAGE_PIXELS,
    ImageItem,
    MultiModalInputs,
    build_multimodal_prompt,
    decode_image,
    image_hash,
    image_placeholder_token,
    normalize_image_placeholders,
    process_images,
)
from deepseek_v41.model.image_processor import ImageGrid, ProcessedImage, TokenType, preprocess_image
from deepseek_v41.model.vision import _span_shapes

P = 509  # image_token_id of the test config
S, I, N, E, T = (int(t) for t in (TokenType.IMAGE_START, TokenType.IMAGE, TokenType.IMAGE_NEWLINE,
                                  TokenType.IMAGE_END, TokenType.TEXT))
# patch 2 px, 3x3 merge: one LLM token is a 6x6-pixel cell; at most 64 span positions per image.
VC = VisionConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=12, patch_size=2,
                  downsample_ratio=3, max_image_tokens=64, min_pixels=36)
CFG = dataclasses.replace(tiny_config(), vision_config=VC, image_token_id=P)


def made_image(n_llm_h, n_llm_w, seed=0) -> ProcessedImage:
    """A ProcessedImage of an n_llm_h x n_llm_w token grid (3x3 patches per token), random patches."""
    n_h, n_w = 3 * n_llm_h, 3 * n_llm_w
    g = torch.Generator().manual_seed(seed)
    patches = torch.randn(n_h * n_w, 3 * 2 * 2, generator=g)
    return ProcessedImage(patches, ImageGrid(2 * n_h, 2 * n_w, n_h, n_w, n_llm_h, n_llm_w))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims ``width x height`` RGB pixels but which holds no pixel data at all."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


# ---------------------------------------------------------------------------------------------- expansion
def test_build_prompt_records_spans_by_hand():
    a, b = made_image(1, 2, seed=1), made_image(2, 1, seed=2)  # spans 1*3+2 = 5 and 2*2+2 = 6
    ids, mm = build_multimodal_prompt([5, P, 7, P], [a, b], CFG)
    assert ids == [5] + [P] * 5 + [7] + [P] * 6
    assert isinstance(mm, MultiModalInputs) and all(isinstance(item, ImageItem) for item in mm.images)
    assert [(item.offset, item.length) for item in mm.images] == [(1, 5), (7, 6)]
    assert mm.spans() == [(1, 6), (7, 13)]
    assert mm.token_types == (T, S, I, I, N, E, T, S, I, N, I, N, E)
    assert mm.num_image_tokens == 11
    assert mm.images[0].image is a and mm.images[1].image is b
    assert [item.hash for item in mm.images] == [image_hash(a), image_hash(b)]
    # images of a range (half-open): [0, 1) is text only, [5, 8) touches both spans, [6, 7) only the text between
    assert mm.overlapping(0, 1) == () and mm.overlapping(6, 7) == ()
    assert mm.overlapping(5, 8) == mm.images and mm.overlapping(0, 2) == mm.images[:1]
    assert mm.overlapping(12, 100) == mm.images[1:]
    # where a chunk may end: 1, 6, 7 and 13 are span edges or text; 3 and 10 cut a span
    assert [mm.boundary_at_or_before(p) for p in (0, 1, 3, 6, 7, 10, 13)] == [0, 1, 1, 6, 7, 7, 13]
    # no image: the prompt is unchanged and all text
    ids, mm = build_multimodal_prompt([3, 4], [], CFG)
    assert ids == [3, 4] and mm.images == () and mm.token_types == (T, T) and mm.spans() == []


def test_build_prompt_errors_name_the_limit():
    with pytest.raises(ValueError, match="no vision tower"):
        build_multimodal_prompt([5, P], [made_image(1, 1)], tiny_config())
    with pytest.raises(ValueError, match="2 image placeholder.*1 image"):
        build_multimodal_prompt([P, 5, P], [made_image(1, 1)], CFG)
    with pytest.raises(ValueError, match="0 image placeholder.*1 image"):
        build_multimodal_prompt([5], [made_image(1, 1)], CFG)
    big = made_image(7, 8)  # 7 * 9 + 2 = 65 positions, one over max_image_tokens = 64
    with pytest.raises(ValueError, match="image 1: .*65 prompt positions.*max_image_tokens=64"):
        build_multimodal_prompt([P, P], [made_image(1, 1), big], CFG)
    # 2 text + 2 spans of 4 = 10 positions
    with pytest.raises(ValueError, match=r"10 positions \(2 text tokens \+ 8 image tokens in 2 image span.*"
                                         r"max_model_len=9"):
        build_multimodal_prompt([1, P, 2, P], [made_image(1, 1), made_image(1, 1, 3)], CFG, max_model_len=9)
    ids, _ = build_multimodal_prompt([1, P, 2, P], [made_image(1, 1), made_image(1, 1, 3)], CFG, max_model_len=10)
    assert len(ids) == 10
    wrong = ProcessedImage(torch.zeros(9, 12, dtype=torch.float64), ImageGrid(6, 6, 3, 3, 1, 1))
    with pytest.raises(ValueError, match="float32"):
        build_multimodal_prompt([P], [wrong], CFG)
    skewed = ProcessedImage(torch.zeros(9, 12), ImageGrid(6, 6, 3, 3, 2, 1))
    with pytest.raises(ValueError, match="inconsistent"):
        build_multimodal_prompt([P], [skewed], CFG)


# ---------------------------------------------------------------------------------------------- content hash
def test_image_hash_is_sha256_of_the_documented_bytes():
    im = made_image(2, 3, seed=4)
    g = im.grid
    want = __import__("hashlib").sha256(
        b"dsv41-image-v1\0" + struct.pack("<6q", g.height, g.width, g.n_vit_h, g.n_vit_w, g.n_llm_h, g.n_llm_w)
        + b"".join(struct.pack("<f", v) for v in im.patches.flatten().tolist())).hexdigest()
    assert image_hash(im) == want
    changed = im.patches.clone()
    changed[5, 3] += 1e-3
    assert image_hash(ProcessedImage(changed, g)) != want
    # the same 36 patches read as another grid are another image
    other = ProcessedImage(im.patches, ImageGrid(2 * 9, 2 * 4, 9, 4, 3, 2))
    assert image_hash(other) != want


def test_image_hash_is_the_same_in_another_process():
    rng = np.random.default_rng(7)
    pixels = rng.integers(0, 256, size=(20, 30, 3), dtype=np.uint8)
    here = image_hash(preprocess_image(pixels, VC))
    code = (
        "import numpy as np, dataclasses\n"
        "from deepseek_v41.config import VisionConfig\n"
        "from deepseek_v41.engine.multimodal import image_hash\n"
        "from deepseek_v41.model.image_processor import preprocess_image\n"
        f"vc = VisionConfig(**{dataclasses.asdict(VC)!r})\n"
        "pixels = np.random.default_rng(7).integers(0, 256, size=(20, 30, 3), dtype=np.uint8)\n"
        "print(image_hash(preprocess_image(pixels, vc)))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={"PYTHONPATH": str(root), "PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


# ---------------------------------------------------------------------------------------------- decoding
def test_process_images_accepts_pil_bytes_and_processed():
    rng = np.random.default_rng(0)
    pil = Image.fromarray(rng.integers(0, 256, size=(12, 18, 3), dtype=np.uint8))
    ready = made_image(1, 1)
    out = process_images([pil, png_bytes(pil), bytearray(png_bytes(pil)), ready], VC)
    want = preprocess_image(pil, VC)
    for got in out[:3]:
        assert got.grid == want.grid and torch.equal(got.patches, want.patches)
    assert out[3] is ready
    jpeg = io.BytesIO()
    pil.save(jpeg, format="JPEG")
    assert process_images([jpeg.getvalue()], VC)[0].grid == want.grid


def test_process_images_refuses_bad_input_clearly():
    with pytest.raises(ValueError, match=r"image 1: cannot decode the image data \(9 bytes") as info:
        process_images([made_image(1, 1), b"not a png"], VC)
    assert "not an image in a format read here" in str(info.value) and "BytesIO" not in str(info.value)
    with pytest.raises(ValueError, match="image 0: the image data is empty"):
        process_images([b""], VC)
    with pytest.raises(ValueError, match="image 0 is a str; pass a PIL image"):
        process_images(["/etc/passwd"], VC)
    truncated = png_bytes(Image.new("RGB", (40, 40), (9, 9, 9)))[:-30]
    with pytest.raises(ValueError, match="cannot decode"):
        process_images([truncated], VC)
    with pytest.raises(ValueError, match="float32"):
        process_images([ProcessedImage(torch.zeros(9, 13), ImageGrid(6, 6, 3, 3, 1, 1))], VC)
    # a format Pillow reads but a client has no reason to send (EPS would run Ghostscript): refused unread
    eps = io.BytesIO()
    Image.new("RGB", (4, 4)).save(eps, format="EPS")
    with pytest.raises(ValueError, match="cannot decode.*the formats read are PNG, JPEG, WEBP, GIF, BMP, TIFF"):
        process_images([eps.getvalue()], VC)
    for fmt in ("WEBP", "GIF", "BMP", "TIFF"):
        buf = io.BytesIO()
        Image.new("RGB", (8, 5), (1, 2, 3)).save(buf, format=fmt)
        assert process_images([buf.getvalue()], VC)[0].grid == preprocess_image(Image.new("RGB", (8, 5)), VC).grid


def test_decompression_bomb_is_refused_before_decoding():
    # 10000 x 10000 = 1e8 pixels, over the 89,478,485 limit; the file holds no pixels, so decoding would fail
    # with a different message: the refusal comes from the header.
    with pytest.raises(ValueError, match=r"10000x10000 = 100,000,000 pixels is over the limit of 89,478,485"):
        decode_image(png_header_only(10000, 10000))
    assert MAX_IMAGE_PIXELS == 89_478_485
    # far over: Pillow's own guard fires inside open; still a ValueError naming the limit
    with pytest.raises(ValueError, match="over the limit of 89,478,485"):
        decode_image(png_header_only(100000, 100000))
    # the limit is a parameter
    small = png_bytes(Image.new("RGB", (40, 30)))
    with pytest.raises(ValueError, match="40x30 = 1,200 pixels is over the limit of 1,199"):
        process_images([small], VC, max_pixels=1199)
    assert process_images([small], VC, max_pixels=1200)[0].patches.dtype == torch.float32
    # a header under the limit with no data behind it is a decode error, not a limit error
    with pytest.raises(ValueError, match="cannot decode"):
        decode_image(png_header_only(100, 100))


def test_decoded_modes_become_rgb_without_compositing():
    rgba = Image.new("RGBA", (6, 6), (200, 10, 20, 0))  # fully transparent: alpha is dropped, not composited
    got = decode_image(png_bytes(rgba))
    assert got.mode == "RGBA"
    canvas = process_images([png_bytes(rgba)], VC)[0]
    red = (200 / 255 - 0.5) / 0.5
    assert canvas.patches[0, 0].item() == pytest.approx(red, abs=1e-6)


# ---------------------------------------------------------------------------------------------- placeholder names
def _tokenizer(specials):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "look": 1, "at": 2, "this": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return tok


@pytest.mark.parametrize("known", [IMAGE, IMAGE_ALIAS])
def test_either_placeholder_spelling_maps_to_the_image_id(known):
    tok = _tokenizer([known])
    image_id = tok.token_to_id(known)
    assert image_placeholder_token(tok) == known
    assert image_placeholder_token(tok, image_id) == known
    with pytest.raises(ValueError, match="no image placeholder token with id 99"):
        image_placeholder_token(tok, 99)
    for spelling in (IMAGE, IMAGE_ALIAS):
        text = normalize_image_placeholders(f"look at {spelling} this {IMAGE}", known)
        assert tok.encode(text).ids == [1, 2, image_id, 3, image_id]
    # a rendered chat prompt uses IMAGE; with the tokenizer's spelling it expands in id space
    prompt = encode_messages([{"role": "user", "content": [{"type": "text", "text": "look"},
                                                           {"type": "image_url", "image_url": {"url": "x"}}]}])
    ids = tok.encode(normalize_image_placeholders(prompt, known)).ids
    assert ids.count(image_id) == 1
    cfg = dataclasses.replace(CFG, image_token_id=image_id)
    expanded, mm = build_multimodal_prompt(ids, [made_image(1, 1)], cfg)
    assert len(expanded) == len(ids) + 3 and mm.spans() == [(ids.index(image_id), ids.index(image_id) + 4)]


def test_tokenizer_without_a_placeholder_is_an_error():
    with pytest.raises(ValueError, match="looked for .*deepseek_image.* and .*image2.*found neither"):
        image_placeholder_token(_tokenizer([]))
    with pytest.raises(ValueError, match="not an image placeholder"):
        normalize_image_placeholders("x", "<image>")


@pytest.mark.parametrize("spelling", [IMAGE, IMAGE_ALIAS])
def test_client_text_with_either_spelling_is_refused(spelling):
    with pytest.raises(ChatFormatError, match="send images as image_url content parts"):
        encode_messages([{"role": "user", "content": f"see {spelling}"}])


def test_made_image_helper_matches_the_span_formula():
    for h, w in [(1, 1), (2, 3), (7, 8)]:
        im = made_image(h, w)
        assert im.grid.span_length == h * (w + 1) + 2 and im.patches.shape == (9 * h * w, 12)
        assert (im.grid.n_llm_h, im.grid.n_llm_w) == (math.ceil(im.grid.n_vit_h / 3), math.ceil(im.grid.n_vit_w / 3))


# ---------------------------------------------------------------------------------------------- property
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_expansion_spans_and_types_agree(data):
    n_images = data.draw(st.integers(0, 4))
    grids = [(data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))) for _ in range(n_images)]
    text = data.draw(st.lists(st.integers(0, P - 1), max_size=12))
    prompt = list(text)
    for _ in range(n_images):  # placeholders at random places
        prompt.insert(data.draw(st.integers(0, len(prompt))), P)
    images = [made_image(h, w, seed=k) for k, (h, w) in enumerate(grids)]
    ids, mm = build_multimodal_prompt(prompt, images, CFG)
    assert len(ids) == len(mm.token_types) == len(text) + sum(h * (w + 1) + 2 for h, w in grids)
    spans = mm.spans()
    assert [item.length for item in mm.images] == [h * (w + 1) + 2 for h, w in grids]
    assert all(a < b <= c for (a, b), (c, _) in zip(spans, spans[1:], strict=False))  # prompt order, no overlap
    inside = set()
    for (start, end), (h, w) in zip(spans, grids, strict=True):
        row = [I] * w + [N]
        assert list(mm.token_types[start:end]) == [S] + row * h + [E]
        assert ids[start:end] == [P] * (end - start)
        inside.update(range(start, end))
    outside = [i for i in range(len(ids)) if i not in inside]
    assert [ids[i] for i in outside] == text and all(mm.token_types[i] == T for i in outside)
    # the model's own span parser reads the same grids back from the token types
    assert _span_shapes(list(mm.token_types)) == grids
    assert mm.num_image_tokens == len(inside)
