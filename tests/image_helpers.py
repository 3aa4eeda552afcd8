"""Test images shared by the engine and server vision tests: rendered text (Pillow's default font) and PNG bytes."""

import io

from PIL import Image, ImageDraw


def text_image(text: str, size=(126, 42)) -> Image.Image:
    """Black ``text`` on a white ``size`` (width, height) RGB image."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((4, 12), text, fill="black")
    return image


def png(image: Image.Image) -> bytes:
    """``image`` encoded as PNG."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
