"""The gateway's own Prometheus metrics (prefix `specgate_`), in a registry of its own."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from functools import partial
from operator import attrgetter
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from specgate.calibration.modes import Pool
from specgate.calibration.pricing import usd_per_million_tokens
from specgate.gateway.advisor import Advisor
from specgate.gateway.throughput import TokenRate
from specgate.workers.latency_fit import FitReport, LatencyFit
from specgate.workers.pools import Fleet, Replica

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
_TPOT_ERROR_BUCKETS = (-0.2, -0.1, -0.05, -0.02, -0.01, -0.005, 0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
MAX_CLASSES = 32
"""Request classes with a label of their own in specgate_slo: a client names its class, and
labels without bound would grow the metrics without bound."""
_ERROR_BUCKETS = (-5.0, -2.0, -1.0, -0.5, -0.2, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _Children:
    """A labelled metric whose children are looked up once per label set, not once per request."""

    def __init__(self, metric: Counter | Histogram) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Counter | Histogram] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class _Summed(Collector):
    """The counters and histograms of every process of the gateway, summed (Prometheus's
    multiprocess files; their gauges are each process's own, shown by that process)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _files(self) -> list[str]:
        return [str(p) for kind in ("counter", "histogram") for p in self.directory.glob(f"{kind}_*.db")]

    def collect(self) -> Iterable[Metric]:
        merged: Iterable[Metric] = MultiProcessCollector.merge(self._files(), accumulate=True)  # type: ignore[no-untyped-call]
        return merged

    def names(self) -> set[str]:
        return {family.name for family in self.collect()}


class _Except(Collector):
    """A registry's metrics but those named."""

    def __init__(self, registry: CollectorRegistry, names: Collection[str]) -> None:
        self.registry, self.names = registry, names

    def collect(self) -> Iterator[Metric]:
        return (family for family in self.registry.collect() if family.name not in self.names)


class _ReplicaGauges(Collector):
    """Per replica, read when /metrics is: the replicas there are then, in the pool each serves
    in then (discovery adds and removes replicas, the policy document moves them)."""

    _GAUGES: tuple[tuple[str, str, Callable[[Replica], float]], ...] = (
        ("specgate_replica_up", "1 when the replica is admitted, 0 when ejected.", lambda rep: float(rep.healthy)),
        ("specgate_replica_in_flight", "Requests this gateway has in flight on the replica.",
         lambda rep: float(rep.in_flight)),
        ("specgate_replica_scrape_age_seconds", "Seconds since the replica's last good scrape.", Fleet.scrape_age),
        ("specgate_replica_drained", "1 while the replica takes no new request (drained by the policy document, "
         "or no longer found by discovery).", lambda rep: float(rep.drained)),
        ("specgate_replica_tokens_per_step", "Tokens a sequence gains per engine step on the replica, from its "
         "spec-decode counters (1 + accepted drafts per step); NaN on a plain replica.",
         lambda rep: rep.tokens_per_step if rep.tokens_per_step is not None else math.nan),
    )  # fmt: skip

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        replicas = list(self.fleet.replicas.values())
        for name, documentation, read in self._GAUGES:
            family = GaugeMetricFamily(name, documentation, labels=("replica", "pool"))
            for replica in replicas:
                family.add_metric((replica.name, replica.pool.value), read(replica))
            yield family
        ejections = CounterMetricFamily("specgate_replica_ejections", "Times the replica was ejected (failures, "
                                        "failed scrapes, no progress).", labels=("replica", "pool"))  # fmt: skip
        for replica in replicas:
            ejections.add_metric((replica.name, replica.pool.value), replica.ejections)
        yield ejections
        share = GaugeMetricFamily("specgate_fleet_share", "This gateway's share of the requests the fleet's "
                                  "replicas serve (first tokens), over the last half minute or so.")  # fmt: skip
        share.add_metric((), self.fleet.share.value)
        yield share


def _stderr(term: int, report: FitReport) -> float:
    return report.stderr[term]


def _fit_gauges(r: CollectorRegistry, fleet: Fleet) -> None:
    """Each pool's re-fitted step costs (`workers/latency_fit.py`), read when /metrics is."""
    scale = Gauge("specgate_step_cost_scale", "Each term of the pool's step cost as its answers show it, over "
                  "the profile's: fixed (a step of one sequence), decode (what sequences and context add), "
                  "prefill (what prompt tokens add).", ("pool", "term"), registry=r)  # fmt: skip
    scale_error = Gauge("specgate_step_cost_scale_stderr", "Standard error of specgate_step_cost_scale.",
                        ("pool", "term"), registry=r)  # fmt: skip
    overhead = Gauge("specgate_ttft_overhead_seconds", "Fitted time before a first token that no engine step "
                     "accounts for (the server's HTTP, tokenization, scheduling).", ("pool",), registry=r)  # fmt: skip
    overhead_error = Gauge("specgate_ttft_overhead_stderr_seconds", "Standard error of "
                           "specgate_ttft_overhead_seconds.", ("pool",), registry=r)  # fmt: skip
    wait = Gauge("specgate_ttft_wait_steps", "Fitted steps of the batch a newcomer finds (as the profile "
                 "prices one) that it waits for its first token beyond the half step in flight.", ("pool",),
                 registry=r)  # fmt: skip
    wait_error = Gauge("specgate_ttft_wait_steps_stderr", "Standard error of specgate_ttft_wait_steps.",
                       ("pool",), registry=r)  # fmt: skip
    error = Gauge("specgate_prediction_log_error", "Root mean square of log(measured / predicted) over the "
                  "pool's recent answers, by kind (ttft, tpot).", ("pool", "kind"), registry=r)  # fmt: skip
    factor = Gauge("specgate_prediction_factor", "Measured over predicted latency that the fitted step costs "
                   "still miss on the pool's answers, smoothed, by kind (ttft, tpot; tpot from answers "
                   "whose batch was about the one predicted): it multiplies the predictions (of a TPOT, "
                   "its decoding, not the stalls by arriving prompts' prefill).",
                   ("pool", "kind"), registry=r)  # fmt: skip
    spread = Gauge("specgate_tpot_spread", "Root mean square of log(measured / predicted) TPOT over the "
                   "pool's answers, predictions as made: the replica's noise and the traffic forecast's "
                   "misses, which the predictions' chances allow for.", ("pool",), registry=r)  # fmt: skip
    answers = Gauge("specgate_step_cost_answers", "Answers measured on the pool, by use: all (checked against "
                    "their predictions) and fitted (from a steady replica: the step costs' evidence).",
                    ("pool", "use"), registry=r)  # fmt: skip

    def reader(fit: LatencyFit, read: Callable[[FitReport], float | None]) -> Callable[[], float]:
        def value() -> float:
            got = read(fit.report())
            return float("nan") if got is None else got

        return value

    for pool, fit in fleet.fits.items():
        name = pool.value
        for i, term in enumerate(("fixed", "decode", "prefill")):
            scale.labels(name, term).set_function(reader(fit, attrgetter(f"scales.{term}")))
            scale_error.labels(name, term).set_function(reader(fit, partial(_stderr, i)))
        overhead.labels(name).set_function(reader(fit, lambda report: report.scales.overhead_ms / 1e3))
        overhead_error.labels(name).set_function(reader(fit, lambda report: _stderr(3, report) / 1e3))
        wait.labels(name).set_function(reader(fit, attrgetter("scales.wait")))
        wait_error.labels(name).set_function(reader(fit, partial(_stderr, 4)))
        error.labels(name, "ttft").set_function(reader(fit, attrgetter("ttft_error")))
        error.labels(name, "tpot").set_function(reader(fit, attrgetter("tpot_error")))
        factor.labels(name, "ttft").set_function(reader(fit, attrgetter("scales.ttft_factor")))
        factor.labels(name, "tpot").set_function(reader(fit, attrgetter("scales.tpot_factor")))
        spread.labels(name).set_function(reader(fit, attrgetter("scales.tpot_spread")))
        answers.labels(name, "all").set_function(reader(fit, attrgetter("answers")))
        answers.labels(name, "fitted").set_function(reader(fit, attrgetter("fitted")))


def _cost_gauges(
    r: CollectorRegistry, fleet: Fleet, tokens: TokenRate, prices: Mapping[Pool, float], clock: Callable[[], float]
) -> None:
    """Each pool's throughput over the last minute and, where its replicas have a price, what a
    million of its tokens cost at that throughput (`calibration/pricing.py`)."""
    rate = Gauge("specgate_output_tokens_per_second", "Tokens the pool generated a second over the last "
                 "minute, as this gateway relayed them.", ("pool",), registry=r)  # fmt: skip
    cost = Gauge("specgate_usd_per_million_output_tokens", "What a million of the pool's tokens cost at its "
                 "throughput over the last minute: its admitted replicas' price per hour ([pricing]) over the "
                 "tokens they generated; +Inf while they generate none.", ("pool",), registry=r)  # fmt: skip

    def per_second(pool: Pool) -> float:
        return tokens.per_second(pool, clock())

    def usd(pool: Pool, price: float) -> float:
        admitted = sum(1 for rep in fleet.replicas.values() if rep.pool is pool and rep.healthy)
        return usd_per_million_tokens(price * admitted, per_second(pool))

    for pool in Pool:
        rate.labels(pool.value).set_function(partial(per_second, pool))
        if pool in prices:
            cost.labels(pool.value).set_function(partial(usd, pool, prices[pool]))


class GatewayMetrics:
    def __init__(
        self,
        fleet: Fleet,
        *,
        with_store: bool = False,
        prices: Mapping[Pool, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        summed: Path | None = None,
    ) -> None:
        """With `summed`, the gateway is one of several processes (`specgate serve --workers N`)
        whose counters and histograms Prometheus's client keeps in files there: /metrics shows them
        summed over the processes, and this process's own gauges."""
        self.summed = summed
        self.registry = r = CollectorRegistry()
        self.tokens = TokenRate(clock())
        """What each pool generated lately, as this gateway relayed it: its throughput."""
        self.output_tokens = _Children(Counter(
            "specgate_output_tokens", "Tokens generated (completion tokens answered), per pool.",
            ("pool",), registry=r,
        ))  # fmt: skip
        _cost_gauges(r, fleet, self.tokens, prices or {}, clock)
        self.requests = _Children(Counter(
            "specgate_requests", "Requests answered, by pool, routing reason and HTTP status.",
            ("pool", "reason", "status"), registry=r,
        ))  # fmt: skip
        self.decisions = _Children(Counter(
            "specgate_routing_decisions", "Routing decisions, by policy, pool and reason.",
            ("policy", "pool", "reason"), registry=r,
        ))  # fmt: skip
        self.retries = _Children(Counter(
            "specgate_retries", "Requests retried on another replica before any byte reached the client.",
            ("pool",), registry=r,
        ))  # fmt: skip
        self.failovers = _Children(Counter(
            "specgate_stream_failovers",
            "Streams whose replica failed midway, by outcome: resumed on another replica, failed "
            "(no replica could go on with it), not_resumable (an answer that cannot be continued from its text).",
            ("outcome",), registry=r,
        ))  # fmt: skip
        self.ttft = _Children(Histogram(
            "specgate_ttft_seconds", "Observed time to first byte of streamed responses, per pool.",
            ("pool",), buckets=_LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.tpot = _Children(Histogram(
            "specgate_tpot_seconds", "Observed mean time per output token of streamed responses, per pool.",
            ("pool",), buckets=_TPOT_BUCKETS, registry=r,
        ))  # fmt: skip
        self.slo = _Children(Counter(
            "specgate_slo", "Requests with an SLO, by SLO kind (ttft, tpot), outcome (met, missed), pool and "
            f"request class (x-request-class; the first {MAX_CLASSES} seen, then 'other'; '-' without one).",
            ("kind", "outcome", "pool", "class"), registry=r,
        ))  # fmt: skip
        self.classes: set[str] = set()
        self.ttft_error = _Children(Histogram(
            "specgate_ttft_prediction_error_seconds", "Predicted minus observed TTFT, per pool.",
            ("pool",), buckets=_ERROR_BUCKETS, registry=r,
        ))  # fmt: skip
        self.tpot_error = _Children(Histogram(
            "specgate_tpot_prediction_error_seconds", "Predicted minus observed TPOT, per pool.",
            ("pool",), buckets=_TPOT_ERROR_BUCKETS, registry=r,
        ))  # fmt: skip
        r.register(_ReplicaGauges(fleet))
        _fit_gauges(r, fleet)
        self.queue_depth = Gauge("specgate_queue_depth", "Requests held in the gateway's admission queue.",
                                 registry=r)  # fmt: skip
        self.queue_held_elsewhere = Gauge(
            "specgate_queue_held_elsewhere", "Requests the gateway's other processes and the other gateways hold "
            "that can still meet their targets (this one places none that cannot meanwhile).", registry=r,
        )  # fmt: skip
        self.queue_wait = _Children(Histogram(
            "specgate_queue_wait_seconds", "Time requests spent in the admission queue, by outcome "
            "(dispatched, refused).", ("outcome",), buckets=_LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.queue_dropped = _Children(Counter(
            "specgate_queue_dropped", "Requests refused from the admission queue, by reason (deadline, "
            "queue-full).", ("reason",), registry=r,
        ))  # fmt: skip
        self.policy_version = Gauge("specgate_policy_version", "Version of the policy document in force.",
                                    registry=r)  # fmt: skip
        self.policy_changes = _Children(Counter(
            "specgate_policy_changes", "Policy documents read from the store, by outcome (applied, rejected).",
            ("outcome",), registry=r,
        ))  # fmt: skip
        self.policy_store_up = Gauge(
            "specgate_policy_store_up", "1 while the policy store (Redis) is reachable, 0 while it is not.",
            registry=r if with_store else None,
        )  # fmt: skip
        self.exchange_failures = Counter(
            "specgate_count_exchange_failures", "Rounds in which the gateway could not exchange its counts "
            "with the other gateways through Redis.", registry=r if with_store else None,
        )  # fmt: skip
        if fleet.shared is not None and fleet.shared.others:
            counted = Gauge("specgate_gateways_counted", "Other gateways whose requests this gateway counts "
                            "as they are sent (exchanged through Redis).", registry=r)  # fmt: skip
            counted.set_function(lambda: float(fleet.shared.gateways_counted()) if fleet.shared is not None else 0.0)

    def exchange_failed(self) -> None:
        self.exchange_failures.inc()

    def advise(self, advisor: Advisor) -> None:
        """The live advisor's recommendation, read when /metrics is (NaN until its first plan)."""

        def read(field: str) -> Callable[[], float]:
            return lambda: float(getattr(advisor.advice.plan, field)) if advisor.advice is not None else math.nan

        r = self.registry
        recommended = Gauge("specgate_recommended_speculative_replicas", "Speculative replicas of the split "
                            "the live advisor recommends for the recent traffic.", registry=r)  # fmt: skip
        gain = Gauge("specgate_recommended_split_gain", "The recommended split's predicted good tokens a second "
                     "(of requests that meet their SLOs) over the current split's, less one, on the recent traffic.",
                     registry=r)  # fmt: skip
        recommended.set_function(read("recommended"))
        gain.set_function(read("gain"))

    def request_class(self, name: str) -> str:
        """The label of a request class: itself while few are known, else 'other'."""
        if name not in self.classes:
            if len(self.classes) >= MAX_CLASSES:
                return "other"
            self.classes.add(name)
        return name

    def exposition(self) -> bytes:
        if self.summed is None:
            return generate_latest(self.registry)
        summed = _Summed(self.summed)
        return generate_latest(summed) + generate_latest(_Except(self.registry, summed.names()))
