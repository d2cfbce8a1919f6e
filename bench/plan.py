"""`specgate plan`: which split of a fleet between the speculative and the plain pool serves a
traffic best, and what its tokens cost.

Every split of N replicas (0 to N speculative, the rest plain) routes the same trace in the offline
simulator with the routing policy (adaptive unless told otherwise), a process per split. For each:
SLO attainment, goodput, TTFT and TPOT p50 and p99, the tokens generated a second and, with a price
per replica-hour, what a million of them cost (`calibration/pricing.py`): all the tokens served, and
only those of requests that met their SLOs (what the traffic is paying for). At the traffic's own
rate every split serves about as many tokens, so the first cost moves little; the second follows
the attainment. Recommended (`gateway/advisor.py`'s `recommend`, which the live advisor follows):
the split whose requests that met their SLOs got the most tokens, the cheapest good tokens at one
price a replica-hour; among those within half a percent of it, the one that meets the most SLOs,
then the one with the lower TPOT p99.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgate.bench.offline import Fleetspec, Scenario, simulate, split_figures, steady
from specgate.bench.traces import TraceRequest, read_trace, scaled
from specgate.calibration.profiles import Profile
from specgate.gateway.advisor import recommend


@dataclass(frozen=True)
class PlanSettings:
    trace: Path
    replicas: int
    profile: Profile
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    price_per_hour: float | None = None
    """USD per replica-hour, the same in either pool."""
    policy: str = "adaptive"
    rate_scale: float = 1.0
    """The trace's requests arriving this many times as fast."""
    max_requests: int = 2000
    seed: int = 0
    jobs: int = 1
    splits: Sequence[int] = field(default=())
    """Speculative replicas of each split to simulate; empty: every one from 0 to `replicas`."""
    warm_up: bool = False
    """Replay the trace back to back and report the second round (`offline.warmed`): a short stretch
    of traffic (the live advisor's window) as a fleet it keeps loaded meets it, not an idle one."""

    def speculative_counts(self) -> list[int]:
        return sorted(set(self.splits)) if self.splits else list(range(self.replicas + 1))


def run_split(settings: PlanSettings, trace: list[TraceRequest], speculative: int) -> dict[str, Any]:
    """One split of the fleet routing the trace: its figures, as `plan` reports them."""
    fleet = Fleetspec(speculative, settings.replicas - speculative)
    scenario = Scenario(
        settings.profile, fleet, settings.policy, settings.slo_ttft_ms, settings.slo_tpot_ms, seed=settings.seed
    )
    result = steady(trace, scenario) if settings.warm_up else simulate(trace, scenario)
    per_hour = settings.price_per_hour * settings.replicas if settings.price_per_hour is not None else None
    return {
        "speculative": speculative, "plain": fleet.plain, "fleet": fleet.label, **split_figures(result, per_hour),
    }  # fmt: skip


def plan(settings: PlanSettings) -> dict[str, Any]:
    counts = settings.speculative_counts()
    if settings.replicas < 1 or any(not 0 <= c <= settings.replicas for c in counts):
        raise ValueError(f"splits of {settings.replicas} replicas need 0 to {settings.replicas} speculative ones")
    trace = read_trace(settings.trace, settings.max_requests)  # once: it may be a pipe
    if settings.rate_scale != 1.0:
        trace = scaled(trace, settings.rate_scale)
    jobs = max(min(settings.jobs, len(counts)), 1)
    if jobs == 1:
        rows = [run_split(settings, trace, c) for c in counts]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(run_split, [settings] * len(counts), [trace] * len(counts), counts))
    chosen = recommend(rows)
    return {
        "trace": str(settings.trace),
        "replicas": settings.replicas,
        "profile": settings.profile.name,
        "policy": settings.policy,
        "slo_ttft_ms": settings.slo_ttft_ms,
        "slo_tpot_ms": settings.slo_tpot_ms,
        "rate_scale": settings.rate_scale,
        "warm_up": settings.warm_up,
        "price_per_hour": settings.price_per_hour,
        "splits": rows,
        "recommended": chosen["speculative"],
    }


def _cell(value: object, digits: int = 0) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else ("inf" if math.isinf(value) else f"{value:.{digits}f}")
    return str(value)


def table(results: dict[str, Any]) -> str:
    """The splits side by side, the recommended one marked, in Markdown."""
    rows = results["splits"]
    priced = results.get("price_per_hour") is not None
    head = "| split | SLO attainment | goodput req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | tokens/s | spec share |"
    rule = "|---|---|---|---|---|---|---|"
    if priced:
        head += " $/M tokens | $/M good tokens |"
        rule += "---|---|"
    lines = [head, rule]
    for r in rows:
        mark = " (recommended)" if r["speculative"] == results["recommended"] else ""
        line = (
            f"| {r['fleet']}{mark} | {r['slo_attainment']:.3f} | {_cell(r['goodput_rps'], 2)} | "
            f"{_cell(r['ttft_p50_ms'])} / {_cell(r['ttft_p99_ms'])} | {_cell(r['tpot_p50_ms'], 1)} / "
            f"{_cell(r['tpot_p99_ms'], 1)} | {_cell(r['tokens_per_s'])} | {r['spec_share']:.2f} |"
        )
        if priced:
            line += f" {_cell(r['usd_per_million_tokens'], 2)} | {_cell(r['usd_per_million_good_tokens'], 2)} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """SLO attainment (and the cost of good tokens, when priced) against the speculative replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["splits"]
    xs = [r["speculative"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["slo_attainment"] for r in rows], marker="o", label="SLO attainment")
    ax.set_xlabel(f"speculative replicas (of {results['replicas']})")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.axvline(results["recommended"], color="grey", linestyle=":", label="recommended")
    if results.get("price_per_hour") is not None:
        cost = ax.twinx()
        values = [r["usd_per_million_good_tokens"] for r in rows]
        cost.plot(xs, [v if math.isfinite(v) else float("nan") for v in values], marker="s", color="tab:red",
                  label="$ per million good tokens")  # fmt: skip
        cost.set_ylabel("$ per million tokens of requests that met their SLOs")
    ax.legend(loc="lower left")
    ax.set_title(
        f"{Path(str(results['trace'])).name}: TTFT {results['slo_ttft_ms']} / TPOT {results['slo_tpot_ms']} ms"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
