"""Probes of the engine model in virtual time: one request alone, one pure decode step, a burst of
requests at once, a long speculative run. Exact and repeatable; the fidelity benchmark and the
tests read the profiles' behaviour through them."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import Profile
from specgate.sim.engine import Engine, EngineConfig
from specgate.sim.outcomes import FinishedRequest


def run_alone(
    profile: Profile, mode: Pool, prompt: int, output: int, *, seed: int = 0, spread: bool = True
) -> FinishedRequest:
    """One request on an idle replica; `spread=False` gives it exactly the mean acceptance rate."""
    engine = Engine(profile, mode, EngineConfig(acceptance_concentration=None if spread else 0.0), seed=seed)
    engine.add_request("only", prompt, output, arrival=0.0)
    finished: list[FinishedRequest] = []
    while engine.has_work():
        finished += engine.step().finished
    (request,) = finished
    return request


def decode_step(profile: Profile, batch: int, context: int) -> tuple[float, float]:
    """(forward ms, whole step ms) of a pure decode step of `batch` sequences at `context` tokens."""
    # A budget that prefills every prompt in the first step makes the second a pure decode.
    engine = Engine(profile, Pool.PLAIN, EngineConfig(max_num_batched_tokens=batch * context))
    for i in range(batch):
        engine.add_request(f"r{i}", context - 1, 8, arrival=0.0)
    first = engine.step()
    step = engine.step()
    if (first.batch.prefill_seqs, step.batch.decode_seqs, step.batch.prefill_tokens) != (batch, batch, 0):
        raise AssertionError("the second step was not a pure decode of the whole batch")
    return step.forward_ms, step.duration * 1e3


@dataclass(frozen=True)
class LoadPoint:
    concurrency: int
    plain_tpot_ms: float
    spec_tpot_ms: float
    plain_preemptions: int
    spec_preemptions: int

    @property
    def speedup(self) -> float:
        return self.plain_tpot_ms / self.spec_tpot_ms


def load_point(
    profile: Profile, concurrency: int, prompt: int = 512, output: int = 256, kv_capacity: int | None = None
) -> LoadPoint:
    """`concurrency` requests arriving at once, in each mode: median TPOT and preemptions."""
    figures: list[tuple[float, int]] = []
    for mode in (Pool.PLAIN, Pool.SPECULATIVE):
        config = EngineConfig(acceptance_concentration=0.0, kv_capacity_tokens=kv_capacity)
        engine = Engine(profile, mode, config)
        for i in range(concurrency):
            engine.add_request(f"r{i}", prompt, output, arrival=0.0)
        tpots: list[float] = []
        while engine.has_work():
            tpots += [f.tpot for f in engine.step().finished if f.tpot is not None]
        figures.append((statistics.median(tpots) * 1e3, engine.counters.preemptions))
    (plain_tpot, plain_pre), (spec_tpot, spec_pre) = figures
    return LoadPoint(concurrency, plain_tpot, spec_tpot, plain_pre, spec_pre)


def speculative_run(profile: Profile, alpha: float, requests: int = 40) -> Engine:
    """A speculative engine after serving `requests` long requests at acceptance `alpha`: its
    counters hold what vLLM's spec-decode metrics would."""
    engine = Engine(profile, Pool.SPECULATIVE, EngineConfig(acceptance_mean=alpha, acceptance_concentration=0.0))
    for i in range(requests):
        engine.add_request(f"r{i}", 256, 400, arrival=0.0)
    while engine.has_work():
        engine.step()
    return engine
