"""The DeepSeek-V4.1 chat format: prompt encoding, DSML tool calls, thinking, and parsing back to OpenAI.

``encode_messages`` renders a request as the prompt string (a port of the official encoder);
``parse_output`` turns a completion into an assistant message; ``StreamingParser`` does the same delta by
delta. No model logic and no HTTP here. Source: CHAT_FORMAT.md.
"""

from .encoding import effort_budget, encode_messages, render_messages
from .errors import ChatFormatError
from .images import ImageSource
from .parsing import ChoiceParser, assistant_message, merge_deltas, parse_output
from .streaming import StreamingParser
from .tokens import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    IMAGE,
    LATEST_REMINDER,
    SYSTEM,
    THINK_END,
    THINK_START,
    USER,
)

__all__ = [
    "ASSISTANT",
    "BOS",
    "DSML",
    "EOS",
    "IMAGE",
    "LATEST_REMINDER",
    "SYSTEM",
    "THINK_END",
    "THINK_START",
    "USER",
    "ChatFormatError",
    "ChoiceParser",
    "ImageSource",
    "StreamingParser",
    "assistant_message",
    "effort_budget",
    "encode_messages",
    "merge_deltas",
    "parse_output",
    "render_messages",
]
