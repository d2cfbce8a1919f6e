"""The latency model against the engine model it is calibrated from, and its corrections."""

from dataclasses import replace

import pytest

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import A100_CODELLAMA_34B, H100_LLAMA31_8B, Profile
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel
from specgate.sim.probes import run_alone
from specgate.workers.pools import FleetSettings, Replica
from specgate.workers.snapshot import ReplicaState

FEATURES = RequestFeatures(
    model="m", stream=True, prompt_tokens=512, max_tokens=None, expected_output_tokens=256, slo_ttft_ms=None,
    slo_tpot_ms=None, forced_pool=None, priority=0, sequence=0,
)  # fmt: skip


def idle(pool: Pool, **changes: object) -> ReplicaState:
    state = Replica("r", "http://r", pool, FleetSettings()).state(0.0)
    return replace(state, healthy=True, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("profile", [A100_CODELLAMA_34B, H100_LLAMA31_8B], ids=lambda p: p.name)
@pytest.mark.parametrize("mode", list(Pool))
def test_idle_predictions_match_the_engine(profile: Profile, mode: Pool) -> None:
    engine = run_alone(profile, mode, 512, 256, spread=False)
    pool = Pool.SPECULATIVE if mode is Pool.SPECULATIVE else Pool.PLAIN
    p = LatencyModel(profile).predict(idle(pool), FEATURES)
    assert engine.ttft is not None
    assert engine.tpot is not None
    assert p.ttft_ms == pytest.approx(engine.ttft * 1e3, rel=0.10)
    assert p.tpot_ms == pytest.approx(engine.tpot * 1e3, rel=0.10)


@pytest.mark.parametrize(
    ("changes", "ttft", "tpot", "harm"),
    [
        ({"in_flight": 40}, "up", "up", "up"),  # a busier batch: slower steps, more requests to harm
        ({"prefill_tokens": 8000, "prefilling": 8}, "up", "same", "same"),  # queued prompts: later first token
        ({"prefill_tokens_per_s": 5000.0, "arrivals_per_s": 10.0}, "same", "up", "same"),  # arriving prompts stall
        ({"ttft_correction": 1.3}, "up", "same", "same"),
        ({"tpot_correction": 0.7}, "same", "down", "down"),
    ],
)
def test_predictions_move_with_state(changes: dict[str, float], ttft: str, tpot: str, harm: str) -> None:
    model = LatencyModel(A100_CODELLAMA_34B)
    base = model.predict(idle(Pool.PLAIN, in_flight=4), FEATURES)
    moved = model.predict(idle(Pool.PLAIN, **{"in_flight": 4, **changes}), FEATURES)
    for name, direction in (("ttft_ms", ttft), ("tpot_ms", tpot), ("harm_ms", harm)):
        before, after = getattr(base, name), getattr(moved, name)
        expected = {"up": after > before * 1.01, "down": after < before * 0.99, "same": after == pytest.approx(before)}
        assert expected[direction], (name, before, after)


def test_observed_tokens_per_step_replace_the_profiles() -> None:
    model = LatencyModel(A100_CODELLAMA_34B)
    assumed = model.predict(idle(Pool.SPECULATIVE), FEATURES)
    observed = model.predict(idle(Pool.SPECULATIVE, tokens_per_step=1.5), FEATURES)
    assert observed.tpot_ms == pytest.approx(assumed.tpot_ms * A100_CODELLAMA_34B.spec.expected_tokens_per_step() / 1.5)


@pytest.mark.parametrize(
    ("slo", "stall_rate", "low", "high"), [(100.0, 0.0, 1.0, 1.0), (30.0, 0.0, 0.0, 0.0), (45.0, 50.0, 0.0, 0.9)]
)
def test_tpot_met_probability(slo: float, stall_rate: float, low: float, high: float) -> None:
    model = LatencyModel(A100_CODELLAMA_34B)
    short = replace(FEATURES, expected_output_tokens=20)
    p = model.predict(idle(Pool.PLAIN, prefill_tokens_per_s=stall_rate * 512, arrivals_per_s=stall_rate), short)
    assert low <= model.tpot_met_probability(p, slo) <= high


def test_a_profile_30_percent_off_converges_within_a_few_hundred_requests() -> None:
    """Observed latencies 30% above the profile: the pooled correction learns the factor."""
    model = LatencyModel(A100_CODELLAMA_34B)
    replica = Replica("plain-0", "http://x", Pool.PLAIN, FleetSettings())
    replica.health.scrape_succeeded(0.0)
    truth = model.predict(replica.state(0.0), FEATURES)
    for _ in range(200):
        p = model.predict(replica.state(0.0), FEATURES)
        replica.observe(truth.ttft_ms * 1.3 / 1e3, truth.tpot_ms * 1.3 / 1e3, p.ttft_ms / 1e3, p.tpot_ms / 1e3)
    learned = model.predict(replica.state(0.0), FEATURES)
    assert learned.ttft_ms == pytest.approx(truth.ttft_ms * 1.3, rel=0.03)
    assert learned.tpot_ms == pytest.approx(truth.tpot_ms * 1.3, rel=0.03)
