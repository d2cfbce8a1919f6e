"""What the simulated replica says and how long it talks.

Output text is drawn word by word from a small vocabulary. Without `ignore_eos` the output length
is drawn from a log-normal fitted to the Azure LLM inference trace's conversation outputs (median
129, mean 211 tokens), capped by `max_tokens`.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

# Median 129 and mean 211 (the conversation trace's outputs) give sigma = sqrt(2 ln(211/129)).
OUTPUT_LOG_MEDIAN = math.log(129.0)
OUTPUT_LOG_SIGMA = math.sqrt(2.0 * math.log(211.0 / 129.0))

_WORDS = (
    " the", " of", " and", " to", " a", " in", " is", " that", " for", " it", " as", " with",
    " on", " be", " by", " this", " are", " from", " at", " or", " an", " which", " can",
    " model", " token", " batch", " request", " latency", " cache", " draft", " verify",
    " replica", " decode", " prefill", " queue", " step", " time", " load", " pool", " route",
)  # fmt: skip


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


_WORD = re.compile(r"\s*\S+")


def count_words(text: str) -> int:
    """Tokens in `text` by the simulated tokenizer: one per word with its leading space, as the
    answers above are made."""
    return len(_WORD.findall(text))
