"""What the simulated replica says and how long it talks.

Prompt sizes are estimated from the text the same way every time (about four UTF-8 bytes per
token, plus the chat template's few tokens per message), output text is drawn word by word
from a small vocabulary, and without `ignore_eos` the output length is drawn from a
log-normal fitted to the Azure LLM inference trace's conversation outputs (median 129,
mean 211 tokens), capped by `max_tokens`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

BYTES_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_PER_REPLY = 3

# Median 129 and mean 211 (the conversation trace's outputs) give sigma = sqrt(2 ln(211/129)).
OUTPUT_LOG_MEDIAN = math.log(129.0)
OUTPUT_LOG_SIGMA = math.sqrt(2.0 * math.log(211.0 / 129.0))

_WORDS = (
    " the", " of", " and", " to", " a", " in", " is", " that", " for", " it", " as", " with",
    " on", " be", " by", " this", " are", " from", " at", " or", " an", " which", " can",
    " model", " token", " batch", " request", " latency", " cache", " draft", " verify",
    " replica", " decode", " prefill", " queue", " step", " time", " load", " pool", " route",
)  # fmt: skip


def text_tokens(text: str) -> int:
    """Estimated token count of a piece of text (0 for the empty string)."""
    return math.ceil(len(text.encode("utf-8")) / BYTES_PER_TOKEN)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """Estimated prompt tokens of a chat request after its chat template is applied."""
    total = CHAT_TOKENS_PER_REPLY
    for message in messages:
        total += CHAT_TOKENS_PER_MESSAGE + text_tokens(_content_text(message.get("content")))
    return total


def completion_prompt_tokens(prompt: str | list[int]) -> int:
    """Estimated prompt tokens of a completion prompt: a string, or token ids counted as given."""
    if isinstance(prompt, str):
        return max(text_tokens(prompt), 1)
    return len(prompt)


def draw_output_length(rng: random.Random, max_tokens: int) -> int:
    """An output length as a model that stops on its own would produce, capped by max_tokens."""
    drawn = round(rng.lognormvariate(OUTPUT_LOG_MEDIAN, OUTPUT_LOG_SIGMA))
    return min(max(drawn, 1), max_tokens)


@dataclass
class Words:
    """The text of one response, produced a few tokens at a time."""

    rng: random.Random

    def take(self, n: int) -> str:
        return "".join(self.rng.choice(_WORDS) for _ in range(n))
