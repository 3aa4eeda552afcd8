"""The one error the chat package raises for a request it cannot encode."""

from __future__ import annotations


class ChatFormatError(ValueError):
    """A request the DeepSeek-V4.1 encoder cannot render faithfully (a server answers it with a 400).

    The message names the offending field (``messages[2].tool_calls[0].function.name``), what was wrong
    and what is allowed; ``where`` holds the field path alone.
    """

    def __init__(self, where: str, message: str):
        self.where = where
        super().__init__(f"{where}: {message}")
