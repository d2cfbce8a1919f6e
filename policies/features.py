"""What a policy knows about the request it routes."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from specgate.calibration.modes import Pool
from specgate.validation import Milliseconds


class SloTargets(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request's latency targets: from its headers, else its class's defaults in the policy document."""

    ttft_ms: Milliseconds | None = None
    tpot_ms: Milliseconds | None = None


@dataclass(frozen=True)
class RequestFeatures:
    model: str
    stream: bool
    prompt_tokens: int
    """Estimated from the body's text (about four bytes a token) or counted from token ids."""
    max_tokens: int | None
    """The request's `max_tokens` / `max_completion_tokens`, if it set one."""
    expected_output_tokens: int | None
    """The output length expected: the client's hint (`x-expected-output-tokens`), or learned."""
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    forced_pool: Pool | None
    """`x-route-pool`, if the client asked for a pool."""
    priority: int
    sequence: int
    """The gateway's running request count: lets stateless policies rotate."""
    output_hinted: bool = False
    """Whether the client gave the output length (then it is known, not estimated)."""
    waited_ms: float = 0.0
    """How long the request has waited in the gateway's admission queue: spent of its TTFT target."""
    draft_speedup: float = 1.0
    """Its tokens per speculative step over the pool's mean, as learned for requests like it
    (`policies/drafts.py`): above 1 it accepts more drafts than most."""

    @property
    def remaining_ttft_ms(self) -> float | None:
        """What is left of the TTFT target after the wait; None without a target."""
        return None if self.slo_ttft_ms is None else self.slo_ttft_ms - self.waited_ms
