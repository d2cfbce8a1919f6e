"""What the gateway learns from each answered request, fed through one place.

After every request: the request counter by pool, reason and status (the gateway's own refusals
and errors included), the access log line when it is on, and, from a successful answer, the
tokens it generated (the pool's throughput, which prices its tokens, and the recent traffic the
live advisor plans on), the output length for its group, the replica's observed TTFT and TPOT and
the re-fit of its pool's step costs, on a speculative replica the speedup of the request's group
over the pool's mean acceptance, the latency histograms, the prediction error and the SLO outcome.
A request the policy refused is recent traffic for the advisor too (`shed`).
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from specgate.calibration.modes import Pool
from specgate.gateway.advisor import Seen, TrafficWindow
from specgate.gateway.attempt import Attempt
from specgate.gateway.errors import GatewayError
from specgate.gateway.journey import Journey
from specgate.gateway.metrics import GatewayMetrics
from specgate.gateway.tracing import Span, Tracer
from specgate.policies.drafts import DraftStats
from specgate.policies.length import LengthStats

ACCESS_LOG = logging.getLogger("specgate.access")


class Feedback:
    def __init__(
        self,
        metrics: GatewayMetrics,
        lengths: LengthStats,
        drafts: DraftStats,
        *,
        access_log: bool,
        window: TrafficWindow | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.metrics = metrics
        self.tracer = tracer
        self.window = window
        """The recent traffic the live advisor plans on."""
        self.lengths = lengths
        self.drafts = drafts
        self.access_log = access_log

    def answered(self, journey: Journey, attempt: Attempt) -> None:
        """A replica's answer reached the client (or the client left while it was coming)."""
        outcome, replica, decision = attempt.outcome, attempt.replica, attempt.decision
        pool = replica.pool.value
        self.metrics.requests.labels(pool, decision.reason, str(outcome.status)).inc()
        self._log(journey, outcome.status, pool, replica.name, decision.reason, outcome.ttft_s)
        if journey.span is not None:
            self._trace(journey, outcome.status, {
                "specgate.pool": pool, "specgate.replica": replica.name, "specgate.reason": decision.reason,
                "specgate.predicted_ttft_ms": decision.predicted_ttft_ms,
                "specgate.predicted_tpot_ms": decision.predicted_tpot_ms,
                "specgate.ttft_ms": outcome.ttft_s * 1e3 if outcome.ttft_s is not None else None,
                "specgate.tpot_ms": outcome.tpot_s * 1e3 if outcome.tpot_s is not None else None,
                "gen_ai.usage.output_tokens": outcome.completion_tokens,
            })  # fmt: skip
        if outcome.status >= 400:
            return
        features, headers = journey.features, journey.headers
        if outcome.generated:
            self.metrics.output_tokens.labels(pool).inc(outcome.generated)
            self.metrics.tokens.add(replica.pool, outcome.generated, time.monotonic())
            self._seen(journey, outcome.generated)
        if outcome.completion_tokens is not None:
            self.lengths.end(journey.length, outcome.completion_tokens, time.monotonic())
        if outcome.streamed:
            _, predicted_tpot_s = decision.predicted_s
            replica.observe(outcome.ttft_s, outcome.tpot_s, decision.terms, outcome.stay, outcome.ended, outcome.step_s)
            if replica.pool is Pool.SPECULATIVE and outcome.tpot_s is not None and predicted_tpot_s is not None:
                self.drafts.observe(journey.draft_group, predicted_tpot_s, features.draft_speedup, outcome.tpot_s)
            if outcome.ttft_s is not None:
                self.metrics.ttft.labels(pool).observe(outcome.ttft_s)
                if decision.predicted_ttft_ms is not None:
                    self.metrics.ttft_error.labels(pool).observe(decision.predicted_ttft_ms / 1e3 - outcome.ttft_s)
            if outcome.tpot_s is not None:
                self.metrics.tpot.labels(pool).observe(outcome.tpot_s)
                if predicted_tpot_s is not None:
                    self.metrics.tpot_error.labels(pool).observe(predicted_tpot_s - outcome.tpot_s)
        request_class = self.metrics.request_class(journey.request_class or "-")
        if headers.slo_ttft_ms is not None and outcome.ttft_s is not None:
            met = (attempt.waited_s + outcome.ttft_s) * 1e3 <= headers.slo_ttft_ms
            self.metrics.slo.labels("ttft", "met" if met else "missed", pool, request_class).inc()
        if headers.slo_tpot_ms is not None and outcome.tpot_s is not None:
            met = outcome.tpot_s * 1e3 <= headers.slo_tpot_ms
            self.metrics.slo.labels("tpot", "met" if met else "missed", pool, request_class).inc()

    def shed(self, journey: Journey) -> None:
        """The policy refused the request (out of reach, or its wait in the admission queue over):
        traffic the fleet did not serve as it is split now, which the advisor plans on as it plans
        on what was answered, at the output length the policy expected of it (none expected, none
        to plan on). Not what the gateway refuses for the client's sake (a malformed request, a
        prompt too long for the model, a client's rate limit): no split would serve that."""
        output = journey.features.expected_output_tokens or journey.features.max_tokens
        if output:
            self._seen(journey, output)

    def _seen(self, journey: Journey, output_tokens: int) -> None:
        if self.window is not None:
            features = journey.features
            self.window.record(Seen(journey.arrived, features.prompt_tokens, output_tokens,
                                    features.slo_ttft_ms, features.slo_tpot_ms))  # fmt: skip

    def refused(
        self, journey: Journey | None, error: GatewayError, request: web.Request | None = None,
        span: Span | None = None,
    ) -> None:  # fmt: skip
        """The gateway answered with an error of its own (nothing of a replica reached the client);
        without a journey, before the request was read whole and parsed: its `request` and `span`.
        (It is counted where it is rendered: `errors.openai_errors`.)"""
        if journey is not None:
            self._log(journey, error.status, "none", "-", error.reason, None)
            if journey.span is not None:
                self._trace(journey, error.status, {"specgate.reason": error.reason}, error=error.message)
            return
        if request is None:
            return
        if self.access_log:
            ACCESS_LOG.info("%s %s %d request_id=- reason=%s", request.method, request.path, error.status, error.reason)
        if span is not None and self.tracer is not None:
            self.tracer.end(span, "specgate.route", {
                "http.request.method": request.method, "url.path": request.path,
                "http.response.status_code": error.status, "specgate.reason": error.reason,
            }, error=error.message)  # fmt: skip

    def _trace(self, journey: Journey, status: int, attributes: dict[str, object], error: str | None = None) -> None:
        """The request's span, with what routed it and what it got; ended once."""
        assert self.tracer is not None
        assert journey.span is not None
        features = journey.features
        self.tracer.end(journey.span, "specgate.route", {
            "http.request.method": journey.request.method, "url.path": journey.request.path,
            "http.response.status_code": status, "gen_ai.request.model": features.model,
            "specgate.request_id": journey.headers.request_id, "specgate.policy": journey.plan.policy.name,
            "specgate.request_class": journey.request_class or None, "specgate.attempts": len(journey.tried),
            "specgate.prompt_tokens": features.prompt_tokens, "specgate.slo_ttft_ms": features.slo_ttft_ms,
            "specgate.slo_tpot_ms": features.slo_tpot_ms, **attributes,
        }, error=error if error is not None else (f"status {status}" if status >= 500 else None))  # fmt: skip
        journey.span = None

    def _log(self, journey: Journey, status: int, pool: str, replica: str, reason: str, ttft_s: float | None) -> None:
        if not self.access_log:
            return
        ttft = f"{ttft_s * 1e3:.1f}" if ttft_s is not None else "-"
        ACCESS_LOG.info(
            "%s %s %d request_id=%s class=%s pool=%s replica=%s reason=%s attempts=%d ttft_ms=%s duration_ms=%.1f",
            journey.request.method, journey.request.path, status, journey.headers.request_id,
            journey.request_class or "-", pool, replica, reason, len(journey.tried), ttft,
            (time.monotonic() - journey.arrived) * 1e3,
        )  # fmt: skip
