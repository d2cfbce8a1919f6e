"""The admission queue: order, bounds, refusal past the wait, and the policy asked with the wait."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specgate.calibration.modes import Pool
from specgate.policies.admission import DEADLINE, Admission, AdmissionQueue
from specgate.policies.decision import Decision, Hold, Shed, Verdict
from specgate.policies.features import RequestFeatures
from specgate.workers.pools import FleetSettings, Replica

FEATURES = RequestFeatures(
    model="m", stream=True, prompt_tokens=100, max_tokens=None, expected_output_tokens=50, slo_ttft_ms=1000.0,
    slo_tpot_ms=50.0, forced_pool=None, priority=0, sequence=0,
)  # fmt: skip
REPLICA = replace(Replica("plain-0", "http://x", Pool.PLAIN, FleetSettings()).state(0.0), healthy=True)


def go(_: str, features: RequestFeatures) -> Verdict:
    return Decision(REPLICA, "meets-slo")


def test_requests_leave_in_priority_then_deadline_order() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    queue.hold("late-deadline", FEATURES, arrived=0.0)
    queue.hold("early-deadline", replace(FEATURES, slo_ttft_ms=300.0), arrived=0.0)
    queue.hold("important", replace(FEATURES, priority=5), arrived=0.1)
    order = [handle for handle, _ in list(queue.review(0.2, go))]
    assert order == ["important", "early-deadline", "late-deadline"]
    assert len(queue) == 0


def test_a_full_queue_refuses_and_a_removed_request_is_forgotten() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(Admission(max_queue=2))
    assert queue.hold("a", FEATURES, 0.0)
    assert queue.hold("b", FEATURES, 0.0)
    assert not queue.hold("c", FEATURES, 0.0)
    queue.remove("a")
    assert len(queue) == 1
    assert queue.hold("c", FEATURES, 0.0)
    assert [h for h, _ in list(queue.review(0.1, go))] == ["b", "c"]


def test_the_policy_is_asked_with_the_time_waited_and_past_the_wait_the_request_is_refused() -> None:
    asked: list[float] = []

    def wait(_: str, features: RequestFeatures) -> Verdict:
        asked.append(features.waited_ms)
        return Hold()

    queue: AdmissionQueue[str] = AdmissionQueue(Admission(max_wait_factor=3.0))
    queue.hold("r", FEATURES, arrived=10.0)
    assert list(queue.review(10.4, wait)) == []
    assert asked == [pytest.approx(400.0)]
    assert queue.next_give_up() == 13.0  # three times its 1 s TTFT target
    ((handle, verdict),) = list(queue.review(13.0, wait))
    assert handle == "r"
    assert isinstance(verdict, Shed)
    assert (verdict.reason, verdict.retry_after_s) == (DEADLINE, 1.0)
    assert asked == [pytest.approx(400.0)]  # refused without asking again
    no_target = replace(FEATURES, slo_ttft_ms=None)
    assert Admission(max_wait_ms=5000.0).give_up_ms(no_target) == 5000.0


def test_a_review_stops_asking_once_the_fleet_holds_several_in_a_row() -> None:
    asked: list[str] = []

    def full(handle: str, _: RequestFeatures) -> Verdict:
        asked.append(handle)
        return Hold()

    queue: AdmissionQueue[str] = AdmissionQueue()
    for i in range(10):
        queue.hold(f"r{i}", replace(FEATURES, slo_ttft_ms=1000.0 + i), arrived=0.0)
    assert list(queue.review(0.1, full, patience=3)) == []
    assert asked == ["r0", "r1", "r2"]
    assert len(queue) == 10


def test_capacity_goes_first_to_requests_that_can_still_meet_their_targets() -> None:
    asked: list[str] = []

    def fleet_with_one_slot(handle: str, features: RequestFeatures) -> Verdict:
        asked.append(handle)
        if handle == "saved":
            return Decision(REPLICA, "meets-slo")
        return Hold()

    queue: AdmissionQueue[str] = AdmissionQueue()
    queue.hold("lost", replace(FEATURES, slo_ttft_ms=100.0), arrived=0.0)  # its target passed at 0.1
    queue.hold("saved", FEATURES, arrived=0.0)
    queue.hold("waiting", replace(FEATURES, slo_ttft_ms=2000.0), arrived=0.0)
    assert [h for h, _ in queue.review(0.25, fleet_with_one_slot)] == ["saved"]
    assert asked == ["saved", "waiting"]  # "lost" is not offered the fleet while "waiting" waits

    def out_of_reach(handle: str, features: RequestFeatures) -> Verdict:
        return Decision(REPLICA, "best-effort", best_effort=True)

    # a request the policy finds out of reach before the queue does goes after the others too
    queue = AdmissionQueue()
    queue.hold("a", FEATURES, arrived=0.0)
    queue.hold("b", replace(FEATURES, slo_ttft_ms=1500.0), arrived=0.0)
    assert [h for h, _ in queue.review(0.5, out_of_reach)] == ["a", "b"]


def test_requests_past_their_target_wait_while_other_queues_hold_requests_that_can_meet_theirs() -> None:
    """Other processes of the gateway, or other gateways, in front of the same fleet: capacity
    goes to their requests that can still be saved before to this queue's that cannot."""

    def out_of_reach(handle: str, features: RequestFeatures) -> Verdict:
        return Decision(REPLICA, "best-effort", best_effort=True)

    queue: AdmissionQueue[str] = AdmissionQueue()
    queue.hold("lost", replace(FEATURES, slo_ttft_ms=100.0), arrived=0.0)  # its target passed at 0.1
    queue.hold("saved", FEATURES, arrived=0.0)
    queue.hold("doomed", FEATURES, arrived=0.0)
    assert queue.live(0.05) == 3
    assert queue.live(0.15) == 2
    assert [h for h, _ in queue.review(0.15, go, budget=1, held_elsewhere=2.0)] == ["saved"]
    assert [h for h, _ in queue.review(0.2, out_of_reach, held_elsewhere=2.0)] == []  # found out of reach: waits
    assert (queue.live(0.2), len(queue)) == (0, 2)  # none left that can be saved: nothing for others to wait on
    assert [h for h, _ in queue.review(0.25, go, held_elsewhere=0.0)] == ["lost", "doomed"]


def test_requests_found_out_of_reach_wait_behind_the_others_and_are_not_asked_again_first() -> None:
    """Under overload the queue's head fills with requests that no replica could serve in time
    even idle: asked once, they wait with the lost ones, and the review's budget goes to those
    behind them."""
    asked: list[str] = []

    def decide(handle: str, _: RequestFeatures) -> Verdict:
        asked.append(handle)
        if handle.startswith("doomed"):
            return Decision(REPLICA, "best-effort", best_effort=True)
        return Hold() if handle == "full" else Decision(REPLICA, "meets-slo")

    queue: AdmissionQueue[str] = AdmissionQueue()
    for i in range(3):  # the earliest deadlines
        queue.hold(f"doomed-{i}", replace(FEATURES, slo_ttft_ms=500.0), arrived=0.0)
    queue.hold("full", FEATURES, arrived=0.0)
    queue.hold("saved", FEATURES, arrived=0.0)
    assert [h for h, _ in queue.review(0.1, decide, budget=4)] == []  # the budget ran out on the doomed
    assert asked == ["doomed-0", "doomed-1", "doomed-2", "full"]
    asked.clear()
    assert [h for h, _ in queue.review(0.2, decide, budget=4)] == ["saved"]
    assert asked == ["full", "saved"]  # a request still waiting in time holds the doomed back
    asked.clear()
    queue.remove("full")
    left = list(queue.review(0.3, decide, budget=4))
    assert [h for h, _ in left] == ["doomed-0", "doomed-1", "doomed-2"]  # nothing else waits: best-effort
    assert all(isinstance(v, Decision) and v.best_effort for _, v in left)
