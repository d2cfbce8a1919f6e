"""The latency model against the engine model it is calibrated from, and its step costs re-fitted."""

import math
import random
from dataclasses import replace

import pytest

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import A100_CODELLAMA_34B, H100_LLAMA31_8B, Profile
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel
from specgate.sim.probes import run_alone
from specgate.workers.latency_fit import LatencyFit, predicted_ms
from specgate.workers.pools import Fleet, FleetSettings, Replica
from specgate.workers.snapshot import ReplicaState, Scales

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
        ({"scales": Scales(overhead_ms=30.0)}, "up", "same", "same"),  # a server slower to start answering
        ({"scales": Scales(fixed=0.7, decode=0.7)}, "down", "down", "down"),  # faster steps
        ({"scales": Scales(prefill=0.5)}, "down", "same", "down"),  # faster prompts: nothing arrives to stall
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


@pytest.mark.parametrize("pool", list(Pool))
def test_a_prediction_is_the_sum_of_its_scaled_terms(pool: Pool) -> None:
    """The terms a prediction hands to the fit are the prediction, at any scales: what the fit
    solves for is what the model predicts with."""
    model = LatencyModel(H100_LLAMA31_8B)
    busy = {"in_flight": 12, "prefill_tokens": 3000, "prefill_tokens_per_s": 4000.0, "arrivals_per_s": 4.0}
    for scales in (Scales(), Scales(2.0, 0.5, 1.5, 12.0), Scales.lowest()):
        p = model.predict(idle(pool, scales=scales, **busy), FEATURES)
        assert predicted_ms(scales, p.terms.ttft) == pytest.approx(p.ttft_ms, rel=1e-9)
        assert predicted_ms(scales, p.terms.tpot) == pytest.approx(p.tpot_ms, rel=1e-9)


def _state(rng: random.Random, pool: Pool) -> ReplicaState:
    """A replica as traffic leaves it: some requests on it, prompts queued and arriving."""
    queued = rng.choice((0, 0, rng.randrange(100, 6000)))
    rate = rng.choice((0.0, rng.uniform(0.5, 8.0)))
    return idle(pool, in_flight=rng.randrange(0, 24), prefill_tokens=queued, prefilling=1 if queued else 0,
                arrivals_per_s=rate, prefill_tokens_per_s=rate * rng.randrange(200, 3000))  # fmt: skip


def _request(rng: random.Random) -> RequestFeatures:
    return replace(FEATURES, prompt_tokens=rng.randrange(50, 6000), expected_output_tokens=rng.randrange(8, 600))


@pytest.mark.parametrize("pool", list(Pool))
@pytest.mark.parametrize(
    "truth", [Scales(2.0, 2.0, 2.0, 0.0), Scales(0.5, 0.5, 0.5, 0.0), Scales(3.0, 1.2, 0.6, 40.0)], ids=str
)
def test_a_profile_off_converges_within_a_few_hundred_requests(pool: Pool, truth: Scales) -> None:
    """Answers from replicas whose costs are the profile's twice over, half of them, or off in
    shape (steps 3x dearer, prompts cheaper, 40 ms before any first token), measured with 15%
    noise: after 300 answers the pool's predictions are within 10% of the truth at states it has
    never seen, and the fit's own error says how far it is."""
    model = LatencyModel(H100_LLAMA31_8B)
    rng = random.Random(7)
    fleet = Fleet({pool: ["http://a", "http://b"]}, FleetSettings())
    replicas = list(fleet.replicas.values())
    for n in range(300):
        state, features = _state(rng, pool), _request(rng)
        live = replace(state, scales=replicas[0].fit.scales)
        priced = model.predict(live, features).terms
        noise = (math.exp(rng.gauss(0, 0.15)), math.exp(rng.gauss(0, 0.15)))
        ttft_s, tpot_s = (
            predicted_ms(truth, t) * e / 1e3 for t, e in zip((priced.ttft, priced.tpot), noise, strict=True)
        )
        replicas[n % 2].observe(ttft_s, tpot_s, priced)
    learned = fleet.snapshot(0.0).replicas[0].scales
    for _ in range(50):
        state, features = _state(rng, pool), _request(rng)
        want = model.predict(replace(state, scales=truth), features)
        got = model.predict(replace(state, scales=learned), features)
        assert got.ttft_ms == pytest.approx(want.ttft_ms, rel=0.1), (learned, state, features)
        assert got.tpot_ms == pytest.approx(want.tpot_ms, rel=0.1), (learned, state, features)
    report = fleet.fits[pool].report()
    assert report.answers == 300
    assert report.tpot_error is not None
    assert report.tpot_error < 0.3  # the noise's 0.15, and the first answers' 2x


def test_one_outlier_moves_the_fit_little() -> None:
    """A request stuck behind a preemption, a hundred times slower than predicted, counts as twice."""
    model = LatencyModel(H100_LLAMA31_8B)
    fit = LatencyFit()
    priced = model.predict(idle(Pool.PLAIN, in_flight=4), FEATURES).terms
    ttft, tpot = priced.ttft, priced.tpot
    for _ in range(100):
        fit.observe(predicted_ms(Scales(), ttft), predicted_ms(Scales(), tpot), priced)
    fit.observe(predicted_ms(Scales(), ttft) * 100, predicted_ms(Scales(), tpot) * 100, priced)
    assert predicted_ms(fit.scales, tpot) == pytest.approx(predicted_ms(Scales(), tpot), rel=0.02)
    assert predicted_ms(fit.scales, ttft) == pytest.approx(predicted_ms(Scales(), ttft), rel=0.02)
