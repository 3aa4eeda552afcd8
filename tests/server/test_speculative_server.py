"""A server running DSpark speculative decoding (issue 7): greedy text equals the plain server's, streamed and not,
usage counts the emitted tokens, and /metrics exposes the spec_decode counters of the engine."""

import openai
import pytest
from serving_helpers import KEYS, MODEL, metrics, start_server

PROMPTS = ["Hello world", "The quick brown fox", "def main():\n    return"]


@pytest.fixture(scope="module")
def spec_server(model_dir):
    live = start_server(model_dir, speculative="dspark", speculative_cost_table="fixed")
    yield live
    live.stop()


def completions(server, prompt: str, stream: bool) -> tuple[str, int]:
    client = openai.OpenAI(base_url=server.v1, api_key=KEYS[0], max_retries=0)
    request = dict(model=MODEL, prompt=prompt, max_tokens=11, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        out = client.completions.create(**request)
        return out.choices[0].text, out.usage.completion_tokens
    parts = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    return "".join(p.choices[0].text for p in parts if p.choices), parts[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_speculative_server_matches_the_plain_one(server, spec_server, stream):
    for prompt in PROMPTS:
        assert completions(spec_server, prompt, stream) == completions(server, prompt, False)


def test_speculative_metrics(spec_server):
    completions(spec_server, PROMPTS[0], False)
    stats = spec_server.llm.engine.stats
    values = metrics(spec_server.url)
    drafts = values[("dsv41:spec_decode_num_drafts_total", ())]
    assert drafts == stats["spec_decode_num_drafts"] > 0
    assert values[("dsv41:spec_decode_num_draft_tokens_total", ())] == stats["spec_decode_num_draft_tokens"]
    assert values[("dsv41:spec_decode_num_accepted_tokens_total", ())] == stats["spec_decode_num_accepted_tokens"]
    # every step speculates here (cost table "fixed"): the exported count of plain steps is the engine's 0
    assert values[("dsv41:spec_decode_num_plain_steps_total", ())] == stats["spec_decode_num_plain_steps"] == 0
    block = spec_server.llm.engine.config.dspark_block_size
    # cost table "fixed": every step verifies the whole block (fewer only where max_tokens leaves less room)
    assert values[("dsv41:spec_decode_verify_length_total", (("length", str(block)),))] > 0
    per_pos = [values[("dsv41:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(j)),))]
               for j in range(block)]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
