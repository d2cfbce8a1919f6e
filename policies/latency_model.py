"""Per-replica latency predictions: the calibrated profile, corrected by what the gateway observes.

For the replica a request would join, with B requests already there (of which it runs all, or,
while it holds requests back in its queue, those it runs but one: a newcomer takes the place of
one that ends):

- TTFT: half a step (the step in flight when the request arrives), and as many more of them as
  the pool's answers show its replicas keep a newcomer waiting (`Scales.wait`), plus the steps
  that prefill the prompt tokens queued ahead of it and its own, in chunks of what the token
  budget leaves beside B decodes; a speculative replica also runs the draft's prefill and its
  first k draft passes.
- TPOT: the step time at batch B + 1 at the batch's mean context (from the scraped KV usage when
  there is one, else this request's prompt plus half its expected output); in a burst, at the
  batch growing by the requests arriving beyond the rate before it (which the answers ending kept
  up with) for about as long again as it has lasted, averaged over the request's life, up to what
  the replica runs at once (`max_num_seqs`, or its KV cache at that context); a speculative replica
  divides its draft-and-verify step by the tokens per step it was last seen to emit (the profile's
  mean until scraped), times what requests like this one get over that mean (`policies/drafts.py`).
  Chunked prefill of the prompts still arriving rides along and slows those steps: at a rate of
  prompt tokens, that prefill takes a share f of the time, and the tokens come 1 / (1 - f) times
  further apart, up to the TPOT of steps that each carry a whole chunk (the token budget less the
  batch's decodes): however many prompts arrive, a step prefills no more and still emits its
  tokens (on a speculative replica, several). The rate is the replica's steady one; in a burst,
  the burst's for about as long again as it has lasted (counted from the request's arrival), then
  the one from before it: a storm of a few seconds adds its stalls to an answer's life once, it
  does not slow every step of a life that its stalls lengthen. The TPOT factor scales the
  decoding alone; a stall is the prompt's prefill, which the prefill scale prices (fitted to
  TTFTs, where prefill is timed directly). A factor fitted to whole TPOTs follows the many answers
  that no stall hit where stalls are rare and large (short answers, long prompts): scaling the
  stalls too, it priced each at a fraction of its cost, and a request that one stall would break
  at a chance far above the share of answers none hits.
- Harm: what joining costs the B requests already there: the steps that prefill this prompt stall
  all of them, and every later step is slower by the rise in step time from B to B + 1, for as
  many steps as this request stays; summed over the B requests.
- Crowding: the SLOs of those B requests its joining is expected to cost (`crowding_loss`), each
  taken to be like it: what its slower steps over half of their remaining lives, and its prefill's
  one stall, take from their chance of meeting its TPOT target.

Each step is priced as the profile's fixed, decode and prefill parts, each scaled by what the
pool's measured answers show (`workers/latency_fit.py`), and TTFT adds the time before the first
token that no step accounts for: a profile that is off, even in its shape, converges to what the
replica really does. TTFT and TPOT are then multiplied by what the fitted steps still miss on the
pool's answers. The prediction carries its terms, for the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

from specgate.calibration.costs import Batch
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import Profile
from specgate.policies.features import RequestFeatures
from specgate.policies.length import PRIORS, band
from specgate.workers.latency_fit import Priced
from specgate.workers.snapshot import ReplicaState, Scales

Vector = tuple[float, float, float]
"""Steps priced by the profile, as their fixed, decode and prefill parts."""
_NONE: Vector = (0.0, 0.0, 0.0)


def _sum(a: Vector, b: Vector) -> Vector:
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def _scaled(a: Vector, factor: float) -> Vector:
    return a[0] * factor, a[1] * factor, a[2] * factor


STEP_SPREAD = 0.03
"""Relative spread of a request's stall-free TPOT that the batch and contexts alone cause."""
OVERLAP = 0.5
"""Of a decoding request's life, the share still ahead of it when another joins its batch, on
average: the part of its TPOT that the newcomer's slower steps weigh on."""
OUTPUT_SPREAD = 1.0
"""Spread (log-normal sigma) of an output length that is estimated, not given by the client: the
Azure traces' lengths spread about so around their mean for a prompt size (0.99 conversation, 1.24
code, from their means and medians)."""
# Gauss-Hermite nodes and weights for an expectation over a standard normal, three points.
_NORMAL_NODES = ((0.0, 2 / 3), (math.sqrt(3), 1 / 6), (-math.sqrt(3), 1 / 6))
CONTEXT_QUANTUM = 32
MEMO_SIZE = 65536


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float
    terms: Priced
    """TTFT and TPOT as the profile prices them, term by term (`workers/latency_fit.py`)."""
    harm_ms: float = 0.0
    """Extra time this request would impose on the requests already on the replica, summed."""
    decode_tpot_ms: float = 0.0
    """TPOT without prefill stalls: the step time at the joined batch over tokens per step."""
    stall_ms: float = 0.0
    """How long one arriving prompt stalls the replica's decoding (the mean prompt arriving there)."""
    stalls: float = 0.0
    """How many prompts are expected to stall this request between its arrival and its end."""
    spread: float = 0.0
    """Relative spread (standard deviation) of the stall-free TPOT from request to request: on a
    speculative replica, requests accept the drafts at different rates; and however the model
    prices it, at least as much as the pool's quiet answers are seen to spread (`Scales.tpot_spread`)."""
    stalls_per_s: float = 0.0
    """How often prompts arrive at the replica and stall its decoding."""
    chunk_stall_ms: float = 0.0
    """The most that prefill can stall one of its steps: a step carries at most a chunk of the
    prompts arriving (the token budget less the batch's decodes) and still emits its tokens, so
    however many prompts arrive, its decoding is slowed by at most this a step."""
    tokens_per_step: float = 1.0
    """The tokens each of its steps emits on average (its own acceptance's, on a speculative replica)."""
    step_cv: float = 0.0
    """How those tokens spread from step to step (standard deviation over mean): a speculative
    step emits its accepted drafts and one more, so a short answer may take a step or two more
    than its mean, or fewer; 0 on a plain replica, whose steps emit one token each."""
    output_spread: float = 0.0
    """Log-normal sigma of the output length around `output_tokens` (0 when the client gave it)."""
    max_output_tokens: int | None = None
    output_tokens: int = 1
    """The output length the prediction assumed."""
    batch: int = 0
    """The requests it would decode beside."""
    crowding_ms: float = 0.0
    """What its joining adds to the stall-free TPOT of each of them while it stays."""

    def completion_ms(self, output_tokens: int) -> float:
        return self.ttft_ms + max(output_tokens - 1, 0) * self.tpot_ms


@dataclass(frozen=True)
class LatencyModel:
    profile: Profile
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    _memo: dict[tuple[Pool, int, int, int], float] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    """Step times already priced: a pure function's results, kept to save the arithmetic."""
    _terms_memo: dict[tuple[Pool, int, int, int], Vector] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def expected_output(self, features: RequestFeatures) -> int:
        if features.expected_output_tokens is not None:
            expected = features.expected_output_tokens
        else:
            expected = PRIORS[band(features.prompt_tokens)]
        if features.max_tokens is not None:
            expected = min(expected, features.max_tokens)
        return max(expected, 1)

    def step_ms(self, pool: Pool, decode_seqs: int, context: float, prefill_tokens: int = 0) -> float:
        """One engine step of `decode_seqs` sequences at `context` tokens, with `prefill_tokens` of
        prompt riding along, as the profile prices it (drafts included on a speculative replica)."""
        # Contexts and prompts within a few tokens cost the same to a fraction of a percent: round
        # them so that the same few steps are priced once, not for every request and every replica.
        chunk = -(-prefill_tokens // CONTEXT_QUANTUM)  # prefill in quanta too, rounded up
        key = (pool, decode_seqs, round(context / CONTEXT_QUANTUM), chunk)
        ms = self._memo.get(key)
        if ms is None:
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            ms = self._memo[key] = self._priced_step(
                pool, decode_seqs, key[2] * CONTEXT_QUANTUM, chunk * CONTEXT_QUANTUM
            )
        return ms

    def _priced_step(self, pool: Pool, decode_seqs: int, context: float, prefill_tokens: int) -> float:
        """One engine step: target forward, CPU overhead and, when speculating, the drafts."""
        steps, spec = self.profile.steps, self.profile.spec
        speculative = pool is Pool.SPECULATIVE
        k = spec.num_speculative_tokens if speculative else 0
        batch = Batch(
            decode_seqs=decode_seqs,
            query_per_seq=1 + k,
            mean_context=context,
            prefill_tokens=prefill_tokens,
            prefill_seqs=1 if prefill_tokens else 0,
        )
        ms = steps.forward_ms(batch) + steps.overhead_ms(batch.num_seqs)
        if speculative:
            drafting = decode_seqs + (1 if prefill_tokens else 0)
            ms += spec.draft.step_ms(k, drafting, drafting * context) + spec.draft.prefill_ms(prefill_tokens)
        return ms

    def _mean_context(self, replica: ReplicaState, batch: int, fallback: float) -> float:
        """A decoding sequence's mean context: the KV cache's tokens, as last scraped, over the
        sequences that held them then (not over the batch now, which counts the requests sent
        since: in a ramp, that priced every step at a fraction of its context)."""
        if replica.kv_usage is None or not batch:
            return fallback
        holders = max(replica.running, 1.0) if replica.running else batch
        return max(replica.kv_usage * self._kv_capacity(replica.pool) / holders, 1.0)

    def _kv_capacity(self, pool: Pool) -> int:
        """The tokens a replica of `pool` holds in its KV cache, as the profile has it."""
        return self.profile.spec.kv_capacity_tokens if pool is Pool.SPECULATIVE else self.profile.kv_capacity_tokens

    def _terms(self, pool: Pool, decode_seqs: int, context: float, prefill_tokens: int = 0) -> Vector:
        """One step as the profile prices it, split into its fixed part (a step of one sequence at
        no context), what its decoding sequences and their contexts add, and what its prompt
        tokens add: the terms the fleet's answers scale (`workers/latency_fit.py`). Kept by the
        same rounded key as `step_ms`: a prediction needs five, for every request and replica."""
        key = (pool, decode_seqs, round(context / CONTEXT_QUANTUM), -(-prefill_tokens // CONTEXT_QUANTUM))
        terms = self._terms_memo.get(key)
        if terms is None:
            fixed = self.step_ms(pool, 1, 0)
            decode = self.step_ms(pool, decode_seqs, context)
            full = self.step_ms(pool, decode_seqs, context, prefill_tokens) if prefill_tokens else decode
            # A step with no sequence decoding (a prompt alone) costs less than the fixed step of
            # one: its fixed part is all it costs, so that no part is negative (a scaled negative
            # part would price a step, and a TTFT, below nothing).
            fixed = min(fixed, decode)
            if len(self._terms_memo) >= MEMO_SIZE:
                self._terms_memo.clear()
            terms = self._terms_memo[key] = (fixed, decode - fixed, full - decode)
        return terms

    def fitted_step_ms(
        self, pool: Pool, scales: Scales, decode_seqs: int, context: float, prefill_tokens: int = 0
    ) -> float:
        """One engine step at the pool's fitted `scales` of the profile's costs."""
        return scales.step_ms(self._terms(pool, decode_seqs, context, prefill_tokens))

    def predict(self, replica: ReplicaState, features: RequestFeatures) -> Prediction:
        pool = replica.pool
        scales = replica.scales
        prompt = max(features.prompt_tokens, 1)
        output = self.expected_output(features)
        batch = min(max(round(replica.load), 0), self.max_num_seqs - 1)
        # A replica holding requests back decodes only those it runs: a newcomer's steps are those
        # of its running batch (it takes the place of one that ends there), however long its queue.
        running = batch
        if replica.waiting and replica.holding and replica.running is not None:
            running = min(batch, max(round(replica.running) - 1, 0))
        context = self._mean_context(replica, running, prompt + output / 2)
        k = self.profile.spec.num_speculative_tokens if pool is Pool.SPECULATIVE else 0

        decode = self._terms(pool, running, context) if running else _NONE
        decode_ms = scales.step_ms(decode)
        chunk = max(self.max_num_batched_tokens - running * (1 + k), 1)

        def prefill(tokens: int) -> Vector:
            full_steps, last = divmod(tokens, chunk)
            terms = _scaled(self._terms(pool, running, context, chunk), full_steps) if full_steps else _NONE
            return _sum(terms, self._terms(pool, running, context, last)) if last else terms

        ttft_terms = _sum(_scaled(decode, 0.5), prefill(max(replica.prefill_tokens, 0) + prompt))
        waits = decode[0] + decode[1]  # each step more that the replica keeps a newcomer waiting
        ttft_ms = (scales.step_ms(ttft_terms) + scales.overhead_ms + scales.wait * waits) * scales.ttft_factor

        if pool is Pool.SPECULATIVE:
            pool_mean = replica.tokens_per_step or self.profile.spec.expected_tokens_per_step()
            tokens_per_step = max(pool_mean * features.draft_speedup, 1.0)  # this request's own acceptance
        else:
            tokens_per_step = 1.0
        factor = scales.tpot_factor
        gaps = max(output - 1, 1)
        joined = self._terms(pool, running + 1, context)
        joined_ms = scales.step_ms(joined)
        # What prefilling one prompt token costs the decoding batch, as the profile prices it: the
        # rate of prompts is measured in real time, and the prefill scale brings it there. (The
        # price of a whole quantum of prompt over its tokens: over the prompt's own few tokens, a
        # 2-token prompt priced each token arriving at 16 times its cost.)
        quanta = -(-prompt // CONTEXT_QUANTUM) * CONTEXT_QUANTUM
        per_token_ms = max(self._terms(pool, running + 1, context, quanta)[2], 0.0) / quanta
        decode_tpot = joined_ms / tokens_per_step * factor
        lives = joined  # the batch it decodes in, over its life: the one it joins, but in a burst
        joining = 0.0
        burst = replica.burst
        if burst is not None and burst.arrivals_per_s > burst.arrivals_before_per_s:
            # The requests arriving beyond the rate before the burst (which the replica's answers
            # ending kept up with) stay in its batch: it grows while the burst lasts, for about as
            # long again as it has (from the request's arrival), up to what the engine runs at once.
            life_ms = ttft_ms + decode_tpot * gaps
            in_burst_ms = min(max(burst.lasted_s * 1e3 - ttft_ms, 0.0), life_ms)
            grown_ms = in_burst_ms - in_burst_ms * in_burst_ms / (2 * life_ms)  # its mean over the life
            growth = (burst.arrivals_per_s - burst.arrivals_before_per_s) * grown_ms / 1e3
            most = max(min(self.max_num_seqs, self._kv_capacity(pool) / max(context, 1.0)), running + 1)
            batch_over_life = round(min(running + 1 + growth, most))
            if batch_over_life > running + 1:
                joining = batch_over_life - running - 1
                lives = self._terms(pool, batch_over_life, context)
                decode_tpot = scales.step_ms(lives) / tokens_per_step * factor
        # Prompts arriving while this request waits for its first token, and while it decodes,
        # each stall its decoding once (`stall_per_token`: one prompt token's prefill, in ms, as
        # the fitted prefill scale prices it; the TPOT factor does not scale a stall).
        stall_per_token = per_token_ms * scales.prefill
        _, waiting_tokens_per_s = replica.prompt_rates(ttft_ms / 1e3)
        queued_stalls = waiting_tokens_per_s * ttft_ms / 1e3 * per_token_ms / gaps  # times the prefill scale
        # However many prompts arrive, a step carries at most a chunk of them beside its decodes
        # (the token budget less theirs) and still emits its tokens: TPOT is at most every step so.
        joined_chunk = max(self.max_num_batched_tokens - (running + 1) * (1 + k), 1)
        chunk_stall_ms = max(self._terms(pool, running + 1, context, joined_chunk)[2], 0.0) * scales.prefill
        unstalled = decode_tpot + queued_stalls * scales.prefill
        every_step_stalled = decode_tpot + chunk_stall_ms / tokens_per_step

        def paced(tokens_per_s: float) -> float:
            """TPOT while prompts arrive at this rate: prefilling them takes a share of the time,
            and the tokens come that much further apart (at most every step stalled)."""
            share = tokens_per_s * stall_per_token / 1e3
            return min(unstalled / (1.0 - share) if share < 1.0 else math.inf, every_step_stalled)

        # The tokens come at the steady rate's pace or, while a burst lasts, at its pace: for about
        # as long again as it has lasted, counted from the request's arrival, and then at the pace
        # of the rate from before it. A burst of bounded length adds its stalls to the answer's
        # life once; it does not slow every step of a life that its stalls lengthen (which would
        # price a storm of a few seconds as one for good).
        life_ms = paced(replica.prefill_tokens_after_burst_per_s()) * gaps
        if replica.burst is not None:
            during = paced(replica.burst.prefill_tokens_per_s)
            in_burst = min(max(replica.burst.lasted_s * 1e3 - ttft_ms, 0.0) / during, gaps)
            life_ms += in_burst * (during - life_ms / gaps)
        tpot = life_ms / gaps
        # The prompts expected over that life, one stall each, at the rates they are expected at.
        rate, tokens_per_s = replica.prompt_rates((ttft_ms + life_ms) / 1e3)
        arriving = tokens_per_s / rate if rate > 0 else prompt
        share = rate * arriving * stall_per_token / 1e3
        stall_ms = arriving * stall_per_token
        next_batch = min(running + 2, self.max_num_seqs)
        per_sequence = self._terms(pool, next_batch, context)[1] - joined[1]
        stalls = rate * (ttft_ms + life_ms) / 1e3
        stay_steps = math.ceil(output / tokens_per_step)
        # what this prompt does to the others
        stall = scales.step_ms(prefill(prompt)) - decode_ms * math.ceil(prompt / chunk)
        harm = batch * (max(stall, 0.0) + max(joined_ms - decode_ms, 0.0) * stay_steps) * factor if batch else 0.0
        priced = Priced(
            self.profile.name, (*ttft_terms, 1.0, waits), (*_scaled(lives, 1 / tokens_per_step), 0.0, 0.0),
            (*joined, 0.0, 0.0), replica.in_flight, per_sequence, queued=replica.prefill_tokens > 0, joining=joining,
            stalls_ms=max(tpot - decode_tpot, 0.0),
            stall_share=max(share, rate * joined_ms / 1e3),
        )  # fmt: skip
        return Prediction(
            ttft_ms=ttft_ms,
            tpot_ms=tpot,
            harm_ms=harm,
            decode_tpot_ms=decode_tpot,
            stall_ms=stall_ms,
            stalls=stalls,
            spread=max(self._spec_spread if pool is Pool.SPECULATIVE else STEP_SPREAD, scales.tpot_spread),
            stalls_per_s=rate,
            chunk_stall_ms=chunk_stall_ms,
            tokens_per_step=tokens_per_step,
            step_cv=self._step_cv if pool is Pool.SPECULATIVE else 0.0,
            output_spread=0.0 if features.output_hinted else OUTPUT_SPREAD,
            max_output_tokens=features.max_tokens,
            output_tokens=output,
            terms=priced,
            batch=running,
            crowding_ms=max(joined_ms - decode_ms, 0.0) / tokens_per_step * factor,
        )

    @cached_property
    def _spec_spread(self) -> float:
        """Relative spread of a speculative request's stall-free TPOT: its acceptance, one standard
        deviation either side of the profile's mean (requests draw theirs from a Beta around it),
        moves its tokens per step; with the batch's own spread on top."""
        spec = self.profile.spec
        mean, c = spec.acceptance_mean, spec.acceptance_concentration
        sd = math.sqrt(mean * (1 - mean) / (c + 1)) if c > 0 else 0.0
        low, high = max(mean - sd, 0.0), min(mean + sd, 0.999)
        steps = spec.expected_tokens_per_step
        acceptance = (steps(high) - steps(low)) / 2 / steps(mean)
        return math.hypot(acceptance, STEP_SPREAD)

    @cached_property
    def _step_cv(self) -> float:
        """Relative spread of the tokens a speculative step emits: its k drafts accepted in a run,
        each with the profile's mean acceptance, and one token more."""
        spec = self.profile.spec
        a, k = spec.acceptance_mean, spec.num_speculative_tokens
        emitted = [(j, a ** (j - 1) * (1 - a)) for j in range(1, k + 1)] + [(k + 1, a**k)]
        mean = spec.expected_tokens_per_step()
        return math.sqrt(max(sum(j * j * p for j, p in emitted) - mean * mean, 0.0)) / mean

    def tpot_met_probability(self, prediction: Prediction, slo_tpot_ms: float) -> float:
        """The chance this request's TPOT stays within `slo_tpot_ms`.

        The stalls come one prompt at a time: over a short answer, one more or one fewer moves its
        TPOT far from the mean. They are counted as a Poisson number of prompts arriving while it
        waits for its first token (those queue behind it and are prefilled as it starts decoding)
        and while it decodes; the answer meets its TPOT if at most k of them land, with k what the
        target leaves room for above the stall-free TPOT, averaged over how that TPOT spreads from
        request to request (and, on a speculative replica, from step to step: a short answer's few
        steps do not average their tokens out). However many land, a step carries at most a chunk
        of prefill beside its decodes: an answer that meets the target with every one of its steps
        so stalled meets it for sure.
        """
        chance = 0.0
        for output, output_weight in self._outputs(prediction):
            gaps = max(output - 1, 1)
            # Stalls over this length of answer: the rate over its life (at the mean stall count
            # when the length is the expected one).
            if output == prediction.output_tokens:
                stalls = prediction.stalls
            else:
                stalls = prediction.stalls_per_s * (prediction.ttft_ms + prediction.tpot_ms * gaps) / 1e3
            # The steps it takes: a speculative step's tokens vary, and over a few steps they
            # do not average out (the relative spread of a sum of n falls as 1 / sqrt(n)).
            steps = gaps / prediction.tokens_per_step
            spread = math.hypot(prediction.spread, prediction.step_cv / math.sqrt(steps))
            for z, weight in _NORMAL_NODES:
                slower = math.exp(spread * z)
                room_ms = (slo_tpot_ms - prediction.decode_tpot_ms * slower) * gaps
                if room_ms < 0:
                    continue
                if room_ms >= steps * slower * prediction.chunk_stall_ms:
                    chance += output_weight * weight  # met even were every step of it stalled
                    continue
                allowed = int(room_ms // prediction.stall_ms) if prediction.stall_ms > 0 else None
                chance += output_weight * weight * (1.0 if allowed is None else _poisson_cdf(allowed, stalls))
        return min(chance, 1.0)

    def crowding_loss(self, prediction: Prediction, slo_tpot_ms: float, met: float | None = None) -> float:
        """How many of the requests it would decode beside are expected to miss a TPOT target of
        `slo_tpot_ms` because it joined them, each taken to be like it (the same target, length
        and stalls): its steps slow theirs for about `OVERLAP` of their lives, and its prefill
        stalls them once. Nothing where they meet the target either way, or miss it either way.

        The chance is a sum of steps in the stall-free TPOT (three points of its spread), and a
        newcomer moves that TPOT by far less than a step's width: it is priced by the chance's
        mean slope over the width of the spread, not by whether it crosses a step. `met`: the
        chance of meeting the target as predicted, when already worked out."""
        if not prediction.batch:
            return 0.0
        tpot = prediction.decode_tpot_ms
        span = max(tpot * max(prediction.spread, STEP_SPREAD) * math.sqrt(3), 1e-3)
        faster = self.tpot_met_probability(replace(prediction, decode_tpot_ms=max(tpot - span, 0.0)), slo_tpot_ms)
        slower = self.tpot_met_probability(replace(prediction, decode_tpot_ms=tpot + span), slo_tpot_ms)
        slowed = (faster - slower) / (2 * span) * prediction.crowding_ms * OVERLAP
        fewer = replace(prediction, stalls=max(prediction.stalls - 1.0, 0.0))
        if met is None:
            met = self.tpot_met_probability(prediction, slo_tpot_ms)
        stalled = self.tpot_met_probability(fewer, slo_tpot_ms) - met
        return prediction.batch * max(slowed + stalled, 0.0)

    @staticmethod
    def _outputs(prediction: Prediction) -> list[tuple[int, float]]:
        """The answer lengths to average over, with their weights: the expected one when it is
        known, else three points of a log-normal whose mean it is (capped by max_tokens)."""
        sigma = prediction.output_spread
        if not sigma:
            return [(prediction.output_tokens, 1.0)]
        median = prediction.output_tokens * math.exp(-sigma * sigma / 2)
        cap = prediction.max_output_tokens
        out = []
        for z, weight in _NORMAL_NODES:
            length = max(round(median * math.exp(sigma * z)), 1)
            out.append((min(length, cap) if cap is not None else length, weight))
        return out


def _poisson_cdf(k: int, mean: float) -> float:
    """P(X <= k) for X ~ Poisson(mean)."""
    if mean <= 0:
        return 1.0
    term = cumulative = math.exp(-mean)
    for i in range(1, min(k, 1000) + 1):
        term *= mean / i
        cumulative += term
        if term < 1e-17 and i > 2 * mean:  # the terms left halve at least each step: they add < 2e-17
            break
    return min(cumulative, 1.0)
