"""What the engine model reports: per-step outputs, finished requests and running totals.

Times are virtual seconds; token counts follow vLLM's counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from specgate.calibration.costs import Batch


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class TokenOutput:
    """What one request got out of one step."""

    request_id: str
    new_tokens: int
    first: bool
    finish_reason: FinishReason | None
    """Set on the request's last output."""


@dataclass(frozen=True)
class FinishedRequest:
    """Per-request timings of a finished request, in virtual seconds."""

    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None
    e2e: float
    queued: float
    prefill: float
    decode: float
    inference: float
    ttft: float | None
    tpot: float | None
    step: float | None = None
    """The median time between its outputs after the first: a typical engine step of its life."""


@dataclass(frozen=True)
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """One engine iteration: when it ran, what it computed, and what came out."""

    start: float
    end: float
    batch: Batch
    forward_ms: float
    draft_ms: float
    overhead_ms: float
    outputs: tuple[TokenOutput, ...]
    finished: tuple[FinishedRequest, ...]
    preempted: tuple[str, ...]
    prompt_tokens: int
    """Prompt tokens of requests that produced their first token in this step (vLLM's counter)."""
    generation_tokens: int
    ttfts: tuple[float, ...]
    inter_token_latencies: tuple[float, ...]
    spec: SpecStats
    num_running: int
    num_waiting: int
    kv_usage: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class EngineCounters:
    """Running totals since start, in the units of vLLM's counters."""

    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    first_tokens: int = 0
    """Requests that got their first token (vLLM's TTFT histogram counts them)."""
    steps: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
