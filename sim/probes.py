"""Probes of the engine model in virtual time: one request alone, one pure decode step, a burst of
requests at once, a long speculative run, clients in a closed loop. Exact and repeatable; the
fidelity benchmark and the tests read the profiles' behaviour through them."""

from __future__ import annotations

import heapq
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


def closed_loop(
    profile: Profile, mode: Pool, clients: int, requests: int, prompt: int, output: int, stagger_s: float = 0.0
) -> tuple[float, float]:
    """Median TTFT and TPOT (ms) of `requests` requests of `prompt` tokens, each answering
    `output`, with `clients` in flight in a closed loop (each client sends its next request as its
    last one ends; the clients start `stagger_s` apart): `specgate bench cpu-fidelity`'s load, in
    virtual time. Each request draws its acceptance from a seed of its own, so that two profiles
    run on the same draws."""
    engine = Engine(profile, mode, EngineConfig())
    sends = [(i * stagger_s, i) for i in range(clients)]
    client_of: dict[str, int] = {}
    finished: list[FinishedRequest] = []
    while len(finished) < requests:
        while sends and len(client_of) < requests and (sends[0][0] <= engine.now or not engine.has_work()):
            at, client = heapq.heappop(sends)
            request_id = f"r{len(client_of)}"
            client_of[request_id] = client
            engine.add_request(request_id, prompt, output, arrival=at, seed=request_id)
        step = engine.step()
        for done in step.finished:
            finished.append(done)
            heapq.heappush(sends, (step.end, client_of[done.request_id]))
    ttfts = [done.ttft * 1e3 for done in finished if done.ttft is not None]
    tpots = [done.tpot * 1e3 for done in finished if done.tpot is not None]
    return statistics.median(ttfts), statistics.median(tpots)
