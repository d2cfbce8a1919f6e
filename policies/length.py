"""Expected output length, learned online from the lengths the gateway sees.

Requests are grouped by model, prompt-size band and an optional request class; each group keeps a
smoothed mean of the completion tokens its finished requests produced. A client's hint
(`x-expected-output-tokens`) wins; a group not seen yet falls back to its band's prior, and the
estimate never exceeds the request's `max_tokens`.

The priors are the Azure LLM inference traces' mean outputs by prompt size (conversation and code
together): long prompts (code completion, retrieval) tend to produce short answers.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from specgate.policies.means import GroupMeans

BAND_EDGES = (256, 1024, 4096)
"""Prompt-size bands: under 256 tokens, 256-1023, 1024-4095, 4096 and more."""
PRIORS = (200, 200, 150, 60)
"""Cold-start expected output tokens per band."""
SMOOTHING = 0.05
MAX_GROUPS = 4096
"""Groups learned at most. `x-request-class` is the client's to choose: a client sending a new class
with every request must not grow the gateway's memory without end. Once this many are known, a
new group is not learned (its requests get their band's prior)."""


def band(prompt_tokens: int) -> int:
    return bisect.bisect_right(BAND_EDGES, prompt_tokens)


@dataclass
class LengthStats:
    """Mutable, owned by whoever routes (the gateway, the offline simulator); read by `expected`."""

    groups: GroupMeans[tuple[str, int, str]] = field(default_factory=lambda: GroupMeans(SMOOTHING, MAX_GROUPS))

    def observe(self, model: str, prompt_tokens: int, output_tokens: int, request_class: str = "") -> None:
        self.groups.observe((model, band(prompt_tokens), request_class), output_tokens)

    def expected(
        self,
        model: str,
        prompt_tokens: int,
        *,
        hint: int | None = None,
        max_tokens: int | None = None,
        request_class: str = "",
    ) -> int:
        if hint is not None:
            estimate = float(hint)
        else:
            b = band(prompt_tokens)
            estimate = self.groups.means.get((model, b, request_class), float(PRIORS[b]))
        if max_tokens is not None:
            estimate = min(estimate, max_tokens)
        return max(round(estimate), 1)
