"""Traffic shapes made from a trace: the same requests, a new arrival process, prompt mix or classes."""

from __future__ import annotations

import math
import statistics
from collections import Counter

import pytest

from specgate.bench import shapes
from specgate.bench.traces import TraceRequest

TRACE = [TraceRequest(i * 0.5, 100 + i % 7, 20 + i % 5) for i in range(2000)]  # 1000 s at 2 req/s


def per_bin(trace: list[TraceRequest], seconds: float = 10.0) -> list[int]:
    counts = Counter(int(r.arrival_s // seconds) for r in trace)
    return [counts.get(i, 0) for i in range(int(trace[-1].arrival_s // seconds) + 1)]


@pytest.mark.parametrize("shape", shapes.ARRIVALS)
def test_every_shape_keeps_the_requests_their_order_and_the_mean_rate(shape: str) -> None:
    shaped = shapes.arrivals(TRACE, shape, seed=1)
    assert [(r.prompt_tokens, r.output_tokens) for r in shaped] == [(r.prompt_tokens, r.output_tokens) for r in TRACE]
    times = [r.arrival_s for r in shaped]
    assert times == sorted(times)
    assert times[-1] == pytest.approx(TRACE[-1].arrival_s, rel=0.1)
    assert shapes.arrivals(TRACE, shape, seed=1) == shaped  # seeded


def test_the_shapes_differ_where_they_should() -> None:
    poisson = per_bin(shapes.arrivals(TRACE, "poisson"))
    onoff = per_bin(shapes.arrivals(TRACE, "onoff"))
    storms = per_bin(shapes.arrivals(TRACE, "storms"))
    ramp = per_bin(shapes.arrivals(TRACE, "ramp"))
    assert max(poisson) < 3 * statistics.fmean(poisson)
    assert onoff.count(0) > len(onoff) / 4  # silences between bursts
    assert max(storms) > 4 * statistics.median(storms)  # storms of several times the calm rate
    third = len(ramp) // 3
    assert sum(ramp[third : 2 * third]) > 2 * sum(ramp[:third])  # the peak of the day in the middle


def test_the_long_prompt_mix() -> None:
    long = shapes.prompts(TRACE, "long", max_model_len=16_384)
    over_8k = sum(r.prompt_tokens > 8192 for r in long) / len(long)
    past_window = sum(r.prompt_tokens >= 16_384 for r in long) / len(long)
    assert over_8k == pytest.approx(1 / 3 + 0.05, abs=0.04)
    # one in twenty drawn past it, and those of the third (8k to 24k tokens, log-uniform) above 16k
    assert past_window == pytest.approx(0.05 + math.log(24_576 / 16_384) / math.log(3) / 3, abs=0.03)
    assert shapes.prompts(TRACE, "recorded", 16_384) == TRACE


def test_request_classes_by_share_with_targets_around_one_slo_pair() -> None:
    shares = Counter(r.request_class for r in shapes.classes(TRACE))
    for name, share in shapes.CLASSES.items():
        assert shares[name] / len(TRACE) == pytest.approx(share, abs=0.04)
    targets = shapes.class_targets(800.0, 60.0)
    assert targets["chat"] == (800.0, 60.0)
    assert targets["interactive"][0] < 800.0 < targets["batch"][0]
