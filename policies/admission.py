"""The gateway's admission queue: requests no replica can serve in time now wait in the gateway,
not in a replica's first-come-first-served queue where they would delay everyone behind them.

The policy decides (`Hold`: wait; a `Decision`: go; a `Shed`: refuse) and is asked again, with
the time the request has waited, whenever capacity may have freed up. The queue only keeps the
waiting requests in the order they are offered the fleet: higher `x-priority` first, then the
earliest deadline. It is pure: time comes in as an argument, so the gateway and the offline
simulator run the same code.
"""

from __future__ import annotations

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

REVIEW_INTERVAL_S = 0.05
"""How often whoever holds the queue offers the fleet to its requests again, besides whenever a
request ends (the gateway and the offline simulator alike)."""
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


@dataclass(frozen=True)
class _Entry(Generic[H]):
    order: tuple[int, float, int]
    """Higher priority first, then the earliest deadline, then first come."""
    handle: H
    features: RequestFeatures
    arrived: float
    """When the request arrived, in seconds of the caller's clock."""
    deadline: float
    """When its TTFT target passes (with none, when it is refused)."""
    give_up: float


@dataclass
class AdmissionQueue(Generic[H]):
    """Requests held in the gateway, each known by the caller's `handle`."""

    settings: Admission = field(default_factory=Admission)
    _entries: dict[H, _Entry[H]] = field(default_factory=dict)
    _order: itertools.count[int] = field(default_factory=itertools.count)
    _out_of_reach: set[H] = field(default_factory=set)
    """Requests the policy placed best-effort though their target had not passed: out of reach."""

    def __len__(self) -> int:
        return len(self._entries)

    def hold(self, handle: H, features: RequestFeatures, arrived: float) -> bool:
        """Keep the request; False when the queue is full (the caller refuses it)."""
        if len(self) >= self.settings.max_queue:
            return False
        give_up = arrived + self.settings.give_up_ms(features) / 1e3
        deadline = arrived + features.slo_ttft_ms / 1e3 if features.slo_ttft_ms is not None else give_up
        order = (-features.priority, deadline, next(self._order))
        self._entries[handle] = _Entry(order, handle, features, arrived, deadline, give_up)
        return True

    def remove(self, handle: H) -> None:
        """Forget a request (its client left)."""
        self._entries.pop(handle, None)
        self._out_of_reach.discard(handle)

    def live(self, now: float) -> int:
        """The requests held that can still meet their targets: neither past their deadline nor
        found out of reach."""
        return sum(1 for e in self._entries.values() if now < e.deadline and e.handle not in self._out_of_reach)

    def next_give_up(self) -> float | None:
        """The earliest time a held request is due to be refused."""
        return min((e.give_up for e in self._entries.values()), default=None)

    def review(
        self,
        now: float,
        decide: Callable[[H, RequestFeatures], Verdict],
        budget: int = 16,
        patience: int = 4,
        held_elsewhere: float = 0.0,
    ) -> Iterator[tuple[H, Decision | Shed | None]]:
        """Offer the fleet to the held requests: yields each request that leaves the queue with what
        became of it, refusing any past its time. The caller dispatches each before it asks for the
        next, so that `decide` sees every dispatch made before (and may hold or remove others
        meanwhile).

        Requests whose TTFT target has passed are offered the fleet only when every request that
        can still meet its own is placed: capacity goes first to requests it can still save; and
        none of them while other queues in front of the same fleet hold requests that can
        (`held_elsewhere`: other processes of the gateway, other gateways), whose capacity they
        would take (six gateways on shared counts, the base grid cell at load 1: each placing its
        own late requests first, they met 10.6 points fewer SLOs than one gateway; waiting for
        the others' too, 1.1 fewer). So
        are those the policy found out of reach before their target passed (it would have placed
        them best-effort), and they are not asked again before the others: under overload the
        queue's head is full of them, and asking each at every review spent the review's budget
        before any request behind them was asked. At most `budget` requests are asked, and none
        more once `patience` in a row were held (the fleet is full for them)."""
        live: list[_Entry[H]] = []
        lost: list[_Entry[H]] = []
        for entry in sorted(self._entries.values(), key=lambda e: e.order):
            if now >= entry.give_up:
                del self._entries[entry.handle]
                self._out_of_reach.discard(entry.handle)
                yield entry.handle, Shed(DEADLINE, 1.0, "no replica could serve it in time")
            else:
                (lost if now >= entry.deadline or entry.handle in self._out_of_reach else live).append(entry)
        asked = held = 0
        waiting = held_elsewhere > 0
        """A request that can still meet its target is held: the lost ones wait for capacity."""
        for phase, entries in (("live", live), ("lost", lost)):
            for entry in entries:
                if entry.handle not in self._entries:
                    continue  # its client left meanwhile
                if asked >= budget or held >= patience or (phase == "lost" and waiting):
                    waiting = waiting or phase == "live"
                    continue
                asked += 1
                verdict = decide(entry.handle, replace(entry.features, waited_ms=(now - entry.arrived) * 1e3))
                if isinstance(verdict, Hold):
                    held += 1
                    waiting = waiting or phase == "live"
                    continue
                if phase == "live" and isinstance(verdict, Decision) and verdict.best_effort:
                    lost.append(entry)  # out of reach after all: after those that are not
                    self._out_of_reach.add(entry.handle)
                    continue
                held = 0
                del self._entries[entry.handle]
                self._out_of_reach.discard(entry.handle)
                yield entry.handle, verdict
