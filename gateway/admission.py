"""The gateway's admission queue, on the event loop: requests the policy holds wait here, not in
a replica's queue, and are offered the fleet again every `REVIEW_INTERVAL_S` and whenever a
request ends, in order of priority and deadline (`policies/admission.py` keeps the order and
the policy decides). How many of them can still meet their targets is published to the
gateway's other processes and the other gateways (`Fleet.hold`), which place none of theirs that
cannot while any can. A held request whose client leaves is forgotten at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from specgate.gateway.journey import Journey
from specgate.gateway.metrics import GatewayMetrics
from specgate.policies.admission import QUEUE_FULL, REVIEW_INTERVAL_S, AdmissionQueue
from specgate.policies.decision import Decision, Shed, Verdict
from specgate.policies.features import RequestFeatures
from specgate.workers.pools import Fleet

_log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Held:
    journey: Journey
    outcome: asyncio.Future[Decision | Shed | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class AdmissionControl:
    def __init__(self, fleet: Fleet, metrics: GatewayMetrics) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.queue: AdmissionQueue[_Held] = AdmissionQueue()
        self._wake = asyncio.Event()
        metrics.queue_depth.set_function(lambda: float(len(self.queue)))
        metrics.queue_held_elsewhere.set_function(fleet.held_elsewhere)

    async def hold(self, journey: Journey) -> Decision | Shed | None:
        """Wait until the policy dispatches or refuses the request; its refusal when the queue is full."""
        held = _Held(journey)
        self.queue.settings = journey.plan.admission
        if not self.queue.hold(held, journey.features, journey.arrived):
            self.metrics.queue_dropped.labels(QUEUE_FULL).inc()
            return Shed(QUEUE_FULL, 1.0, f"the admission queue is full ({self.queue.settings.max_queue} requests)")
        self._wake.set()
        self._publish()
        try:
            verdict = await held.outcome
        finally:
            self.queue.remove(held)
            self._publish()
        waited = time.monotonic() - journey.arrived
        self.metrics.queue_wait.labels("dispatched" if isinstance(verdict, Decision) else "refused").observe(waited)
        if isinstance(verdict, Shed):
            self.metrics.queue_dropped.labels(verdict.reason).inc()
        return verdict

    def kick(self) -> None:
        """Capacity may have freed up: review the queue now rather than at the next interval."""
        if len(self.queue):
            self._wake.set()

    def _decide(self, held: _Held, features: RequestFeatures) -> Verdict:
        try:
            return held.journey.plan.decide(features, self.fleet.snapshot(time.monotonic(), held.journey.plan.profile))
        except Exception:  # a bug must fail this request (503), not leave it waiting for ever
            _log.exception("deciding for a held request failed")
            return None

    def _publish(self) -> None:
        """Tell the other processes and gateways how many requests held here can still be saved."""
        self.fleet.hold(self.queue.live(time.monotonic()))

    async def review(self) -> None:
        reviewed = self.queue.review(time.monotonic(), self._decide, held_elsewhere=self.fleet.held_elsewhere())
        for held, verdict in reviewed:
            if not held.outcome.done():
                held.outcome.set_result(verdict)
                # Let the request go on until it has been counted on its replica (its attempt
                # does that before its first await), so that the next decision sees it there.
                await asyncio.sleep(0)
        self._publish()

    async def run(self) -> None:
        """Until cancelled: review the queue while it holds requests, at once when kicked."""
        while True:
            if len(self.queue):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), REVIEW_INTERVAL_S)
            else:
                await self._wake.wait()
            self._wake.clear()
            await self.review()
