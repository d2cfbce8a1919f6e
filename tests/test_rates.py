"""Prompt rates read over the time their prompts have been seen (`workers/rates.py`)."""

from __future__ import annotations

import math
import random

import pytest

from specgate.workers.rates import PromptRate, as_counts, per_s

WINDOW_S = 10.0


def poisson(rate: PromptRate, rnd: random.Random, arrivals_per_s: float, since: float, until: float) -> None:
    """Prompts of 100 tokens at random at `arrivals_per_s` from `since` to `until`."""
    now = since
    while (now := now + rnd.expovariate(arrivals_per_s)) < until:
        rate.add(100, now)


def plain(rate: PromptRate, now: float) -> float:
    """What the decaying count alone reads (bar the first prompt): its prompts over the time constant."""
    return rate.prompts * math.exp(-(now - rate.at) / rate.window_s) / rate.window_s


@pytest.mark.parametrize("arrivals_per_s", [2.0, 8.0, 30.0])
def test_a_stream_that_has_just_begun_reads_as_its_rate_not_a_fraction_of_it(arrivals_per_s: float) -> None:
    """Five seconds into a stream (half the time constant), the decaying count reads 0.4 of it;
    read over the five seconds it has been seen, it is the rate, to the noise of the arrivals.
    (Not where two prompts or fewer are expected in them: one prompt is no rate yet.)"""
    readings, fractions = [], []
    for seed in range(200):
        rate = PromptRate(WINDOW_S)
        poisson(rate, random.Random(seed), arrivals_per_s, 0.0, 5.0)
        readings.append(rate.per_s(5.0)[0])
        fractions.append(plain(rate, 5.0) / arrivals_per_s)
    assert sum(readings) / len(readings) == pytest.approx(arrivals_per_s, rel=0.1)
    assert sum(fractions) / len(fractions) < 0.45  # (what was read before: 1 - e^{-1/2} = 0.39)


def test_long_after_it_began_a_rate_is_the_decaying_count_and_forgets_as_it_does() -> None:
    rate = PromptRate(WINDOW_S)
    poisson(rate, random.Random(1), 4.0, 0.0, 300.0)
    assert rate.per_s(300.0)[0] == pytest.approx(plain(rate, 300.0), rel=1e-6)
    assert rate.per_s(300.0)[1] == pytest.approx(100 * rate.per_s(300.0)[0])
    # a silence after the prompts began is seen: it is counted as one
    assert rate.per_s(330.0)[0] == pytest.approx(rate.per_s(300.0)[0] * math.exp(-3.0), rel=1e-6)


def test_the_first_prompt_marks_the_start_and_is_not_itself_counted() -> None:
    rate = PromptRate(WINDOW_S)
    assert rate.per_s(7.0) == (0.0, 0.0)
    rate.add(1000, 3.0)
    assert rate.per_s(3.0) == (0.0, 0.0)
    assert rate.per_s(9.0) == (0.0, 0.0)  # one prompt is no rate yet
    rate.add(500, 4.0)  # one more a second later: one in the second seen, of 500 tokens
    seen = WINDOW_S * -math.expm1(-1.0 / WINDOW_S)  # (the second, weighed as the count decays)
    assert rate.per_s(4.0) == pytest.approx((1.0 / seen, 500.0 / seen))


def test_counts_written_back_read_as_the_rates_they_were_made_from_then_decay_as_any() -> None:
    """`as_counts` is what the counts of several processes, summed as rates, are written back as:
    read at the moment they are written, they are those rates; later, they decay and their time
    seen grows as one process's would."""
    one, other = PromptRate(WINDOW_S), PromptRate(WINDOW_S)
    poisson(one, random.Random(2), 3.0, 0.0, 8.0)
    poisson(other, random.Random(3), 5.0, 0.0, 8.0)
    summed = [a + b for a, b in zip(one.per_s(8.0), other.per_s(8.0), strict=True)]
    seen = max(rate.seen_s + 8.0 - rate.at for rate in (one, other))  # (the longer of their times seen)
    prompts, tokens = as_counts(summed[0], summed[1], seen, WINDOW_S)
    assert per_s(prompts, tokens, 8.0, seen, WINDOW_S, 8.0) == pytest.approx(summed)
    later = per_s(prompts, tokens, 8.0, seen, WINDOW_S, 9.5)
    apart = [a + b for a, b in zip(one.per_s(9.5), other.per_s(9.5), strict=True)]
    assert later == pytest.approx(apart, rel=0.02)


def test_times_out_of_order_neither_grow_the_time_seen_nor_the_counts_backwards() -> None:
    rate = PromptRate(WINDOW_S)
    rate.add(10, 5.0)
    rate.add(10, 6.0)
    rate.add(10, 5.5)  # (requests dispatched concurrently may be counted a little out of order)
    assert (rate.at, rate.seen_s, rate.prompts) == (6.0, 1.0, 2.0)
    assert rate.per_s(6.0)[0] == pytest.approx(rate.prompts / (WINDOW_S * -math.expm1(-1.0 / WINDOW_S)))
