"""`specgate bench daily`: a day of traffic with quiet hours and a peak, compressed into one run, on
every fixed split of a fleet and on a fleet that switches servers between the pools as the live
advisor does (the policy document's `switching`: plans on the recent traffic, at the rate the
day before's same minutes say comes next unless `--no-yesterday`, the `Governor`'s hysteresis, a
server drained, restarted for `--restart-min` serving nothing, re-admitted in the other pool),
from `--starts` at dawn and, where that fleet ends the day in another split, again from the split
it ended in, its advisor knowing how long those moves took (a fleet that switches every day
begins each as the last ended). All in the offline
simulator, side by side in one run, every core used.

The day: the conversation trace's requests arriving along `bench/shapes.py`'s `ramp` (from 0.15 to
1.85 times the mean rate, peak at noon) at `--rate-scale` times the trace's own mean rate. Per
fleet: SLO attainment, goodput, TTFT and TPOT p99, and what a million tokens cost at
`--price-per-hour` a server (all tokens, and those of requests that met their SLOs). Per hour of
the day: the arrival rate, each fleet's attainment, and the switching fleet's speculative servers.
Writes results.json, report.md and timeline.png to `--out`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgate.bench.offline import Fleetspec, RunResult, Scenario, Switchover, simulate, throughput
from specgate.bench.outputs import write
from specgate.bench.shapes import arrivals
from specgate.bench.traces import TraceRequest, read_trace, scaled
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES
from specgate.policies.document import Switching

TRACE = Path("../shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv")
HOURS = 24


@dataclass(frozen=True)
class Day:
    trace: Path
    requests: int
    rate_scale: float
    replicas: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    profile: str = DEFAULT_PROFILE
    price_per_hour: float = 3.49
    seed: int = 0
    interval_min: float = 20.0
    """How often the advisor plans, in minutes of the day (the run compresses a day of 1440)."""
    window_min: float = 20.0
    restart_min: float = 2.0
    """How long a switched server serves nothing: a real server's drain and restart."""
    confirmations: int = 2
    min_gain: float = 0.01
    yesterday: bool = True
    """The advisor has seen the day before (the same ramp, other arrivals): it plans on the rate
    that the same minutes then say comes next, as the live advisor does from its second day."""
    sigmas: float = Switching().sigmas
    """Standard errors of a plan's own noise a move's gain must clear beyond `min_gain`."""

    def requests_of_the_day(self, seed: int | None = None) -> list[TraceRequest]:
        trace = scaled(read_trace(self.trace, self.requests), self.rate_scale)
        return arrivals(trace, "ramp", self.seed if seed is None else seed)

    def switchover(self, span_s: float, moves_s: tuple[float, ...] = ()) -> Switchover:
        """The advisor's timings, from minutes of the day to seconds of the run; `moves_s`: how long
        its moves of the day before took."""
        s = span_s / (24 * 60)
        rules = Switching(enabled=True, min_per_pool=0, confirmations=self.confirmations, min_gain=self.min_gain,
                          sigmas=self.sigmas, cooldown_ms=self.interval_min * s * 1e3)  # fmt: skip
        history = [r.arrival_s - span_s for r in self.requests_of_the_day(self.seed + 1)] if self.yesterday else []
        return Switchover(rules, self.interval_min * s, self.window_min * s, self.restart_min * s, min_requests=50,
                          history=tuple(history), period_s=span_s, moves_s=moves_s)  # fmt: skip


@dataclass(frozen=True)
class Job:
    day: Day
    speculative: int
    """Speculative servers of the fixed split, or of the switching fleet at dawn."""
    switching: bool
    next_day: bool = False
    """A switching fleet's second day: it starts as its first ended."""
    moves_s: tuple[float, ...] = ()
    """How long the moves of the switching fleet's day before took (its advisor remembers them)."""


def run(job: Job) -> dict[str, Any]:
    day = job.day
    trace = day.requests_of_the_day()
    fleet = Fleetspec(job.speculative, day.replicas - job.speculative)
    scenario = Scenario(
        PROFILES[day.profile], fleet, "adaptive", day.slo_ttft_ms, day.slo_tpot_ms, seed=day.seed,
        switching=day.switchover(trace[-1].arrival_s, job.moves_s) if job.switching else None,
    )  # fmt: skip
    result = simulate(trace, scenario)
    label = fleet.label
    if job.next_day:
        label = f"switching, the next day (from {fleet.label}, as it ended)"
    elif job.switching:
        label = f"switching (from {fleet.label} at dawn)"
    return {
        "fleet": label, "speculative": job.speculative, "switching": job.switching, **result.summary(),
        **throughput(result, day.price_per_hour * day.replicas),
        **hourly(result, result.span_s or 1e-9), "switches": [
            {"drained_s": a, "serving_s": b, "server": name, "to": pool.value} for a, b, name, pool in result.switches
        ], "plans": [
            {**plan.row(), "hour": plan.at_s / (result.span_s or 1e-9) * 24} for plan in result.plans
        ],
    }  # fmt: skip


def hourly(result: RunResult, span: float) -> dict[str, list[float]]:
    """By hour of arrival: the SLO attainment of the requests that arrived (refused ones missed),
    and the output tokens a second of those that met their SLOs."""
    met, seen, good_tokens = [0] * HOURS, [0] * HOURS, [0] * HOURS
    served = [(s.arrival_s, s.output_tokens if s.meets() else None) for s in result.served]
    for at, tokens in served + [(at, None) for at, _ in result.refusals]:
        hour = min(int(at / span * HOURS), HOURS - 1)
        seen[hour] += 1
        if tokens is not None:
            met[hour] += 1
            good_tokens[hour] += tokens
    return {
        "hourly_attainment": [m / n if n else math.nan for m, n in zip(met, seen, strict=True)],
        "hourly_good_tokens_per_s": [t / (span / HOURS) for t in good_tokens],
    }


def speculative_at(row: dict[str, Any], t: float) -> int:
    """The switching fleet's speculative servers at `t` (a restarting server counts in neither
    pool)."""
    n = int(row["speculative"])
    for s in row["switches"]:
        was_speculative = s["to"] == Pool.PLAIN.value
        if s["serving_s"] <= t:
            n += -1 if was_speculative else 1
        elif s["drained_s"] <= t and was_speculative:
            n -= 1
    return n


def speculative_by_hour(row: dict[str, Any], span: float) -> list[int]:
    """The switching fleet's speculative servers at the middle of each hour."""
    return [speculative_at(row, (hour + 0.5) * span / HOURS) for hour in range(HOURS)]


def ended_with(row: dict[str, Any]) -> int:
    """The switching fleet's speculative servers at the end of its day."""
    return speculative_at(row, math.inf)


def move_times(row: dict[str, Any]) -> tuple[float, ...]:
    """How long each of the switching fleet's moves took, from its drain to serving again."""
    return tuple(s["serving_s"] - s["drained_s"] for s in row["switches"])


def run_day(day: Day, starts: Sequence[int], jobs: int) -> dict[str, Any]:
    """Every fixed split and a switching fleet from each of `starts` at dawn; and, where a switching
    fleet ends its day in another split than it began, its next day, begun as it ended, its advisor
    knowing how long its moves took (a fleet that switches every day starts each as the last ended:
    its steady state)."""
    trace = day.requests_of_the_day()
    span = trace[-1].arrival_s - trace[0].arrival_s
    with ProcessPoolExecutor(max(min(jobs, day.replicas + 1 + len(starts)), 1)) as pool:
        first_days = [pool.submit(run, Job(day, k, True)) for k in starts]  # the longest runs first
        fixed_runs = [pool.submit(run, Job(day, k, False)) for k in range(day.replicas + 1)]
        switching = [f.result() for f in first_days]
        next_days = [pool.submit(run, Job(day, ended_with(r), True, next_day=True, moves_s=move_times(r)))
                     for r in switching if ended_with(r) != r["speculative"]]  # fmt: skip
        rows = [f.result() for f in fixed_runs] + switching + [f.result() for f in next_days]
    rate = [0] * HOURS
    for request in trace:
        rate[min(int(request.arrival_s / span * HOURS), HOURS - 1)] += 1
    fixed = [r for r in rows if not r["switching"]]
    best = max(fixed, key=lambda r: r["slo_attainment"])
    cheapest = min(fixed, key=lambda r: r["usd_per_million_good_tokens"])
    for r in rows:
        if r["switching"]:
            r["speculative_by_hour"] = speculative_by_hour(r, span)
            r["margin_to_best_fixed"] = r["slo_attainment"] - best["slo_attainment"]
            r["good_token_cost_to_cheapest_fixed"] = (
                r["usd_per_million_good_tokens"] / cheapest["usd_per_million_good_tokens"]
            )
    return {
        "settings": {**day.__dict__, "trace": str(day.trace)}, "span_s": span,
        "arrivals_per_s_by_hour": [n / (span / HOURS) for n in rate], "runs": rows,
        "best_fixed": best["fleet"], "cheapest_fixed": cheapest["fleet"],
    }  # fmt: skip


def hindsight(results: dict[str, Any]) -> float:
    """The attainment of a fleet that knew each hour's best fixed split and switched to it at no
    cost: what switching could win at most, at this resolution."""
    fixed: list[list[float]] = [r["hourly_attainment"] for r in results["runs"] if not r["switching"]]
    weights: list[float] = results["arrivals_per_s_by_hour"]
    best = [max((run[h] for run in fixed if not math.isnan(run[h])), default=0.0) for h in range(len(weights))]
    return sum(w * b for w, b in zip(weights, best, strict=True)) / sum(weights)


def report(results: dict[str, Any], command: str) -> str:
    s = results["settings"]
    lines = [
        "# A day of traffic: fixed splits against a fleet that switches",
        "",
        f"`{command}`",
        "",
        f"{s['replicas']} servers ({s['profile']}), SLO TTFT {s['slo_ttft_ms']:g} / TPOT {s['slo_tpot_ms']:g} ms, "
        f"{len(results['arrivals_per_s_by_hour'])} hours compressed into {results['span_s']:.0f} s of the "
        f"conversation trace's requests ({s['requests']}) at {s['rate_scale']:g}x its mean rate along a daily "
        f"ramp; {s['price_per_hour']:g} USD a server-hour. The switching fleet plans every {s['interval_min']:g} "
        f"minutes of the day on the last {s['window_min']:g}"
        + (" (at the rate the day before's same minutes say comes next)" if s["yesterday"] else "")
        + f", moves one server when {s['confirmations']} plans in a row predict at least "
        f"{s['min_gain'] * 100:g}% more good tokens for the split they recommend (their gains, pooled, by "
        f"{s.get('sigmas', 0):g} standard errors of their mean more), the next as soon as it is back "
        f"while that plan wants more, and a switched server serves nothing for {s['restart_min']:g} minutes.",
        "",
        "| fleet | SLO attainment | goodput req/s | TTFT p99 ms | TPOT p99 ms | $/M tokens | $/M good tokens "
        "| switches |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['fleet']} | {r['slo_attainment']:.3f} | {r['goodput_rps']:.2f} | {r['ttft_p99_ms']:.0f} | "
            f"{r['tpot_p99_ms']:.1f} | {r['usd_per_million_tokens']:.2f} | {r['usd_per_million_good_tokens']:.2f} | "
            f"{len(r['switches']) if r['switching'] else '-'} |"
        )
    lines += ["", f"Best fixed split on attainment: {results['best_fixed']}; on the cost of good tokens: "
              f"{results['cheapest_fixed']}. In hindsight, the best fixed split of each hour, switched at "
              f"no cost, would meet {hindsight(results):.3f}.", ""]  # fmt: skip
    for r in results["runs"]:
        if r["switching"]:
            lines.append(
                f"- {r['fleet']}: {r['margin_to_best_fixed'] * 100:+.1f} points of attainment against the best "
                f"fixed split; good tokens at {r['good_token_cost_to_cheapest_fixed']:.3f}x the cheapest fixed "
                f"split's cost. Speculative servers by hour: {' '.join(str(n) for n in r['speculative_by_hour'])}."
            )
    lines += ["", "Attainment by hour of the day:", ""]
    hours = len(results["arrivals_per_s_by_hour"])
    lines.append("| fleet | " + " | ".join(str(h) for h in range(hours)) + " |")
    lines.append("|---|" + "---|" * hours)
    lines.append("| arrivals/s | " + " | ".join(f"{v:.1f}" for v in results["arrivals_per_s_by_hour"]) + " |")
    for r in results["runs"]:
        cells = " | ".join("-" if math.isnan(v) else f"{v:.2f}" for v in r["hourly_attainment"])
        lines.append(f"| {r['fleet']} | {cells} |")
    lines += ["", "Output tokens a second of the requests that met their SLOs, by hour of arrival:", ""]
    lines.append("| fleet | " + " | ".join(str(h) for h in range(hours)) + " |")
    lines.append("|---|" + "---|" * hours)
    for r in results["runs"]:
        lines.append(f"| {r['fleet']} | " + " | ".join(f"{v:.0f}" for v in r["hourly_good_tokens_per_s"]) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = range(len(results["arrivals_per_s_by_hour"]))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.bar(hours, results["arrivals_per_s_by_hour"], color="lightgrey", label="arrivals/s")
    top.set_ylabel("arrivals per second")
    servers = top.twinx()
    for r in results["runs"]:
        if r["switching"]:
            servers.step(hours, r["speculative_by_hour"], where="mid", label=f"speculative servers: {r['fleet']}")
    servers.set_ylabel("speculative servers")
    servers.set_ylim(-0.2, results["settings"]["replicas"] + 0.2)
    servers.legend(loc="upper left", fontsize=7)
    for r in results["runs"]:
        style = "-" if r["switching"] else ":"
        bottom.plot(hours, r["hourly_attainment"], style, marker="." if r["switching"] else None, label=r["fleet"])
    bottom.set_ylabel("SLO attainment")
    bottom.set_xlabel("hour of the day")
    bottom.set_ylim(0, 1.02)
    bottom.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench daily") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=12000)
    parser.add_argument("--rate-scale", type=float, default=1.0, help="the day's mean rate, x the trace's")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=60.0)
    parser.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE)
    parser.add_argument("--price-per-hour", type=float, default=3.49, help="USD a server-hour")
    parser.add_argument("--restart-min", type=float, default=Day.restart_min,
                        help="minutes of the day a switched server serves nothing")  # fmt: skip
    parser.add_argument("--interval-min", type=float, default=Day.interval_min, help="how often the advisor plans")
    parser.add_argument("--window-min", type=float, default=Day.window_min, help="the recent traffic it plans on")
    parser.add_argument("--confirmations", type=int, default=Day.confirmations, help="plans that must agree")
    parser.add_argument(
        "--min-gain", type=float, default=Day.min_gain, help="predicted share of good tokens a move must add"
    )
    parser.add_argument("--sigmas", type=float, default=Day.sigmas,
                        help="standard errors of a plan's noise a gain must clear beyond --min-gain")  # fmt: skip
    parser.add_argument("--no-yesterday", dest="yesterday", action="store_false",
                        help="the switching fleet's advisor has not seen the day before (its first day)")  # fmt: skip
    parser.add_argument("--starts", type=lambda t: [int(v) for v in t.split(",")], default=None,
                        help="speculative servers of the switching fleet at dawn (default: half)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/daily"))
    args = parser.parse_args(argv)
    logging.getLogger("specgate").setLevel(logging.WARNING)  # the simulated replicas coming up, and the like
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}")
    day = Day(
        args.trace, args.requests, args.rate_scale, args.replicas, args.slo_ttft_ms, args.slo_tpot_ms, args.profile,
        args.price_per_hour, args.seed, args.interval_min, args.window_min, args.restart_min, args.confirmations,
        args.min_gain, args.yesterday, args.sigmas,
    )  # fmt: skip
    results = run_day(day, args.starts if args.starts is not None else [args.replicas // 2], args.jobs)
    command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)]).strip()
    results["command"] = command
    write(args.out, "results", results, report(results, command), report_name="report")
    plot(results, args.out / "timeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
