"""Speculative-decoding acceptance, read from vLLM's `vllm:spec_decode_*` counters.

vLLM publishes counters, not a rate. Between two readings:

- draft acceptance rate = Δaccepted / Δdraft_tokens (vLLM's own definition),
- mean tokens per step = 1 + Δaccepted / Δdrafts (the accepted run plus the bonus token),
- the per-token acceptance probability a of Leviathan et al., whose chain of k drafts yields
  E[tokens per step] = (1 - a^(k+1)) / (1 - a). Position i is tried only when positions
  0..i-1 were all accepted, so from the per-position counts the maximum-likelihood a is
  Σ accepted / Σ tried, with tried(0) = drafts and tried(i) = accepted(i-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecCounters:
    """A reading of a speculative replica's counters."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_pos: tuple[float, ...] = ()

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        return self._combined(earlier, -1.0)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        """The counts of two intervals together."""
        return self._combined(other, 1.0)

    def _combined(self, other: SpecCounters, sign: float) -> SpecCounters:
        positions = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + (0.0,) * (positions - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + (0.0,) * (positions - len(other.accepted_per_pos))
        return SpecCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted_tokens + sign * other.accepted_tokens,
            tuple(a + sign * b for a, b in zip(mine, theirs, strict=True)),
        )


@dataclass(frozen=True)
class Acceptance:
    draft_acceptance_rate: float
    """Accepted draft tokens over proposed draft tokens."""
    mean_tokens_per_step: float
    """Tokens a sequence emits per verification step, bonus token included."""
    per_token_alpha: float | None
    """Leviathan's per-token acceptance probability; None without per-position counts."""
    drafts: float


def _per_token_alpha(drafts: float, per_pos: Sequence[float]) -> float | None:
    if not per_pos or drafts <= 0:
        return None
    tried = drafts + sum(per_pos[:-1])
    return sum(per_pos) / tried if tried > 0 else None


def acceptance(delta: SpecCounters) -> Acceptance | None:
    """Acceptance over an interval; None when the interval saw no drafts (or a counter reset)."""
    if delta.drafts <= 0 or delta.draft_tokens <= 0 or delta.accepted_tokens < 0:
        return None
    return Acceptance(
        draft_acceptance_rate=delta.accepted_tokens / delta.draft_tokens,
        mean_tokens_per_step=1.0 + delta.accepted_tokens / delta.drafts,
        per_token_alpha=_per_token_alpha(delta.drafts, delta.accepted_per_pos),
        drafts=delta.drafts,
    )


def decode_steps(delta: SpecCounters, generated: float | None) -> float:
    """How many decode steps the sequences ran over an interval, given the tokens they generated in
    it (their first tokens, which the prompts' steps emit, left out): each step emits a token of its
    own and the drafts it accepted, so the generated tokens less the accepted ones. A proposer that
    drafts only where it finds a match (n-gram) also runs steps without drafts, which counting the
    drafts would miss (and so overrate its tokens per step). Without a generation count that adds
    up (every drafting step emits its own token besides those accepted): the drafts; none across a
    counter reset."""
    if generated is None or generated < delta.drafts + delta.accepted_tokens:
        return float(delta.drafts) if acceptance(delta) is not None else 0.0
    return generated - delta.accepted_tokens
