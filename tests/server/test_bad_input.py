"""Input the server must refuse with a clear 400 instead of failing inside: lone UTF-16 surrogates anywhere in a
request (issue 22 item 14)."""

import httpx
import pytest
from serving_helpers import KEYS, MODEL, auth

HEADERS = {**auth(KEYS[0]), "content-type": "application/json"}


def post(url: str, raw: str) -> httpx.Response:
    """POST a raw JSON text (so that it can spell a lone surrogate, which json.dumps would not keep as such)."""
    return httpx.post(url, content=raw.encode(), headers=HEADERS, timeout=60)


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", '{"model": "@M", "prompt": ["\\ud800"], "max_tokens": 2}', "prompt[0]"),
    ("/v1/completions", '{"model": "@M", "prompt": "ab\\udfffc", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "@M", "prompt": "ab", "stop": ["x\\ud800"], "max_tokens": 2}', "stop[0]"),
    ("/v1/chat/completions", '{"model": "@M", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"model": "@M", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\udc00"}]}]}', "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"model": "@M", "messages": [{"role": "user", "content": "hi", "\\ud800": 1}]}',
     "messages[0] (a key)"),
    ("/v1/chat/completions", '{"model": "@M", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
     '"function", "function": {"name": "f", "description": "\\ud800"}}]}', "tools[0].function.description"),
    ("/v1/chat/completions", '{"model": "@M", "messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}',
     "user"),
    ("/tokenize", '{"model": "@M", "prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"model": "@M", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
])
def test_lone_surrogate_is_a_400(server, path, raw, param):
    response = post(server.url + path, raw.replace("@M", MODEL))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "lone UTF-16 surrogate" in error["message"], error


def test_surrogate_pair_is_fine(server):
    response = post(server.url + "/v1/completions", '{"model": "@M", "prompt": ["\\ud83d\\ude00 hi"], '
                    '"max_tokens": 2}'.replace("@M", MODEL))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_is_capped(server, path):
    """At most 4 stop strings (OpenAI's limit) of at most 1024 characters each (issue 22 item 3)."""
    base = {"model": MODEL, "max_tokens": 2, **({"prompt": "Hi"} if "chat" not in path else
                                                 {"messages": [{"role": "user", "content": "Hi"}]})}
    for stop, message in ((["a", "b", "c", "d", "e"], "at most 4 strings"),
                          ("x" * 1025, "at most 1024 characters"), (["ok", "y" * 5000], "at most 1024 characters")):
        response = httpx.post(server.url + path, json={**base, "stop": stop}, headers=HEADERS, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "stop" and message in error["message"], error
    ok = httpx.post(server.url + path, json={**base, "stop": ["a", "b", "c", "z" * 1024]}, headers=HEADERS, timeout=60)
    assert ok.status_code == 200, ok.text


def test_unicode_check_is_iterative_and_skips_token_ids():
    """The walk has no recursion limit (a deeply nested message) and does not visit validated token-id lists."""
    from deepseek_v41.server.errors import APIError
    from deepseek_v41.server.protocol import ChatCompletionRequest, CompletionRequest
    from deepseek_v41.server.text import check_unicode

    deep = {"leaf": "bad \ud800"}
    for _ in range(3000):
        deep = {"x": [deep]}
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "extra": deep}])
    with pytest.raises(APIError) as caught:
        check_unicode(request)
    assert caught.value.param.startswith("messages[0].extra.x[0].x[0]") and caught.value.param.endswith(".leaf")
    ids = CompletionRequest(prompt=[list(range(3, 200_000))] * 20)
    check_unicode(ids)  # 4M ids: not walked (this would take seconds)
