"""Traffic the adaptive policy was not developed on, made from a recorded trace.

Each shape keeps the trace's requests (their prompt and output lengths, in order) and its mean
arrival rate, and changes one thing: when they arrive (`ARRIVALS`), how long their prompts are
(`PROMPTS`), or which request class they belong to (`classes`). Everything is seeded: the same
arguments give the same trace.

Arrival shapes, each an inhomogeneous Poisson process whose rate averages to the trace's:

- `recorded`: as the trace has them;
- `poisson`: a constant rate;
- `onoff`: bursts: a quarter of the time at four times the mean rate, silence in between;
- `storms`: regime switching: calm stretches, and storms of 5 to 10 times the calm rate;
- `ramp`: a day compressed into the run: quiet, a peak in the middle, quiet again.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

from specgate.bench.traces import TraceRequest

ARRIVALS = ("recorded", "poisson", "onoff", "storms", "ramp")
PROMPTS = ("recorded", "long")
BIN_S = 1.0
"""Resolution of the rate functions, in seconds of the trace."""


def _rates_onoff(bins: int, rng: random.Random) -> list[float]:
    rates: list[float] = []
    on = rng.random() < 0.25
    while len(rates) < bins:
        length = max(1, round(rng.expovariate(1 / (8.0 if on else 24.0))))
        rates += [4.0 if on else 0.0] * length
        on = not on
    return rates[:bins]


def _rates_storms(bins: int, rng: random.Random) -> list[float]:
    rates: list[float] = []
    storm = False
    while len(rates) < bins:
        length = max(1, round(rng.expovariate(1 / (10.0 if storm else 40.0))))
        rates += [rng.uniform(5.0, 10.0) if storm else 1.0] * length
        storm = not storm
    return rates[:bins]


def _rates_ramp(bins: int, rng: random.Random) -> list[float]:
    return [1.0 - 0.85 * math.cos(2 * math.pi * (i + 0.5) / bins) for i in range(bins)]


_RATES: dict[str, Callable[[int, random.Random], list[float]]] = {
    "poisson": lambda bins, _: [1.0] * bins,
    "onoff": _rates_onoff,
    "storms": _rates_storms,
    "ramp": _rates_ramp,
}


def arrivals(trace: Sequence[TraceRequest], shape: str, seed: int = 0) -> list[TraceRequest]:
    """The same requests, in the same order, arriving as `shape` says at the same mean rate."""
    if shape == "recorded" or len(trace) < 2:
        return list(trace)
    rng = random.Random(f"arrivals-{shape}-{seed}")
    span = trace[-1].arrival_s - trace[0].arrival_s
    bins = max(int(span / BIN_S), 1)
    rates = _RATES[shape](bins, rng)
    total = sum(rates)
    # Cumulative intensity, scaled so that the whole run expects len(trace) arrivals.
    cumulative = [0.0]
    for rate in rates:
        cumulative.append(cumulative[-1] + rate * len(trace) / total)
    # Unit-rate Poisson arrivals conditioned on their number: n + 1 exponential gaps scaled to span
    # the whole intensity, then mapped back to time through it.
    gaps = [rng.expovariate(1.0) for _ in range(len(trace) + 1)]
    scale = cumulative[-1] / sum(gaps)
    out, position = [], 0.0
    for request, gap in zip(trace, gaps, strict=False):
        position += gap * scale
        i = min(max(bisect.bisect_left(cumulative, position) - 1, 0), bins - 1)
        within = (position - cumulative[i]) / (cumulative[i + 1] - cumulative[i]) if rates[i] > 0 else 0.0
        out.append(replace(request, arrival_s=(i + within) * span / bins))
    return out


def prompts(trace: Sequence[TraceRequest], mix: str, max_model_len: int, seed: int = 0) -> list[TraceRequest]:
    """`long`: a third of the prompts 8k to 24k tokens long, and one in twenty past the model's
    context window (which vLLM refuses); `recorded`: as the trace has them."""
    if mix == "recorded":
        return list(trace)
    rng = random.Random(f"prompts-{mix}-{seed}")
    out = []
    for request in trace:
        draw = rng.random()
        if draw < 0.05:
            prompt = rng.randint(max_model_len, max_model_len * 3 // 2)
        elif draw < 0.05 + 1 / 3:
            prompt = round(math.exp(rng.uniform(math.log(8192), math.log(24576))))
        else:
            prompt = request.prompt_tokens
        out.append(replace(request, prompt_tokens=prompt))
    return out


CLASSES = {"interactive": 0.3, "chat": 0.5, "batch": 0.2}
"""The request classes of a mixed workload, with their shares."""


def class_targets(ttft_ms: float, tpot_ms: float) -> dict[str, tuple[float, float]]:
    """Each class's (TTFT, TPOT) targets around one SLO pair: interactive tighter on the first
    token, batch ten times looser on it and three times on the pace."""
    return {
        "interactive": (ttft_ms / 2, tpot_ms),
        "chat": (ttft_ms, tpot_ms),
        "batch": (ttft_ms * 10, tpot_ms * 3),
    }


def classes(trace: Sequence[TraceRequest], seed: int = 0) -> list[TraceRequest]:
    """Every request in one of `CLASSES`, drawn by its share."""
    rng = random.Random(f"classes-{seed}")
    names, weights = list(CLASSES), list(CLASSES.values())
    return [replace(r, request_class=rng.choices(names, weights)[0]) for r in trace]
