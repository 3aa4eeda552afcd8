"""A six-turn agent conversation with the prefix cache evicted to disk between turns equals the no-cache run
(issue 6; SPEC.md §4.3). Lives with the server tests for their chat-capable tiny model and tokenizer."""

import json

import torch

from deepseek_v41.engine import LLM, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


def conversation_turns(llm, evict, turns=6):
    """Run the conversation, appending a tool call and its result after each reply; returns each reply's tokens
    and the cached tokens each turn reported."""
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "Look at the project and tell me what it does."}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    replies, cached = [], []
    for turn in range(turns):
        out = llm.chat(messages, params, tools=TOOLS)[0]
        replies.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/part{turn}.py"})}}
        messages += [{"role": "assistant", "content": f"Reading part {turn}.", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"call_{turn}",
                      "content": f"def part{turn}():\n    return {turn} * {turn + 1}\n"}]
        evict(llm)
    return replies, cached


def test_six_turn_agent_conversation_equals_the_no_cache_run(model_dir, tmp_path):
    def load(**args):
        llm = LLM(model_dir, dtype=torch.float64, max_model_len=4096, **args)
        return llm

    def to_disk(llm):
        if llm.engine.prefix_cache is not None:
            llm.engine.prefix_cache.drop_device_tier()

    cold, _ = conversation_turns(load(enable_prefix_caching=False), to_disk)
    warm, cached = conversation_turns(load(cache_dir=str(tmp_path), swa_pool_bytes=1 << 28, replay="exact"), to_disk)
    assert warm == cold
    assert all(c > 0 for c in cached[1:])  # every turn after the first reused the conversation so far
