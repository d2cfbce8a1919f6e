"""Baseline policies and the routing plan, as tables over small snapshots."""

from dataclasses import replace

import pytest

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import A100_CODELLAMA_34B
from specgate.policies.decision import Decision
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel
from specgate.policies.registry import RoutingPlan, build_policy
from specgate.validation import Invalid
from specgate.workers.snapshot import ReplicaState, Snapshot

MODEL = LatencyModel(A100_CODELLAMA_34B)


def replica(
    name: str, pool: Pool, in_flight: int = 0, healthy: bool = True, running: float | None = None
) -> ReplicaState:
    return ReplicaState(
        name=name, url=f"http://{name}", pool=pool, healthy=healthy, in_flight=in_flight, prefilling=0,
        prefill_tokens=0, prefill_tokens_per_s=0.0, arrivals_per_s=0.0,
        dispatched_since_scrape=0, running=running,
        waiting=0.0 if running is not None else None, kv_usage=None, tokens_per_step=None, scrape_age_s=None,
        observed_ttft_s=None, observed_tpot_s=None,
    )  # fmt: skip


FEATURES = RequestFeatures(
    model="m", stream=False, prompt_tokens=512, max_tokens=256, expected_output_tokens=None, slo_ttft_ms=None,
    slo_tpot_ms=None, forced_pool=None, priority=0, sequence=0,
)  # fmt: skip
S = Pool.SPECULATIVE
P = Pool.PLAIN
FLEET = Snapshot((replica("spec-0", S, 3), replica("spec-1", S, 1), replica("plain-0", P, 2), replica("plain-1", P, 0)))
SPEC_DOWN = Snapshot((replica("spec-0", S, healthy=False), replica("plain-0", P, 5), replica("plain-1", P, 4)))
PLAIN_DOWN = Snapshot((replica("spec-0", S, 9), replica("plain-0", P, healthy=False)))
ALL_DOWN = Snapshot((replica("spec-0", S, healthy=False), replica("plain-0", P, healthy=False)))


@pytest.mark.parametrize(
    ("policy", "params", "snapshot", "chosen", "reason"),
    [
        ("least-loaded", {}, FLEET, "plain-1", "least-loaded"),
        ("speculative-only", {}, FLEET, "spec-1", "speculative-only"),
        ("plain-only", {}, FLEET, "plain-1", "plain-only"),
        ("speculative-only", {}, SPEC_DOWN, "plain-1", "speculative-pool-down"),
        ("plain-only", {}, PLAIN_DOWN, "spec-0", "plain-pool-down"),
        # spec pool carries (3 + 1) / 2 = 2 requests per replica
        ("threshold", {"max_load": 3}, FLEET, "spec-1", "below-threshold"),
        ("threshold", {"max_load": 2}, FLEET, "plain-1", "above-threshold"),
        ("threshold", {"max_load": 3}, SPEC_DOWN, "plain-1", "above-threshold"),
        ("least-loaded", {}, ALL_DOWN, None, None),
        ("threshold", {}, ALL_DOWN, None, None),
        ("round-robin", {}, ALL_DOWN, None, None),
    ],
)
def test_policy_table(
    policy: str, params: dict[str, object], snapshot: Snapshot, chosen: str | None, reason: str | None
) -> None:
    decision = build_policy(policy, params, MODEL).decide(FEATURES, snapshot)
    if chosen is None:
        assert decision is None
        return
    assert isinstance(decision, Decision)
    assert (decision.replica.name, decision.reason) == (chosen, reason)
    assert decision.predicted_ttft_ms is not None
    assert decision.predicted_tpot_ms is not None
    assert decision.predicted_ttft_ms > 0
    assert decision.predicted_tpot_ms > 0


def test_threshold_uses_scraped_load_when_fresh() -> None:
    busy = Snapshot((replica("spec-0", S, 0, running=20.0), replica("plain-0", P, 0)))
    decision = build_policy("threshold", {"max_load": 8}, MODEL).decide(FEATURES, busy)
    assert isinstance(decision, Decision)
    assert decision.replica.name == "plain-0"


def test_round_robin_rotates_over_healthy_replicas() -> None:
    policy = build_policy("round-robin", {}, MODEL)
    names = []
    for seq in range(8):
        decision = policy.decide(replace(FEATURES, sequence=seq), SPEC_DOWN)
        assert isinstance(decision, Decision)
        names.append(decision.replica.name)
    assert names == ["plain-0", "plain-1"] * 4


@pytest.mark.parametrize(
    ("allow", "forced", "chosen", "reason"),
    [
        (True, Pool.SPECULATIVE, "spec-1", "forced"),
        (True, Pool.PLAIN, "plain-1", "forced"),
        (False, Pool.SPECULATIVE, "plain-1", "least-loaded"),
    ],
)
def test_plan_honours_forced_pool_when_allowed(allow: bool, forced: Pool, chosen: str, reason: str) -> None:
    plan = RoutingPlan(build_policy("least-loaded", {}, MODEL), MODEL, allow_pool_override=allow)
    decision = plan.decide(replace(FEATURES, forced_pool=forced), FLEET)
    assert isinstance(decision, Decision)
    assert (decision.replica.name, decision.reason) == (chosen, reason)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("nope", {}, "unknown policy"),
        ("least-loaded", {"max_load": 3}, "unknown key"),
        ("threshold", {"max_load": -1}, "max_load"),
        ("threshold", {"max_load": "8"}, "max_load"),
        ("threshold", {"max_load": True}, "max_load"),
    ],
)
def test_build_policy_rejects_bad_names_and_params(name: str, params: dict[str, object], message: str) -> None:
    with pytest.raises(Invalid, match=message):
        build_policy(name, params, MODEL)


def test_speculative_prediction_trades_ttft_for_tpot() -> None:
    spec = MODEL.predict(replica("s", S), FEATURES)
    plain = MODEL.predict(replica("p", P), FEATURES)
    assert spec.ttft_ms > plain.ttft_ms
    assert spec.tpot_ms < plain.tpot_ms
    loaded = MODEL.predict(replica("p", P, in_flight=100), FEATURES)
    assert loaded.tpot_ms > plain.tpot_ms
