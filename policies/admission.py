"""The gateway's admission queue: requests no replica can serve in time now wait in the gateway,
not in a replica's first-come-first-served queue where they would delay everyone behind them.

The policy decides (`Hold`: wait; a `Decision`: go; a `Shed`: refuse) and is asked again, with
the time the request has waited, whenever capacity may have freed up. The queue only keeps the
waiting requests in the order they are offered the fleet: higher `x-priority` first, then the
earliest deadline. It is pure: time comes in as an argument, so the gateway and the offline
simulator run the same code.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Annotated, Generic, TypeVar

import msgspec
from msgspec import Meta

from specgate.policies.decision import Decision, Hold, Shed, Verdict
from specgate.policies.features import RequestFeatures
from specgate.validation import Milliseconds

H = TypeVar("H")

QUEUE_FULL = "queue-full"
DEADLINE = "deadline"


class Admission(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The policy document's `admission`: how requests that cannot be served in time now are held."""

    enabled: bool = True
    """Hold them in the gateway; off, they are placed at once wherever they do least harm."""
    max_queue: Annotated[int, Meta(ge=0, le=1_000_000)] = 1000
    """Requests held at once; a request that finds the queue full is refused (429)."""
    max_wait_factor: Annotated[float, Meta(ge=1, le=1000)] = 3.0
    """How long past its arrival a request may still be served, as a multiple of its TTFT target:
    past its target it is served best-effort, where it delays no one; past this it is refused."""
    max_wait_ms: Milliseconds = 30_000.0
    """The same bound for a request without a TTFT target."""
    refuse_infeasible: bool = True
    """Refuse at once (400) a request whose SLOs no replica could meet even idle."""

    def give_up_ms(self, features: RequestFeatures) -> float:
        """How long after its arrival the request is refused if it has not been dispatched."""
        if features.slo_ttft_ms is None:
            return self.max_wait_ms
        return self.max_wait_factor * features.slo_ttft_ms


@dataclass(order=True)
class _Entry(Generic[H]):
    key: tuple[int, float, int]
    handle: H = field(compare=False)
    features: RequestFeatures = field(compare=False)
    arrived: float = field(compare=False)
    """When the request arrived, in seconds of the caller's clock."""
    give_up: float = field(compare=False)


@dataclass
class AdmissionQueue(Generic[H]):
    """Requests held in the gateway, each known by the caller's `handle`."""

    settings: Admission = field(default_factory=Admission)
    _heap: list[_Entry[H]] = field(default_factory=list)
    _gone: set[int] = field(default_factory=set)
    _order: itertools.count[int] = field(default_factory=itertools.count)
    _ids: dict[H, int] = field(default_factory=dict)
    """Handle -> the entry's sequence number, for removal."""

    def __len__(self) -> int:
        return len(self._ids)

    def hold(self, handle: H, features: RequestFeatures, arrived: float) -> bool:
        """Keep the request; False when the queue is full (the caller refuses it)."""
        if len(self) >= self.settings.max_queue:
            return False
        deadline = arrived + (features.slo_ttft_ms or self.settings.give_up_ms(features)) / 1e3
        give_up = arrived + self.settings.give_up_ms(features) / 1e3
        number = next(self._order)
        heapq.heappush(self._heap, _Entry((-features.priority, deadline, number), handle, features, arrived, give_up))
        self._ids[handle] = number
        return True

    def remove(self, handle: H) -> None:
        """Forget a request (its client left)."""
        number = self._ids.pop(handle, None)
        if number is not None:
            self._gone.add(number)

    def next_give_up(self) -> float | None:
        """The earliest time a held request is due to be refused."""
        live = [e.give_up for e in self._heap if e.key[2] not in self._gone]
        return min(live) if live else None

    def review(
        self, now: float, decide: Callable[[H, RequestFeatures], Verdict], budget: int = 16, patience: int = 4
    ) -> Iterator[tuple[H, Decision | Shed | None]]:
        """Offer the fleet to the held requests: yields each request that leaves the queue with what
        became of it, refusing any past its time. The caller dispatches each before it asks for the
        next, so that `decide` sees every dispatch made before.

        Requests whose TTFT target has passed are offered the fleet only when every request that
        can still meet its own is placed: capacity goes first to requests it can still save. At
        most `budget` requests are asked, and none more once `patience` in a row were held (the
        fleet is full for them)."""
        live: list[_Entry[H]] = []
        lost: list[_Entry[H]] = []
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry.key[2] in self._gone:
                self._gone.discard(entry.key[2])
            elif now >= entry.give_up:
                self._ids.pop(entry.handle, None)
                yield entry.handle, Shed(DEADLINE, 1.0, "no replica could serve it in time")
            else:
                (lost if now >= entry.key[1] else live).append(entry)
        kept: list[_Entry[H]] = []
        asked = held = 0
        try:
            for phase, entries in (("live", live), ("lost", lost)):
                for entry in entries:
                    if asked >= budget or held >= patience or (phase == "lost" and kept):
                        kept.append(entry)
                        continue
                    asked += 1
                    verdict = decide(entry.handle, replace(entry.features, waited_ms=(now - entry.arrived) * 1e3))
                    if isinstance(verdict, Hold):
                        held += 1
                        kept.append(entry)
                        continue
                    if phase == "live" and isinstance(verdict, Decision) and verdict.best_effort:
                        lost.append(entry)  # out of reach after all: after those that are not
                        continue
                    held = 0
                    self._ids.pop(entry.handle, None)
                    yield entry.handle, verdict
        finally:
            for entry in kept:
                heapq.heappush(self._heap, entry)
