"""The offline simulator: a fleet of engine models, the gateway's view of it, and a trace, in virtual time.

Discrete-event: requests arrive as the (rate-scaled) trace says; each replica is the same engine
model the simulated replica serves (`workers.sim.engine`); routing is the same policy code the
gateway runs, deciding on the same `Fleet` accounting — scraped load refreshed only every scrape
interval (stale, as in production) plus the gateway's own exact in-flight counts, and the latency
corrections and learned output lengths fed by the requests that finish.

The policy never sees a request's true output length: requests carry a realistic `max_tokens`
cap, and only the `exact` hint scenario hands the true length over as the client's hint.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specgate.bench.traces import TraceRequest
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import Profile
from specgate.policies.decision import Decision
from specgate.policies.document import SCHEMA_VERSION, PolicyDocument, parse
from specgate.policies.features import RequestFeatures
from specgate.policies.latency_model import LatencyModel
from specgate.policies.length import LengthStats
from specgate.sim.engine import Engine, EngineConfig
from specgate.sim.outcomes import StepResult
from specgate.workers.acceptance import SpecCounters
from specgate.workers.pools import Fleet, FleetSettings, Replica
from specgate.workers.scrape import VllmLoad
from specgate.workers.snapshot import ReplicaState

MODEL = "model"
MAX_TOKENS = 4096
"""The cap every simulated client sends: generous, as real clients set it, and not the answer."""


@dataclass(frozen=True)
class Fleetspec:
    spec: int
    plain: int

    @property
    def label(self) -> str:
        if not self.spec:
            return f"all-plain x{self.plain}"
        if not self.plain:
            return f"all-speculative x{self.spec}"
        return f"{self.spec} speculative + {self.plain} plain"


@dataclass(frozen=True)
class Scenario:
    profile: Profile
    fleet: Fleetspec
    policy: str
    """A policy as the command line gives it (`policy_document`): its name, then its settings."""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    hint: bool = False
    """Hand each request's true output length to the policy as the client's hint."""
    scrape_interval_s: float = 0.25
    seed: int = 0


@dataclass(frozen=True)
class Served:
    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    pool: Pool
    prompt_tokens: int
    output_tokens: int

    def meets(self, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
        if slo_ttft_ms is not None and self.ttft_s * 1e3 > slo_ttft_ms:
            return False
        tpot_ms = self.tpot_s * 1e3 if self.tpot_s is not None else None
        return not (slo_tpot_ms is not None and tpot_ms is not None and tpot_ms > slo_tpot_ms)


@dataclass(frozen=True)
class RunResult:
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    served: tuple[Served, ...]
    shed: int
    span_s: float

    @property
    def requests(self) -> int:
        return len(self.served) + self.shed

    def summary(self) -> dict[str, float | int]:
        met = sum(s.meets(self.slo_ttft_ms, self.slo_tpot_ms) for s in self.served)
        ttft = [s.ttft_s * 1e3 for s in self.served]
        tpot = [s.tpot_s * 1e3 for s in self.served if s.tpot_s is not None]
        e2e = [s.e2e_s * 1e3 for s in self.served]
        spec = sum(s.pool is Pool.SPECULATIVE for s in self.served)
        return {
            "requests": self.requests,
            "slo_attainment": met / self.requests if self.requests else 0.0,
            "goodput_rps": met / self.span_s if self.span_s else 0.0,
            "ttft_p50_ms": _pct(ttft, 0.5),
            "ttft_p99_ms": _pct(ttft, 0.99),
            "tpot_p50_ms": _pct(tpot, 0.5),
            "tpot_p99_ms": _pct(tpot, 0.99),
            "e2e_p50_ms": _pct(e2e, 0.5),
            "e2e_p99_ms": _pct(e2e, 0.99),
            "spec_share": spec / len(self.served) if self.served else 0.0,
            "shed": self.shed,
        }


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if q == 0.5:
        return float(statistics.median(values))
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class _SimReplica:
    engine: Engine
    busy: bool = False


def _fits(profile: Profile, request: TraceRequest) -> TraceRequest:
    """Clip a trace request to what the model's context window and the client's cap allow."""
    prompt = min(request.prompt_tokens, profile.max_model_len - 2)
    output = min(request.output_tokens, MAX_TOKENS, profile.max_model_len - prompt)
    return TraceRequest(request.arrival_s, prompt, max(output, 1))


def policy_document(spec: str, profile: str) -> PolicyDocument:
    """A policy document from its command-line form: `adaptive:shedding.enabled=true;harm_weight=0.25`
    is the adaptive policy with shedding on and its `harm_weight` parameter set. A setting named
    like a key of the document (`exploration`, `shedding.below_priority`) sets that key; any other is
    one of the policy's `params`. Values: true/false, whole numbers, other numbers."""
    name, _, rest = spec.partition(":")
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "policy": name, "profile": profile, "params": {}}
    for item in filter(None, rest.split(";")):
        key, _, text = item.partition("=")
        value: object = text == "true" if text in ("true", "false") else int(text) if _is_int(text) else float(text)
        *parents, last = key.split(".")
        node = doc if key.split(".")[0] in PolicyDocument.__struct_fields__ else doc["params"]
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return parse(doc)


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


def simulate(trace: Sequence[TraceRequest], scenario: Scenario) -> RunResult:
    profile = scenario.profile
    plan = policy_document(scenario.policy, profile.name).compile("offline")
    pools = {Pool.SPECULATIVE: [f"sim://spec-{i}" for i in range(scenario.fleet.spec)],
             Pool.PLAIN: [f"sim://plain-{i}" for i in range(scenario.fleet.plain)]}  # fmt: skip
    fleet = Fleet(pools, FleetSettings(scrape_interval_s=scenario.scrape_interval_s))
    sims: dict[str, _SimReplica] = {}
    for i, (name, replica) in enumerate(fleet.replicas.items()):
        mode = Pool.SPECULATIVE if replica.pool is Pool.SPECULATIVE else Pool.PLAIN
        sims[name] = _SimReplica(Engine(profile, mode, EngineConfig(), seed=scenario.seed * 1000 + i))
    lengths = LengthStats()
    requests = [_fits(profile, r) for r in trace]

    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()
    routed: dict[str, tuple[TraceRequest, str, Decision]] = {}
    served: list[Served] = []
    shed = 0
    arrivals_left = len(requests)

    def start_step(name: str) -> None:
        sim = sims[name]
        step = sim.engine.step()
        sim.busy = True
        heapq.heappush(events, (step.end, next(order), "step", (name, step)))

    def scrape(now: float) -> None:
        for name, replica in fleet.replicas.items():
            engine = sims[name].engine
            c = engine.counters
            spec = SpecCounters(c.drafts, c.draft_tokens, c.accepted_tokens, tuple(c.accepted_per_pos))
            load = VllmLoad(
                running=engine.num_running,
                waiting=engine.num_waiting,
                kv_usage=engine.kv_usage,
                preemptions=c.preemptions,
                prompt_tokens=c.prompt_tokens,
                generation_tokens=c.generation_tokens,
                spec=spec if engine.speculative else None,
            )
            replica.scraped(load, now, replica.dispatched)

    def arrive(index: int, request: TraceRequest) -> None:
        nonlocal shed, arrivals_left
        arrivals_left -= 1
        now = request.arrival_s
        features = RequestFeatures(
            model=MODEL,
            stream=True,
            prompt_tokens=request.prompt_tokens,
            max_tokens=MAX_TOKENS,
            expected_output_tokens=lengths.expected(
                MODEL,
                request.prompt_tokens,
                hint=request.output_tokens if scenario.hint else None,
                max_tokens=MAX_TOKENS,
            ),
            slo_ttft_ms=scenario.slo_ttft_ms,
            slo_tpot_ms=scenario.slo_tpot_ms,
            forced_pool=None,
            priority=0,
            sequence=index,
        )
        decision = plan.decide(features, fleet.snapshot(now))
        if not isinstance(decision, Decision):
            shed += 1
            return
        name = decision.replica.name
        fleet.replicas[name].dispatched_one(request.prompt_tokens, now)
        request_id = f"r{index}"
        routed[request_id] = (request, name, decision)
        sims[name].engine.add_request(request_id, request.prompt_tokens, request.output_tokens, arrival=now)
        if not sims[name].busy:
            start_step(name)

    def step_done(name: str, step: StepResult) -> None:
        replica = fleet.replicas[name]
        for out in step.outputs:
            if out.first:
                replica.first_byte(routed[out.request_id][0].prompt_tokens)
        for done in step.finished:
            request, _, decision = routed.pop(done.request_id)
            replica.finished(got_first_byte=True)
            assert done.ttft is not None
            replica.observe(done.ttft, done.tpot, *decision.predicted_s)
            lengths.observe(MODEL, request.prompt_tokens, done.output_tokens)
            served.append(
                Served(done.ttft, done.tpot, done.e2e, replica.pool, request.prompt_tokens, request.output_tokens)
            )
        sims[name].busy = False
        if sims[name].engine.has_work():
            start_step(name)

    scrape(0.0)
    heapq.heappush(events, (scenario.scrape_interval_s, next(order), "scrape", None))
    for index, request in enumerate(requests):
        heapq.heappush(events, (request.arrival_s, next(order), "arrival", (index, request)))
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrival":
            arrive(*payload)  # type: ignore[misc]
        elif kind == "step":
            step_done(*payload)  # type: ignore[misc]
        elif routed or arrivals_left:
            scrape(now)
            heapq.heappush(events, (now + scenario.scrape_interval_s, next(order), "scrape", None))
    span = requests[-1].arrival_s - requests[0].arrival_s if len(requests) > 1 else 1.0
    return RunResult(scenario.slo_ttft_ms, scenario.slo_tpot_ms, tuple(served), shed, span)


def attainable(
    trace: Sequence[TraceRequest], profile: Profile, slo_ttft_ms: float | None, slo_tpot_ms: float | None
) -> float:
    """The clairvoyant bound: the share of requests that would meet their SLOs on an idle replica
    of the better mode for them (their true output length known)."""
    model = LatencyModel(profile)
    ok = 0
    for request in (_fits(profile, r) for r in trace):
        features = RequestFeatures(
            model=MODEL, stream=True, prompt_tokens=request.prompt_tokens, max_tokens=MAX_TOKENS,
            expected_output_tokens=request.output_tokens, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
            forced_pool=None, priority=0, sequence=0,
        )  # fmt: skip
        for pool in Pool:
            p = model.predict(_idle(pool), features)
            ttft_ok = slo_ttft_ms is None or p.ttft_ms <= slo_ttft_ms
            tpot_ok = slo_tpot_ms is None or request.output_tokens <= 1 or p.tpot_ms <= slo_tpot_ms
            if ttft_ok and tpot_ok:
                ok += 1
                break
    return ok / len(trace) if trace else 0.0


def _idle(pool: Pool) -> ReplicaState:
    """A replica with nothing on it, as the gateway would see one."""
    return dataclasses.replace(Replica("idle", "", pool, FleetSettings()).state(0.0), healthy=True)
