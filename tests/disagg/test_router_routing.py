"""The router's choice of backend (deepseek_v41/disagg/routing.py): prefix affinity within a load bound, the least
loaded otherwise, a bounded map, and the prefill request's fields (issue 29)."""

from __future__ import annotations

from deepseek_v41.disagg.routing import (
    CHAT,
    COMPLETIONS,
    BackendPool,
    PrefixAffinity,
    RouterConfig,
    has_images,
    prefill_request,
    prefix_hashes,
)


def pool(**kwargs) -> BackendPool:
    return BackendPool(RouterConfig(decode=["http://d1:1", "http://d2:1", "http://d3:1"], prefill=["http://p:1"],
                                    **kwargs))


def test_least_loaded_then_fewest_sent_when_no_prefix_matches():
    p = pool()
    d1, d2, d3 = p.backends["decode"]
    d1.outstanding, d2.outstanding, d3.outstanding = 2, 1, 1
    d2.served, d3.served = 5, 4
    assert p.choose("decode", [], set()) == (d3, False)
    d3.up = False
    assert p.choose("decode", [], set()) == (d2, False)
    assert p.choose("decode", [], {d2.url}) == (d1, False)
    assert p.choose("decode", [], {d1.url, d2.url}) == (None, False)


def test_longest_prefix_wins_unless_its_server_is_too_busy():
    p = pool(affinity_max_imbalance=2)
    d1, d2, _ = p.backends["decode"]
    short = prefix_hashes(CHAT, {"messages": [{"role": "user", "content": "a"}]}, "", 512)
    long = prefix_hashes(CHAT, {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
                         "", 512)
    assert long[:1] == short
    p.record("decode", short, d1)
    p.record("decode", long, d2)  # d2 served the longer conversation later
    assert p.choose("decode", long + [b"more"], set()) == (d2, True)
    assert p.choose("decode", short, set()) == (d2, True)  # d2 holds the short prefix too now
    d2.outstanding = 3  # 3 more than the idle d3: beyond the bound of 2
    assert p.choose("decode", long, set())[1] is False
    d2.outstanding = 2
    assert p.choose("decode", long, set()) == (d2, True)
    d2.up = False  # down: the next longest match on a healthy server does not exist; least loaded
    assert p.choose("decode", long, set())[1] is False


def test_the_affinity_map_is_bounded():
    a = PrefixAffinity(max_entries=3)
    a.record([b"1", b"2"], "x")
    a.record([b"3", b"4"], "y")
    assert a.match([b"1"], {"x", "y"}) == (None, 0)  # the oldest entry went
    assert a.match([b"2", b"3", b"9"], {"x", "y"}) == ("y", 2)
    assert a.match([b"2", b"3"], {"x"}) == ("x", 1)  # y is not a candidate


def test_prefill_request_fields():
    chat = {"messages": [], "stream": True, "stream_options": {"include_usage": True}, "n": 2, "min_tokens": 3,
            "max_tokens": 50, "temperature": 0, "kv_transfer_params": {"from": "client"}}
    assert prefill_request(CHAT, chat) == {"messages": [], "stream": False, "max_tokens": 1, "temperature": 0,
                                           "max_completion_tokens": 1,
                                           "kv_transfer_params": {"do_remote_decode": True}}
    assert prefill_request(COMPLETIONS, {"prompt": "x"}) == {"prompt": "x", "stream": False, "max_tokens": 1,
                                                             "kv_transfer_params": {"do_remote_decode": True}}
    assert chat["stream"] is True and chat["n"] == 2  # the client's body is not changed


def test_image_parts_are_found():
    def body(part):
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}

    assert has_images(body({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}))
    assert has_images(body({"type": "input_image", "image_url": "https://x/y.png"}))
    assert not has_images(body({"type": "text", "text": "no image"}))
    assert not has_images({"messages": "not a list"}) and not has_images({"prompt": "x"})


def test_cache_salt_model_and_tools_separate_prefixes():
    base = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    h = prefix_hashes(CHAT, base, "", 512)
    for other in ({**base, "model": "n"}, {**base, "cache_salt": "s"}, {**base, "tools": [{"type": "function"}]}):
        assert prefix_hashes(CHAT, other, "", 512) != h
    assert prefix_hashes(CHAT, dict(reversed(list(base.items()))), "", 512) == h  # key order does not matter
    assert prefix_hashes(COMPLETIONS, {"prompt": 5}, "", 512) == []  # not a prompt: the server says why
