"""The live advisor's window of recent traffic, and what it hands the plan."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from specgate.bench.traces import read_trace
from specgate.calibration import profile_file
from specgate.calibration.profiles import A100_CODELLAMA_34B, PROFILES
from specgate.gateway.advisor import (
    Advisor,
    AdvisorSettings,
    DailyRates,
    Governor,
    Seen,
    SplitPlan,
    TrafficWindow,
    commonest_slo,
    gain_error,
    split_gain,
    trace_csv,
)
from specgate.policies.document import Switching


def seen(at: float, ttft: float | None = 2000.0, tpot: float | None = 50.0) -> Seen:
    return Seen(at, 100 + int(at), 20, ttft, tpot)


def test_the_window_keeps_the_last_requests_of_its_span_and_no_more() -> None:
    window = TrafficWindow(window_s=60.0, max_requests=3)
    for at in (0.0, 10.0, 20.0, 30.0):
        window.record(seen(at))
    assert [s.at for s in window.requests(now=35.0)] == [10.0, 20.0, 30.0]  # the most recent three
    assert [s.at for s in window.requests(now=75.0)] == [20.0, 30.0]  # 10 s is out of the last minute
    assert window.requests(now=1000.0) == []


def test_the_plan_reads_the_window_as_a_trace(tmp_path: Path) -> None:
    requests = [seen(100.0), seen(100.5), seen(103.0)]
    path = tmp_path / "t.csv"
    path.write_bytes(trace_csv(requests))
    trace = read_trace(path)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == [
        (0.0, 200, 20), (0.5, 200, 20), (3.0, 203, 20)
    ]  # fmt: skip


def test_the_plan_can_read_the_window_at_another_rate(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(trace_csv([seen(100.0), seen(101.0), seen(104.0)], rate_scale=2.0))
    assert [r.arrival_s for r in read_trace(path)] == [0.0, 0.5, 2.0]


def yesterday_and_today(rate: Callable[[float], float], until: float) -> DailyRates:
    """Arrivals at `rate(time of day)` a second, evenly spaced, over the day before and today until
    `until` (seconds of today)."""
    daily = DailyRates(period_s=86_400.0, bin_s=60.0)
    at = -86_400.0
    while at < until:
        daily.record(at)
        at += 1.0 / rate(at % 86_400.0)
    return daily


def test_the_rate_to_come_is_what_the_same_minutes_brought_yesterday() -> None:
    def ramp(t: float) -> float:
        return 1.0 + 9.0 * t / 86_400.0  # 1 a second at midnight, 10 just before the next

    daily = yesterday_and_today(ramp, until=43_200.0)  # noon
    growth = daily.growth(43_200.0, window_s=900.0, horizon_s=3_600.0)
    assert growth == pytest.approx(ramp(43_200.0 + 1_800.0) / ramp(43_200.0 - 450.0), rel=0.01)
    assert growth is not None
    assert growth > 1.0
    assert DailyRates().growth(43_200.0, 900.0, 3_600.0) is None  # no day seen yet
    quiet = yesterday_and_today(lambda t: 0.01, until=43_200.0)  # 9 requests in 15 minutes
    assert quiet.growth(43_200.0, 900.0, 3_600.0) is None  # too few to tell a trend from chance


def test_the_counts_of_two_days_ago_are_forgotten() -> None:
    daily = yesterday_and_today(lambda t: 1.0, until=0.0)
    assert daily.between(-86_400.0, 0.0) == pytest.approx(86_400.0, rel=1e-3)
    daily.record(2 * 86_400.0)
    assert daily.between(-86_400.0, 0.0) == 0.0
    assert daily.between(2 * 86_400.0 - 1.0, 2 * 86_400.0 + 60.0) == 1.0


def test_the_plan_takes_the_commonest_slo_pair() -> None:
    assert commonest_slo([]) is None
    assert commonest_slo([seen(0, None, None), seen(1, 2000.0, None)]) is None  # no request with both
    mixed = [seen(0, 800.0, 40.0), seen(1), seen(2), seen(3, None, None), seen(4, None, None), seen(5, None, None)]
    assert commonest_slo(mixed) == (2000.0, 50.0)


def test_a_profile_that_is_not_built_in_is_a_file_for_the_plans_while_the_gateway_runs() -> None:
    mine = dataclasses.replace(A100_CODELLAMA_34B, name="mine")
    advisor = Advisor(AdvisorSettings(), lambda: (1, 1), lambda: "mine", {**PROFILES, "mine": mine})
    assert set(advisor.profile_files) == {"mine"}  # the built-in ones the plan knows by name
    path = advisor.profile_files["mine"]
    assert profile_file.load(path).profile == mine
    advisor.close()
    assert not path.parent.exists()
    assert Advisor(AdvisorSettings(enabled=False), lambda: (1, 1), lambda: "mine", {"mine": mine}).profile_files == {}


RULES = Switching(enabled=True, min_per_pool=1, confirmations=2, min_gain=0.01, cooldown_ms=60_000)


def test_the_governor_moves_one_server_after_plans_agree_and_waits_after_a_move() -> None:
    want_more = {1: 800.0, 2: 850.0, 3: 860.0, 4: 870.0}  # good tokens a second, by speculative servers
    g = Governor()
    assert g.move(RULES, SplitPlan(4, 1, want_more), 4, now=0.0) == 0  # one plan is not enough
    assert g.move(RULES, SplitPlan(4, 1, want_more), 4, now=10.0) == 1  # a step toward the recommendation
    assert g.move(RULES, SplitPlan(4, 2, want_more), 4, now=20.0) == 0
    assert g.move(RULES, SplitPlan(4, 2, want_more), 4, now=30.0) == 0  # agreed, but within the cooldown
    assert g.move(RULES, SplitPlan(4, 2, want_more), 4, now=80.0) == 1
    # Never below the minimum of a pool: 4 of 4 speculative would leave no plain server.
    assert Governor().move(RULES, SplitPlan(4, 3, want_more), 4, now=0.0) == 0
    flat = {1: 850.0, 2: 853.0, 3: 857.0}  # less than 1% more good tokens: not worth a restart
    g = Governor()
    assert [g.move(RULES, SplitPlan(3, 1, flat), 4, now=t) for t in (0.0, 100.0, 200.0)] == [0, 0, 0]


def test_the_governor_follows_a_confirmed_direction_a_server_each_cooldown() -> None:
    more = {0: 700.0, 1: 750.0, 2: 800.0, 3: 850.0, 4: 900.0}
    flat = dict.fromkeys(range(5), 800.0)
    rules = msgspec.structs.replace(RULES, min_per_pool=0)
    g = Governor()
    steps = [
        g.move(rules, SplitPlan(4, current, more), 4, now=t)
        for t, current in ((0.0, 0), (60.0, 0), (120.0, 1), (180.0, 2))
    ]
    assert steps == [0, 1, 1, 1]  # confirmed once, then one server a plan (a cooldown apart) toward the target
    assert g.move(rules, SplitPlan(3, 3, flat), 4, now=240.0) == 0  # a plan that sees nothing to gain ends it
    assert g.move(rules, SplitPlan(4, 3, more), 4, now=300.0) == 0  # and the direction must be confirmed anew
    assert g.move(rules, SplitPlan(4, 3, more), 4, now=360.0) == 1


def test_the_governor_forgets_a_streak_when_the_plans_change_their_mind() -> None:
    more, fewer = {1: 800.0, 2: 850.0, 3: 900.0}, {1: 900.0, 2: 850.0, 3: 800.0}
    g = Governor()
    steps = [
        g.move(RULES, SplitPlan(r, 2, a), 4, now=100.0 * i)
        for i, (a, r) in enumerate([(more, 3), (fewer, 1), (more, 3)])
    ]
    assert steps == [0, 0, 0]
    assert g.move(RULES, SplitPlan(3, 2, more), 4, now=400.0) == 1
    assert Governor().move(msgspec.structs.replace(RULES, confirmations=1), SplitPlan(1, 2, fewer), 4, now=0.0) == -1


async def test_the_advisor_switches_a_server_when_its_plans_agree() -> None:
    """The conversation trace's own pace on a fleet of 1 speculative and 3 plain A100 servers with
    a 40 ms TPOT target: more speculation meets more (plans of `specgate plan`, run for real)."""
    trace = read_trace(Path(__file__).parents[2] / "shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv", 200)
    settings = AdvisorSettings(interval_s=120.0, window_s=3600.0, min_requests=100, max_requests=200)
    moves: list[int] = []

    async def mover(step: int) -> None:
        moves.append(step)
        await asyncio.sleep(0.05)  # a drain and a restart

    advisor = Advisor(settings, lambda: (1, 3), lambda: A100_CODELLAMA_34B.name, PROFILES,
                      lambda: msgspec.structs.replace(RULES, cooldown_ms=0), mover)  # fmt: skip
    start = time.monotonic() - trace[-1].arrival_s
    for r in trace:
        advisor.window.record(Seen(start + r.arrival_s, r.prompt_tokens, r.output_tokens, 2000.0, 40.0))
    first = await advisor.plan_once()
    assert first is not None
    assert first.plan.recommended > 1
    assert moves == []  # once is not enough
    await advisor.plan_once()
    # 1 + 3 to 3 + 1 (one plain server kept): a server at a time, the second as the first is back
    assert moves == [1, 1], [(s["speculative"], s["slo_attainment"]) for s in first.splits]
    assert len(advisor.governor.moves_s) == 2
    assert all(0.05 <= s < 5.0 for s in advisor.governor.moves_s)  # the next plans look further ahead by them
    off = Advisor(settings, lambda: (1, 3), lambda: A100_CODELLAMA_34B.name, PROFILES, Switching, mover)
    off.window, off.governor = advisor.window, Governor(streak=1, direction=1)  # one plan from a move
    await off.plan_once()
    assert moves == [1, 1]  # switching is off unless the policy document enables it


async def test_the_advisor_plans_on_the_rate_yesterday_brought_next() -> None:
    """Yesterday, the same minutes' traffic tripled over the next two intervals: the plan replays
    the window's requests three times as fast, and every split meets less than at their own pace."""
    trace = read_trace(Path(__file__).parents[2] / "shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv", 200)
    settings = AdvisorSettings(interval_s=120.0, window_s=600.0, min_requests=100, max_requests=200)
    plans = {}
    for history in (False, True):
        advisor = Advisor(settings, lambda: (2, 2), lambda: A100_CODELLAMA_34B.name, PROFILES)
        now = time.monotonic()
        if history:
            yesterday = now - advisor.window.daily.period_s
            for i in range(100):  # 1 every 6 s over the window's 600 s, then 3 times as many
                advisor.window.daily.record(yesterday - 600.0 + 6.0 * i)
            for i in range(120):  # over the 240 s (two intervals) after it
                advisor.window.daily.record(yesterday + 2.0 * i)
        start = now - trace[-1].arrival_s
        for r in trace:
            advisor.window.record(Seen(start + r.arrival_s, r.prompt_tokens, r.output_tokens, 2000.0, 50.0))
        plans[history] = await advisor.plan_once()
    plain, grown = plans[False], plans[True]
    assert plain is not None
    assert grown is not None
    assert plain.growth is None
    assert grown.growth == pytest.approx(3.0, rel=0.15)  # counted by the minute: a minute's smear
    assert grown.view()["rate_growth"] == grown.growth
    assert grown.view()["plan_horizon_s"] == 240.0  # two intervals; no move made yet
    for at_pace, faster in zip(plain.splits, grown.splits, strict=True):
        assert faster["slo_attainment"] < at_pace["slo_attainment"]


def test_once_a_direction_is_confirmed_the_next_server_moves_as_the_last_is_back() -> None:
    """The plan wants all four servers plain: after the first move, one more each time a move
    ends, with no cooldown between, until the plan's split is reached."""
    plain_wins = {0: 900.0, 1: 850.0, 2: 800.0, 3: 750.0, 4: 700.0}
    rules = msgspec.structs.replace(RULES, min_per_pool=0)  # cooldown 60 s
    g = Governor()
    assert g.move(rules, SplitPlan(0, 4, plain_wins), 4, now=0.0, after_move=True) == 0  # no direction confirmed yet
    assert [g.move(rules, SplitPlan(0, 4, plain_wins), 4, now=t) for t in (0.0, 100.0)] == [0, -1]
    assert [
        g.move(rules, SplitPlan(0, current, plain_wins), 4, now=101.0, after_move=True) for current in (3, 2, 1, 0)
    ] == [
        -1,
        -1,
        -1,
        0,
    ]
    assert g.move(rules, SplitPlan(0, 1, plain_wins), 4, now=120.0) == 0  # the cooldown still spaces the plans' moves
    assert (
        g.move(rules, SplitPlan(0, 1, {**plain_wins, 0: 855.0}), 4, now=121.0, after_move=True) == 0
    )  # not worth min_gain


def test_plans_look_ahead_as_long_as_the_moves_take() -> None:
    """A plan made now stands until two more can undo it, and the moves it starts come first: up
    to one per server, as long as the last moves took from their drain to serving again."""
    plain_wins = {0: 900.0, 1: 850.0, 2: 800.0, 3: 750.0, 4: 700.0}
    rules = msgspec.structs.replace(RULES, min_per_pool=0)
    g = Governor()
    assert g.horizon_s(rules, 60.0, 4) == 120.0  # no move seen: nothing known of their time
    assert [g.move(rules, SplitPlan(0, 4, plain_wins), 4, now=t) for t in (0.0, 100.0)] == [0, -1]
    assert g.move(rules, SplitPlan(0, 3, plain_wins), 4, now=130.0, after_move=True) == -1
    assert g.move(rules, SplitPlan(0, 2, plain_wins), 4, now=150.0, after_move=True) == -1
    assert g.horizon_s(rules, 60.0, 4) == 4 * 25.0 + 120.0  # moves of 30 and 20 s
    assert g.horizon_s(rules, 60.0, 8) == 8 * 25.0 + 120.0


def test_the_governor_crosses_a_valley_toward_the_better_end() -> None:
    """Past saturation mixed fleets may do worse than either end: the move toward the best split
    counts that split's gain, not the next step's."""
    valley = {0: 790.0, 1: 740.0, 2: 730.0, 3: 740.0, 4: 750.0}
    rules = msgspec.structs.replace(RULES, min_per_pool=0, confirmations=1, cooldown_ms=0)
    g = Governor()
    assert [g.move(rules, SplitPlan(0, current, valley), 4, now=10.0 - current) for current in (4, 3, 2, 1)] == [-1] * 4


def test_a_split_gains_the_share_of_good_tokens_it_adds() -> None:
    assert split_gain({0: 800.0, 4: 1000.0}, 4, 0) == 0.25
    assert split_gain({0: 800.0, 4: 1000.0}, 0, 4) == pytest.approx(-0.2)
    assert split_gain({0: 0.0, 4: 10.0}, 4, 0) == math.inf  # from nothing met, anything is worth a move
    assert split_gain({0: 0.0, 4: 0.0}, 4, 0) == 0.0
    assert math.isnan(split_gain({0: 800.0}, 4, 0))  # a split the plan did not cover
    assert (
        Governor().move(msgspec.structs.replace(RULES, confirmations=1), SplitPlan(3, 1, {1: 800.0}), 4, now=0.0) == 0
    )


def test_a_move_needs_a_gain_that_stands_out_of_the_plans_own_noise() -> None:
    """Two plans that both predict 5% more good tokens for all plain: in one, every stretch of the
    traffic gains about that; in the other, one stretch gains it all and the rest are a wash either
    way. The second is what a plan of splits that are really alike looks like, and moves nothing."""
    speculative = [1000.0] * 10
    steady = [1040.0, 1060.0, 1050.0, 1045.0, 1055.0, 1050.0, 1040.0, 1060.0, 1050.0, 1050.0]
    lucky = [1500.0, 1000.0, 960.0, 1040.0, 980.0, 1020.0, 1000.0, 1000.0, 1000.0, 1000.0]
    rules = msgspec.structs.replace(RULES, min_per_pool=0, confirmations=1, cooldown_ms=0, sigmas=1.0)
    for plain, moves in ((steady, -1), (lucky, 0)):
        stretches = {0: plain, 4: speculative}
        good_tokens = {0: sum(plain) / 10, 4: 1000.0}
        assert split_gain(good_tokens, 0, 4) == pytest.approx(0.05)
        assert Governor().move(rules, SplitPlan(0, 4, good_tokens, stretches), 4, now=0.0) == moves
        # Without the stretches, or with the noise not asked for (the default), the figure is exact.
        assert Governor().move(rules, SplitPlan(0, 4, good_tokens), 4, now=0.0) == -1
        exact = msgspec.structs.replace(rules, sigmas=0.0)
        assert Governor().move(exact, SplitPlan(0, 4, good_tokens, stretches), 4, now=0.0) == -1
    assert gain_error({0: steady, 4: speculative}, 0, 4) == pytest.approx(0.0023, abs=0.0005)
    assert gain_error({0: lucky, 4: speculative}, 0, 4) == pytest.approx(0.050, abs=0.002)
    assert gain_error({0: lucky}, 0, 4) == 0.0  # a split the plan gave no stretches: nothing known
    assert gain_error({0: lucky, 4: [1000.0] * 5}, 0, 4) == 0.0
    assert gain_error({0: lucky, 4: [0.0] * 10}, 0, 4) == 0.0  # from nothing met: any gain is real


def test_a_streak_of_plans_pools_its_evidence_before_it_moves() -> None:
    """Plans that each see all plain 3% ahead of 1 + 3, each with a standard error of 3%: none alone
    clears the 1% asked for by one error more, but their mean does once enough of them agree, the
    sooner the less their windows overlap; then the direction is followed as any confirmed one."""
    speculative = [1000.0] * 10
    plain = [1030.0 + (90.0 if i % 2 else -90.0) for i in range(10)]
    stretches, good_tokens = {0: plain, 1: speculative}, {0: sum(plain) / 10, 1: 1000.0}
    error = gain_error(stretches, 0, 1)
    assert split_gain(good_tokens, 0, 1) == pytest.approx(0.03)
    assert 0.02 < error < 0.04  # one plan: 3% +- 3%, within its own noise
    rules = msgspec.structs.replace(RULES, min_per_pool=0, confirmations=1, cooldown_ms=0, sigmas=1.0)
    found = SplitPlan(0, 1, good_tokens, stretches)

    def plans_to_move(fresh: float) -> int:
        g = Governor()
        for plan in range(1, 20):
            if g.move(rules, found, 4, now=float(plan), fresh=fresh):
                return plan
        return 0

    # 3% - 3% / sqrt(n) >= 1%: from the third independent plan; half-overlapping windows, the fourth.
    assert plans_to_move(1.0) == 3
    assert plans_to_move(0.5) == 4
    assert plans_to_move(0.0) == 0  # the same traffic planned again is no more evidence
    g = Governor()
    for plan in range(2):
        g.move(rules, found, 4, now=float(plan))
    view = g.view()
    assert (view["direction"], view["plans"], view["confirmed"]) == (-1, 2, False)
    assert view["pooled_gain"] == pytest.approx(0.03)
    assert view["pooled_gain_error"] == pytest.approx(error / math.sqrt(2))
    # A plan that stops wanting the move ends the streak and its evidence.
    g = Governor()
    assert g.move(rules, found, 4, now=1.0) == 0
    assert g.move(rules, found, 4, now=2.0) == 0
    assert g.move(rules, SplitPlan(0, 1, {0: 1000.0, 1: 1000.0}, stretches), 4, now=3.0) == 0
    assert g.evidence == []
    assert not g.confirmed
    assert g.move(rules, found, 4, now=4.0) == 0
    # Without the noise asked for, the plans' figures count as exact, as before.
    assert Governor().move(msgspec.structs.replace(rules, sigmas=0.0), found, 4, now=0.0) == -1


def test_the_plans_stretches_are_read_by_split() -> None:
    rows: list[dict[str, Any]] = [
        {"speculative": 0, "good_tokens_per_s": 1.0, "good_tokens_per_s_by_stretch": [1.0, 1.0]},
        {"speculative": 1, "good_tokens_per_s": 2.0},  # a plan from before the stretches
    ]
    plan = SplitPlan.of(rows, 1, 0)
    assert plan.stretches == {0: [1.0, 1.0]}
    assert plan.good_tokens == {0: 1.0, 1: 2.0}
    assert (plan.gain, plan.gain_error) == (1.0, 0.0)  # no stretches of the recommended split: nothing known
