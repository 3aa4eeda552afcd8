"""Image content parts without a server: which parts are images and where their pixels come from, the order of
the images as their placeholders appear in the rendered prompt (tool results sorted, developer turns dropped),
data URLs, and cutting a raw prompt at its placeholders."""

import base64

import pytest

from deepseek_v41.chat import ChatFormatError, render_messages
from deepseek_v41.chat import tokens as T
from deepseek_v41.chat.images import data_url_bytes, image_source, read_offline, split_at_placeholders


def img(name: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{name}"}}


def names(sources) -> list[str]:
    return [s.url.rsplit(",", 1)[1] for s in sources]


def test_images_come_in_placeholder_order_across_messages():
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "sys"}, img("S")]},
        {"role": "user", "content": [img("U1"), {"type": "text", "text": "between"}, img("U2")]},
        {"role": "assistant", "content": [{"type": "text", "text": "seen"}, img("A")], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        # Tool results arrive out of call order; the encoder sorts them by call order, images with them.
        {"role": "tool", "tool_call_id": "c2", "content": [img("T2")]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r1"}, img("T1")]},
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,U3"}]},
    ]
    prompt, sources = render_messages(messages)
    assert prompt.count(T.IMAGE) == len(sources) == 7
    assert names(sources) == ["S", "U1", "U2", "A", "T1", "T2", "U3"]
    assert [s.where for s in sources][:3] == ["messages[0].content[1]", "messages[1].content[0]",
                                              "messages[1].content[2]"]
    assert prompt.index("r1") < prompt.index("</tool_result>")  # T1's result is rendered first


def test_a_dropped_developer_turn_takes_its_images_along():
    messages = [{"role": "developer", "content": [{"type": "text", "text": "dev"}, img("D")]},
                {"role": "user", "content": [img("U")]}]
    prompt, sources = render_messages(messages, thinking=True)
    assert names(sources) == ["U"] and prompt.count(T.IMAGE) == 1
    prompt, sources = render_messages(messages, thinking=False)
    assert names(sources) == ["D", "U"] and prompt.count(T.IMAGE) == 2


@pytest.mark.parametrize(("part", "url"), [
    ({"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}}, "https://x/a.png"),
    ({"type": "image_url", "image_url": "https://x/a.png"}, "https://x/a.png"),
    ({"type": "input_image", "image_url": "https://x/a.png", "detail": "auto"}, "https://x/a.png"),
    ({"type": "input_image", "image_url": {"url": "https://x/a.png"}}, "https://x/a.png"),
    ({"type": "image", "url": "https://x/a.png"}, "https://x/a.png"),
    ({"type": "image", "data": "QUJD"}, "data:image/*;base64,QUJD"),
    ({"type": "image", "data": "data:image/png;base64,QUJD"}, "data:image/png;base64,QUJD"),
    ({"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "QUJD"}},
     "data:image/jpeg;base64,QUJD"),
    ({"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}, "https://x/a.png"),
])
def test_image_part_spellings(part, url):
    assert image_source(part, "p").url == url


@pytest.mark.parametrize(("part", "words"), [
    ({"type": "image_url"}, "an image_url part needs"),
    ({"type": "input_image", "image_url": ""}, "an input_image part needs"),
    ({"type": "input_image", "file_id": "file-1"}, "by file_id are not supported"),
    ({"type": "image_pil", "image_pil": "a.png"}, "must be a PIL.Image.Image"),
    ({"type": "image", "source": {"type": "file"}}, "an image part needs a 'source'"),
])
def test_bad_image_parts(part, words):
    with pytest.raises(ChatFormatError, match=words):
        render_messages([{"role": "user", "content": [part]}])


def test_data_urls():
    data = b"\x89PNG\r\n\x1a\n" + bytes(range(200))
    encoded = base64.b64encode(data).decode()
    assert data_url_bytes(f"data:image/png;base64,{encoded}", 1000, "p") == data
    wrapped = "\n".join(encoded[i:i + 76] for i in range(0, len(encoded), 76))  # MIME line breaks
    assert data_url_bytes(f"data:image/png;base64,{wrapped}", 1000, "p") == data
    assert data_url_bytes(f"data:;base64,{encoded}", 1000, "p") == data
    for url, words in ((f"data:image/png;base64,{encoded}", "larger than the 100 bytes"),
                       ("data:image/png;base64", "needs a ','"),
                       ("data:application/pdf;base64,QUJD", "is not an image"),
                       ("data:image/png;charset=utf-8,abc", "only base64 data URLs"),
                       ("data:image/png;base64,QUJ", "not valid base64")):
        with pytest.raises(ValueError, match=words):
            data_url_bytes(url, 100, "p")


def test_oversized_data_url_is_refused_before_decoding(monkeypatch):
    calls = []
    monkeypatch.setattr(base64, "b64decode", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match="larger than"):
        data_url_bytes("data:image/png;base64," + "A" * 4000, 100, "p")
    assert not calls


def test_read_offline_reads_files_and_refuses_urls(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"abc")
    source = image_source({"type": "image_url", "image_url": path.as_uri()}, "p")
    assert read_offline(source, 10) == b"abc"
    with pytest.raises(ValueError, match="larger than the 2 bytes"):
        read_offline(source, 2)
    with pytest.raises(ValueError, match="not fetched in-process"):
        read_offline(image_source({"type": "image_url", "image_url": "https://x/a.png"}, "p"), 10)


def test_split_at_placeholders():
    assert split_at_placeholders(f"a{T.IMAGE}b{T.IMAGE_ALIAS}c{T.IMAGE}") == ["a", "b", "c", ""]
    assert split_at_placeholders("no images") == ["no images"]
