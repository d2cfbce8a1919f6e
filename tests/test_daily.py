"""`specgate bench daily`'s accounting of a day by the hour."""

from __future__ import annotations

import math
from collections import Counter

from specgate.bench.daily import ended_with, hourly, move_times
from specgate.bench.offline import RunResult, Served
from specgate.calibration.modes import Pool
from specgate.policies.features import SloTargets


def test_each_hour_counts_the_requests_that_arrived_in_it_and_the_good_tokens_of_those_met() -> None:
    slo = SloTargets(1000.0, 50.0)
    met = Served(0.2, 0.02, 6.2, Pool.PLAIN, 100, 300, slo, arrival_s=10.0)
    late = Served(2.0, 0.02, 12.0, Pool.PLAIN, 100, 500, slo, arrival_s=20.0)  # TTFT over its target
    evening = Served(0.1, 0.01, 2.1, Pool.SPECULATIVE, 100, 200, slo, arrival_s=2350.0)
    day = RunResult((met, late, evening), Counter({"shed": 1}), 2400.0, refusals=((150.0, "shed"),))
    hours = hourly(day, 2400.0)  # an hour of the day is 100 s of the run
    attainment, good_tokens = hours["hourly_attainment"], hours["hourly_good_tokens_per_s"]
    assert (attainment[0], attainment[1], attainment[23]) == (0.5, 0.0, 1.0)  # the refused one missed
    assert all(math.isnan(a) for a in attainment[2:23])
    assert good_tokens[0] == 3.0  # the met request's 300 tokens over the hour's 100 s, not the late one's
    assert (good_tokens[1], good_tokens[23]) == (0.0, 2.0)


def test_a_switching_fleet_ends_its_day_where_its_moves_took_it() -> None:
    moves = [
        {"drained_s": 10.0 * i, "serving_s": 10.0 * i + 5, "server": f"s{i}", "to": to}
        for i, to in enumerate(["speculative", "speculative", "plain", "speculative"])
    ]
    assert ended_with({"speculative": 2, "switches": moves}) == 4
    assert ended_with({"speculative": 1, "switches": []}) == 1
    assert move_times({"speculative": 2, "switches": moves}) == (5.0,) * 4  # what its next day plans ahead by
