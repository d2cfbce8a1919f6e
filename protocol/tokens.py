"""Prompt sizes estimated from text, the same way everywhere in specgate.

About four UTF-8 bytes per token, plus the few tokens a chat template adds per message and for
the reply; token-id prompts are counted as given. The gateway routes on this estimate and the
simulated replica charges prefill by it, so both see the same size for the same request.
"""

from __future__ import annotations

import math
from typing import Any

BYTES_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_PER_REPLY = 3


def text_tokens(text: str) -> int:
    """Estimated token count of a piece of text (0 for the empty string)."""
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN)


def content_text(content: Any) -> str:
    """The text of a chat message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def chat_prompt_tokens(messages: list[Any]) -> int:
    """Estimated prompt tokens of a chat request after its chat template is applied."""
    total = CHAT_TOKENS_PER_REPLY
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        total += CHAT_TOKENS_PER_MESSAGE + text_tokens(content_text(content))
    return total


def completion_prompt_tokens(prompt: str | list[int]) -> int:
    """Estimated prompt tokens of a completion prompt: a string, or token ids counted as given."""
    if isinstance(prompt, str):
        return max(text_tokens(prompt), 1)
    return len(prompt)


_COMPLETION_TOKENS = b'"completion_tokens":'


def completion_tokens(data: bytes) -> int | None:
    """The last `completion_tokens` in a response body or stream tail, found without parsing JSON."""
    at = data.rfind(_COMPLETION_TOKENS)
    if at < 0:
        return None
    digits = data[at + len(_COMPLETION_TOKENS) : at + len(_COMPLETION_TOKENS) + 24].lstrip()
    end = 0
    while end < len(digits) and 48 <= digits[end] <= 57:
        end += 1
    return int(digits[:end]) if end else None
