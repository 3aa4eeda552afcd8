"""Image content parts: where an image part's pixels come from, data URLs, in-process reads, placeholder splits.

Accepted parts (CHAT_FORMAT.md §2 rule 1; each renders as one ``<｜deepseek_image｜>`` placeholder):

- ``{"type": "image_url", "image_url": {"url": URL, "detail": ...}}`` (OpenAI chat), also with ``image_url`` as
  the URL string itself (vLLM accepts both);
- ``{"type": "input_image", "image_url": URL}`` (OpenAI Responses; ``image_url`` may also be ``{"url": URL}``;
  ``file_id`` is refused: there is no file store);
- ``{"type": "image", ...}`` with ``url``, ``data`` (a data URL or bare base64) or an Anthropic-style ``source``
  (``{"type": "base64", "media_type": ..., "data": ...}`` or ``{"type": "url", "url": ...}``);
- ``{"type": "image_pil", "image_pil": PIL.Image}`` (vLLM's ``LLM.chat`` part; only in-process, never over HTTP).

URL is a ``data:image/...;base64,...`` URL, an ``http(s)://`` URL or a ``file://`` URL; whether the last two may
be read is the caller's policy (``dsv41 serve``: :mod:`deepseek_v41.server.media`). The bytes are decoded by
:func:`deepseek_v41.engine.multimodal.decode_image` (size read from the header first: a decompression bomb is
refused before it is expanded).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .errors import ChatFormatError
from .tokens import IMAGE_NAMES

IMAGE_PART_TYPES = ("image_url", "input_image", "image", "image_pil")


@dataclass(frozen=True)
class ImageSource:
    """One image part: ``url`` (a data, http(s) or file URL) or ``pil`` (a PIL image), and ``where`` it was in the
    request (``messages[0].content[1]``), for error messages."""

    where: str
    url: str | None = None
    pil: Any = None

    @property
    def scheme(self) -> str:
        """``"pil"``, ``"data"``, ``"http"``, ``"https"``, ``"file"`` or another URL scheme (lowercase)."""
        if self.pil is not None:
            return "pil"
        return self.url.split(":", 1)[0].lower() if ":" in self.url else ""


def _url_field(value: Any, at: str, kind: str) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ChatFormatError(at, f"an {kind} part needs 'image_url': {{'url': <non-empty string>}} or the URL "
                                  f"string")
    return url


def image_source(part: dict[str, Any], where: str) -> ImageSource:
    """The :class:`ImageSource` of an image content part (module docstring); ChatFormatError naming the field for a
    part of an image type that holds no usable image reference."""
    kind = part.get("type")
    if kind == "image_url":
        return ImageSource(where, url=_url_field(part.get("image_url"), where, "image_url"))
    if kind == "input_image":
        if part.get("file_id") is not None and part.get("image_url") is None:
            raise ChatFormatError(f"{where}.file_id", "images by file_id are not supported (this server keeps no "
                                                      "files); send 'image_url' with a data URL or an http(s) URL")
        return ImageSource(where, url=_url_field(part.get("image_url"), where, "input_image"))
    if kind == "image_pil":
        image = part.get("image_pil")
        if not _is_pil(image):
            raise ChatFormatError(f"{where}.image_pil", f"must be a PIL.Image.Image (LLM.chat only), got "
                                                        f"{type(image).__name__}")
        return ImageSource(where, pil=image)
    if kind == "image":
        if isinstance(part.get("url"), str) and part["url"]:
            return ImageSource(where, url=part["url"])
        data = part.get("data")
        if isinstance(data, str) and data:
            return ImageSource(where, url=data if data.startswith("data:") else f"data:image/*;base64,{data}")
        source = part.get("source")
        if isinstance(source, dict):
            if source.get("type") == "url" and isinstance(source.get("url"), str) and source["url"]:
                return ImageSource(where, url=source["url"])
            if source.get("type") == "base64" and isinstance(source.get("data"), str) and source["data"]:
                media = source.get("media_type") or "image/*"
                return ImageSource(where, url=f"data:{media};base64,{source['data']}")
        raise ChatFormatError(where, "an image part needs a 'source' ({'type': 'base64', 'media_type': ..., "
                                     "'data': ...} or {'type': 'url', 'url': ...}), a 'url' or 'data' (base64 or a "
                                     "data URL)")
    raise ChatFormatError(where, f"part type {kind!r} is not an image part; image parts: {list(IMAGE_PART_TYPES)}")


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a dependency
        return False
    return isinstance(value, Image.Image)


def data_url_bytes(url: str, max_bytes: int, where: str) -> bytes:
    """The decoded bytes of a ``data:[<media type>][;base64],<data>`` URL.

    Only base64 data of an ``image/*`` media type (or none) is taken. Raises ValueError naming ``where`` for
    another media type, data that is not base64, or more than ``max_bytes`` decoded bytes (checked on the encoded
    length first, so an oversized URL is refused before it is decoded)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError(f"{where}: a data URL needs a ',' before its data (data:image/png;base64,...)")
    params = header[5:].split(";") if header[:5].lower() == "data:" else []
    media = params[0].strip().lower() if params else ""
    if media and not media.startswith("image/"):
        raise ValueError(f"{where}: a data URL of media type {media!r} is not an image; use image/png, image/jpeg, "
                         f"image/webp, image/gif or image/bmp")
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise ValueError(f"{where}: only base64 data URLs are taken (data:image/png;base64,...)")
    payload = "".join(payload.split())  # some clients wrap base64 at 76 columns
    if len(payload) // 4 * 3 > max_bytes + 2:
        raise ValueError(f"{where}: the image is larger than the {max_bytes} bytes allowed per image")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{where}: the data URL's data is not valid base64 ({exc})") from None
    if len(data) > max_bytes:
        raise ValueError(f"{where}: the image is larger than the {max_bytes} bytes allowed per image")
    return data


def split_at_placeholders(text: str, placeholders: tuple[str, ...] = IMAGE_NAMES) -> list[str]:
    """``text`` cut at every image placeholder: ``k`` placeholders give ``k + 1`` pieces (some maybe empty).
    Tokenize each piece and put ``image_token_id`` between them to get the prompt in token-id space, whatever id
    the tokenizer gives the placeholder's spelling."""
    pieces = [text]
    for placeholder in placeholders:
        pieces = [part for piece in pieces for part in piece.split(placeholder)]
    return pieces


def read_offline(source: ImageSource, max_bytes: int) -> Any:
    """The image of a part for an in-process caller (``LLM.chat``): the PIL image itself, or the encoded bytes of a
    data URL or of a ``file://`` URL (a path on this machine; the caller is trusted). Raises ValueError naming the
    part for an http(s) URL (nothing is fetched in-process: load it and pass an ``image_pil`` part), another scheme,
    a missing file, or more than ``max_bytes`` bytes."""
    scheme = source.scheme
    if scheme == "pil":
        return source.pil
    if scheme == "data":
        return data_url_bytes(source.url, max_bytes, source.where)
    if scheme == "file":
        path = Path(unquote(urlsplit(source.url).path))
        try:
            with path.open("rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ValueError(f"{source.where}: cannot read {str(path)!r}: {exc.strerror or exc}") from None
        if len(data) > max_bytes:
            raise ValueError(f"{source.where}: the image is larger than the {max_bytes} bytes allowed per image")
        return data
    if scheme in ("http", "https"):
        raise ValueError(f"{source.where}: image URLs are not fetched in-process; load the image yourself and "
                         f"pass {{'type': 'image_pil', 'image_pil': image}} (or a data URL), or serve the model "
                         f"with dsv41 serve --allowed-media-domains")
    raise ValueError(f"{source.where}: an image URL must be a data URL (data:image/png;base64,...) or file://, got "
                     f"scheme {scheme!r}")
