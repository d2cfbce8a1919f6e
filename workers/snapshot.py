"""The frozen view of the fleet that a policy decides on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from specgate.calibration.modes import Pool

CORRECTION_RANGE = (0.2, 5.0)
"""How far the fleet's measurements may scale a term of the profile's step cost, either way."""
WAIT_RANGE = (0.0, 8.0)
"""The steps a newcomer may be found to wait beyond the half step in flight: none (an engine that
takes it at the next step, its HTTP front out of the way) to a handful (a server whose CPU is
shared, one that schedules ahead)."""


@dataclass(frozen=True)
class Scales:
    """The profile's step cost as the fleet measures it (`workers/latency_fit.py`): each term of a
    step's time scaled by what the pool's answers show, a fixed time before any first token that
    no engine step accounts for (the server's HTTP, tokenization and scheduling), and what the
    steps so priced still miss of the TTFT and TPOT the pool's requests see."""

    fixed: float = 1.0
    """The cost of a step with one sequence at no context: launch, scheduling, sampling."""
    decode: float = 1.0
    """What more sequences, and their contexts, add to a step."""
    prefill: float = 1.0
    """What a step's prompt tokens add to it."""
    overhead_ms: float = 0.0
    ttft_factor: float = 1.0
    """Measured over predicted TTFT, smoothed, left after the fitted step costs: what the model's
    picture of the replica misses (a queue it does not see, a batch that is not the one priced)."""
    tpot_factor: float = 1.0
    tpot_spread: float = 0.0
    """How far the pool's measured TPOTs spread about their predictions as made (the root mean
    square of the log ratio): the noise of the replica itself (a CPU shared with other work, a
    batch that changes under a request), which no step accounts for, and what the forecast of the
    prompts arriving missed; 0 before enough answers to say."""
    wait: float = 0.0
    """Steps of the batch a newcomer finds (as the profile prices one) that it waits for its first
    token beyond the half step in flight: vLLM's engine takes a newcomer at the next step, but its
    HTTP front, tokenizer and detokenizer may share the engine's CPU, and an engine that schedules
    a step ahead may take it a step later."""

    def step_ms(self, terms: tuple[float, float, float]) -> float:
        """A step (or a sum of steps) given as its profile-priced fixed, decode and prefill parts."""
        return self.fixed * terms[0] + self.decode * terms[1] + self.prefill * terms[2]

    @classmethod
    def lowest(cls) -> Scales:
        """As fast as the fleet may say the profile's replicas are."""
        low = CORRECTION_RANGE[0]
        return cls(low, low, low, 0.0, wait=WAIT_RANGE[0])


@dataclass(frozen=True)
class Burst:
    """Prompts sent to a replica faster lately than its steady rate shows: the rates over a short
    window, when they see more prompt tokens than the longer one, and how long they have (at
    least the short window)."""

    arrivals_per_s: float
    prefill_tokens_per_s: float
    lasted_s: float
    arrivals_before_per_s: float = 0.0
    prefill_tokens_before_per_s: float = 0.0
    """The rates before it began, which it is expected to fall back to: the longer window's rates
    when it began (`Replica.dispatched_one`, every process's prompts counted). Not the longer
    window's rates now, which a burst a few seconds old has already raised: the forecast would count
    the burst once while it lasts, and again for the rest of a life as if it never ended."""

    def shared(self, share: float) -> Burst:
        """The fleet's, from this gateway's own over its share of the fleet's work."""
        return replace(self, arrivals_per_s=self.arrivals_per_s / share,
                       prefill_tokens_per_s=self.prefill_tokens_per_s / share,
                       arrivals_before_per_s=self.arrivals_before_per_s / share,
                       prefill_tokens_before_per_s=self.prefill_tokens_before_per_s / share)  # fmt: skip


@dataclass(frozen=True)
class ReplicaState:
    """One replica as the gateway sees it at decision time."""

    name: str
    """Stable short name (`spec-0`, `plain-1`), used in headers and metric labels."""
    url: str
    pool: Pool
    healthy: bool
    in_flight: int
    """Requests the gateway has sent there and not seen finish: fresher than any scrape."""
    prefilling: int
    """Of those, requests that have not produced their first byte yet."""
    prefill_tokens: int
    """The prompt tokens of those requests: prefill work queued ahead of a newcomer."""
    prefill_tokens_per_s: float
    """Prompt tokens sent to the replica per second, smoothed: the prefill that will interrupt decoding."""
    arrivals_per_s: float
    """Requests sent to the replica per second, smoothed: how often decoding is interrupted."""
    dispatched_since_scrape: int
    """Requests sent there since the scrape the load figures below come from."""
    running: float | None
    """`vllm:num_requests_running` at the last scrape; None before the first or when stale."""
    waiting: float | None
    kv_usage: float | None
    tokens_per_step: float | None
    """Mean tokens per speculative step over the pool's recent drafts; None before any."""
    scrape_age_s: float | None
    observed_ttft_s: float | None
    """Smoothed TTFT the gateway observed on this replica."""
    observed_tpot_s: float | None
    scales: Scales = Scales()
    """The pool's step costs against its profile's, fitted from the answers the gateway measured."""
    checked: int = 0
    """How many of the pool's predictions the gateway has seen measured (the scales' evidence)."""
    max_model_len: int | None = None
    """The replica's context window (its /v1/models), once read."""
    holding: bool = False
    """Requests waited in its queue at its last two scrapes: it holds newcomers back (its batch or
    its KV cache full), rather than queueing them for a step or two, as it does in a ramp."""
    weight: float = 1.0
    """The operator's preference for the replica's pool (policy document): policies divide its
    load and its predicted completion by it, so a pool of weight 2 takes about twice the share."""
    burst: Burst | None = None
    """Prompts arriving faster than the steady rates above, lately; None when they do not."""

    def idle(self) -> ReplicaState:
        """The same replica with nothing on it: what a request could get at best there."""
        return replace(
            self, in_flight=0, prefilling=0, prefill_tokens=0, prefill_tokens_per_s=0.0, arrivals_per_s=0.0,
            dispatched_since_scrape=0, running=None, waiting=None, kv_usage=None, burst=None,
        )  # fmt: skip

    def prompt_rates(self, horizon_s: float) -> tuple[float, float]:
        """Prompts and prompt tokens a second to expect over the next `horizon_s`: a burst's rates
        for about as long again as it has lasted, not the whole horizon, and then the rates from
        before it (nothing tells how long a burst will last but how long it has: a storm seen for
        two seconds does not stall every step of an answer a minute long; one seen for a minute
        does); with no burst, the steady rates."""
        if self.burst is None:
            return self.arrivals_per_s, self.prefill_tokens_per_s
        b = self.burst
        lasts = min(b.lasted_s / horizon_s, 1.0) if horizon_s > 0 else 1.0
        return (
            b.arrivals_before_per_s + (b.arrivals_per_s - b.arrivals_before_per_s) * lasts,
            b.prefill_tokens_before_per_s + (b.prefill_tokens_per_s - b.prefill_tokens_before_per_s) * lasts,
        )

    def prefill_tokens_after_burst_per_s(self) -> float:
        """Prompt tokens a second to expect once a burst on now is over: the rate from before it."""
        return self.burst.prefill_tokens_before_per_s if self.burst is not None else self.prefill_tokens_per_s

    @property
    def load(self) -> float:
        """Requests on the replica: the scraped queue plus what was sent since, or our own count."""
        if self.running is None or self.waiting is None:
            return float(self.in_flight)
        return max(self.running + self.waiting + self.dispatched_since_scrape, float(self.in_flight))


@dataclass(frozen=True)
class Snapshot:
    replicas: tuple[ReplicaState, ...]
    held: float = 0.0
    """Requests the gateway's admission queues hold that can still meet their targets: what waits
    for capacity. This process's and the other processes' and gateways' as they last told; told
    nothing of them, this gateway's divided by its share of the fleet's work (`Share`)."""

    def healthy(self, pool: Pool | None = None) -> tuple[ReplicaState, ...]:
        return tuple(r for r in self.replicas if r.healthy and (pool is None or r.pool is pool))

    def fitting(self, prompt_tokens: int) -> Snapshot:
        """Without the replicas whose context window leaves no room for an answer to the prompt."""
        fits = tuple(r for r in self.replicas if r.max_model_len is None or prompt_tokens < r.max_model_len)
        return replace(self, replicas=fits)

    def without(self, names: frozenset[str]) -> Snapshot:
        return replace(self, replicas=tuple(r for r in self.replicas if r.name not in names))

    def steered(self, weights: Mapping[Pool, float], drained: frozenset[Pool]) -> Snapshot:
        """Without the drained pools' replicas, and with each pool's weight on its replicas."""
        return replace(
            self,
            replicas=tuple(
                replace(r, weight=weights.get(r.pool, 1.0)) if weights.get(r.pool, 1.0) != r.weight else r
                for r in self.replicas
                if r.pool not in drained
            ),
        )
