"""The offline simulator: a fleet of engine models, the gateway's view of it, and a trace, in virtual time.

Discrete-event: requests arrive as the (rate-scaled) trace says; each replica is the same engine
model the simulated replica serves (`workers.sim.engine`); routing is the same policy code the
gateway runs, deciding on the same `Fleet` accounting — scraped load refreshed only every scrape
interval (stale, as in production) plus the gateway's own exact in-flight counts, and the pools'
fitted step costs and learned output lengths fed by the requests that finish (lengths in the
order their requests arrived, as the gateway learns them).

The policy never sees a request's true output length: requests carry a realistic `max_tokens`
cap, and only the `exact` hint scenario hands the true length over as the client's hint.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from specgate.bench.traces import TraceRequest
from specgate.calibration.modes import Pool
from specgate.calibration.pricing import usd_per_million_tokens
from specgate.calibration.profiles import PROFILES, Profile
from specgate.gateway.advisor import DailyRates, Governor, SplitPlan, recommend
from specgate.policies.admission import QUEUE_FULL, REVIEW_INTERVAL_S, AdmissionQueue
from specgate.policies.decision import Decision, Hold, Shed, Verdict
from specgate.policies.document import SCHEMA_VERSION, PolicyDocument, Switching, parse
from specgate.policies.features import RequestFeatures, SloTargets
from specgate.policies.latency_model import LatencyModel
from specgate.policies.length import LengthStats, Pending
from specgate.sim.engine import Engine, EngineConfig
from specgate.sim.outcomes import StepResult
from specgate.workers.acceptance import SpecCounters
from specgate.workers.pools import Fleet, FleetSettings, Replica, Stay
from specgate.workers.scrape import VllmLoad
from specgate.workers.shared import SharedCounts
from specgate.workers.snapshot import ReplicaState, Scales

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
class Switchover:
    """A fleet whose servers switch between the pools as the live advisor switches them: every
    `interval_s` it plans on the requests of the last `window_s` (every split, simulated with the
    same policy on them replayed back to back, the second round counted: `warmed`), the `Governor`
    decides, and a server it moves is drained, restarted (`restart_s`, serving nothing) and
    re-admitted in the other pool."""

    rules: Switching = Switching(enabled=True)  # noqa: RUF009 (immutable)
    interval_s: float = 60.0
    window_s: float = 120.0
    restart_s: float = 60.0
    """From a drained server's last answer to its first scrape in the other mode."""
    min_requests: int = 100
    max_requests: int = 600
    """The most recent this many of the window's requests are planned on."""
    history: tuple[float, ...] = ()
    """Arrivals of the period before the run (at negative times): with them, each plan is made on
    the window's requests at the rate the same minutes one period ago say comes next
    (`DailyRates.growth`), as the live advisor does from its second day."""
    period_s: float = 86_400.0
    moves_s: tuple[float, ...] = ()
    """How long the advisor's moves before the run took (`Governor.moves_s`): a gateway that
    switched the day before remembers them, and plans ahead by them from its first plan."""


@dataclass(frozen=True)
class Scenario:
    profile: Profile
    fleet: Fleetspec
    policy: str
    """A policy as the command line gives it (`policy_document`): its name, then its settings."""
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_classes: Mapping[str, SloTargets] = field(default_factory=dict)
    """SLOs by request class, for the requests a trace puts in one (the others get the pair above)."""
    hint: bool = False
    """Hand each request's true output length to the policy as the client's hint."""
    scrape_interval_s: float = 0.25
    seed: int = 0
    believed: Profile | None = None
    """The profile the policy predicts with, when it is not the replicas' own (a profile of other
    hardware: how fast the gateway learns what its replicas really cost)."""
    refit: bool = True
    """Re-fit each pool's step costs from its answers, as the gateway does (False keeps the
    profile's: what the re-fit is worth)."""
    switching: Switchover | None = None
    """Servers switched between the pools during the run, as the advisor would; None: a fixed split."""
    gateways: int = 1
    """Gateways in front of the fleet, each with its own accounting (its own dispatches, scrapes at
    its own moments, its own fits and queue); requests reach them in turn, as from a load
    balancer. More than one shows what they do not see of each other (the herd effect)."""
    count_share: bool = True
    """Each gateway counts its requests as its share of the fleet's (`workers.pools.Share`)."""
    shared_counts: bool = False
    """The gateways count one another's requests as they are sent, fit the step costs from one
    another's answers and move one set of correction factors, through the shared counts the
    processes of one gateway keep (`workers.shared`): the processes of `specgate serve --workers`."""
    exchange_s: float | None = None
    """The gateways exchange their counts, fits and factors this often, each at moments of its
    own, as separate gateways do through the policy's Redis (`gateway/exchange.py`): each reads
    the others' as they last left them."""

    def slo_for(self, request_class: str) -> SloTargets:
        return self.slo_classes.get(request_class) or SloTargets(self.slo_ttft_ms, self.slo_tpot_ms)


@dataclass(frozen=True)
class Served:
    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    pool: Pool
    prompt_tokens: int
    output_tokens: int
    slo: SloTargets = SloTargets()  # noqa: RUF009 (immutable)
    """The request's own targets."""
    reason: str = ""
    """Why the policy chose where it went."""
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    arrival_s: float = 0.0
    held_s: float = 0.0
    """Of its TTFT, the time it waited in the gateway's admission queue (not the replica's)."""

    def meets(self) -> bool:
        if self.slo.ttft_ms is not None and self.ttft_s * 1e3 > self.slo.ttft_ms:
            return False
        tpot_ms = self.tpot_s * 1e3 if self.tpot_s is not None else None
        return not (self.slo.tpot_ms is not None and tpot_ms is not None and tpot_ms > self.slo.tpot_ms)


TOO_LONG = "too-long"
"""Why a request whose prompt does not fit the model's context window was refused (vLLM's 400)."""


@dataclass(frozen=True)
class Plan:
    """One plan of a switching fleet's advisor, as the `Governor` was asked to act on it."""

    at_s: float
    plan: SplitPlan
    step: int
    """The move the `Governor` started on it: +1, -1 or 0."""

    def row(self) -> dict[str, Any]:
        """As `specgate bench daily` writes it: when, the split it found and the one recommended,
        each split's planned good tokens a second, the gain and its error, and the move."""
        plan = self.plan
        return {
            "at_s": self.at_s, "current": plan.current, "recommended": plan.recommended,
            "good_tokens_per_s": dict(plan.good_tokens), "gain": plan.gain, "gain_error": plan.gain_error,
            "step": self.step,
        }  # fmt: skip


@dataclass(frozen=True)
class RunResult:
    served: tuple[Served, ...]
    refused: Mapping[str, int]
    """Requests answered with an error instead, by reason (`too-long`, and the policy's)."""
    span_s: float
    scales: Mapping[Pool, Scales] = field(default_factory=dict)
    """Each pool's step costs as re-fitted by the end of the run."""
    switches: tuple[tuple[float, float, str, Pool], ...] = ()
    """Each server switched: when it was drained, when it served again, which, and its new pool."""
    refusals: tuple[tuple[float, str], ...] = ()
    """Each refused request's arrival and why."""
    plans: tuple[Plan, ...] = ()
    """Each plan the switching fleet's advisor made, in order."""

    def between(self, start_s: float, end_s: float) -> RunResult:
        """Only the requests that arrived from `start_s` to before `end_s`."""
        refusals = tuple(r for r in self.refusals if start_s <= r[0] < end_s)
        served = tuple(s for s in self.served if start_s <= s.arrival_s < end_s)
        span = min(self.span_s, end_s) - start_s
        return dataclasses.replace(self, served=served, refused=Counter(why for _, why in refusals), span_s=span,
                                   refusals=refusals)  # fmt: skip

    @property
    def requests(self) -> int:
        return len(self.served) + sum(self.refused.values())

    def summary(self) -> dict[str, float | int]:
        met = sum(s.meets() for s in self.served)
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
            "shed": sum(n for reason, n in self.refused.items() if reason != TOO_LONG),
            "too_long": self.refused.get(TOO_LONG, 0),
        }


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if q == 0.5:
        return float(statistics.median(values))
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class _Move:
    """A server being switched to the other pool: drained, then restarted."""

    name: str
    to: Pool
    drained_at: float


@dataclass
class _SimReplica:
    engine: Engine
    busy: bool = False


def max_tokens(profile: Profile, prompt_tokens: int) -> int:
    """The cap a client sends: generous, and within what the context window leaves the answer."""
    return min(MAX_TOKENS, profile.max_model_len - prompt_tokens)


def fits(profile: Profile, request: TraceRequest) -> bool:
    """Whether vLLM accepts the request: a prompt must leave room for one token of answer."""
    return request.prompt_tokens < profile.max_model_len


def policy_document(spec: str, profile: str, profiles: Mapping[str, Profile] = PROFILES) -> PolicyDocument:
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
    return parse(doc, profiles=profiles)


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit()


def simulate(
    trace: Sequence[TraceRequest], scenario: Scenario, measured: tuple[float, float] | None = None
) -> RunResult:
    """The trace routed by the scenario's gateway(s) over its simulated fleet. With `measured`, the
    stretch of arrivals whose requests are the ones measured: the run ends as the last of them
    ends, and the traffic after the stretch goes on only until then."""
    profile = scenario.profile
    believed = scenario.believed or profile
    known = {**PROFILES, profile.name: profile, believed.name: believed}  # they may come from files
    document = policy_document(scenario.policy, believed.name, known)
    plan = document.compile("offline", known)
    pools = {Pool.SPECULATIVE: [f"sim://spec-{i}" for i in range(scenario.fleet.spec)],
             Pool.PLAIN: [f"sim://plain-{i}" for i in range(scenario.fleet.plain)]}  # fmt: skip
    settings = FleetSettings(
        scrape_interval_s=scenario.scrape_interval_s, refit=scenario.refit, count_share=scenario.count_share
    )
    gateways = range(scenario.gateways)
    shared: list[SharedCounts | None] = [None] * scenario.gateways
    if scenario.shared_counts:
        path = SharedCounts.create(scenario.gateways)
        try:
            shared = [SharedCounts(path, scenario.gateways, g) for g in gateways]
        finally:
            path.unlink()  # (mapped, it lives as long as they do)
    elif scenario.exchange_s is not None:
        for g in gateways:
            path = SharedCounts.create(1, others=True)
            try:
                shared[g] = SharedCounts(path, 1, 0, others=True)
            finally:
                path.unlink()
    board: dict[str, bytes] = {}
    """Each gateway's summary as it last left it (`workers.shared.SharedCounts.summary`)."""
    fleets = [Fleet(pools, settings, shared[g]) for g in gateways]
    fleet = fleets[0]  # every gateway's holds the same replicas, under the same names
    sims: dict[str, _SimReplica] = {}
    for i, (name, replica) in enumerate(fleet.replicas.items()):
        sims[name] = _SimReplica(Engine(profile, replica.pool, EngineConfig(), seed=scenario.seed * 1000 + i))
    lengths = [LengthStats() for _ in gateways]
    learning: dict[str, Pending | None] = {}
    """Requests admitted and not yet ended, by id: their lengths, for their gateway to learn."""

    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()
    routed: dict[str, tuple[TraceRequest, str, Decision, float, Stay, int]] = {}
    """Requests on a replica: the request, the replica, the decision, how long it was held, its
    stay there, and the gateway that sent it."""
    waiting: dict[int, tuple[TraceRequest, RequestFeatures]] = {}
    queues: list[AdmissionQueue[int]] = [AdmissionQueue(document.admission) for _ in gateways]
    review_scheduled = False
    served: list[Served] = []
    refused: list[tuple[float, str]] = []
    arrivals_left = len(trace)
    start_s, end_s = measured if measured is not None else (math.inf, math.inf)
    to_measure = sum(1 for r in trace if start_s <= r.arrival_s < end_s)
    """Requests of the measured stretch not yet served or refused."""

    def ended(request: TraceRequest) -> None:
        nonlocal to_measure
        if start_s <= request.arrival_s < end_s:
            to_measure -= 1

    def start_step(name: str) -> None:
        sim = sims[name]
        step = sim.engine.step()
        sim.busy = True
        heapq.heappush(events, (step.end, next(order), "step", (name, step)))

    def scrape(now: float, gateway: int) -> None:
        for name, replica in fleets[gateway].replicas.items():
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
                first_tokens=c.first_tokens,
            )
            fleets[gateway].scraped(replica, load, now, replica.dispatched_by_gateway(now))

    def exchange(now: float, gateway: int) -> None:
        counts = shared[gateway]
        assert counts is not None
        windows = (settings.rate_window_s, settings.burst_window_s)
        board[str(gateway)] = counts.summary(now, windows, now)
        counts.take_all(str(gateway), board, now, now, windows, stale_s=settings.stale_after_s, most=len(board))

    def arrive(index: int, request: TraceRequest) -> None:
        nonlocal arrivals_left
        arrivals_left -= 1
        if not fits(profile, request):
            refused.append((request.arrival_s, TOO_LONG))
            ended(request)
            return
        now = request.arrival_s
        cap = max_tokens(profile, request.prompt_tokens)
        slo = scenario.slo_for(request.request_class)
        gateway = index % scenario.gateways
        learning[f"r{index}"] = lengths[gateway].begin(MODEL, request.prompt_tokens, request.request_class)
        features = RequestFeatures(
            model=MODEL,
            stream=True,
            prompt_tokens=request.prompt_tokens,
            max_tokens=cap,
            expected_output_tokens=lengths[gateway].expected(
                MODEL,
                request.prompt_tokens,
                hint=request.output_tokens if scenario.hint else None,
                max_tokens=cap,
                request_class=request.request_class,
            ),
            slo_ttft_ms=slo.ttft_ms,
            slo_tpot_ms=slo.tpot_ms,
            forced_pool=None,
            priority=0,
            sequence=index,
            output_hinted=scenario.hint,
        )
        waiting[index] = (request, features)
        settle(index, plan.decide(features, fleets[gateway].snapshot(now, plan.profile)), now)

    def settle(index: int, verdict: Verdict, now: float) -> None:
        request, features = waiting[index]
        gateway = index % scenario.gateways
        if isinstance(verdict, Hold):
            if queues[gateway].hold(index, features, now):
                fleets[gateway].hold(queues[gateway].live(now))
                schedule_review(now)
                return
            verdict = Shed(QUEUE_FULL, 1.0)
        del waiting[index]
        request_id = f"r{index}"
        if not isinstance(verdict, Decision):
            refused.append((request.arrival_s, verdict.reason if verdict is not None else "no-replica"))
            ended(request)
            lengths[gateway].end(learning.pop(request_id), None, now)
            return
        name = verdict.replica.name
        stay = fleets[gateway].replicas[name].dispatched_one(request.prompt_tokens, now)
        routed[request_id] = (request, name, verdict, now - request.arrival_s, stay, gateway)
        output = min(request.output_tokens, max_tokens(profile, request.prompt_tokens))
        # The request accepts drafts as its content does, wherever it goes: every policy and every
        # split is measured on the same draws.
        seed = f"{scenario.seed}:{index}"
        sims[name].engine.add_request(request_id, request.prompt_tokens, output, arrival=now, seed=seed)
        if not sims[name].busy:
            start_step(name)

    def decide(view: Fleet, now: float, _: int, features: RequestFeatures) -> Verdict:
        return plan.decide(features, view.snapshot(now, plan.profile))

    def review(now: float, only: set[int] | None = None) -> None:
        """Offers the fleet to the requests held (in the gateways of `only`: those that saw one of
        their requests finish, which is all a gateway knows of capacity freed between scrapes)."""
        for gateway, queue in enumerate(queues):
            if len(queue) and (only is None or gateway in only):
                view = fleets[gateway]
                elsewhere = view.held_elsewhere()  # (other gateways' requests that can still be saved)
                for index, verdict in queue.review(now, partial(decide, view, now), held_elsewhere=elsewhere):
                    settle(index, verdict, now)
                view.hold(queue.live(now))

    def held() -> int:
        return sum(len(queue) for queue in queues)

    def schedule_review(now: float) -> None:
        nonlocal review_scheduled
        if not review_scheduled:
            review_scheduled = True
            heapq.heappush(events, (now + REVIEW_INTERVAL_S, next(order), "review", None))

    def step_done(name: str, step: StepResult) -> None:
        for out in step.outputs:
            if out.first:
                request, *_, gateway = routed[out.request_id]
                fleets[gateway].replicas[name].first_byte(request.prompt_tokens, step.end)
                lengths[gateway].start(learning[out.request_id], step.end)
        finished_by = set()
        for done in step.finished:
            request, _, decision, held, stay, gateway = routed.pop(done.request_id)
            finished_by.add(gateway)
            replica = fleets[gateway].replicas[name]
            replica.finished(got_first_byte=True, now=step.end)
            assert done.ttft is not None
            replica.observe(done.ttft, done.tpot, decision.terms, stay, step.end, done.step)
            lengths[gateway].end(learning.pop(done.request_id), done.output_tokens, step.end)
            slo = scenario.slo_for(request.request_class)
            served.append(
                Served(  # as the client sees it: the wait in the gateway's queue included
                    held + done.ttft,
                    done.tpot,
                    held + done.e2e,
                    replica.pool,
                    request.prompt_tokens,
                    done.output_tokens,
                    slo,
                    decision.reason,
                    decision.predicted_ttft_ms,
                    decision.predicted_tpot_ms,
                    request.arrival_s,
                    held,
                )
            )
            ended(request)
        sims[name].busy = False
        if sims[name].engine.has_work():
            start_step(name)
        restart_when_idle(name, step.end)
        if step.finished:
            review(step.end, finished_by)  # capacity has freed up: a held request may fit now

    # --- switching servers between the pools, as the advisor would -------------------------------
    switchover = scenario.switching
    governor = Governor()
    governor.moves_s.extend(switchover.moves_s if switchover is not None else ())
    placement: dict[str, Pool] = {}
    """Servers, by URL, serving in a pool other than their first."""
    moving: _Move | None = None
    """The server being switched now."""
    switches: list[tuple[float, float, str, Pool]] = []
    plans: list[Plan] = []
    arrived_at = [r.arrival_s for r in trace]
    daily = DailyRates(switchover.period_s, switchover.period_s / 1440) if switchover is not None else DailyRates()
    for at in switchover.history if switchover is not None else ():
        daily.record(at)
    counted = 0
    """The requests whose arrivals `daily` has counted."""
    last_plan: SplitPlan | None = None

    def advise(now: float) -> None:
        nonlocal moving, counted, last_plan
        assert switchover is not None
        last = bisect.bisect_right(arrived_at, now)
        first = max(bisect.bisect_right(arrived_at, now - switchover.window_s), last - switchover.max_requests)
        for at in arrived_at[counted:last]:
            daily.record(at)
        counted = last
        window = list(trace[first:last])
        if moving is not None or len(window) < switchover.min_requests:
            return
        replicas = len(fleet.replicas)
        horizon_s = governor.horizon_s(switchover.rules, switchover.interval_s, replicas)
        growth = daily.growth(now, switchover.window_s, horizon_s)
        if growth is not None:
            window = [dataclasses.replace(r, arrival_s=r.arrival_s / growth) for r in window]
        current = sum(r.pool is Pool.SPECULATIVE for r in fleet.replicas.values())
        splits = []
        for spec in range(replicas + 1):
            fixed = dataclasses.replace(scenario, fleet=Fleetspec(spec, replicas - spec), switching=None)
            planned = steady(window, fixed)
            splits.append({"speculative": spec, **split_figures(planned, None)})
        last_plan = SplitPlan.of(splits, int(recommend(splits)["speculative"]), current)
        fresh = switchover.interval_s / switchover.window_s
        step = governor.move(switchover.rules, last_plan, replicas, now, fresh=fresh)
        plans.append(Plan(now, last_plan, step))
        if step:
            start_move(step, now)

    def start_move(step: int, now: float) -> None:
        nonlocal moving
        to = Pool.SPECULATIVE if step > 0 else Pool.PLAIN
        name = min((n for n, r in fleet.replicas.items() if r.pool is to.other),
                   key=lambda n: sims[n].engine.num_running + sims[n].engine.num_waiting)  # fmt: skip
        moving = _Move(name, to, now)
        for view in fleets:
            view.arrange(placement, drained={fleet.replicas[name].url})
        restart_when_idle(name, now)

    def restart_when_idle(name: str, now: float) -> None:
        if moving is not None and moving.name == name and not sims[name].busy and not sims[name].engine.has_work():
            assert switchover is not None
            heapq.heappush(events, (now + switchover.restart_s, next(order), "restarted", name))

    def restarted(name: str, now: float) -> None:
        nonlocal moving, last_plan
        assert moving is not None
        to = moving.to
        replica = fleet.replicas[name]
        if to is replica.home_pool:
            placement.pop(replica.url, None)
        else:
            placement[replica.url] = to
        seed = scenario.seed * 1000 + list(fleet.replicas).index(name) + 100 * (len(switches) + 1)
        sims[name] = _SimReplica(Engine(profile, to, EngineConfig(), seed=seed))
        for view in fleets:
            view.arrange(placement, drained=())
        switches.append((moving.drained_at, now, name, to))
        moving = None
        if last_plan is not None:
            assert switchover is not None
            current = sum(r.pool is Pool.SPECULATIVE for r in fleet.replicas.values())
            last_plan = dataclasses.replace(last_plan, current=current)
            step = governor.move(switchover.rules, last_plan, len(fleet.replicas), now, after_move=True)
            if step:
                start_move(step, now)

    for gateway in gateways:  # each scrapes at moments of its own, spread over the interval
        scrape(0.0, gateway)
        first = scenario.scrape_interval_s * (1.0 + gateway / scenario.gateways)
        heapq.heappush(events, (first, next(order), "scrape", gateway))
        if scenario.exchange_s is not None:
            first = scenario.exchange_s * (1.0 + gateway / scenario.gateways)
            heapq.heappush(events, (first, next(order), "exchange", gateway))
    if switchover is not None:
        heapq.heappush(events, (switchover.interval_s, next(order), "advise", None))
    for index, request in enumerate(trace):
        heapq.heappush(events, (request.arrival_s, next(order), "arrival", (index, request)))
    while events and (measured is None or to_measure > 0):
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrival":
            arrive(*payload)  # type: ignore[misc]
        elif kind == "step":
            step_done(*payload)  # type: ignore[misc]
        elif kind == "review":
            review_scheduled = False
            review(now)
            if held():
                schedule_review(now)
        elif kind == "advise":
            assert switchover is not None
            advise(now)
            if arrivals_left:
                heapq.heappush(events, (now + switchover.interval_s, next(order), "advise", None))
        elif kind == "restarted":
            restarted(payload, now)  # type: ignore[arg-type]
        elif kind == "exchange":
            if routed or arrivals_left or held():
                assert scenario.exchange_s is not None
                exchange(now, payload)  # type: ignore[arg-type]
                heapq.heappush(events, (now + scenario.exchange_s, next(order), "exchange", payload))
        elif routed or arrivals_left or held():
            scrape(now, payload)  # type: ignore[arg-type]
            review(now, {payload})  # type: ignore[arg-type]
            heapq.heappush(events, (now + scenario.scrape_interval_s, next(order), "scrape", payload))
    span = trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 1.0
    scales = {pool: fit.scales for pool, fit in fleet.fits.items()}
    return RunResult(
        tuple(served), Counter(why for _, why in refused), span, scales, tuple(switches), tuple(refused), tuple(plans)
    )


TAIL_S = 120.0
"""How long the traffic after a counted round may go on (`warmed`): far longer than any request
that meets a latency target lives; the run ends as the counted round's last request ends."""
MAX_TAIL_ROUNDS = 60


def warmed(trace: Sequence[TraceRequest]) -> tuple[list[TraceRequest], float, float]:
    """The requests over and over, back to back, and when the second round starts and ends: the
    first round loads the fleet as this traffic keeps it loaded, the second is the one to count,
    and the rounds after it keep the load on while its requests finish (`simulate`'s `measured`
    ends the run as they do; the rounds last `TAIL_S`, at least one, at most `MAX_TAIL_ROUNDS`).
    Alone, a short stretch of traffic meets an idle fleet and leaves its last requests to finish
    on an emptying one, and past saturation both make it look better than it is: a window only
    about as long as its requests take (a few hundred requests of a busy fleet) was measured as if
    its load came and went, and the splits looked alike where, kept up, one met 4-20 points more an
    hour. One round after it is not enough on a fast fleet: 400 requests at twice its capacity
    arrive within two seconds, and their answers, seconds long, were measured mostly on a fleet
    whose traffic had stopped (conversation trace, 2 + 2 H100s, Llama 3.1 8B: the counted
    requests ended a median 6.7 s after their round, the traffic 2.1 s after it)."""
    if not trace:
        return [], 0.0, 0.0
    span = trace[-1].arrival_s - trace[0].arrival_s
    period = span + span / max(len(trace) - 1, 1) or 1.0  # one mean gap between the rounds
    after = min(max(math.ceil(TAIL_S / period), 1), MAX_TAIL_ROUNDS)
    rounds = [
        dataclasses.replace(r, arrival_s=r.arrival_s - trace[0].arrival_s + k * period)
        for k in range(2 + after)
        for r in trace
    ]
    return rounds, period, 2 * period


def throughput(result: RunResult, fleet_per_hour: float | None) -> dict[str, float]:
    """The tokens a second the fleet generated, all of them and those of requests that met their
    SLOs, and, when the fleet has a price an hour, what a million of each cost."""
    span = result.span_s or 1e-9
    tokens = sum(s.output_tokens for s in result.served) / span
    good = sum(s.output_tokens for s in result.served if s.meets()) / span
    figures = {"tokens_per_s": tokens, "good_tokens_per_s": good}
    if fleet_per_hour is not None:
        figures["usd_per_million_tokens"] = usd_per_million_tokens(fleet_per_hour, tokens)
        figures["usd_per_million_good_tokens"] = usd_per_million_tokens(fleet_per_hour, good)
    return figures


STRETCHES = 10
"""A plan's counted round cut into this many stretches of equal time (`good_tokens_by_stretch`)."""


def good_tokens_by_stretch(result: RunResult, stretches: int = STRETCHES) -> list[float]:
    """The output tokens a second of the requests that met their SLOs, by the stretch of the run
    they arrived in (`stretches` of equal time over `span_s`, from the first arrival counted): how
    much of a split's figure each part of its traffic gave, from which two splits' difference on
    the same traffic has a spread (`gateway/advisor.py`'s `gain_error`)."""
    starts = [s.arrival_s for s in result.served] + [at for at, _ in result.refusals]
    if not starts or result.span_s <= 0:
        return [0.0] * stretches
    first, width = min(starts), result.span_s / stretches
    good = [0.0] * stretches
    for s in result.served:
        if s.meets():
            good[min(int((s.arrival_s - first) / width), stretches - 1)] += s.output_tokens
    return [tokens / width for tokens in good]


def split_figures(result: RunResult, fleet_per_hour: float | None) -> dict[str, Any]:
    """A plan's figures for one split of the fleet, as `specgate plan` and the simulator's advisor
    both report them: the run's summary, its tokens a second (and their cost), and its good tokens
    by stretch of the traffic."""
    return {
        **result.summary(), **throughput(result, fleet_per_hour),
        "good_tokens_per_s_by_stretch": good_tokens_by_stretch(result),
    }  # fmt: skip


def steady(trace: Sequence[TraceRequest], scenario: Scenario) -> RunResult:
    """The traffic's figures on a fleet it keeps loaded: its second round of a stretch of it,
    kept up until that round's last request ends (`warmed`)."""
    rounds, start, end = warmed(trace)
    return simulate(rounds, scenario, measured=(start, end)).between(start, end)


def attainable(trace: Sequence[TraceRequest], scenario: Scenario) -> float:
    """The clairvoyant bound: the share of requests that would meet their SLOs on an idle replica
    of the better mode for them (their true output length known)."""
    profile = scenario.profile
    model = LatencyModel(profile)
    ok = 0
    for request in trace:
        if not fits(profile, request):
            continue
        slo = scenario.slo_for(request.request_class)
        output = min(request.output_tokens, max_tokens(profile, request.prompt_tokens))
        features = RequestFeatures(
            model=MODEL, stream=True, prompt_tokens=request.prompt_tokens, max_tokens=output,
            expected_output_tokens=output, slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms,
            forced_pool=None, priority=0, sequence=0,
        )  # fmt: skip
        for pool in Pool:
            p = model.predict(_idle(pool), features)
            ttft_ok = slo.ttft_ms is None or p.ttft_ms <= slo.ttft_ms
            tpot_ok = slo.tpot_ms is None or output <= 1 or p.tpot_ms <= slo.tpot_ms
            if ttft_ok and tpot_ok:
                ok += 1
                break
    return ok / len(trace) if trace else 0.0


def _idle(pool: Pool) -> ReplicaState:
    """A replica with nothing on it, as the gateway would see one."""
    return dataclasses.replace(Replica("idle", "", pool, FleetSettings()).state(0.0), healthy=True)
