"""The live state of every replica: scraped load, the gateway's own accounting, and health.

All of it is mutated on the gateway's event loop only (no locks needed); a policy never sees it
directly, only the frozen `Snapshot` that `Fleet.snapshot()` builds.

Health (`workers/health.py`): admitted on the first good scrape of `/metrics` and `/health`,
ejected on failures of its own with a backoff that grows on repeat, probed before it is trusted
again, and ejected when it holds requests but makes no progress.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import aiohttp

from specgate.calibration.modes import Pool
from specgate.workers import latency_fit
from specgate.workers.acceptance import SpecCounters, decode_steps
from specgate.workers.health import Health
from specgate.workers.latency_fit import MAX_STALL_SHARE, LatencyFit, Priced
from specgate.workers.rates import PromptRate
from specgate.workers.scrape import MetricsFormatError, VllmLoad, parse_vllm_metrics
from specgate.workers.shared import Others, SharedCounts, SharedSlot
from specgate.workers.snapshot import Burst, ReplicaState, Snapshot

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetSettings:
    scrape_interval_s: float = 0.25
    scrape_timeout_s: float = 1.0
    stale_after_s: float = 2.0
    """Scraped load older than this is ignored; the gateway's own counts remain."""
    eject_after: int = 3
    """Consecutive failures (requests on the replica's socket, or scrapes) that eject it."""
    failure_window: int = 20
    eject_failure_share: float = 0.5
    """A replica is also ejected when this share of its last `failure_window` requests failed
    (once it has served at least half that many)."""
    base_ejection_s: float = 2.0
    """How long a first ejection lasts; each repeat lasts twice as long, up to `max_ejection_s`."""
    max_ejection_s: float = 60.0
    hang_after_s: float = 20.0
    """A replica with requests in flight whose token counters stand still this long is ejected."""
    smoothing: float = 0.2
    """Weight of the newest observation in the smoothed TTFT and TPOT."""
    fit_window: float = latency_fit.WINDOW
    """Over about how many recent answers each pool's step costs are re-fitted."""
    fit_prior_weight: float = latency_fit.PRIOR_WEIGHT
    """As how many answers the profile's own step costs count in that fit."""
    correction_smoothing: float = latency_fit.SMOOTHING
    """Weight of the newest answer in the TTFT and TPOT factors that the fitted steps still miss."""
    refit: bool = True
    """False keeps the profile's step costs as they are, whatever the answers say (to measure
    what re-fitting them is worth)."""
    rate_window_s: float = 10.0
    """Time constant of the smoothed rate of prompts (and their tokens) sent to each replica."""
    burst_window_s: float = 2.0
    """A shorter one: when prompts come faster over it (a burst), its rate is the one used."""
    share_window_s: float = 30.0
    """Time constant of this gateway's share of the fleet's work (`Share`)."""
    count_share: bool = True
    """Count this gateway's requests as its share of the fleet's (`Share`); False counts only
    them (to measure what the share is worth with several gateways)."""
    acceptance_window_steps: float = 2000.0
    """Over how many recent sequence-steps the speculative pool's tokens per step are estimated."""

    def latency_fit(self) -> LatencyFit:
        """A pool's step-cost fit, as these settings make it."""
        return LatencyFit(self.fit_window, self.fit_prior_weight, self.correction_smoothing, learn=self.refit)


BURST_SIGNIFICANCE = 3.0
"""Standard deviations of chance by which a burst's prompts exceed the steady rate's
(`Replica._is_burst`): a control chart's limit, tested at every arrival, so that steady random
arrivals rarely set one off (2-8% of arrivals, against 11-22% at two deviations)."""


@dataclass
class Share:
    """This gateway's share of the work the fleet's replicas do: its requests that reached their
    first token, over the first tokens the replicas' counters show (the count of
    `vllm:time_to_first_token_seconds`), both decaying with a time constant. (Requests, not
    prompt tokens: a few long prompts would make a share of tokens swing by half in seconds.)
    A stream's first token is its first byte, when vLLM counts it too; a non-streamed answer shows
    its first token only at its end, so those are counted when sent, ahead of the replicas'
    count by a TTFT: they err towards a share of 1, counting only its own, as without a share.
    (Counting streams when sent too, a fleet in overload, where requests wait seconds in the
    replicas' queues, made the share swing from a third to 0.9 for one gateway of three.)

    A gateway sees its own dispatches at once and everyone else's only at the next scrape. Beside
    others (other gateways, clients that call the replicas directly), what it counts of its own
    is about this share of what the replicas get: it divides its own counts by it (`Replica.state`),
    so N gateways behind one load balancer each see the fleet about as one gateway alone would,
    not 1/N of it, and do not all pile onto the replica that looked idle at the last scrape.
    Alone it stays at 1."""

    window_s: float = 30.0
    own: float = 0.0
    fleet: float = 0.0
    at: float = 0.0

    MIN_EVIDENCE = 20.0
    """First tokens the replicas must have produced lately before the share moves from 1."""
    FLOOR = 1.0 / 64

    def _decay(self, now: float) -> None:
        keep = math.exp(-max(now - self.at, 0.0) / self.window_s)
        self.own, self.fleet, self.at = self.own * keep, self.fleet * keep, max(now, self.at)

    def sent(self, now: float, requests: float = 1.0) -> None:
        """One of this gateway's requests reached its first token (or, not streamed, was sent);
        or, told by a scrape, `requests` of its other processes' did."""
        self._decay(now)
        self.own += requests

    def processed(self, requests: float, now: float) -> None:
        """A scrape showed a replica's count of first tokens grow by `requests`."""
        self._decay(now)
        self.fleet += requests

    @property
    def value(self) -> float:
        """1/N, N the whole number of gateways (or their like) nearest the fleet's first tokens
        over this gateway's: a gateway alone is at 1 exactly, though the replicas' counters run a
        little ahead of the first bytes it sees (by a step, and the network), and one of three at a
        third, not at a third give or take the noise of the last half minute's requests."""
        if self.fleet < self.MIN_EVIDENCE or self.own >= self.fleet:
            return 1.0
        return max(1.0 / round(self.fleet / max(self.own, 1e-9)), self.FLOOR)  # the ratio is over 1 here


def _sequence_steps(delta: SpecCounters, load: VllmLoad, previous: VllmLoad | None) -> float:
    """The decode steps between two scrapes (`acceptance.decode_steps`), from the generated tokens
    less the first tokens, which vLLM's TTFT histogram counts."""
    generated = None
    if previous is not None and previous.generation_tokens is not None and load.generation_tokens is not None:
        generated = load.generation_tokens - previous.generation_tokens
        if previous.first_tokens is not None and load.first_tokens is not None:
            generated -= load.first_tokens - previous.first_tokens  # the prefills' tokens
    return decode_steps(delta, generated)


def _ewma(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


KV_CROWDED = 0.9
"""Past this share of its KV cache a replica may preempt requests or hold new ones back: its batch
is no longer the one the latency model prices."""
MAX_BUSY_S = 30.0
"""The longest a replica's 429 (and its Retry-After) keeps requests away from it."""


@dataclass(frozen=True)
class Stay:
    """A request's time on a replica: when it was sent, and the replica's `request_seconds` and
    `dispatched_by_gateway` then (this request counted)."""

    sent: float
    request_seconds: float
    dispatched: float


class Replica:
    def __init__(
        self, name: str, url: str, pool: Pool, settings: FleetSettings, fit: LatencyFit | None = None,
        share: Share | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.url = url.rstrip("/")
        self.pool = pool
        self.home_pool = pool
        """The pool the configuration puts it in; the policy document may move it (`move`)."""
        self.drained = False
        """Takes no new requests (the policy document's): its server may be restarting."""
        self.retired = False
        """Discovery no longer finds it: drained, and gone from the fleet once its requests end."""
        self.settings = settings
        self.health = self._new_health()
        self.waiting: set[Callable[[], None]] = set()
        """Callbacks of the attempts still waiting for their first byte here, called if it is
        ejected: they give up on it and go elsewhere."""
        self.streaming: set[Callable[[], None]] = set()
        """Callbacks of the attempts relaying an answer from here, called if it is found hung:
        their streams go on elsewhere."""
        self.in_flight = 0
        self._requests = (0.0, 0.0)
        """`request_seconds` at the last change of `in_flight`, and when that was."""
        self.crowded_at = -math.inf
        """When a scrape last showed requests held back in it, or its KV cache nearly full."""
        self.holding = False
        """Whether the last two scrapes both showed requests waiting in its queue: it holds them back."""
        self.prefilling = 0
        self.prefill_tokens = 0
        self.dispatched = 0
        self.sent = 0
        """Of those, the ones counted in this gateway's share (`Share.sent`)."""
        self.shared: SharedSlot | None = None
        """Its counts as this gateway's other processes publish theirs (`workers/shared.py`)."""
        self._others_sent = 0.0
        self.load: VllmLoad | None = None
        self.max_model_len: int | None = None
        """The context window the replica's /v1/models reports, read when it is admitted."""
        self.scraped_at: float | None = None
        self.tokens_per_step: float | None = None
        self.recent_steps = 0.0
        self.recent_accepted = 0.0
        self.observed_ttft_s: float | None = None
        self.observed_tpot_s: float | None = None
        self.fit = fit if fit is not None else settings.latency_fit()
        """The step costs of its pool, re-fitted from the answers of all its replicas."""
        self.share = share if share is not None else Share(settings.share_window_s)
        """This gateway's share of the fleet's work (the fleet's, shared by all its replicas)."""
        self._rates = (PromptRate(self.settings.rate_window_s), PromptRate(self.settings.burst_window_s))
        self._burst_since: float | None = None
        """Since when its prompts come faster than the longer window shows; None when they do not."""
        self._burst_before = (0.0, 0.0)
        """The longer window's prompts and prompt tokens a second (all processes') when it began."""
        self._calm: tuple[float, tuple[float, float]] = (0.0, (0.0, 0.0))
        """The last prompt's arrival that found the shorter window at or below the longer, and
        the longer window's rates then: where a burst that begins now began, and from what."""
        self._dispatched_at_scrape = 0.0
        self._last_spec: SpecCounters | None = None
        self._progress: tuple[float, float] = (-1.0, 0.0)
        """The token counters' last sum, and when it last moved."""
        self.busy_until = 0.0
        """Until when it takes no request, after a 429."""
        self.ejections = 0
        """Times it was ejected, all told."""
        self.received_at = 0.0
        """When a byte of an answer last arrived from it (a replica still sending is not hung,
        whatever its counters say: what it sends may have been generated a while ago)."""

    def _new_health(self) -> Health:
        s = self.settings
        return Health(
            self.name, s.eject_after, s.base_ejection_s, s.max_ejection_s,
            failure_window=s.failure_window, eject_failure_share=s.eject_failure_share,
        )  # fmt: skip

    def move(self, pool: Pool, fit: LatencyFit) -> None:
        """Serve in `pool` from now on: its server was restarted with (or without) speculation.
        What was learned of the old server goes (its acceptance, latencies, load, health record);
        its requests still in flight finish and are counted as before."""
        self.pool, self.fit = pool, fit
        self.load, self.scraped_at, self._last_spec = None, None, None
        self.tokens_per_step, self.recent_steps, self.recent_accepted = None, 0.0, 0.0
        self.observed_ttft_s = self.observed_tpot_s = None
        self.health = self._new_health()

    def drain(self, drained: bool) -> None:
        """Take no new requests, or take them again. Back from a drain it starts a fresh health
        record, admitted at its next good scrape: the server may have been restarted meanwhile,
        and failures while drained (a server down for the restart) are not held against it."""
        if self.drained and not drained:
            self.health = self._new_health()
        self.drained = drained

    # --- the gateway's own accounting ---------------------------------------------------------

    def _own_request_seconds(self, now: float) -> float:
        return self._requests[0] + self.in_flight * max(now - self._requests[1], 0.0)

    def request_seconds(self, now: float) -> float:
        """The gateway's requests on it (all its processes'), integrated over time."""
        return self._stay(now, self._others(now)).request_seconds

    def _stay(self, now: float, others: Others | None) -> Stay:
        """`request_seconds` and `dispatched_by_gateway` at `now`, with the other processes' `others`."""
        request_seconds, dispatched = self._own_request_seconds(now), float(self.dispatched)
        if others is not None:
            request_seconds, dispatched = request_seconds + others.request_seconds, dispatched + others.dispatched
        return Stay(now, request_seconds, dispatched)

    def _count(self, change: int, now: float | None) -> None:
        at = time.monotonic() if now is None else now
        self._requests = (self._own_request_seconds(at), max(at, self._requests[1]))
        self.in_flight += change

    def dispatched_one(self, prompt_tokens: int = 0, now: float | None = None, *, stream: bool = True) -> Stay:
        """A request sent to it: its stay, for `observe` when it is answered."""
        at = time.monotonic() if now is None else now
        if not stream:
            self.share.sent(at)
            self.sent += 1
        self.dispatched += 1
        self._count(1, at)
        self.prefilling += 1
        self.prefill_tokens += prompt_tokens
        others = self._others(at)  # (read once: this process's own counts are not in them)
        if now is not None:
            steady, burst = (r.per_s(now) for r in self._rates)
            was_bursting = self._is_burst(steady[0], burst[0], going_on=self._burst_since is not None)
            if not was_bursting:
                self._burst_since = None
                if burst[0] <= steady[0]:
                    # Calm: a burst that begins from here rises from this rate, this process's
                    # prompts and the other processes' alike (it is told from chance only a few
                    # prompts into it, which the longer window by then counts too).
                    if others is not None:
                        steady = (steady[0] + others.rates[0][0], steady[1] + others.rates[0][1])
                    self._calm = (now, steady)
            for rate in self._rates:
                rate.add(prompt_tokens, now)
            if not self._bursting(now):
                self._burst_since = None
            elif not was_bursting:  # (decaying, the shorter window can only fall behind the longer)
                self._burst_since, self._burst_before = self._calm
        self._publish()
        return self._stay(at, others)

    def _publish(self) -> None:
        if self.shared is not None:
            rates = tuple(r.words() for r in self._rates)
            self.shared.publish(self.in_flight, self.prefilling, self.prefill_tokens, self.dispatched, self.sent, rates,
                                self._requests)  # fmt: skip

    def _others(self, now: float) -> Others | None:
        if self.shared is None:
            return None
        return self.shared.others(now, (self.settings.rate_window_s, self.settings.burst_window_s))

    def dispatched_by_gateway(self, now: float) -> float:
        """Requests this gateway (all its processes) has sent it, all told."""
        others = self._others(now)
        return self.dispatched + (others.dispatched if others is not None else 0.0)

    def prompt_rates(self, now: float, others: Others | None = None) -> tuple[float, float, Burst | None]:
        """Prompts and prompt tokens sent per second lately (with `others`, this gateway's other
        processes' too), over the longer window, and a burst when the shorter one sees more tokens
        (which the longer one is slow to follow), with how long this process has seen it last."""
        rates = [r.per_s(now) for r in self._rates]
        if others is not None:
            rates = [(own[0] + more[0], own[1] + more[1]) for own, more in zip(rates, others.rates, strict=True)]
        (prompts, tokens), (burst_prompts, burst_tokens) = rates
        if not self._is_burst(prompts, burst_prompts, going_on=self._burst_since is not None):
            return prompts, tokens, None
        # What came before the burst, as the longer window had it when this process saw it begin
        # (its own prompts and the other processes'): the rate it is expected to fall back to. A
        # burst that the others' prompts show and this process's do not has only begun.
        since, before = now, (prompts, tokens)
        if self._burst_since is not None:
            since, before = self._burst_since, self._burst_before
        lasted = max(now - since, self.settings.burst_window_s)
        return prompts, tokens, Burst(burst_prompts, burst_tokens, lasted, *before)

    def _bursting(self, now: float) -> bool:
        """Whether this process's own prompts make a burst (`_is_burst`)."""
        (prompts, _), (burst_prompts, _) = (r.per_s(now) for r in self._rates)
        return self._is_burst(prompts, burst_prompts, going_on=self._burst_since is not None)

    def _is_burst(self, prompts: float, burst_prompts: float, *, going_on: bool) -> bool:
        """Whether the shorter window's prompts a second, `burst_prompts`, make a burst beside the
        longer window's, `prompts`. One `going_on` lasts while the shorter window sees more
        prompts. One begins only when it sees more than chance gives: prompts arriving at random
        at a steady rate put the shorter window above the longer about half the time, each
        arrival's jitter, and taken for bursts they would grow every batch priced in steady
        traffic. For random arrivals at the longer window's rate λ, the two windows' difference
        has a variance of λ (1/2a + 1/2b - 2/(a + b)) (time constants a and b); a burst begins at
        an excess of `BURST_SIGNIFICANCE` standard deviations. (Prompts, not their tokens: one
        long prompt is not a burst, and it would hold the longer window's tokens above the
        shorter's through a storm of short ones.)"""
        if burst_prompts <= prompts:
            return False
        if going_on:
            return True
        a, b = self.settings.burst_window_s, self.settings.rate_window_s
        chance = prompts * (1 / (2 * a) + 1 / (2 * b) - 2 / (a + b))
        return burst_prompts - prompts > BURST_SIGNIFICANCE * math.sqrt(chance)

    def _prefilled(self, prompt_tokens: int) -> None:
        self.prefilling -= 1
        self.prefill_tokens -= prompt_tokens

    def first_byte(self, prompt_tokens: int = 0, now: float | None = None, *, stream: bool = True) -> None:
        self._prefilled(prompt_tokens)
        if stream:
            self.share.sent(time.monotonic() if now is None else now)
            self.sent += 1
        self._publish()

    def finished(self, *, got_first_byte: bool, prompt_tokens: int = 0, now: float | None = None) -> None:
        self._count(-1, now)
        if not got_first_byte:  # no first token the share would count
            self._prefilled(prompt_tokens)
        self._publish()

    def counted_share(self) -> float:
        """What this gateway's own counts are divided by to be the fleet's (`Share`)."""
        return self.share.value if self.settings.count_share else 1.0

    def observe(
        self,
        ttft_s: float | None,
        tpot_s: float | None,
        terms: Priced | None = None,
        stay: Stay | None = None,
        now: float | None = None,
        step_s: float | None = None,
    ) -> None:
        """Record what a request saw; with the terms of the predictions it was routed on, re-fit
        the pool's step costs: from its TTFT and `step_s`, the median time between the events of
        its stream, at the batch it decoded beside over its `stay` (ended `now`), if the replica
        stayed uncrowded meanwhile (`LatencyFit.observe`)."""
        w = self.settings.smoothing
        if ttft_s is not None:
            self.observed_ttft_s = _ewma(self.observed_ttft_s, ttft_s, w)
        if tpot_s is not None:
            self.observed_tpot_s = _ewma(self.observed_tpot_s, tpot_s, w)
        if terms is None:
            return
        in_flight, steady = None, True
        if stay is not None:
            end = time.monotonic() if now is None else now
            if end > stay.sent:  # all the fleet's requests, as far as this gateway's share tells
                ended = self._stay(end, self._others(end))
                in_flight = (ended.request_seconds - stay.request_seconds) / (end - stay.sent)
                # (at least itself: a process of the gateway restarted meanwhile takes its requests back)
                in_flight = max(in_flight / self.counted_share(), 1.0)
                if step_s is not None and step_s > 0:
                    # Prompts that joined it meanwhile were prefilled in the steps its events were
                    # timed over: past a share of them, their median is no longer a decode step.
                    joined = (ended.dispatched - stay.dispatched) / self.counted_share()
                    steps = max(end - stay.sent - (ttft_s or 0.0), 0.0) / step_s
                    if joined > MAX_STALL_SHARE * steps:
                        step_s = None
            # uncrowded at the scrape before it was sent, and at every one since
            steady = self.crowded_at < stay.sent - self.settings.scrape_interval_s

        def ms(seconds: float | None) -> float | None:
            return seconds * 1e3 if seconds is not None else None

        self.fit.observe(ms(ttft_s), ms(tpot_s), terms, in_flight, steady=steady, step_ms=ms(step_s))

    # --- health -------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Admitted (up, or being probed after an ejection)."""
        return self.health.admitted

    def available(self, now: float | None = None) -> bool:
        """Takes a request now: admitted (a probed replica only one at a time), and not busy."""
        if self.busy_until and (time.monotonic() if now is None else now) < self.busy_until:
            return False
        return self.health.available(self.in_flight)

    def busy(self, seconds: float, now: float | None = None) -> None:
        """It answered 429: not broken, but it takes nothing more for a while."""
        self.busy_until = (time.monotonic() if now is None else now) + min(max(seconds, 0.0), MAX_BUSY_S)

    def succeeded(self, now: float | None = None) -> None:
        self.health.request_succeeded(time.monotonic() if now is None else now)

    def failed(self, reason: str, *, eject: bool = False, now: float | None = None) -> None:
        """A failure on the replica's own socket (never a client's)."""
        if self.health.request_failed(time.monotonic() if now is None else now, reason, at_once=eject):
            self._ejected()

    def _ejected(self, *, hung: bool = False) -> None:
        self.ejections += 1
        for give_up in list(self.waiting) + (list(self.streaming) if hung else []):
            give_up()

    def scrape_failed(self, reason: str, now: float | None = None) -> None:
        if self.drained:
            return  # a drained server may be down on purpose
        if self.health.scrape_failed(time.monotonic() if now is None else now, reason):
            self._ejected()

    def scraped(self, load: VllmLoad, now: float, dispatched_at_send: float) -> None:
        self.health.scrape_succeeded(now)
        self._check_progress(load, now)
        previous, self.load = self.load, load
        self.scraped_at = now
        if previous is not None and previous.first_tokens is not None and load.first_tokens is not None:
            grown = load.first_tokens - previous.first_tokens
            if grown > 0:  # (less: the server restarted, its counters with it)
                self.share.processed(grown, now)
        # Requests still waiting a scrape later: the replica holds them back (a newcomer waits in
        # its queue only until the next step).
        queued = (load.waiting or 0.0) > 0 and previous is not None and (previous.waiting or 0.0) > 0
        self.holding = queued
        if queued or (load.kv_usage or 0.0) >= KV_CROWDED:
            self.crowded_at = now
        self._dispatched_at_scrape = dispatched_at_send
        others = self._others(now)
        if others is not None:  # the other processes' requests, in the share (fewer: one restarted)
            if others.sent > self._others_sent:
                self.share.sent(now, others.sent - self._others_sent)
            self._others_sent = others.sent
        if load.spec is not None:
            if self._last_spec is not None:
                delta = load.spec - self._last_spec
                steps = _sequence_steps(delta, load, previous)
                if steps > 0 and delta.accepted_tokens >= 0:
                    # A sliding window over the last steps: one short interval reflects only the few
                    # requests running then, whose acceptance says little about the next request's.
                    keep = max(1.0 - steps / self.settings.acceptance_window_steps, 0.0)
                    self.recent_steps = self.recent_steps * keep + steps
                    self.recent_accepted = self.recent_accepted * keep + delta.accepted_tokens
                    self.tokens_per_step = 1.0 + self.recent_accepted / self.recent_steps
            self._last_spec = load.spec

    def _check_progress(self, load: VllmLoad, now: float) -> None:
        """Eject a replica that holds requests but whose token counters stand still, and that sends
        nothing meanwhile: hung."""
        counters = (load.prompt_tokens or 0.0) + (load.generation_tokens or 0.0)
        last, since = self._progress
        if counters != last or not self.in_flight or now - self.received_at < self.settings.hang_after_s:
            self._progress = (counters, now)
        elif now - since >= self.settings.hang_after_s and self.health.eject(now, "no progress"):
            self._progress = (counters, now)
            self._ejected(hung=True)

    def state(self, now: float, tokens_per_step: float | None = None) -> ReplicaState:
        load = self.load
        age = (now - self.scraped_at) if self.scraped_at is not None else None
        fresh = load is not None and age is not None and age <= self.settings.stale_after_s
        # The fleet's requests on it, as far as this gateway can tell: its own (all its processes')
        # over its share of the fleet's work (`Share`; 1 when it is alone in front of the fleet).
        others = self._others(now)
        arrivals_per_s, prefill_tokens_per_s, burst = self.prompt_rates(now, others)
        in_flight, prefilling = float(self.in_flight), float(self.prefilling)
        prefill_tokens, dispatched = float(self.prefill_tokens), self.dispatched - self._dispatched_at_scrape
        if others is not None:
            in_flight += others.in_flight
            prefilling += others.prefilling
            prefill_tokens += others.prefill_tokens
            dispatched += others.dispatched
        share = self.counted_share()
        return ReplicaState(
            name=self.name,
            url=self.url,
            pool=self.pool,
            healthy=self.available(now) and not self.drained,
            in_flight=round(in_flight / share),
            prefilling=round(prefilling / share),
            prefill_tokens=round(prefill_tokens / share),
            prefill_tokens_per_s=prefill_tokens_per_s / share,
            arrivals_per_s=arrivals_per_s / share,
            burst=burst.shared(share) if burst is not None else None,
            dispatched_since_scrape=round(dispatched / share),
            running=load.running if fresh and load else None,
            waiting=load.waiting if fresh and load else None,
            kv_usage=load.kv_usage if fresh and load else None,
            tokens_per_step=self.tokens_per_step if tokens_per_step is None else tokens_per_step,
            scrape_age_s=age,
            observed_ttft_s=self.observed_ttft_s,
            observed_tpot_s=self.observed_tpot_s,
            scales=self.fit.scales,
            checked=self.fit.answers,
            max_model_len=self.max_model_len,
            holding=self.holding and fresh,
        )


async def _get(session: aiohttp.ClientSession, url: str, limit: aiohttp.ClientTimeout) -> str:
    async with session.get(url, timeout=limit) as response:
        if response.status != 200:
            raise MetricsFormatError(f"{url.rsplit('/', 1)[-1]} answered {response.status}")
        return await response.text()


async def _max_model_len(session: aiohttp.ClientSession, url: str, limit: aiohttp.ClientTimeout) -> int | None:
    """vLLM's /v1/models `max_model_len` of the replica's first model; None when it does not say."""
    try:
        async with session.get(f"{url}/v1/models", timeout=limit) as response:
            if response.status != 200:
                return None
            body = await response.json(content_type=None)
        value = body["data"][0]["max_model_len"]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_PREFIX = {Pool.SPECULATIVE: "spec", Pool.PLAIN: "plain"}


class Fleet:
    """Every replica of both pools, by name."""

    def __init__(
        self, pools: dict[Pool, list[str]], settings: FleetSettings, shared: SharedCounts | None = None
    ) -> None:
        self.settings = settings
        self.shared = shared
        """Where this gateway's processes count their requests (`workers/shared.py`); None alone."""
        self.replicas: dict[str, Replica] = {}
        self.share = Share(settings.share_window_s)
        """This gateway's share of the work the fleet does (1 alone in front of it)."""
        self.fits = {pool: settings.latency_fit() for pool in Pool}
        """Each pool's step costs, re-fitted from the answers of all its replicas (and a prior
        centered on what the other pool's show)."""
        for number, (pool, fit) in enumerate(self.fits.items()):
            fit.siblings = [other for p, other in self.fits.items() if p is not pool]
            if shared is not None:  # (every process numbers the pools alike: in Pool's order)
                fit.shared = shared.fit(number)
        self._named = dict.fromkeys(Pool, 0)
        """Replicas named so far per pool: a new one takes the next number, never a used one."""
        self._arranged: tuple[Mapping[str, Pool], Collection[str]] = ({}, ())
        self._held = 0
        """Requests this process holds that can still meet their targets, as last told."""
        for pool, urls in pools.items():
            for url in urls:
                self._join(pool, url)

    def _join(self, pool: Pool, url: str) -> Replica:
        name = f"{_PREFIX[pool]}-{self._named[pool]}"
        self._named[pool] += 1
        replica = self.replicas[name] = Replica(name, url, pool, self.settings, self.fits[pool], self.share)
        if self.shared is not None:
            replica.shared = self.shared.slot(replica.url)
        return replica

    def hold(self, live: int) -> None:
        """How many requests this process holds that can still meet their targets: in its
        snapshots, and published for the other processes and gateways (`workers/shared.py`)."""
        self._held = live
        if self.shared is not None:
            self.shared.hold(live)

    def held_elsewhere(self) -> float:
        """The requests the other processes and gateways hold that can still meet their targets."""
        return self.shared.held_elsewhere() if self.shared is not None else 0.0

    def arrange(self, pools: Mapping[str, Pool], drained: Collection[str]) -> None:
        """Replicas, by URL, in a pool other than the configured one, and those that take no new
        requests (the policy document's `replicas`); URLs this fleet does not have are ignored."""
        self._arranged = (pools, drained)
        for replica in self.replicas.values():
            pool = pools.get(replica.url, replica.home_pool)
            if pool is not replica.pool:
                _log.info("replica %s (%s) now serves in the %s pool", replica.name, replica.url, pool.value)
                replica.move(pool, self.fits[pool])
            drain = replica.url in drained or replica.retired
            if drain != replica.drained:
                _log.info("replica %s %s", replica.name, "drained" if drain else "takes requests again")
                replica.drain(drain)

    def reconcile(self, found: Mapping[Pool, Collection[str]]) -> tuple[list[Replica], list[Replica]]:
        """The replicas discovery finds now, by pool (`workers/discovery.py`): URLs new to the
        fleet join it (admitted at their first good scrape), and those no longer found retire:
        drained, and removed once this gateway has no request left on them. A URL found in both
        pools stays in the first. Returns the replicas that joined and those removed."""
        homes: dict[str, Pool] = {}
        for pool, urls in found.items():
            for url in urls:
                homes.setdefault(url.rstrip("/"), pool)
        by_url = {r.url: r for r in self.replicas.values()}
        joined = [self._join(pool, url) for url, pool in homes.items() if url not in by_url]
        for replica in joined:
            _log.info("replica %s (%s) found in the %s pool", replica.name, replica.url, replica.pool.value)
        for url, replica in by_url.items():
            home = homes.get(url)
            if home is not None and home is not replica.home_pool:
                replica.home_pool = home  # its labels changed: the document's placement still wins
            retire = home is None
            if retire != replica.retired:
                _log.info("replica %s (%s) %s", replica.name, url, "no longer found" if retire else "found again")
                replica.retired = retire
        self.arrange(*self._arranged)
        removed = [r for r in self.replicas.values() if r.retired and r.in_flight == 0]
        for replica in removed:
            del self.replicas[replica.name]
            if replica.shared is not None:
                replica.shared.release()
        return joined, removed

    def snapshot(self, now: float, profile: str | None = None) -> Snapshot:
        """Every replica's state; step costs (the fits are the pool's) and acceptance are pooled
        per pool. The fits follow `profile`, the one the deciding policy predicts with.

        Replicas of one pool run the same engine on the same hardware and serve the same mix of
        requests, so what one teaches about the model holds for all. Per-replica figures learned
        from a few noisy requests would make a lucky replica look fast, attract traffic and
        overload it before it learns better.
        """
        if profile is not None:
            for fit in self.fits.values():
                fit.follow(profile)
        sums: dict[Pool, list[float]] = {}
        for r in self.replicas.values():
            total = sums.setdefault(r.pool, [0.0, 0.0])
            total[0] += r.recent_steps
            total[1] += r.recent_accepted
        pooled = {pool: 1.0 + accepted / steps if steps > 0 else None for pool, (steps, accepted) in sums.items()}
        states = tuple(r.state(now, pooled[r.pool]) for r in self.replicas.values())
        # Told nothing of the others' queues, this gateway's holds about its share of the fleet's.
        share = self.share.value if self.shared is None and self.settings.count_share else 1.0
        return Snapshot(states, held=self._held / share + self.held_elsewhere())

    @staticmethod
    def scrape_age(replica: Replica) -> float:
        """Seconds since the replica's last good scrape (NaN before the first)."""
        if replica.scraped_at is None:
            return float("nan")
        return time.monotonic() - replica.scraped_at

    def any_serving(self) -> bool:
        """Some replica takes requests: admitted, and neither drained nor retired (a fleet drained
        whole, for a switch or by discovery, cannot serve however healthy its servers)."""
        return any(r.healthy and not r.drained for r in self.replicas.values())

    def scraped(self, replica: Replica, load: VllmLoad, now: float, dispatched_at_send: float) -> None:
        """A scrape of `replica` answered with `load` (`dispatched_at_send`: `dispatched_by_gateway`
        when it was sent)."""
        replica.scraped(load, now, dispatched_at_send)
        self.fits[replica.pool].refresh()  # what the other processes fitted meanwhile

    async def scrape_once(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        dispatched = replica.dispatched_by_gateway(time.monotonic())
        timeout = aiohttp.ClientTimeout(total=self.settings.scrape_timeout_s)
        try:
            text, _ = await asyncio.gather(
                _get(session, f"{replica.url}/metrics", timeout), _get(session, f"{replica.url}/health", timeout)
            )
            load = parse_vllm_metrics(text)
        except (aiohttp.ClientError, TimeoutError, MetricsFormatError, UnicodeDecodeError) as exc:
            replica.scrape_failed(f"scrape failed: {exc!r}")
            return
        was_admitted = replica.healthy
        self.scraped(replica, load, time.monotonic(), dispatched)
        if replica.healthy and not was_admitted:  # (re)admitted: it may have restarted with other flags
            replica.max_model_len = await _max_model_len(session, replica.url, timeout)

    async def scrape_forever(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrape_once(session, replica)
            await asyncio.sleep(max(self.settings.scrape_interval_s - (loop.time() - started), 0.0))
