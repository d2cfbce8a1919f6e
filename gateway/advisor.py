"""The live advisor: the split of the fleet that the recent traffic wants, planned off the request
path.

The gateway keeps the requests it answered over the last `window_s` (when each arrived, its prompt
and output tokens, its SLO targets), and those its policy refused for want of a replica to serve
them in time (at the output length it expected of them): they are traffic the fleet, split another
way, might have served, and the plans replay them as the offline simulator's do. Every `interval_s`,
with enough of them, it hands them to `specgate plan` in a child process (`bench/plan.py`: every
split of the fleet's replicas simulated with the adaptive policy on this traffic, replayed back
to back so that the second round, which it reports, meets a fleet this traffic has loaded and
keeps loaded while its requests finish, rather than an idle one or one emptying behind it, and
from the second day at the rate the same minutes brought next the day before (`DailyRates`); the
profile the policy document names and the traffic's commonest SLO pair) and only awaits its
answer: the event loop does none of the work.
The split it recommends (`recommend`) is the one whose requests that met their SLOs were served the
most tokens: what the fleet is paid to serve, and at one price a server-hour the cheapest good
tokens; SLO attainment breaks ties. The recommendation and its predicted gain over the fleet's
current split go to `/metrics` (`specgate_recommended_speculative_replicas`,
`specgate_recommended_split_gain`) and `GET /admin/fleet`; a log line says when the recommendation
changes.

It recommends; it moves a server only when the policy document's `switching` enables it and the
gateway can restart servers (a [launch] section and a policy store): then, when `confirmations`
plans in a row want the same direction, each predicting that the recommended split serves at least
`min_gain` (a share) more good tokens than the current one, and no move was made in the last
`cooldown_ms`, it switches one server (`gateway/switching.py`), never leaving a pool with fewer
than `min_per_pool`; once that server serves in its other pool, the next at once while that plan
wants more of the direction (`Governor.move`, `after_move`), and while every later plan still
wants it, one more each `cooldown_ms`, until one does not. The `Governor` holds that hysteresis;
the offline simulator runs the same one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import math
import shutil
import statistics
import tempfile
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specgate.calibration import profile_file
from specgate.calibration.profiles import PROFILES, Profile
from specgate.policies.document import Switching
from specgate.workers import launch

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdvisorSettings:
    enabled: bool = True
    interval_s: float = 300.0
    """How often it plans: this long after the last plan ended."""
    plan_timeout_s: float = 300.0
    """The longest one plan may take (a child process simulating every split): past it, no plan
    this time. Not the interval: on a slow machine a plan may take longer than a short interval,
    and would then never finish."""
    window_s: float = 900.0
    """How far back the traffic it plans on goes."""
    min_requests: int = 100
    """Fewer requests in the window than this: no plan (too little to tell splits apart)."""
    max_requests: int = 2000
    """The most recent this many of them, at most, are planned on."""


@dataclass(frozen=True)
class Seen:
    """One request answered, or refused by the policy, as the plan replays it."""

    at: float
    prompt_tokens: int
    output_tokens: int
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None


class DailyRates:
    """Arrivals counted in stretches of `bin_s` over the last two `period_s` (a day): how the traffic
    grew or fell over the next minutes one period ago, which a daily pattern repeats."""

    def __init__(self, period_s: float = 86_400.0, bin_s: float = 60.0) -> None:
        self.period_s = period_s
        self.bin_s = bin_s
        self._counts: dict[int, int] = {}
        self._latest = -math.inf

    def record(self, at: float) -> None:
        index = math.floor(at / self.bin_s)
        self._counts[index] = self._counts.get(index, 0) + 1
        if at > self._latest + self.bin_s:  # forget what is over two periods old, now and then
            self._latest = at
            oldest = math.floor((at - 2 * self.period_s) / self.bin_s)
            for stale in [i for i in self._counts if i < oldest]:
                del self._counts[stale]

    def between(self, start: float, end: float) -> float:
        """Arrivals counted from `start` to `end`, a partly covered stretch by its covered share."""
        total = 0.0
        for index in range(math.floor(start / self.bin_s), math.ceil(end / self.bin_s)):
            low, high = max(start, index * self.bin_s), min(end, (index + 1) * self.bin_s)
            total += self._counts.get(index, 0) * max(high - low, 0.0) / self.bin_s
        return total

    def growth(self, now: float, window_s: float, horizon_s: float, at_least: int = 50) -> float | None:
        """How many times the rate of the last `window_s` one period ago the rate of the `horizon_s`
        after it was then; None without at least `at_least` arrivals in each of the two a period
        ago (no day of history yet, or too little traffic to tell)."""
        before = self.between(now - self.period_s - window_s, now - self.period_s)
        ahead = self.between(now - self.period_s, now - self.period_s + horizon_s)
        if before < at_least or ahead < at_least:
            return None
        return (ahead / horizon_s) / (before / window_s)


TIE = 0.005
"""Splits within this share of the most good tokens count as as good."""


def recommend(splits: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The split whose requests that met their SLOs were served the most tokens a second
    (`good_tokens_per_s`): within `TIE` of it, the one that meets the most SLOs, then the lowest
    TPOT p99. Good tokens, not requests: a split that meets many short requests and misses the
    long ones meets more SLOs and serves less of what the fleet is paid for (as a peak begins, a
    speculative fleet may meet as many requests as a plain one while serving a tenth fewer good
    tokens, and meet fewer of both an hour later)."""
    most = max(s["good_tokens_per_s"] for s in splits)
    contenders = [s for s in splits if s["good_tokens_per_s"] >= most * (1 - TIE)]

    def tpot_p99(split: Mapping[str, Any]) -> float:
        return math.inf if math.isnan(split["tpot_p99_ms"]) else float(split["tpot_p99_ms"])

    return min(contenders, key=lambda s: (-s["slo_attainment"], tpot_p99(s)))


def split_gain(good_tokens: Mapping[int, float], target: int, current: int) -> float:
    """How much more good tokens a second the `target` split serves than the `current` one, as a
    share of the current one's (splits by their speculative servers)."""
    now, then = good_tokens.get(current, math.nan), good_tokens.get(target, math.nan)
    if now > 0:
        return then / now - 1
    return math.inf if then > 0 else 0.0


def gain_error(stretches: Mapping[int, Sequence[float]], target: int, current: int) -> float:
    """The standard error of `split_gain(target, current)` from the plan's own traffic: the two
    splits' difference in good tokens stretch by stretch (the same requests, routed on either
    fleet), its spread over the stretches' number, as a share of the current split's good tokens. A
    plan of the same minutes at a rate 0.5% higher or lower moves the gain by about as much (1.4-4.5%
    of good tokens at the busy hours of the daily bench, 1.1-6.1% this way). 0 where either split has
    no stretches, or they differ in number (nothing known of the noise)."""
    now, then = stretches.get(current, ()), stretches.get(target, ())
    if len(now) < 2 or len(now) != len(then) or sum(now) <= 0:
        return 0.0
    differences = [b - a for a, b in zip(now, then, strict=True)]
    return statistics.stdev(differences) * math.sqrt(len(now)) / sum(now)


@dataclass(frozen=True)
class SplitPlan:
    """What one plan found: every split's good tokens a second, by its speculative servers, the
    split it recommends and the one the fleet had. The live advisor and the simulator's both hand
    it to the `Governor`, and report its gain."""

    recommended: int
    current: int
    good_tokens: Mapping[int, float]
    """Each split's good tokens a second (`good_tokens_per_s`)."""
    stretches: Mapping[int, Sequence[float]] = field(default_factory=dict)
    """Each split's good tokens a second in each stretch of the plan's traffic
    (`good_tokens_per_s_by_stretch`); splits without them left out."""

    @classmethod
    def of(cls, splits: Sequence[Mapping[str, Any]], recommended: int, current: int) -> SplitPlan:
        """From a plan's rows of splits (`specgate plan --json`'s `splits`)."""
        good_tokens = {int(s["speculative"]): float(s["good_tokens_per_s"]) for s in splits}
        stretches = {
            int(s["speculative"]): [float(v) for v in s["good_tokens_per_s_by_stretch"]]
            for s in splits
            if s.get("good_tokens_per_s_by_stretch")
        }
        return cls(recommended, current, good_tokens, stretches)

    def gain_to(self, target: int) -> float:
        """The `target` split's gain over the current one (`split_gain`)."""
        return split_gain(self.good_tokens, target, self.current)

    def error_to(self, target: int) -> float:
        """The standard error of `gain_to(target)` (`gain_error`)."""
        return gain_error(self.stretches, target, self.current)

    @property
    def gain(self) -> float:
        """The recommended split's gain over the current one."""
        return self.gain_to(self.recommended)

    @property
    def gain_error(self) -> float:
        return self.error_to(self.recommended)


class TrafficWindow:
    """The requests seen over the last `window_s`, at most `max_requests` of them, and the
    arrivals of the last two days (`daily`)."""

    def __init__(self, window_s: float, max_requests: int) -> None:
        self.window_s = window_s
        self._seen: deque[Seen] = deque(maxlen=max_requests)
        self.daily = DailyRates()

    def record(self, seen: Seen) -> None:
        self._seen.append(seen)
        self.daily.record(seen.at)

    def requests(self, now: float) -> list[Seen]:
        while self._seen and self._seen[0].at < now - self.window_s:
            self._seen.popleft()
        return list(self._seen)


def trace_csv(seen: list[Seen], rate_scale: float = 1.0) -> bytes:
    """The requests as a trace `specgate plan` reads (`timestamp_s,input_tokens,output_tokens`),
    arriving `rate_scale` times as fast as they did."""
    start = seen[0].at if seen else 0.0
    rows = [f"{(s.at - start) / rate_scale:.4f},{max(s.prompt_tokens, 1)},{max(s.output_tokens, 1)}" for s in seen]
    return ("timestamp_s,input_tokens,output_tokens\n" + "\n".join(rows) + "\n").encode()


def commonest_slo(seen: list[Seen]) -> tuple[float, float] | None:
    """The SLO pair most of the requests that carry both targets carry; None when none does."""
    pairs = Counter((s.slo_ttft_ms, s.slo_tpot_ms) for s in seen)
    known = [(pair, n) for pair, n in pairs.most_common() if pair[0] is not None and pair[1] is not None]
    if not known:
        return None
    (ttft, tpot), _ = known[0]
    assert ttft is not None
    assert tpot is not None
    return ttft, tpot


def _written(profiles: Mapping[str, Profile]) -> dict[str, Path]:
    files = {}
    for name, profile in profiles.items():
        if name not in PROFILES:
            path = files[name] = Path(tempfile.mkdtemp(prefix="specgate-advisor-")) / "profile.json"
            path.write_bytes(profile_file.dumps(profile, "the gateway's profiles", datetime.date.today()))
    return files


@dataclass(frozen=True)
class Advice:
    plan: SplitPlan
    """The split recommended, the fleet's as it is, and the recommended one's predicted good tokens
    a second over the current one's (`SplitPlan.gain`), on this traffic."""
    requests: int
    slo: tuple[float, float]
    profile: str
    planned_at: float
    """Wall-clock time (Unix seconds)."""
    splits: list[dict[str, Any]] = field(default_factory=list)
    growth: float | None = None
    """The rate planned on, as a multiple of the window's (`DailyRates.growth`); None: as it was."""
    horizon_s: float = 0.0
    """How far ahead that rate was looked for (`Governor.horizon_s`)."""

    def view(self) -> dict[str, object]:
        """As GET /admin/fleet shows it."""
        attainment = {str(s["speculative"]): s["slo_attainment"] for s in self.splits}
        good_tokens = {str(s["speculative"]): s["good_tokens_per_s"] for s in self.splits}
        plan = self.plan
        return {
            "recommended_speculative_replicas": plan.recommended, "current_speculative_replicas": plan.current,
            "predicted_gain": plan.gain, "predicted_gain_error": plan.gain_error, "requests": self.requests,
            "slo_ttft_ms": self.slo[0], "slo_tpot_ms": self.slo[1], "profile": self.profile,
            "planned_at": self.planned_at, "attainment_by_speculative_replicas": attainment,
            "good_tokens_per_s_by_speculative_replicas": good_tokens, "rate_growth": self.growth,
            "plan_horizon_s": self.horizon_s,
        }  # fmt: skip


@dataclass
class Governor:
    """When a plan moves a server: hysteresis over the advisor's successive plans."""

    streak: int = 0
    """Plans in a row that wanted a move in `direction` (a move does not end the streak: once
    confirmed, a direction is followed, a server each cooldown, until a plan stops wanting it;
    confirming each move anew made the fleet a phase late for every phase of a day)."""
    direction: int = 0
    evidence: list[tuple[float, float]] = field(default_factory=list)
    """Each plan of the streak's gain and its standard error (`gain_error`): pooled, they must
    clear `min_gain` by `sigmas` standard errors before the streak's direction is followed."""
    confirmed: bool = False
    """The streak's evidence has cleared: its direction is followed while plans want it."""
    fresh: float = 1.0
    """The share of each plan's traffic the one before it did not see (as `move` last had it)."""
    moved_at: float = -math.inf
    """When the last move began."""
    moves_s: deque[float] = field(default_factory=lambda: deque(maxlen=8))
    """How long the last moves took, from the drain to serving in the other pool."""

    def view(self) -> dict[str, object]:
        """The plans in a row that want a move, as GET /admin/fleet shows them."""
        gain, error = pooled(self.evidence, self.fresh)
        return {"direction": self.direction, "plans": self.streak, "pooled_gain": gain, "pooled_gain_error": error,
                "confirmed": self.confirmed}  # fmt: skip

    def horizon_s(self, rules: Switching, interval_s: float, replicas: int) -> float:
        """How far ahead a plan made now looks: the moves it starts take up to one per server, a
        server at a time, as long as the recent moves took (none known: no time), and the split they
        reach stands until `confirmations` more plans, an interval apart, can undo it. The plans
        are made on the rate expected over that long."""
        move_s = sum(self.moves_s) / len(self.moves_s) if self.moves_s else 0.0
        return replicas * move_s + max(rules.confirmations, 1) * interval_s

    def move(
        self, rules: Switching, plan: SplitPlan, replicas: int, now: float, *, after_move: bool = False,
        fresh: float = 1.0,
    ) -> int:  # fmt: skip
        """+1: a plain server should speculate now; -1: a speculative one should stop; 0: stay.
        `now` in seconds. The gain that counts is the recommended split's (within the minimum per
        pool) over the current one's, not the next step's: mixed fleets may do worse than either
        end (past saturation on some hardware), and a move toward a better end must not be stopped
        by the valley between.

        `after_move`: asked again of the same plan when its move has ended (the server serves in its
        other pool, the plan's `current` counting it): the next step at once if that plan wants more
        of a confirmed direction, no cooldown (which is between plans). A server a plan apart, a fleet
        took 80 minutes of a day to turn all plain for a peak its plans had seen coming.

        The plan's `stretches` give the gain's own noise (`gain_error`); none: taken as exact. A
        streak is confirmed when its plans' gains, pooled, clear `min_gain` by `rules.sigmas`
        standard errors of their mean: one plan of a few hundred requests cannot tell splits 3%
        apart, three in a row that each see it can. `fresh`: the share of a plan's traffic that the
        plan before it did not see (its interval over its window, at most 1): plans of overlapping
        windows are not independent evidence."""
        step, gain, error = _wanted(rules, plan, replicas)
        if after_move:
            if math.isfinite(self.moved_at):
                self.moves_s.append(now - self.moved_at)
            step = step if step == self.direction and self.confirmed else 0
            if step:
                self.moved_at = now
            return step
        if step == 0:
            self.streak, self.direction, self.evidence, self.confirmed = 0, 0, [], False
            return 0
        if step != self.direction:
            self.streak, self.direction, self.evidence, self.confirmed = 0, step, [], False
        self.streak, self.fresh = self.streak + 1, fresh
        self.evidence.append((gain, error))
        if not self.confirmed and self.streak >= rules.confirmations:
            self.confirmed = _clears(rules, self.evidence, fresh)
        if not self.confirmed or now - self.moved_at < rules.cooldown_ms / 1e3:
            return 0
        self.moved_at = now
        return step


def _wanted(rules: Switching, plan: SplitPlan, replicas: int) -> tuple[int, float, float]:
    """The step toward the recommended split (within the minimum per pool) if the plan predicts it
    serves at least `min_gain` more good tokens than the current one, else 0; with that gain and
    its standard error."""
    target = min(max(plan.recommended, rules.min_per_pool), replicas - rules.min_per_pool)
    step = (target > plan.current) - (target < plan.current)
    if step == 0:
        return 0, 0.0, 0.0
    gain, error = plan.gain_to(target), plan.error_to(target)
    return (step if gain >= rules.min_gain else 0), gain, error


def pooled(evidence: Sequence[tuple[float, float]], fresh: float) -> tuple[float, float]:
    """Plans' gains and their standard errors, pooled: the mean gain and its standard error. Plans
    whose windows overlap count as fewer: each adds `fresh` (at most 1) of a plan's evidence."""
    if not evidence:
        return 0.0, 0.0
    mean = sum(gain for gain, _ in evidence) / len(evidence)
    independent = 1.0 + (len(evidence) - 1) * min(max(fresh, 0.0), 1.0)
    return mean, math.sqrt(sum(e * e for _, e in evidence) / len(evidence) / independent)


def _clears(rules: Switching, evidence: Sequence[tuple[float, float]], fresh: float) -> bool:
    """Whether the plans' gains, pooled, clear `min_gain` by `sigmas` standard errors of their mean."""
    mean, error = pooled(evidence, fresh)
    if rules.sigmas == 0 or math.isinf(mean):
        return mean >= rules.min_gain
    return mean - rules.sigmas * error >= rules.min_gain


Mover = Callable[[int], Awaitable[None]]
"""Switches one server: +1 a plain one to the speculative pool, -1 the other way."""


class Advisor:
    def __init__(
        self,
        settings: AdvisorSettings,
        fleet_split: Callable[[], tuple[int, int]],
        profile: Callable[[], str],
        profiles: Mapping[str, Profile] = PROFILES,
        rules: Callable[[], Switching] = Switching,
        mover: Mover | None = None,
    ) -> None:
        self.settings = settings
        self.window = TrafficWindow(settings.window_s, settings.max_requests)
        self.fleet_split = fleet_split
        """The fleet's speculative and plain replicas now."""
        self.profile = profile
        """The profile the policy in force predicts with."""
        self.profile_files = _written(profiles) if settings.enabled else {}
        """The profiles that are not built in, as files its plans (child processes) can read:
        written once, at start-up, before serving."""
        self.advice: Advice | None = None
        self.rules = rules
        """The policy document's `switching`, as it is now."""
        self.mover = mover
        """How this gateway switches a server; None where it cannot (no [launch], no store)."""
        self.governor = Governor()

    def close(self) -> None:
        for path in self.profile_files.values():
            shutil.rmtree(path.parent, ignore_errors=True)

    async def run(self) -> None:
        """Until cancelled: a plan every `interval_s`."""
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                await self.plan_once()
            except (OSError, ValueError, KeyError) as exc:
                _log.warning("advisor: no plan this time: %r", exc)

    async def plan_once(self) -> Advice | None:
        now = time.monotonic()
        seen = self.window.requests(now)
        slo = commonest_slo(seen)
        if len(seen) < self.settings.min_requests or slo is None:
            return None
        # At the rate this time of day brought over the move's horizon yesterday, if there was one.
        spec, plain = self.fleet_split()
        horizon_s = self.governor.horizon_s(self.rules(), self.settings.interval_s, spec + plain)
        growth = self.window.daily.growth(now, self.settings.window_s, horizon_s)
        profile = self.profile()
        if profile in PROFILES:
            which = ["--profile", profile]
        elif profile in self.profile_files:
            which = ["--profile-file", str(self.profile_files[profile])]
        else:
            raise KeyError(f"profile {profile!r} has no file to plan with")
        argv = launch.specgate_argv(
            "plan", "--trace", "/dev/stdin", "--replicas", str(spec + plain), "--slo-ttft-ms", f"{slo[0]:g}",
            "--slo-tpot-ms", f"{slo[1]:g}", *which, "--json", "-", "--jobs", "1", "--warm-up",
            "--max-requests", str(self.settings.max_requests),
        )  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            preexec_fn=launch.die_with_parent,
        )  # fmt: skip
        try:
            csv = trace_csv(seen, growth or 1.0)
            out, err = await asyncio.wait_for(proc.communicate(csv), timeout=self.settings.plan_timeout_s)
        finally:
            if proc.returncode is None:  # timed out or cancelled: it goes too
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if proc.returncode != 0:
            raise ValueError(f"specgate plan exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
        results = json.loads(out)
        splits = results["splits"]
        plan = SplitPlan.of(splits, int(results["recommended"]), spec)
        advice = Advice(plan, len(seen), slo, profile, time.time(), splits, growth, horizon_s)
        if self.advice is None or self.advice.plan.recommended != plan.recommended:
            _log.info(
                "advisor: %d speculative + %d plain recommended for the last %d requests at %.2f times their rate "
                "(now %d + %d; predicted good tokens %+.1f%% +- %.1f%%)", plan.recommended,
                spec + plain - plan.recommended, len(seen), growth or 1.0, spec, plain, plan.gain * 100,
                plan.gain_error * 100,
            )  # fmt: skip
        self.advice = advice
        rules = self.rules()
        if rules.enabled:
            # The plan covers every split: the recommended and the current one among them.
            fresh = self.settings.interval_s / self.settings.window_s
            step = self.governor.move(rules, plan, spec + plain, time.monotonic(), fresh=fresh)
            if step and self.mover is None:
                _log.warning("advisor: switching is enabled but this gateway cannot restart servers "
                             "(it needs a [launch] section and a policy store)")  # fmt: skip
            elif step and self.mover is not None:
                while step:  # the move ends when the server serves in its other pool
                    await self.mover(step)
                    plan = replace(plan, current=plan.current + step)
                    step = self.governor.move(rules, plan, spec + plain, time.monotonic(), after_move=True)
        return advice
