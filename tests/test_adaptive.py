"""The adaptive policy's decisions, as tables, and a property test over arbitrary snapshots."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import A100_CODELLAMA_34B
from specgate.policies.adaptive import Adaptive
from specgate.policies.decision import Decision, Shed, Shedding
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel
from specgate.policies.registry import POLICY_NAMES, Knobs, build_policy
from specgate.validation import Invalid
from specgate.workers.pools import FleetSettings, Replica
from specgate.workers.snapshot import ReplicaState, Snapshot

MODEL = LatencyModel(A100_CODELLAMA_34B)
FEATURES = RequestFeatures(
    model="m", stream=True, prompt_tokens=512, max_tokens=None, expected_output_tokens=256, slo_ttft_ms=2000.0,
    slo_tpot_ms=50.0, forced_pool=None, priority=0, sequence=1,
)  # fmt: skip


def state(name: str, pool: Pool, in_flight: int = 0, **changes: object) -> ReplicaState:
    base = Replica(name, f"http://{name}", pool, FleetSettings()).state(0.0)
    return replace(base, **{"healthy": True, "in_flight": in_flight, **changes})  # type: ignore[arg-type]


IDLE = Snapshot((state("spec-0", Pool.SPECULATIVE), state("plain-0", Pool.PLAIN)))
SPEC_BUSY = Snapshot((state("spec-0", Pool.SPECULATIVE, 180), state("plain-0", Pool.PLAIN, 2)))
ALL_SLOW = Snapshot((state("spec-0", Pool.SPECULATIVE, 250), state("plain-0", Pool.PLAIN, 250)))
# plain-0's requests are already past their TPOT target; plain-1's still meet theirs
ONE_LATE = Snapshot((state("plain-0", Pool.PLAIN, 250), state("plain-1", Pool.PLAIN, 4)))


@pytest.mark.parametrize(
    ("snapshot", "features", "chosen", "reason"),
    [
        # idle fleet, long answer: speculation halves TPOT and still meets TTFT
        (IDLE, FEATURES, "spec-0", "meets-slo"),
        # a TTFT target the draft's prefill breaks: plain
        (IDLE, replace(FEATURES, slo_ttft_ms=115.0, slo_tpot_ms=None), "plain-0", "meets-slo"),
        # a TPOT target only speculation meets
        (IDLE, replace(FEATURES, slo_tpot_ms=25.0), "spec-0", "meets-slo"),
        # the speculative replica's batch is large: plain
        (SPEC_BUSY, FEATURES, "plain-0", "meets-slo"),
        # nothing meets the SLO: best effort where it costs least
        (ALL_SLOW, replace(FEATURES, slo_tpot_ms=20.0), "plain-0", "best-effort"),
        # a request that likely misses its TTFT anywhere joins the replica that is late already,
        # not the one whose requests it would slow past their targets (its 127 ms TTFT there
        # is 97% of the target: a 30% chance)
        (ONE_LATE, replace(FEATURES, slo_ttft_ms=127.0 / 0.97), "plain-0", "best-effort"),
        # no SLO at all: the fastest completion
        (IDLE, replace(FEATURES, slo_ttft_ms=None, slo_tpot_ms=None), "spec-0", "fastest"),
    ],
)
def test_decision_table(snapshot: Snapshot, features: RequestFeatures, chosen: str, reason: str) -> None:
    decision = Adaptive(MODEL, exploration=0.0).decide(features, snapshot)
    assert isinstance(decision, Decision)
    assert (decision.replica.name, decision.reason) == (chosen, reason)
    assert decision.predicted_ttft_ms is not None
    assert decision.predicted_tpot_ms is not None


def test_exploration_sends_the_configured_share_to_the_other_pool() -> None:
    policy = Adaptive(MODEL, exploration=0.1)
    reasons = [policy.decide(replace(FEATURES, sequence=i), IDLE) for i in range(1000)]
    explored = [d for d in reasons if isinstance(d, Decision) and d.reason == "explore"]
    assert len(explored) == pytest.approx(100, abs=2)
    assert all(d.replica.pool is Pool.PLAIN for d in explored)


@pytest.mark.parametrize(("priority", "shed"), [(-1, True), (0, False), (5, False)])
def test_shedding_only_when_enabled_and_priority_allows(priority: int, shed: bool) -> None:
    hopeless = replace(FEATURES, slo_tpot_ms=5.0, priority=priority)
    decision = Adaptive(MODEL, shedding=Shedding(enabled=True, below_priority=0)).decide(hopeless, ALL_SLOW)
    assert isinstance(decision, Shed) is shed
    assert isinstance(Adaptive(MODEL).decide(hopeless, ALL_SLOW), Decision)  # shedding off by default


@pytest.mark.parametrize(
    ("params", "field"),
    [({"exploration": 0.1}, "params.exploration"), ({"harm_weight": -1}, "params.harm_weight"),
     ({"shed": True}, "params.shed"), ({"slo_margin": "high"}, "params.slo_margin"),
     ({"tolerance": 2}, "params.tolerance")],
)  # fmt: skip
def test_bad_adaptive_parameters(params: dict[str, object], field: str) -> None:
    with pytest.raises(Invalid) as exc:
        build_policy("adaptive", params, MODEL)
    assert exc.value.field == field


replica_states = st.builds(
    lambda name, pool, healthy, in_flight, prefill, rate, running, kv, tps, c1, c2: state(
        name,
        pool,
        in_flight,
        healthy=healthy,
        prefill_tokens=prefill,
        prefilling=1 if prefill else 0,
        prefill_tokens_per_s=rate,
        running=running,
        waiting=0.0 if running is not None else None,
        kv_usage=kv,
        tokens_per_step=tps,
        ttft_correction=c1,
        tpot_correction=c2,
    ),
    st.sampled_from(["a", "b", "c", "d"]),
    st.sampled_from(list(Pool)),
    st.booleans(),
    st.integers(0, 2000),
    st.integers(0, 10**6),
    st.floats(0, 1e6),
    st.one_of(st.none(), st.floats(0, 5000)),
    st.one_of(st.none(), st.floats(0, 1)),
    st.one_of(st.none(), st.floats(0, 10)),
    st.floats(0.2, 5),
    st.floats(0.2, 5),
)
features = st.builds(
    lambda prompt, out, max_tokens, ttft, tpot, seq, prio: replace(
        FEATURES,
        prompt_tokens=prompt,
        expected_output_tokens=out,
        max_tokens=max_tokens,
        slo_ttft_ms=ttft,
        slo_tpot_ms=tpot,
        sequence=seq,
        priority=prio,
    ),
    st.integers(0, 10**6),
    st.one_of(st.none(), st.integers(1, 10**6)),
    st.one_of(st.none(), st.integers(1, 10**6)),
    st.one_of(st.none(), st.floats(0.001, 1e7)),
    st.one_of(st.none(), st.floats(0.001, 1e7)),
    st.integers(0, 10**9),
    st.integers(-10, 10),
)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=150, deadline=None)
@given(replicas=st.lists(replica_states, max_size=6), request=features, shed=st.booleans())
def test_every_policy_returns_a_healthy_replica_and_never_raises(
    name: str, replicas: list[ReplicaState], request: RequestFeatures, shed: bool
) -> None:
    knobs = Knobs(shedding=Shedding(enabled=shed and name == "adaptive"))
    decision = build_policy(name, {}, MODEL, knobs).decide(request, Snapshot(tuple(replicas)))
    if not any(r.healthy for r in replicas):
        assert decision is None
    elif isinstance(decision, Decision):
        assert decision.replica.healthy
        assert decision.replica in replicas
        assert decision.predicted_ttft_ms is not None
        assert decision.predicted_ttft_ms >= 0
    else:
        assert isinstance(decision, Shed)
        assert shed
        assert request.priority < 0
