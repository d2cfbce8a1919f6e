"""The latency model against the engine model it is calibrated from, and its step costs re-fitted."""

import math
import random
import statistics
from dataclasses import replace

import pytest

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import A100_CODELLAMA_34B, H100_LLAMA31_8B, Profile
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel
from specgate.sim.engine import Engine, EngineConfig
from specgate.sim.probes import run_alone
from specgate.workers.latency_fit import LatencyFit, Priced, predicted_ms
from specgate.workers.pools import Fleet, FleetSettings, Replica
from specgate.workers.snapshot import Burst, ReplicaState, Scales

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


@pytest.mark.parametrize("pool", list(Pool))
def test_a_burst_of_prompts_stalls_a_short_life_all_through_and_a_long_one_only_at_its_start(pool: Pool) -> None:
    model = LatencyModel(A100_CODELLAMA_34B)
    steady = {"in_flight": 4, "arrivals_per_s": 0.5, "prefill_tokens_per_s": 500.0}
    burst = Burst(8.0, 8000.0, lasted_s=2.0, arrivals_before_per_s=0.5, prefill_tokens_before_per_s=500.0)

    def tpot(output: int, **changes: object) -> float:
        features = replace(FEATURES, expected_output_tokens=output)
        return model.predict(idle(pool, **{**steady, **changes}), features).tpot_ms

    short, long = 8, 2000
    # A life shorter than the burst has lasted (stalls and wait for its first token included): as
    # if its rate held all through.
    assert tpot(short, burst=replace(burst, lasted_s=30.0)) == pytest.approx(
        tpot(short, arrivals_per_s=burst.arrivals_per_s, prefill_tokens_per_s=burst.prefill_tokens_per_s), rel=0.05
    )
    # A life of a minute or more: close to the steady rate, the burst's stalls spread over it.
    at_steady, with_burst = tpot(long), tpot(long, burst=burst)
    all_burst = tpot(long, arrivals_per_s=burst.arrivals_per_s, prefill_tokens_per_s=burst.prefill_tokens_per_s)
    assert at_steady < with_burst < at_steady + (all_burst - at_steady) * 0.2


@pytest.mark.parametrize("pool", list(Pool))
def test_however_many_prompts_arrive_each_step_carries_one_chunk_of_them_and_still_emits_its_tokens(
    pool: Pool,
) -> None:
    """An answer decoding while long prompts keep queueing behind it: every step of its life
    prefills a chunk of them beside its decodes. Its TPOT is that step over the tokens a step
    emits (on a speculative replica, several), however far the prompts outrun the replica."""
    engine = Engine(H100_LLAMA31_8B, pool, EngineConfig(acceptance_concentration=0.0))
    engine.add_request("answer", 512, 41, arrival=0.0)
    for i in range(40):  # (more than its life's steps can prefill)
        engine.add_request(f"prompt-{i}", 16_000, 1, arrival=0.0)
    measured = None
    while measured is None:
        measured = next((f.tpot for f in engine.step().finished if f.request_id == "answer"), None)
    model = LatencyModel(H100_LLAMA31_8B)
    features = replace(FEATURES, expected_output_tokens=41, output_hinted=True)
    for rate in (20.0, 200.0):  # prompts a second, past what it can prefill, and far past
        flooded = idle(pool, arrivals_per_s=rate, prefill_tokens_per_s=rate * 16_000)
        p = model.predict(flooded, features)
        assert p.tpot_ms == pytest.approx(measured * 1e3, rel=0.15)
        # (the target at the stalled steps, with the room the spread of the steps asks for)
        assert model.tpot_met_probability(p, measured * 1e3 * 2) == pytest.approx(1.0)
    # A replica that decodes one token a step stalls past a target that one of several does not.
    assert (measured * 1e3 < 120.0) is (pool is Pool.SPECULATIVE)


def test_a_short_answer_on_a_speculative_replica_spreads_by_the_tokens_its_few_steps_emit() -> None:
    """A speculative step emits its accepted run of drafts and one token more: over a few steps
    that does not average out, and short answers miss a target that long ones meet."""
    model = LatencyModel(H100_LLAMA31_8B)
    chances = {}
    for output in (5, 257):
        tpots = [run_alone(H100_LLAMA31_8B, Pool.SPECULATIVE, 512, output, seed=s).tpot for s in range(200)]
        features = replace(FEATURES, expected_output_tokens=output, output_hinted=True)
        p = model.predict(idle(Pool.SPECULATIVE), features)
        target_ms = p.decode_tpot_ms * 1.5
        measured = sum(t is not None and t * 1e3 <= target_ms for t in tpots) / len(tpots)
        chances[output] = model.tpot_met_probability(p, target_ms)
        assert chances[output] == pytest.approx(measured, abs=0.25), output
    assert chances[5] < 0.9 < chances[257]


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


def test_the_slos_a_newcomer_costs_the_batch_it_joins_grow_with_the_batch_and_nearing_the_target() -> None:
    """Nothing on an empty replica, nothing where the batch meets its target either way or misses
    it either way; in between, more the more requests it slows and the nearer they are to it."""
    model = LatencyModel(A100_CODELLAMA_34B)

    def loss(in_flight: int, slo_tpot_ms: float) -> float:
        return model.crowding_loss(model.predict(idle(Pool.PLAIN, in_flight=in_flight), FEATURES), slo_tpot_ms)

    assert loss(0, 45.0) == 0.0
    assert loss(8, 100.0) == 0.0
    assert loss(8, 30.0) == 0.0
    assert 0.0 < loss(24, 45.0) < loss(40, 45.0) < loss(48, 45.0)
    assert loss(40, 45.0) > 10 * loss(40, 50.0)


@pytest.mark.parametrize("pool", list(Pool))
def test_a_prediction_is_the_sum_of_its_scaled_terms(pool: Pool) -> None:
    """The terms a prediction hands to the fit are the prediction, at any scales (and times the
    factors the steps still miss): what the fit solves for is what the model predicts with."""
    model = LatencyModel(H100_LLAMA31_8B)
    busy = {"in_flight": 12, "prefill_tokens": 3000, "prefill_tokens_per_s": 4000.0, "arrivals_per_s": 4.0}
    for scales in (Scales(), Scales(2.0, 0.5, 1.5, 12.0), Scales(2.0, 0.5, 1.5, 12.0, 1.3, 0.8), Scales.lowest()):
        p = model.predict(idle(pool, scales=scales, **busy), FEATURES)
        assert predicted_ms(scales, p.terms.ttft) * scales.ttft_factor == pytest.approx(p.ttft_ms, rel=1e-9)
        tpot = predicted_ms(scales, p.terms.tpot) * scales.tpot_factor + p.terms.stalls_ms  # (stalls unscaled)
        assert tpot == pytest.approx(p.tpot_ms, rel=1e-9)


@pytest.mark.parametrize("pool", list(Pool))
def test_no_part_of_a_step_is_negative_so_no_scale_prices_a_step_below_nothing(pool: Pool) -> None:
    """An idle replica prefills a prompt in a step with no sequence decoding, which costs less than
    the fixed step of one; priced as a negative decode part, a fleet that fitted a large decode
    scale (3x here) predicted a negative TTFT (Hypothesis found -33.7 ms on a speculative one)."""
    model = LatencyModel(A100_CODELLAMA_34B)
    for prompt in (0, 1, 40, 4000):
        for scales in (Scales(1.0, 3.0, 1.0, 0.0), Scales(0.2, 5.0, 0.2, 0.0), Scales(5.0, 0.2, 5.0, 0.0)):
            p = model.predict(idle(pool, scales=scales), replace(FEATURES, prompt_tokens=prompt))
            assert min(p.terms.ttft) >= 0
            assert p.ttft_ms > 0


def _state(rng: random.Random, pool: Pool) -> ReplicaState:
    """A replica as traffic leaves it: some requests on it, prompts queued and arriving."""
    queued = rng.choice((0, 0, rng.randrange(100, 6000)))
    rate = rng.choice((0.0, rng.uniform(0.5, 8.0)))
    return idle(pool, in_flight=rng.randrange(0, 24), prefill_tokens=queued, prefilling=1 if queued else 0,
                arrivals_per_s=rate, prefill_tokens_per_s=rate * rng.randrange(200, 3000))  # fmt: skip


def _request(rng: random.Random) -> RequestFeatures:
    return replace(FEATURES, prompt_tokens=rng.randrange(50, 6000), expected_output_tokens=rng.randrange(8, 600))


def _measured(
    model: LatencyModel, state: ReplicaState, features: RequestFeatures, priced: Priced, truth: Scales
) -> tuple[float, float, float]:
    """What a replica whose costs are `truth` does with a request (TTFT, TPOT and step, ms),
    without noise: the TTFT and step that the terms of its prediction `priced` price at `truth`,
    the TPOT that the model predicts at `truth`, its stalls included."""
    tpot = model.predict(replace(state, scales=truth), features).tpot_ms
    return predicted_ms(truth, priced.ttft), tpot, predicted_ms(truth, priced.step)


@pytest.mark.parametrize("pool", list(Pool))
@pytest.mark.parametrize(
    ("truth", "median", "p90"),
    [
        (Scales(2.0, 2.0, 2.0), 0.07, 0.12),
        (Scales(0.5, 0.5, 0.5), 0.07, 0.12),
        (Scales(3.0, 1.2, 0.6, 40.0), 0.25, 0.8),  # the prior holds the profile's shape: slower
    ],
    ids=("2x-slower", "2x-faster", "other-shape"),
)
def test_a_profile_off_converges_within_a_few_hundred_requests(
    pool: Pool, truth: Scales, median: float, p90: float
) -> None:
    """Answers from replicas whose costs are the profile's twice over, half of them, or off in
    shape (steps 3x dearer, prompts cheaper, 40 ms before any first token: learned in part, as
    the prior holds the profile's shape), measured with 15% noise: after 300 answers the pool's
    predictions at states it has never seen are close to the truth (the median and 90th
    percentile of the larger of the TTFT and TPOT errors), where the profile's own are off by half
    or more, and the fit's own error says how far it is."""
    model = LatencyModel(H100_LLAMA31_8B)
    rng = random.Random(7)
    fleet = Fleet({pool: ["http://a", "http://b"]}, FleetSettings())
    replicas = list(fleet.replicas.values())
    for n in range(300):
        state, features = _state(rng, pool), _request(rng)
        live = replace(state, scales=replicas[0].fit.scales)
        priced = model.predict(live, features).terms
        ttft_s, tpot_s, step_s = (
            ms * math.exp(rng.gauss(0, 0.15)) / 1e3 for ms in _measured(model, state, features, priced, truth)
        )
        replicas[n % 2].observe(ttft_s, tpot_s, priced, step_s=step_s)
    learned = fleet.snapshot(0.0).replicas[0].scales
    errors: dict[str, list[float]] = {"learned": [], "profile": []}
    for _ in range(100):
        state, features = _state(rng, pool), _request(rng)
        want = model.predict(replace(state, scales=truth), features)
        for name, scales in (("learned", learned), ("profile", Scales())):
            got = model.predict(replace(state, scales=scales), features)
            errors[name].append(max(abs(got.ttft_ms / want.ttft_ms - 1), abs(got.tpot_ms / want.tpot_ms - 1)))
    assert statistics.median(errors["learned"]) < median, learned
    assert statistics.quantiles(errors["learned"], n=10)[-1] < p90, learned
    assert statistics.median(errors["profile"]) >= 0.5
    report = fleet.fits[pool].report()
    assert report.answers == 300
    assert report.tpot_error is not None
    assert report.tpot_error < 0.3  # the noise's 0.15, and the first answers' 2x


@pytest.mark.parametrize("pool", list(Pool))
def test_a_server_that_keeps_newcomers_waiting_longer_is_learned_as_a_wait_in_steps(pool: Pool) -> None:
    """A server whose HTTP front shares the engine's CPU keeps a newcomer waiting longer the more
    it decodes: its TTFT holds a step more of the batch it finds than the half step in flight
    the profile prices, and 15 ms more at any load. Short prompts, so the wait is most of it.
    From 300 answers (15% noise) the fit finds the wait, in steps, and the overhead apart from
    it, and the pool's TTFTs at loads it has not seen come out right, idle or busy, where the
    profile's at load were a quarter short or more."""
    truth = Scales(overhead_ms=15.0, wait=1.0)
    model = LatencyModel(H100_LLAMA31_8B)
    rng = random.Random(11)
    fleet = Fleet({pool: ["http://a"]}, FleetSettings())
    replica = fleet.replicas[f"{'spec' if pool is Pool.SPECULATIVE else 'plain'}-0"]

    def state(in_flight: int) -> ReplicaState:
        return idle(pool, in_flight=in_flight)

    def request() -> RequestFeatures:
        return replace(FEATURES, prompt_tokens=rng.randrange(20, 300), expected_output_tokens=rng.randrange(20, 200))

    for _ in range(300):
        live = replace(state(rng.choice((0, 2, 4, 8, 16))), scales=replica.fit.scales)
        priced = model.predict(live, request()).terms
        ttft_s, tpot_s, step_s = (
            predicted_ms(truth, t) * math.exp(rng.gauss(0, 0.15)) / 1e3 for t in (priced.ttft, priced.tpot, priced.step)
        )
        replica.observe(ttft_s, tpot_s, priced, step_s=step_s)
    learned = replica.fit.scales
    assert learned.wait == pytest.approx(1.0, abs=0.25), learned
    assert learned.overhead_ms == pytest.approx(15.0, abs=6.0), learned
    for in_flight in (0, 6, 12, 24):
        features = request()
        want = model.predict(replace(state(in_flight), scales=truth), features).ttft_ms
        got = model.predict(replace(state(in_flight), scales=learned), features).ttft_ms
        assert got == pytest.approx(want, rel=0.08), (in_flight, learned)
        if in_flight >= 12:
            assert model.predict(state(in_flight), features).ttft_ms < 0.75 * want


def test_one_outlier_moves_the_fit_little() -> None:
    """A request stuck behind a preemption, a hundred times slower than predicted, counts as twice."""
    model = LatencyModel(H100_LLAMA31_8B)
    fit = LatencyFit()
    priced = model.predict(idle(Pool.PLAIN, in_flight=4), FEATURES).terms
    ttft, tpot, step = (predicted_ms(Scales(), t) for t in (priced.ttft, priced.tpot, priced.step))
    for _ in range(100):
        fit.observe(ttft, tpot, priced, step_ms=step)
    fit.observe(ttft * 100, tpot * 100, priced, step_ms=step * 100)
    for terms, before in ((priced.ttft, ttft), (priced.tpot, tpot), (priced.step, step)):
        assert predicted_ms(fit.scales, terms) == pytest.approx(before, rel=0.02)
    assert fit.scales.ttft_factor == pytest.approx(1.0, rel=0.04)  # moved once, by at most 2 ** 0.05
    assert fit.scales.tpot_factor == pytest.approx(1.0, rel=0.04)


def test_the_fit_follows_the_profile_the_plan_predicts_with() -> None:
    """Scales fitted against one profile mean nothing for another: a plan that predicts with
    another profile starts from its own costs, and answers priced by the old one are ignored."""
    model = LatencyModel(H100_LLAMA31_8B)
    fleet = Fleet({Pool.PLAIN: ["http://a"]}, FleetSettings())
    replica = fleet.replicas["plain-0"]
    for _ in range(50):
        priced = model.predict(fleet.snapshot(0.0, H100_LLAMA31_8B.name).replicas[0], FEATURES).terms
        replica.observe(predicted_ms(Scales(2.0, 2.0, 2.0), priced.ttft) / 1e3, None, priced)
    learned = fleet.snapshot(0.0, H100_LLAMA31_8B.name).replicas[0].scales
    assert predicted_ms(learned, priced.ttft) == pytest.approx(predicted_ms(Scales(), priced.ttft) * 2, rel=0.05)
    assert fleet.snapshot(0.0, A100_CODELLAMA_34B.name).replicas[0].scales == Scales()
    replica.observe(1.0, None, priced)  # an answer still in flight when the plan changed
    assert fleet.fits[Pool.PLAIN].answers == 0


@pytest.mark.parametrize("pool", list(Pool))
def test_a_batch_that_changes_under_a_request_is_not_read_as_other_decode_costs(pool: Pool) -> None:
    """Requests sent to a quiet replica that then fills up, and to a busy one that then empties:
    fitted against the batch at dispatch, decoding would look nearly free of the batch (the fixed
    cost taking it all); fitted against the batch each request decoded beside, the profile that
    priced the answers is found again."""
    model = LatencyModel(H100_LLAMA31_8B)
    rng = random.Random(5)
    # A light prior: what is measured here is the fit's reading of the batch, not the prior's pull.
    fits = {"life": LatencyFit(prior_weight=1.0), "dispatch": LatencyFit(prior_weight=1.0)}
    for _ in range(300):
        sent, mean = rng.randrange(0, 40), round(rng.uniform(1, 41))
        priced = model.predict(idle(pool, in_flight=sent), FEATURES).terms
        decoded = model.predict(idle(pool, in_flight=mean - 1), FEATURES)
        step = predicted_ms(Scales(), decoded.terms.step)
        fits["life"].observe(None, decoded.tpot_ms, priced, mean, step_ms=step)
        fits["dispatch"].observe(None, decoded.tpot_ms, priced, step_ms=step)
    life, dispatch = fits["life"].scales, fits["dispatch"].scales
    for scale in (life.fixed, life.decode):
        assert scale == pytest.approx(1.0, abs=0.03)
    assert dispatch.decode < 0.9 < 1.0 < dispatch.fixed


def test_a_pool_seldom_chosen_starts_from_what_the_other_learned() -> None:
    """Both pools run the same model on the same hardware: when the speculative pool's answers
    show a profile twice too slow, the plain pool, which has had no answer yet, is predicted on
    nearly what they show, not on the profile the policy would otherwise never see corrected."""
    model = LatencyModel(H100_LLAMA31_8B)
    fleet = Fleet({Pool.SPECULATIVE: ["http://s"], Pool.PLAIN: ["http://p"]}, FleetSettings())
    spec = fleet.replicas["spec-0"]
    truth = Scales(0.5, 0.5, 0.5)
    rng = random.Random(3)
    for _ in range(300):
        state, features = _state(rng, Pool.SPECULATIVE), _request(rng)
        priced = model.predict(replace(state, scales=spec.fit.scales), features).terms
        ttft_s, tpot_s, step_s = (ms / 1e3 for ms in _measured(model, state, features, priced, truth))
        spec.observe(ttft_s, tpot_s, priced, step_s=step_s)
    learned = fleet.snapshot(0.0).replicas[1].scales
    assert fleet.fits[Pool.PLAIN].answers == 0
    for scale in (learned.fixed, learned.decode, learned.prefill):
        assert 0.5 <= scale < 0.6  # as far as the other pool's answers outweigh the prior: nearly all the way
    assert (learned.ttft_factor, learned.tpot_factor) == (1.0, 1.0)  # what the model misses is each pool's own


def _spread_after(noise: float, truth: Scales, arrivals_per_s: float = 0.0, answers: int = 400) -> float:
    """The TPOT spread a plain pool's fit learns from `answers` answers of replicas whose costs
    are `truth`, each TPOT off by log-normal `noise`, prompts arriving at `arrivals_per_s`."""
    model = LatencyModel(H100_LLAMA31_8B)
    fit = LatencyFit()
    rng = random.Random(5)
    for _ in range(answers):
        state = idle(Pool.PLAIN, in_flight=rng.randrange(0, 8), arrivals_per_s=arrivals_per_s,
                     prefill_tokens_per_s=arrivals_per_s * 1000, scales=fit.scales)  # fmt: skip
        features = _request(rng)
        priced = model.predict(state, features).terms
        ttft, tpot, step = _measured(model, state, features, priced, truth)
        fit.observe(ttft, tpot * math.exp(rng.gauss(0, noise)), priced, step_ms=step)
    return fit.scales.tpot_spread


def test_the_spread_of_tpots_is_learned_and_widens_the_chance() -> None:
    """A replica whose TPOTs spread 10% from request to request (a CPU shared with other work)
    is learned as such, while the fit converges from a profile 1.5x off; a noiseless one that
    starts as far off is not read as noisy; TPOTs that prompts stalled spread by what the forecast
    of the prompts missed. The spread then widens the TPOT chance: a target 7% under the
    predicted TPOT is a long shot, not out of reach."""
    slower = Scales(1.5, 1.5, 1.5)
    assert _spread_after(0.10, slower) == pytest.approx(0.10, abs=0.02)
    assert _spread_after(0.0, slower) < 0.04  # the fit's own convergence, soon over
    # Answers that prompts stalled count too: off by how many more or fewer prompts came than the
    # forecast said, they spread as widely, and the chance allows for it.
    assert _spread_after(0.30, slower, arrivals_per_s=20.0) == pytest.approx(0.30, abs=0.05)
    assert _spread_after(0.10, slower, answers=8) == 0.0  # too few to say
    model = LatencyModel(H100_LLAMA31_8B)
    quiet = idle(Pool.PLAIN)
    predicted = model.predict(quiet, FEATURES)
    target = predicted.tpot_ms / 1.07
    assert model.tpot_met_probability(predicted, target) == 0.0
    noisy = model.predict(replace(quiet, scales=Scales(tpot_spread=0.10)), FEATURES)
    assert noisy.tpot_ms == predicted.tpot_ms
    assert 0.1 < model.tpot_met_probability(noisy, target) < 0.5


def test_a_short_prompt_prices_the_prompts_arriving_per_token_not_per_rounded_quantum() -> None:
    """What a prompt token arriving costs the batch is priced from a whole quantum of prompt (32
    tokens, so that nearby lengths share one price), over that quantum: a 2-token prompt's answer
    was priced with the quantum's cost over its own 2 tokens, as if each token arriving cost 16
    times what it does, and the gateway held such requests until their TTFT target passed."""
    model = LatencyModel(H100_LLAMA31_8B)
    state = idle(Pool.PLAIN, in_flight=8, arrivals_per_s=4.0, prefill_tokens_per_s=4.0 * 1000)
    tiny, whole = (
        model.predict(state, replace(FEATURES, prompt_tokens=n, expected_output_tokens=64, output_hinted=True))
        for n in (2, 32)
    )
    assert tiny.stall_ms == pytest.approx(whole.stall_ms, rel=0.02)
    assert tiny.tpot_ms == pytest.approx(whole.tpot_ms, rel=0.05)


def test_the_tpot_factor_scales_the_decoding_not_the_stalls() -> None:
    """A factor learnt where the replica decodes 20% slower than its fitted steps say (or faster)
    scales a TPOT's decoding so, however busy the replica; the prompts' prefill that stalls it is
    priced by the prefill scale the TTFTs fit, whatever the factor: the factor neither compounds
    the prefill's share of the time (a share of 0.6 read as 0.72 slows the tokens 1.4 times more)
    nor prices a stall at a fraction of its cost where it fell below 1."""
    model = LatencyModel(H100_LLAMA31_8B)
    features = replace(FEATURES, expected_output_tokens=200, output_hinted=True)
    tpots = []
    for arrivals in (0.0, 10.0, 25.0):
        busy = {"in_flight": 8, "arrivals_per_s": arrivals, "prefill_tokens_per_s": arrivals * 1000.0}
        plain = model.predict(idle(Pool.PLAIN, **busy), features)
        assert plain.tpot_ms < plain.decode_tpot_ms + plain.chunk_stall_ms  # (every step stalled: not what binds)
        for factor in (0.5, 1.2):
            other = model.predict(idle(Pool.PLAIN, **busy, scales=Scales(tpot_factor=factor)), features)
            assert other.decode_tpot_ms == pytest.approx(factor * plain.decode_tpot_ms, rel=1e-9)
            assert (other.stall_ms, other.chunk_stall_ms) == (plain.stall_ms, plain.chunk_stall_ms)
        tpots.append(plain.tpot_ms)
    assert tpots[2] > 1.5 * tpots[0]  # the prompts take a good share of the replica's time


def test_short_answers_that_few_stalls_hit_do_not_price_a_stall_below_its_cost() -> None:
    """Long prompts arriving now and then, short answers: most answers meet their TPOT target with
    room to spare, and the one a prompt's prefill lands in misses it several times over. Fitted to
    such answers, the TPOT factor follows the many (the mean of their logs) and falls well below 1;
    were it to scale the stalls too, a request that one stall would break would be given a chance
    far above the share of answers no stall hits."""
    model = LatencyModel(H100_LLAMA31_8B)
    features = replace(FEATURES, prompt_tokens=2000, expected_output_tokens=12, output_hinted=True)
    state = idle(Pool.SPECULATIVE, in_flight=2, arrivals_per_s=1.0, prefill_tokens_per_s=8000.0)
    truth = model.predict(state, features)  # the replica is the profile, and the stalls a Poisson count
    rng = random.Random(1)
    fit = LatencyFit()
    for _ in range(300):
        stalled = sum(rng.random() < truth.stalls / 200 for _ in range(200))
        tpot = truth.decode_tpot_ms + stalled * truth.stall_ms / 11
        fit.observe(None, tpot, model.predict(replace(state, scales=fit.scales), features).terms)
    assert fit.scales.tpot_factor < 0.8  # the many that no stall hit
    p = model.predict(replace(state, scales=fit.scales), features)
    target = truth.decode_tpot_ms + 0.9 * truth.stall_ms / 11  # one stall breaks it
    assert model.tpot_met_probability(p, target) == pytest.approx(math.exp(-truth.stalls), abs=0.05)


def _burst_answer(
    profile: Profile, pool: Pool, rate: float, lasted_s: float, output: int
) -> tuple[ReplicaState, float]:
    """Requests with short prompts and long answers arriving at `rate` a second at an idle replica
    for twice `lasted_s`, and an answer of `output` tokens sent to it halfway: the replica as the
    gateway sees it when the answer is sent (the burst as long as it has lasted by then, from
    nothing before it), and the answer's TPOT in ms."""
    prompt = 32
    engine = Engine(profile, pool, EngineConfig(acceptance_concentration=0.0))
    arrivals = [i / rate for i in range(round(rate * 2 * lasted_s))]
    state, sent, tpot = None, 0, None
    while tpot is None:
        while sent < len(arrivals) and arrivals[sent] <= engine.now:
            engine.add_request(f"burst-{sent}", prompt, 3000, arrival=arrivals[sent])
            sent += 1
        if state is None and engine.now >= lasted_s:
            burst = Burst(rate, rate * prompt, lasted_s)
            state = idle(pool, in_flight=engine.num_running + engine.num_waiting, running=float(engine.num_running),
                         waiting=float(engine.num_waiting), kv_usage=engine.kv_usage, burst=burst)  # fmt: skip
            engine.add_request("answer", prompt, output, arrival=engine.now)
        tpot = next((f.tpot for f in engine.step().finished if f.request_id == "answer"), None)
    assert state is not None
    return state, tpot * 1e3


@pytest.mark.parametrize(
    ("profile", "pool", "rate"),
    [
        (H100_LLAMA31_8B, Pool.PLAIN, 40.0),
        (H100_LLAMA31_8B, Pool.SPECULATIVE, 40.0),
        (A100_CODELLAMA_34B, Pool.SPECULATIVE, 20.0),
    ],
    ids=["h100-plain", "h100-speculative", "a100-speculative"],
)
def test_a_burst_grows_the_batch_an_answer_decodes_in(profile: Profile, pool: Pool, rate: float) -> None:
    """Requests arriving faster than before a burst, and staying, fill the batch while it lasts:
    an answer sent two seconds into one (which lasts as long again) decodes beside far more
    requests than it joined. Priced at the batch it joins, its TPOT is 9-29% short of what the
    engine measures; priced at the batch growing for as long again as the burst has lasted,
    within 12%."""
    state, measured = _burst_answer(profile, pool, rate, lasted_s=2.0, output=150)
    model = LatencyModel(profile)
    features = replace(FEATURES, prompt_tokens=32, expected_output_tokens=150, output_hinted=True)
    grown = model.predict(state, features)
    assert state.burst is not None
    joined = model.predict(replace(state, burst=replace(state.burst, arrivals_per_s=0.0)), features)
    assert grown.terms.joining > 10
    assert joined.terms.joining == 0
    assert grown.tpot_ms == pytest.approx(measured, rel=0.15)
    assert joined.tpot_ms < grown.tpot_ms
    assert abs(grown.tpot_ms - measured) < abs(joined.tpot_ms - measured) * 0.6


def test_the_batch_grows_no_further_than_the_engine_runs_at_once() -> None:
    """However fast requests arrive, a replica runs at most `max_num_seqs` of them (fewer when
    their contexts fill its KV cache): a storm of thousands a second prices the TPOT of a full
    batch, not of a batch of thousands."""
    model = LatencyModel(H100_LLAMA31_8B, max_num_seqs=64)
    storm = idle(Pool.PLAIN, in_flight=8, burst=Burst(5000.0, 5000.0 * 32, lasted_s=60.0))
    features = replace(FEATURES, prompt_tokens=32, expected_output_tokens=150, output_hinted=True)
    p = model.predict(storm, features)
    assert p.terms.joining == 64 - 8 - 1
    full = model.predict(idle(Pool.PLAIN, in_flight=63), features)
    assert p.decode_tpot_ms == pytest.approx(full.decode_tpot_ms, rel=0.01)


def test_the_tpot_factor_learns_what_the_model_misses_not_what_the_forecast_did() -> None:
    """Answers 30% slower than their decoding priced at the batch they decoded beside move the
    TPOT factor to 1.3, whether that batch was the one they were priced at or twenty times it (a
    storm that outlasted its forecast): a factor learning the crowded answers against the batch
    they joined would multiply every later prediction, at whatever batch, by the storm. Their
    forecast's miss counts in how far the TPOTs spread."""
    model = LatencyModel(H100_LLAMA31_8B)
    priced = model.predict(idle(Pool.PLAIN, in_flight=4), FEATURES).terms
    at_hundred = model.predict(idle(Pool.PLAIN, in_flight=99), FEATURES).terms
    tpot, crowded_tpot = predicted_ms(Scales(), priced.tpot), predicted_ms(Scales(), at_hundred.tpot)
    assert crowded_tpot > tpot * 1.5  # the batch that grew costs the decoding more
    assert predicted_ms(Scales(), priced.tpot_over(100.0)) == pytest.approx(crowded_tpot, rel=0.01)
    assert priced.tpot_over(5.0) == priced.tpot
    as_priced, crowded = LatencyFit(), LatencyFit()
    for _ in range(200):
        as_priced.observe(None, tpot * 1.3, priced, in_flight=5.0)
        crowded.observe(None, crowded_tpot * 1.3, priced, in_flight=100.0)
    assert as_priced.scales.tpot_factor == pytest.approx(1.3, rel=0.02)
    assert crowded.scales.tpot_factor == pytest.approx(1.3, rel=0.03)
    assert crowded.scales.tpot_spread > as_priced.scales.tpot_spread + 0.1


@pytest.mark.parametrize("pool", list(Pool))
def test_the_context_a_step_is_priced_at_is_the_kv_cache_over_the_sequences_that_held_it(pool: Pool) -> None:
    """Scraped with 4 sequences of 4000 tokens running and 8 requests sent since (not in the cache yet),
    a newcomer's steps are those of 13 sequences at about 4000 tokens each, not at a third of that."""
    model = LatencyModel(A100_CODELLAMA_34B)
    capacity = model._kv_capacity(pool)
    scraped = idle(pool, in_flight=12, running=4.0, waiting=0.0, kv_usage=4 * 4000 / capacity,
                   dispatched_since_scrape=8)  # fmt: skip
    p = model.predict(scraped, FEATURES)
    at_context = model.step_ms(pool, 13, 4000) / p.tokens_per_step
    assert p.decode_tpot_ms == pytest.approx(at_context, rel=0.02)
    assert p.decode_tpot_ms > model.step_ms(pool, 13, 4000 / 3) / p.tokens_per_step * 1.05


@pytest.mark.parametrize("pool", list(Pool))
def test_a_queue_seen_at_one_scrape_is_a_ramp_and_one_that_outlasts_it_holds_newcomers_back(pool: Pool) -> None:
    """Requests waiting at one scrape are prompts queued for the next steps: a newcomer decodes beside
    them all. Waiting at two, the replica holds newcomers back, and one decodes in its running batch."""
    model = LatencyModel(A100_CODELLAMA_34B)
    scraped = idle(pool, in_flight=24, running=8.0, waiting=16.0)
    ramp = model.predict(scraped, FEATURES)
    held = model.predict(replace(scraped, holding=True), FEATURES)
    assert (ramp.batch, held.batch) == (24, 7)
    assert ramp.decode_tpot_ms > held.decode_tpot_ms
