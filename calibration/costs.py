"""Step-time models: how long one engine step takes on a given batch.

Two interchangeable models stand behind the `StepModel` protocol:

- `TableStepModel` interpolates measured operator tables (decode and verification step
  times at a few batch sizes and two context lengths, prefill time by prompt length) and
  adds the measured CPU overhead per step.
- `LinearStepModel` evaluates a fitted linear model
  `base + per_token x batched_tokens + per_kv x kv_tokens` plus a fixed per-step overhead, where a
  prompt token and a verified draft token may each have a cost of their own.

`DraftCost` prices the draft side of speculative decoding. All times are milliseconds.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol


@dataclass(frozen=True)
class Curve:
    """A piecewise-linear function through measured points, extended linearly past both ends."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or len(self.xs) < 2:
            raise ValueError("a curve needs at least two points and as many ys as xs")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:], strict=False)):
            raise ValueError("curve xs must be strictly increasing")

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        i = bisect.bisect_right(xs, x) - 1
        i = min(max(i, 0), len(xs) - 2)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def scaled(self, factor: float) -> Curve:
        return Curve(self.xs, tuple(y * factor for y in self.ys))


@dataclass(frozen=True)
class StepTable:
    """Step time by batch size, measured at a short and a long context."""

    batch_sizes: tuple[int, ...]
    short_context: int
    short_ms: tuple[float, ...]
    long_context: int
    long_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if not len(self.batch_sizes) == len(self.short_ms) == len(self.long_ms):
            raise ValueError("a step table needs one time per batch size in each row")
        if self.long_context <= self.short_context:
            raise ValueError("long_context must exceed short_context")

    @cached_property
    def _rows(self) -> tuple[Curve, Curve]:
        sizes = tuple(float(b) for b in self.batch_sizes)
        return Curve(sizes, self.short_ms), Curve(sizes, self.long_ms)

    def at(self, batch: float, context: float) -> float:
        """Interpolate linearly in batch size and in context; never below half the short-context time."""
        short_row, long_row = self._rows
        short, long = short_row(batch), long_row(batch)
        frac = (context - self.short_context) / (self.long_context - self.short_context)
        return max(short + (long - short) * frac, 0.5 * short)

    def scaled(self, factor: float) -> StepTable:
        return StepTable(
            self.batch_sizes,
            self.short_context,
            tuple(t * factor for t in self.short_ms),
            self.long_context,
            tuple(t * factor for t in self.long_ms),
        )


@dataclass(frozen=True)
class Batch:
    """What one engine step computes.

    decode_seqs sequences each verify `query_per_seq` tokens (1 for plain decoding, k+1 when
    verifying k draft tokens) against `mean_context` cached tokens; `prefill_tokens` prompt
    tokens from `prefill_seqs` sequences ride along as chunked prefill.
    """

    decode_seqs: int = 0
    query_per_seq: int = 1
    mean_context: float = 0.0
    prefill_tokens: int = 0
    prefill_seqs: int = 0

    @property
    def num_seqs(self) -> int:
        return self.decode_seqs + self.prefill_seqs


def prompt_pairs(batch: Batch) -> float:
    """Pairs of a prompt's tokens where the later attends to the earlier, summed over the step's
    prompts (taken as equal shares of its prompt tokens)."""
    seqs = max(batch.prefill_seqs, 1)
    return batch.prefill_tokens * batch.prefill_tokens / (2 * seqs)


class StepModel(Protocol):
    def forward_ms(self, batch: Batch) -> float:
        """GPU time of the target model's forward pass over the batch."""
        ...

    def overhead_ms(self, num_seqs: int) -> float:
        """CPU time per step (scheduling, input preparation, sampling)."""
        ...


@dataclass(frozen=True)
class Linear:
    """`intercept + slope x n`."""

    intercept: float
    slope: float

    def __call__(self, n: float) -> float:
        return self.intercept + self.slope * n


@dataclass(frozen=True)
class TableStepModel:
    """Step times interpolated from measured operator tables.

    A verification step of q tokens per sequence costs the decode step plus the extra
    compute the table measured for `verify_query` tokens, scaled by (q - 1) / (verify_query - 1).
    A step with both decode and prefill reads the weights once, so the weight-read time
    counted by both tables is subtracted once.
    """

    decode: StepTable
    verify: StepTable
    verify_query: int
    prefill: Curve
    weight_read_ms: float
    overhead: Linear

    def forward_ms(self, batch: Batch) -> float:
        decode_ms = 0.0
        if batch.decode_seqs:
            b, ctx = batch.decode_seqs, batch.mean_context
            decode_ms = self.decode.at(b, ctx)
            if batch.query_per_seq > 1:
                extra = max(self.verify.at(b, ctx) - decode_ms, 0.0)
                decode_ms += extra * (batch.query_per_seq - 1) / (self.verify_query - 1)
        prefill_ms = self.prefill(batch.prefill_tokens) if batch.prefill_tokens else 0.0
        if decode_ms and prefill_ms:
            return decode_ms + prefill_ms - min(self.weight_read_ms, decode_ms, prefill_ms)
        return decode_ms + prefill_ms

    def overhead_ms(self, num_seqs: int) -> float:
        return self.overhead(num_seqs)


@dataclass(frozen=True)
class LinearStepModel:
    """A fitted linear model of the forward pass plus a fixed per-step overhead."""

    base_ms: float
    per_token_us: float
    """A decoding sequence's token; every token when the two below are not given."""
    per_kv_token_ns: float
    step_overhead_ms: float
    per_prefill_token_us: float | None = None
    """A prompt token, when it costs differently (on a CPU, attention makes it dearer)."""
    per_verify_token_us: float | None = None
    """A draft token verified beside its sequence's own (k per speculative sequence), its
    drafting included: checked together, like a small prefill, they cost differently."""
    per_prompt_pair_ns: float = 0.0
    """A prompt token attending to an earlier one of its prompt: a prompt of p tokens costs this
    p²/2 times on top, attention's share that grows with the prompt (a CPU feels it from a few
    hundred tokens). The prompts of one step count as equal shares of its prompt tokens."""

    def forward_ms(self, batch: Batch) -> float:
        if not batch.num_seqs:
            return 0.0
        decoded = batch.decode_seqs
        verified = batch.decode_seqs * (batch.query_per_seq - 1)
        prefill = self.per_token_us if self.per_prefill_token_us is None else self.per_prefill_token_us
        verify = self.per_token_us if self.per_verify_token_us is None else self.per_verify_token_us
        us = self.per_token_us * decoded + verify * verified + prefill * batch.prefill_tokens
        kv_tokens = batch.decode_seqs * batch.mean_context + batch.prefill_tokens
        ms = self.base_ms + us / 1e3 + self.per_kv_token_ns * kv_tokens / 1e6
        if self.per_prompt_pair_ns and batch.prefill_tokens:
            ms += self.per_prompt_pair_ns * prompt_pairs(batch) / 1e6
        return ms

    def overhead_ms(self, num_seqs: int) -> float:
        return self.step_overhead_ms if num_seqs else 0.0


@dataclass(frozen=True)
class ScaledStepModel:
    """Another model's steps on other hardware: its decoding, its prompts' prefill and its CPU
    time per step each a given factor dearer (or cheaper)."""

    base: StepModel
    decode: float = 1.0
    prefill: float = 1.0
    fixed: float = 1.0
    """The CPU time per step."""

    def forward_ms(self, batch: Batch) -> float:
        decoding = Batch(batch.decode_seqs, batch.query_per_seq, batch.mean_context)
        decode_ms = self.base.forward_ms(decoding) if batch.decode_seqs else 0.0
        prefill_ms = self.base.forward_ms(batch) - decode_ms if batch.prefill_tokens else 0.0
        return self.decode * decode_ms + self.prefill * prefill_ms

    def overhead_ms(self, num_seqs: int) -> float:
        return self.fixed * self.base.overhead_ms(num_seqs)


@dataclass(frozen=True)
class DraftCost:
    """Time the proposer spends per engine step, and on the prompt of a new request.

    `step_ms` = step_fixed + k x (pass + pass_per_seq x B) + kv_tokens x (per_step_kv + k x per_pass_kv),
    where kv_tokens is the context summed over the B drafting sequences.
    """

    step_fixed_ms: float = 0.0
    pass_ms: float = 0.0
    pass_per_seq_us: float = 0.0
    per_step_kv_ns: float = 0.0
    per_pass_kv_ns: float = 0.0
    prefill_fixed_ms: float = 0.0
    prefill_per_token_us: float = 0.0

    def step_ms(self, k: int, seqs: int, kv_tokens: float) -> float:
        if not seqs:
            return 0.0
        passes = k * (self.pass_ms + self.pass_per_seq_us * seqs / 1e3)
        kv = kv_tokens * (self.per_step_kv_ns + k * self.per_pass_kv_ns) / 1e6
        return self.step_fixed_ms + passes + kv

    def prefill_ms(self, tokens: int) -> float:
        if not tokens:
            return 0.0
        return self.prefill_fixed_ms + self.prefill_per_token_us * tokens / 1e3

    def scaled(self, decode: float, prefill: float) -> DraftCost:
        """On other hardware: drafting `decode` times dearer, the draft's prefill `prefill` times."""
        return DraftCost(
            self.step_fixed_ms * decode, self.pass_ms * decode, self.pass_per_seq_us * decode,
            self.per_step_kv_ns * decode, self.per_pass_kv_ns * decode,
            self.prefill_fixed_ms * prefill, self.prefill_per_token_us * prefill,
        )  # fmt: skip
