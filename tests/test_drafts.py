"""Acceptance per request: how much a prompt repeats itself, the speedup learned per group of
requests, and the latency model's use of it."""

import json
import math
import time
from dataclasses import replace

import pytest

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import A100_CODELLAMA_34B, H100_LLAMA31_8B, Profile
from specgate.gateway.body import parse_body
from specgate.policies.drafts import MAX_GROUPS, MAX_SPEEDUP, MIN_OBSERVATIONS, DraftStats, group
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel
from specgate.protocol.endpoints import Endpoint
from specgate.protocol.repetition import MAX_WORDS, repetition, text_repetition
from specgate.sim.engine import Engine, EngineConfig
from specgate.sim.outcomes import FinishedRequest
from specgate.workers.pools import FleetSettings, Replica

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
PROSE = (
    "The river ran high that spring, and the ferryman counted the days until the water fell. "
    "Travellers waited on the far bank with their carts, trading news of the mountain roads, "
    "while children threw stones to see how far the current would carry them before they sank."
)


def test_a_prompt_that_repeats_itself_scores_high_and_free_text_low() -> None:
    assert text_repetition(f"Repeat this code exactly:\n\n{CODE * 4}") > 0.6
    assert text_repetition(PROSE) == 0.0
    assert text_repetition("") == text_repetition("Hi.") == 0.0
    assert repetition(list(range(50)) * 4) == pytest.approx(0.75, abs=0.02)  # token ids too
    assert repetition(list(range(200))) == 0.0


def test_the_work_is_bounded_by_the_prompt_s_tail() -> None:
    huge = PROSE * 20_000 + CODE * 200  # about 5 MB: only its repeated end is looked at
    started = time.perf_counter()
    score = text_repetition(huge)
    assert time.perf_counter() - started < 0.05
    assert score == pytest.approx(text_repetition(CODE * 200), abs=0.01)
    assert repetition(list(range(10 * MAX_WORDS))) == 0.0


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


@pytest.mark.parametrize(
    ("endpoint", "body", "repeats"),
    [
        (Endpoint.CHAT, {"messages": [{"role": "system", "content": "Copy."}, user(CODE * 4)]}, True),
        (Endpoint.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": CODE * 4}]}]}, True),
        (Endpoint.CHAT, {"messages": [user(PROSE), {"role": "assistant", "content": None}]}, False),
        (Endpoint.CHAT, {"messages": []}, False),
        (Endpoint.COMPLETIONS, {"prompt": CODE * 4}, True),
        (Endpoint.COMPLETIONS, {"prompt": ["x", CODE * 4]}, True),
        (Endpoint.COMPLETIONS, {"prompt": list(range(40)) * 3}, True),
        (Endpoint.COMPLETIONS, {"prompt": [[1, 2], list(range(300))]}, False),
    ],
)  # fmt: skip
def test_the_gateway_reads_the_repetition_of_every_prompt_shape(
    endpoint: Endpoint, body: dict[str, object], repeats: bool
) -> None:
    fields = parse_body(json.dumps(body).encode(), endpoint, ("m",))
    assert (fields.repetition > 0.5) is repeats


def _observe(stats: DraftStats, key: tuple[str, str, str, int], predicted: float, observed: float, n: int) -> None:
    for _ in range(n):
        stats.observe(key, predicted * 1e-3 / stats.speedup(key), stats.speedup(key), observed * 1e-3)


def test_each_group_learns_its_speedup_over_the_pool_s_mean() -> None:
    stats = DraftStats()
    copy, free = group("m", "/v1/chat/completions", "", 0.7), group("m", "/v1/chat/completions", "", 0.0)
    assert copy != free
    assert stats.speedup(copy) == 1.0  # nothing known: the pool's mean
    # predicted 30 ms at the pool's mean for both; copying decodes at 20, free text at 45
    for _ in range(40):
        _observe(stats, copy, 30.0, 20.0, 1)
        _observe(stats, free, 30.0, 45.0, 1)
    assert stats.speedup(copy) / stats.speedup(free) == pytest.approx(45.0 / 20.0, rel=0.05)
    assert stats.speedup(copy) > 1.0 > stats.speedup(free)
    # what every group shares (a profile 2x off) cancels out
    shared = DraftStats()
    for _ in range(40):
        _observe(shared, copy, 30.0, 40.0, 1)
        _observe(shared, free, 30.0, 90.0, 1)
    assert shared.speedup(copy) / shared.speedup(free) == pytest.approx(90.0 / 40.0, rel=0.05)


def test_a_group_is_used_once_seen_enough_and_within_bounds() -> None:
    stats = DraftStats()
    key, other = group("m", "e", "", 0.9), group("m", "e", "", 0.0)
    _observe(stats, other, 30.0, 30.0, 10)
    _observe(stats, key, 30.0, 1.0, MIN_OBSERVATIONS - 1)
    assert stats.speedup(key) == 1.0
    _observe(stats, key, 30.0, 1.0, 1)
    assert stats.speedup(key) == MAX_SPEEDUP
    stats.observe(key, 0.0, 1.0, 0.03)  # nonsense is ignored
    stats.observe(key, 0.03, 1.0, -1.0)
    assert stats.groups.counts[key] == MIN_OBSERVATIONS


def test_groups_are_bounded() -> None:
    stats = DraftStats()
    for i in range(MAX_GROUPS + 10):
        stats.observe(group("m", "e", f"class-{i}", 0.0), 0.03, 1.0, 0.03)
    assert len(stats.groups.counts) == MAX_GROUPS


@pytest.mark.parametrize("profile", [A100_CODELLAMA_34B, H100_LLAMA31_8B], ids=lambda p: p.name)
@pytest.mark.parametrize("alpha", [0.2, 0.9])
def test_a_request_s_own_acceptance_predicts_its_tpot(profile: Profile, alpha: float) -> None:
    """A request that accepts `alpha` of the drafts, on an idle speculative replica whose pool
    accepts the profile's mean: its TPOT predicted with its speedup matches the engine's."""
    engine = Engine(profile, Pool.SPECULATIVE, EngineConfig(acceptance_concentration=0.0))
    engine.add_request("only", 512, 256, arrival=0.0, alpha=alpha)
    finished: list[FinishedRequest] = []
    while engine.has_work():
        finished += engine.step().finished
    (request,) = finished
    assert request.tpot is not None
    spec = profile.spec
    features = RequestFeatures(
        model="m", stream=True, prompt_tokens=512, max_tokens=None, expected_output_tokens=256, slo_ttft_ms=None,
        slo_tpot_ms=None, forced_pool=None, priority=0, sequence=0,
        draft_speedup=spec.expected_tokens_per_step(alpha) / spec.expected_tokens_per_step(),
    )  # fmt: skip
    idle = replace(Replica("r", "http://r", Pool.SPECULATIVE, FleetSettings()).state(0.0), healthy=True)
    model = LatencyModel(profile)
    own = model.predict(idle, features)
    assert own.tpot_ms == pytest.approx(request.tpot * 1e3, rel=0.10)
    pooled = model.predict(idle, replace(features, draft_speedup=1.0))
    assert not math.isclose(pooled.tpot_ms, own.tpot_ms, rel_tol=0.10)  # the pool's mean would be off
    plain = replace(idle, pool=Pool.PLAIN)
    assert model.predict(plain, features).tpot_ms == model.predict(plain, replace(features, draft_speedup=1.0)).tpot_ms
