"""How much of a prompt repeats itself: what an n-gram proposer (vLLM's prompt lookup) can draft from.

An n-gram proposer drafts the tokens that followed the last few tokens where they occurred earlier
in the context: it drafts often, and its drafts are accepted often, when the text repeats (code
that is being copied or edited, documents quoted back, structured data). The statistic is the
share of the prompt's word trigrams that are repeats, over its last `MAX_WORDS` words (token ids
for a prompt given as ids): tens of microseconds whatever the prompt's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_WORDS = 512
"""The prompt's tail that is looked at: the work per request is bounded by it."""
BYTES_PER_WORD = 8
"""Generous for text (English averages about six with its space): the slice split holds the tail."""
TAIL_BYTES = MAX_WORDS * BYTES_PER_WORD


def repetition(units: Sequence[Any]) -> float:
    """The share of repeated trigrams among the last `MAX_WORDS` units (words or token ids): 0 when
    every trigram is new, towards 1 for text that is the same passage over and over."""
    tail = units[-MAX_WORDS:]
    grams = len(tail) - 2
    if grams < 2:
        return 0.0
    return 1.0 - len(set(zip(tail, tail[1:], tail[2:], strict=False))) / grams


def text_repetition(text: str) -> float:
    # Split only the end that can count: a multi-megabyte prompt is not split whole.
    return repetition(text[-TAIL_BYTES:].split())
