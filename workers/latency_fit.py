"""A pool's step costs, re-fitted online from the answers the gateway measures.

The latency model prices every prediction from the profile's step costs, and says how much of it
is each term (`policies/latency_model.py`): of the steps a request waits through before its first
token, and of one step of the batch it decodes in, how much is a step's fixed cost, how much the
decoding sequences and their contexts add, and how much prompt tokens add. What the replica
really does is that sum with each term scaled by what the profile got wrong, plus, before the
first token, a fixed time no engine step accounts for (the server's HTTP, tokenization,
scheduling) and a wait that grows with the batch already there: the model has a newcomer wait out
half the step in flight, but a server whose engine shares its CPU with its HTTP front, or one
that schedules a step ahead, keeps it waiting longer, by a number of that batch's steps that the
answers show. The scales are the least-squares fit of what the pool's recent answers timed of its
steps (`LatencyFit.observe`: the median gap between a stream's events, the TTFT of a request with
nothing queued ahead of it):

- in relative errors: each equation is divided by its prediction, so a 2 s TTFT and a 20 ms step
  weigh alike;
- recent ones: each answer weighs 1 - 1/window less than the next, so the fit follows a fleet that
  changes (a replica restarted with other flags, other traffic);
- bounded: a measurement over twice or under half its prediction counts as that bound (one request
  stuck behind a preemption cannot wreck the fit), and each scale stays within CORRECTION_RANGE;
- from the profile's shape: a prior as heavy as `prior_weight` answers holds the three scales
  together, and lightly at 1, and the overhead and the wait at 0, until the answers say
  otherwise; so terms the traffic cannot tell apart (every request alone on its replica: the
  fixed and the decode cost move together) keep the profile's split between them, at the level
  the answers show;
- from steady replicas only: nothing held back in them, room in their KV cache.

Each answer is fitted against the profile's own terms, not against a prediction already corrected:
what the fit said before cannot feed back into what it learns next.

What the steps so fitted still miss of the TTFT and TPOT the pool's requests see is kept as a
smoothed ratio per kind (`Scales.ttft_factor`, `tpot_factor`): the model's picture of a replica is
not the replica (a queue it does not time, a crowded KV cache), and that error is not the step
costs'. The TPOT factor scales a TPOT's decoding, not the stalls that arriving prompts' prefill
adds to it (`Priced.stalls_ms`, priced by the fitted prefill scale); it is fitted to the whole
TPOT, stalls and all. Both learn from every answer, the TPOT factor against the answer's decoding
re-priced at the batch it really decoded beside (the mean of the gateway's requests on its
replica over its life, as the step fit takes it): a batch other than the one the prediction took
(a storm that outlasted its forecast, a cold start) is the forecast's miss, which the factor
would carry into every later prediction, at whatever batch. Leaving such answers out instead
leaves out mostly those whose batch grew (a batch of one can grow tenfold, but shrink by one at
most) and biases the factor low. How far the TPOTs spread about their predictions as made is
kept too (`Scales.tpot_spread`): the replica's own noise and what the forecast of the batch and
of the arriving prompts missed (a storm that went on longer, or ended sooner, than it had
lasted), which the chance of meeting a TPOT target must allow for; so a request far inside its
target is sent however uncertain the forecast, and one at its edge is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specgate.workers.shared import FIT_TERMS, SharedFit
from specgate.workers.snapshot import CORRECTION_RANGE, WAIT_RANGE, Scales

Terms = tuple[float, float, float, float, float]
"""A prediction as the profile prices it, term by term: the fixed, decode and prefill parts of its
steps; 1 where the overhead before the first token adds to it (a TTFT), else 0; and, in a TTFT,
one step of the batch it finds there as the profile prices it (what each step more of waiting
adds), else 0."""
_PROFILE: Terms = (1.0, 1.0, 1.0, 0.0, 0.0)
"""The scales, overhead and wait that leave the profile as it is."""

WINDOW = 300.0
"""Over about how many recent answers a pool's step costs are fitted."""
PRIOR_WEIGHT = 20.0
"""As how many answers the profile's own step costs count."""
SMOOTHING = 0.05
"""Weight of the newest answer in the TTFT and TPOT factors that the fitted steps still miss."""
LEVEL_PRIOR_SHARE = 0.1
"""How firmly the prior holds the scales' common level at 1, against their shape."""
OVERHEAD_PRIOR_MS = 100.0
"""The prior holds the overhead at 0 as firmly as `prior_weight` answers of this many ms would."""
WAIT_PRIOR_STEPS = 10.0
"""And the wait, as firmly as `prior_weight` answers of this many steps would: loosely (a step is a
fraction of a TTFT, so each answer at load says little of it alone), but enough to hold it where
no answer has seen a batch."""
MAX_OVERHEAD_MS = 60_000.0
_MAX_RATIO = 2.0
MAX_STALL_SHARE = 0.2
QUIET_STALL_SHARE = 0.05
"""An answer whose replica was expected to take a prompt in at most this share of its steps:
its TPOT spreads by the replica's own noise, not by how many prompts happened to land."""
SPREAD_MIN_ANSWERS = 10.0
"""Quiet answers (by their decayed weight) before their spread is taken as the replica's."""
MAX_SPREAD = 0.5
_MAX_FACTOR_STEP = math.log(2.0)
"""One answer moves a factor as if it were at most twice or half its prediction: one request
stuck behind a preemption cannot wreck it."""


@dataclass(frozen=True)
class Priced:
    """A request's predicted TTFT and TPOT, and one engine step of the batch it joins, term by
    term, as the profile named `basis` prices them."""

    basis: str
    ttft: Terms
    tpot: Terms
    """Its TPOT's decoding: the steps of the batch it decodes in, over the tokens a step emits (what
    the prompts arriving meanwhile add is apart, `stalls_ms`)."""
    step: Terms
    """One step of the batch it decodes in (a speculative step's drafts and verification)."""
    in_flight: int = 0
    """The gateway's requests on the replica when it was predicted (this one not counted)."""
    per_sequence: float = 0.0
    """What one more sequence in the batch adds to the step's decode term."""
    queued: bool = False
    """Prompts were waiting for their first token there: its TTFT waits on their prefill, which
    the gateway counts but cannot time."""
    joining: float = 0.0
    """Requests it was expected to see join its replica's batch over its life beyond those that
    leave (a burst's), on average: what the prediction took the batch to grow by."""
    stalls_ms: float = 0.0
    """What prefilling the prompts arriving meanwhile adds to its TPOT, as predicted: `tpot`
    prices its decoding alone, which is all the TPOT factor scales."""
    stall_share: float = 0.0
    """The larger of the share of the replica's time the model expects arriving prompts' prefill
    to take and the share of its steps they ride in: past MAX_STALL_SHARE the median gap between
    events may be a step with some prefill, no longer a decode step."""

    def step_over(self, in_flight: float | None) -> Terms:
        """The step at the batch the request really decoded beside: `in_flight`, the mean of the
        gateway's requests on the replica over its life (this one counted), instead of the count
        when it was sent. Fitted against the batch at dispatch, a batch that grows or shrinks under
        a request would read as decode costs flatter than they are."""
        if in_flight is None:
            return self.step
        fixed, decode, prefill, overhead, wait = self.step
        return fixed, decode + (in_flight - 1 - self.in_flight) * self.per_sequence, prefill, overhead, wait

    def tpot_over(self, in_flight: float | None) -> Terms:
        """Its TPOT's decoding at the batch it really decoded beside (`in_flight`, as `step_over`
        takes it) instead of the one its prediction took (the batch it joined, grown by those
        expected to join it). A TPOT's terms are its step's over the tokens a step emits: the
        fixed term, the same at any batch, gives that ratio."""
        if in_flight is None or self.step[0] <= 0:
            return self.tpot
        fixed, decode, prefill, overhead, wait = self.tpot
        beyond = in_flight - (self.in_flight + 1 + self.joining)
        return fixed, max(decode + beyond * self.per_sequence * fixed / self.step[0], 0.0), prefill, overhead, wait


def predicted_ms(scales: Scales, terms: Terms) -> float:
    """What the fitted step costs say of a TTFT or TPOT given as its terms (before the factors)."""
    return scales.step_ms(terms[:3]) + scales.overhead_ms * terms[3] + scales.wait * terms[4]


@dataclass(frozen=True)
class FitReport:
    """What the fit says, for /metrics and /admin/fleet."""

    scales: Scales
    stderr: Terms
    """The standard error of each scale (and of the overhead, in ms, and the wait, in steps), from
    the recent residuals."""
    answers: int
    """Answers measured."""
    fitted: int
    """Of those, the answers of a steady replica, which the step costs are fitted from."""
    ttft_error: float | None
    """Root mean square of log(measured / predicted) over the recent TTFTs, each predicted with
    the fit as it stood when it was measured; None before any."""
    tpot_error: float | None


class LatencyFit:
    def __init__(
        self,
        window: float = WINDOW,
        prior_weight: float = PRIOR_WEIGHT,
        smoothing: float = SMOOTHING,
        *,
        learn: bool = True,
    ) -> None:
        self.learn = learn
        """False: answers only count in the prediction error; the scales stay the profile's."""
        self.basis: str | None = None
        """The profile whose terms the scales multiply: the first answer's, until `follow` says another."""
        self._keep = 1.0 - 1.0 / window
        self._smoothing = smoothing
        # The prior, as a quadratic penalty (θ - θ0)ᵀ R (θ - θ0): the three scales apart from their
        # mean (the profile's shape) weigh `prior_weight` answers, their common level
        # LEVEL_PRIOR_SHARE of that (a profile of other hardware is off in level before shape),
        # the overhead and the wait as set above.
        shape, level = prior_weight, prior_weight * LEVEL_PRIOR_SHARE
        self._prior = [[(shape * ((i == j) - 1 / 3) + level / 3) if i < 3 and j < 3 else 0.0 for j in range(FIT_TERMS)]
                       for i in range(FIT_TERMS)]  # fmt: skip
        self._prior[3][3] = prior_weight / OVERHEAD_PRIOR_MS**2
        self._prior[4][4] = prior_weight / WAIT_PRIOR_STEPS**2
        self._prior_weight = prior_weight
        self.shared: SharedFit | None = None
        """Where this gateway's other processes publish their fits of the same pool: their sums
        join this one's (`workers/shared.py`)."""
        self.siblings: list[LatencyFit] = []
        """The fits of the fleet's other pools: the same hardware and model, so what they learn of
        the profile is this one's prior (`center_on`)."""
        self._forget()

    def center_on(self, sibling: LatencyFit) -> None:
        """Center the prior on what `sibling`, the fit of another pool of the fleet, has learned,
        as far as its fitted answers bear it out (none: the profile; as many as the prior weighs:
        halfway): the replicas of both pools run the same model on the same hardware, so a
        profile of other hardware is off for both, and a pool the policy seldom chooses starts
        from what the other has shown instead of from a profile known to be off."""
        n = sibling.fitted
        share = n / (n + self._prior_weight)
        theirs = sibling.scales
        self._center(
            (
                1.0 + share * (theirs.fixed - 1.0),
                1.0 + share * (theirs.decode - 1.0),
                1.0 + share * (theirs.prefill - 1.0),
                share * theirs.overhead_ms,
                share * theirs.wait,
            )
        )
        self._solve()

    def _center(self, center: Terms) -> None:
        """Center the prior on `center` (scales, overhead and wait)."""
        self._at_prior = [sum(self._prior[i][j] * center[j] for j in range(FIT_TERMS)) for i in range(FIT_TERMS)]
        """R θ0, θ0 the prior's center."""

    def _forget(self) -> None:
        self._center(_PROFILE)  # the profile's own costs, until `center_on` says otherwise
        self._xx = [[0.0] * FIT_TERMS for _ in range(FIT_TERMS)]
        """Decayed sums over the answers of x xᵀ, x the relative terms."""
        self._xy = [0.0] * FIT_TERMS
        self._residual = (0.0, 0.0)
        """Decayed sum of the squared relative residuals of the fit, and of their weights."""
        self._errors: dict[str, tuple[float, float]] = {}
        self._quiet = (0.0, 0.0)
        """Decayed sums over quiet answers of half the squared change in the TPOT's log error from
        the quiet answer before, and of their weights."""
        self._last_quiet: float | None = None
        self.scales: Scales = Scales()
        self._factors_stamp = 0
        """The gateway's count of updates to the factors when this process last changed or took them."""
        self.answers = 0
        self.fitted: int = 0
        self._stderr: Terms = (0.0, 0.0, 0.0, 0.0, 0.0)

    def follow(self, basis: str) -> None:
        """Predictions are now priced by the profile `basis`: scales fitted against another one
        mean nothing for it, and are forgotten."""
        if basis != self.basis:
            if self.basis is not None:
                self._forget()
            self.basis = basis

    def observe(
        self,
        ttft_ms: float | None,
        tpot_ms: float | None,
        priced: Priced,
        in_flight: float | None = None,
        *,
        steady: bool = True,
        step_ms: float | None = None,
    ) -> None:
        """One answer: its measured TTFT and TPOT (None when not measured), its predictions term
        by term (ignored when priced by another profile than the one followed), the mean of the
        gateway's requests on its replica while it was there, whether the replica stayed steady
        meanwhile, and the median time between the events of its stream (one engine step each).

        The step costs are fitted from what times steps: the median gap between a stream's events
        (a stall by a prompt's prefill is an outlier there, not the median, while prompts take a
        small share of the replica's time) against one step of its batch, and the TTFT of a
        request that found no prompt queued ahead of it (its own prefill and part of a step).
        Only answers from a steady replica (nothing held back in it, room in its KV cache, then
        and throughout) count: past that, requests wait for memory, are preempted and swapped
        back, the model's batch is not the replica's, and the answer would teach the step costs
        the wrong lesson. Every answer counts in the prediction error and in the factors."""
        if self.basis is None:
            self.basis = priced.basis
        elif priced.basis != self.basis:
            return
        rows = []
        measured = {}
        self._take_factors()
        factors = {"ttft": self.scales.ttft_factor, "tpot": self.scales.tpot_factor}
        for kind, seen, terms in (("ttft", ttft_ms, priced.ttft), ("tpot", tpot_ms, priced.tpot)):
            predicted = predicted_ms(self.scales, terms)
            if seen is None or seen <= 0 or not math.isfinite(seen) or predicted <= 0:
                continue
            measured[kind] = seen
            log_error = math.log(seen / self._as_made(kind, priced, factors[kind]))
            self._error(kind, log_error)
            if kind == "tpot" and priced.stall_share <= QUIET_STALL_SHARE:
                self._quiet_error(log_error)
        if not measured:
            return
        self.answers += 1
        if not self.learn:
            return
        if steady:
            if "ttft" in measured and not priced.queued:
                rows.append((measured["ttft"], priced.ttft))
            if step_ms is not None and step_ms > 0 and math.isfinite(step_ms) and priced.stall_share <= MAX_STALL_SHARE:
                rows.append((step_ms, priced.step_over(in_flight)))
        if rows:
            self._fit(rows)
        # What the step costs, as now fitted, still miss of predictions as they are made (at the
        # batch when the request is sent): a smoothed ratio by kind, each answer moving it a
        # bounded step. The error it follows changes with the load, so every process of the
        # gateway moves the same factors, one answer after another (`SharedFit`).
        low, high = CORRECTION_RANGE
        # A TPOT over a batch that was not the one priced is partly the forecast's miss (a storm
        # that lasted longer than it had, or ended sooner), which the spread takes up: the factor,
        # which multiplies every prediction after it, whatever the batch, learns the answer
        # against its decoding at the batch it decoded beside.
        for kind, seen in measured.items():
            predicted = self._as_made(kind, priced, factors[kind], in_flight)
            step = max(-_MAX_FACTOR_STEP, min(_MAX_FACTOR_STEP, math.log(seen / predicted)))
            factors[kind] = min(max(factors[kind] * math.exp(self._smoothing * step), low), high)
        self.scales = replace(
            self.scales, ttft_factor=factors["ttft"], tpot_factor=factors["tpot"], tpot_spread=self._spread()
        )
        self._factors_stamp += 1
        if self.shared is not None and self.basis is not None:
            self.shared.publish_factors(self.basis, factors["ttft"], factors["tpot"], self._factors_stamp)

    def _as_made(self, kind: str, priced: Priced, factor: float, in_flight: float | None = None) -> float:
        """A TTFT or TPOT as the fitted steps now price it and `factor` corrects it: all of a
        TTFT; of a TPOT, its decoding (at the batch it decoded beside, given `in_flight`), and
        its stalls as predicted."""
        if kind == "ttft":
            return predicted_ms(self.scales, priced.ttft) * factor
        return predicted_ms(self.scales, priced.tpot_over(in_flight)) * factor + priced.stalls_ms

    def _fit(self, measured: list[tuple[float, Terms]]) -> None:
        """Fit the answer's equations: each relative to its prediction, the measurement bounded."""
        rows = []
        for seen, terms in measured:
            predicted = predicted_ms(self.scales, terms)
            if predicted > 0:
                bounded = min(max(seen, predicted / _MAX_RATIO), predicted * _MAX_RATIO)
                rows.append(([t / predicted for t in terms], bounded / predicted))
        if not rows:
            return
        keep = self._keep
        for i in range(FIT_TERMS):
            self._xy[i] *= keep
            for j in range(FIT_TERMS):
                self._xx[i][j] *= keep
        for x, y in rows:
            for i in range(FIT_TERMS):
                self._xy[i] += x[i] * y
                for j in range(FIT_TERMS):
                    self._xx[i][j] += x[i] * x[j]
        self.fitted += 1
        if self.shared is not None and self.basis is not None:
            self.shared.publish(self.basis, self.fitted, self._xx, self._xy)
        self._solve(rows)
        for sibling in self.siblings:
            sibling.center_on(self)

    def _error(self, kind: str, log_ratio: float) -> None:
        total, weight = self._errors.get(kind, (0.0, 0.0))
        self._errors[kind] = (total * self._keep + log_ratio * log_ratio, weight * self._keep + 1.0)

    def _quiet_error(self, log_ratio: float) -> None:
        last, self._last_quiet = self._last_quiet, log_ratio
        if last is not None:
            total, weight = self._quiet
            self._quiet = (total * self._keep + (log_ratio - last) ** 2 / 2, weight * self._keep + 1.0)

    def _spread(self) -> float:
        """How far TPOTs spread about their predictions: the root mean square of the TPOT log
        error of predictions as made (the traffic's forecast missed, as well as the replica's
        noise), and at least the standard deviation of the quiet answers' log error, from how it
        changes from one answer to the next (the noise of independent answers, not the drift of a
        prediction still converging, which the TPOT factor takes up)."""
        total, weight = self._quiet
        quiet = math.sqrt(total / weight) if weight >= SPREAD_MIN_ANSWERS else 0.0
        made = self._rms("tpot", SPREAD_MIN_ANSWERS) or 0.0
        return min(max(quiet, made), MAX_SPREAD)

    def _rms(self, kind: str, min_weight: float = 0.0) -> float | None:
        """The root mean square of the recent log errors of `kind`'s predictions as made; None
        before answers weighing more than nothing (and at least `min_weight`)."""
        total, weight = self._errors.get(kind, (0.0, 0.0))
        return math.sqrt(total / weight) if weight > 0 and weight >= min_weight else None

    def _solve(self, rows: Sequence[tuple[list[float], float]] = ()) -> None:
        """The scales from the answers so far and the prior; `rows`, the newest answer's
        equations, join the residuals the standard errors rest on."""
        n = FIT_TERMS
        a = [[self._xx[i][j] + self._prior[i][j] for j in range(n)] for i in range(n)]
        b = [self._xy[i] + self._at_prior[i] for i in range(n)]
        if self.shared is not None and self.basis is not None:  # the other processes' answers too
            _, xx, xy = self.shared.summed(self.basis)
            a = [[a[i][j] + xx[i][j] for j in range(n)] for i in range(n)]
            b = [b[i] + xy[i] for i in range(n)]
        inverse = _inverse(a)
        if inverse is None:
            return
        theta = [sum(inverse[i][j] * b[j] for j in range(n)) for i in range(n)]
        low, high = CORRECTION_RANGE
        self.scales = replace(
            self.scales,
            fixed=min(max(theta[0], low), high),
            decode=min(max(theta[1], low), high),
            prefill=min(max(theta[2], low), high),
            overhead_ms=min(max(theta[3], 0.0), MAX_OVERHEAD_MS),
            wait=min(max(theta[4], WAIT_RANGE[0]), WAIT_RANGE[1]),
        )
        total, weight = self._residual
        for x, y in rows:
            r = y - sum(x[i] * theta[i] for i in range(n))
            total, weight = total * self._keep + r * r, weight * self._keep + 1.0
        self._residual = (total, weight)
        variance = total / weight if weight > 0 else 0.0
        e = [math.sqrt(variance * inverse[i][i]) for i in range(n)]
        self._stderr = (e[0], e[1], e[2], e[3], e[4])

    def refresh(self) -> None:
        """Take up what the other processes have fitted since this one last did."""
        if self.shared is not None and self.learn:
            self._solve()
            self._take_factors()

    def _take_factors(self) -> None:
        """The factors as another process last changed them, if it did after this one."""
        if self.shared is None or self.basis is None:
            return
        latest = self.shared.latest_factors(self.basis)
        if latest is not None and latest[2] > self._factors_stamp:
            ttft, tpot, self._factors_stamp = latest
            self.scales = replace(self.scales, ttft_factor=ttft, tpot_factor=tpot)

    def report(self) -> FitReport:
        return FitReport(self.scales, self._stderr, self.answers, self.fitted, self._rms("ttft"), self._rms("tpot"))


def _inverse(a: list[list[float]]) -> list[list[float]] | None:
    """The inverse of a small symmetric positive definite matrix (Gauss-Jordan, partial pivoting);
    None if it is singular."""
    n = len(a)
    m = [row[:] + [1.0 if i == j else 0.0 for j in range(n)] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        p = m[col][col]
        m[col] = [v / p for v in m[col]]
        for r in range(n):
            if r != col and m[r][col] != 0.0:
                f = m[r][col]
                m[r] = [v - f * w for v, w in zip(m[r], m[col], strict=True)]
    return [row[n:] for row in m]
