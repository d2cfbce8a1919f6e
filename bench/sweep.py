"""`specgate bench offline`: every policy over a trace at several loads, side by side, in one run.

For each rate scale, each policy routes the same requests over the same mixed fleet; homogeneous
fleets of the same size (all plain, all speculative, least-loaded) run beside them; a clairvoyant
bound gives the share of requests that could meet their SLOs at all. Writes DIR/results.json,
DIR/report.md and PNG plots of attainment and p99 TTFT against load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specgate.bench.offline import Fleetspec, Scenario, attainable, simulate
from specgate.bench.outputs import in_parallel
from specgate.bench.traces import TraceRequest, read_trace, scaled
from specgate.calibration.profiles import Profile

ALL_PLAIN = "all-plain fleet"
ALL_SPEC = "all-speculative fleet"


@dataclass(frozen=True)
class SweepSettings:
    trace: Path
    profile: Profile
    spec_replicas: int
    plain_replicas: int
    policies: tuple[str, ...]
    rate_scales: tuple[float, ...]
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    max_requests: int | None
    hint: bool
    seed: int
    out: Path
    jobs: int = os.cpu_count() or 1


def _run(job: tuple[SweepSettings, str, float, Sequence[TraceRequest]]) -> dict[str, object]:
    settings, label, rate, trace = job
    total = settings.spec_replicas + settings.plain_replicas
    if label == ALL_PLAIN:
        fleet, policy = Fleetspec(0, total), "least-loaded"
    elif label == ALL_SPEC:
        fleet, policy = Fleetspec(total, 0), "least-loaded"
    else:
        fleet, policy = Fleetspec(settings.spec_replicas, settings.plain_replicas), label
    scenario = Scenario(
        settings.profile,
        fleet,
        policy,
        slo_ttft_ms=settings.slo_ttft_ms,
        slo_tpot_ms=settings.slo_tpot_ms,
        hint=settings.hint,
        seed=settings.seed,
    )
    result = simulate(scaled(list(trace), rate), scenario)
    return {"policy": label, "fleet": fleet.label, "rate_scale": rate, **result.summary()}


def run_sweep(settings: SweepSettings) -> dict[str, object]:
    trace = read_trace(settings.trace, settings.max_requests)
    labels = [*settings.policies, ALL_PLAIN, ALL_SPEC]
    jobs = [(settings, label, rate, trace) for rate in settings.rate_scales for label in labels]
    runs = in_parallel(_run, jobs, settings.jobs)
    scenario = Scenario(settings.profile, Fleetspec(1, 1), "least-loaded", settings.slo_ttft_ms, settings.slo_tpot_ms)
    bound = attainable(trace, scenario)
    return {
        "trace": str(settings.trace.name),
        "requests_per_run": len(trace),
        "trace_span_s": trace[-1].arrival_s,
        "profile": settings.profile.name,
        "fleet": Fleetspec(settings.spec_replicas, settings.plain_replicas).label,
        "slo_ttft_ms": settings.slo_ttft_ms,
        "slo_tpot_ms": settings.slo_tpot_ms,
        "hint": "exact" if settings.hint else "none",
        "seed": settings.seed,
        "runs": runs,
        "bound": {
            "slo_attainment": bound,
            "what": "share meeting both SLOs alone on an idle replica of the better mode",
        },
    }


def write_outputs(results: dict[str, object], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(report(results, command))
    plot(results, out)


def _by_policy(results: dict[str, object]) -> dict[str, dict[float, dict[str, object]]]:
    table: dict[str, dict[float, dict[str, object]]] = {}
    for run in results["runs"]:  # type: ignore[attr-defined]
        table.setdefault(str(run["policy"]), {})[float(run["rate_scale"])] = run
    return table


def report(results: dict[str, object], command: str) -> str:
    table = _by_policy(results)
    rates = sorted({rate for runs in table.values() for rate in runs})
    bound = results["bound"]["slo_attainment"]  # type: ignore[index]
    lines = [
        f"# Offline benchmark: {results['trace']}",
        "",
        f"`{command}`",
        "",
        f"{results['requests_per_run']} requests per run ({results['trace_span_s']:.0f} s of trace at rate x1), "
        f"profile `{results['profile']}`, fleet {results['fleet']}, SLO TTFT {results['slo_ttft_ms']} ms / "
        f"TPOT {results['slo_tpot_ms']} ms, output-length hint: {results['hint']}. Homogeneous fleets have "
        f"the same number of replicas. Clairvoyant bound (every request alone on an idle replica of its "
        f"better mode): {bound:.3f}. Refused: answered with an error by the policy (shed, held past its "
        "wait, or out of reach even idle); too long: prompts past the model's context window, which vLLM "
        "refuses (they count as missed).",
        "",
        "## SLO attainment (share of requests meeting both SLOs)",
        "",
        "| policy | " + " | ".join(f"x{r:g}" for r in rates) + " | mean |",
        "|---|" + "---|" * (len(rates) + 1),
    ]
    for policy, runs in table.items():
        values = [float(runs[r]["slo_attainment"]) for r in rates if r in runs]  # type: ignore[arg-type]
        cells = [f"{float(runs[r]['slo_attainment']):.3f}" if r in runs else "-" for r in rates]  # type: ignore[arg-type]
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {sum(values) / len(values):.3f} |")
    lines += [
        "",
        "## Latency (ms) and routing, per load",
        "",
        "| policy | rate | goodput req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | e2e p50 | e2e p99 "
        "| spec share | refused | too long |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rate in rates:
        for policy, runs in table.items():
            run = runs.get(rate)
            if run is None:
                continue
            cells = [f"x{rate:g}", f"{run['goodput_rps']:.2f}"]
            cells += [f"{run[k]:.0f}" for k in ("ttft_p50_ms", "ttft_p99_ms")]
            cells += [f"{run[k]:.1f}" for k in ("tpot_p50_ms", "tpot_p99_ms")]
            cells += [f"{run[k]:.0f}" for k in ("e2e_p50_ms", "e2e_p99_ms")]
            cells += [f"{run['spec_share']:.2f}", str(run["shed"]), str(run.get("too_long", 0))]
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, object], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = _by_policy(results)
    stem = Path(str(results["trace"])).stem
    for metric, label, name in (
        ("slo_attainment", "SLO attainment", "attainment"),
        ("ttft_p99_ms", "TTFT p99 (ms)", "ttft_p99"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, runs in table.items():
            rates = sorted(runs)
            ax.plot(rates, [float(runs[r][metric]) for r in rates], marker="o", label=policy)  # type: ignore[arg-type]
        if metric == "slo_attainment":
            ax.axhline(results["bound"]["slo_attainment"], color="grey", linestyle="--", label="clairvoyant bound")  # type: ignore[index]
            ax.set_ylim(0, 1.02)
        else:
            ax.set_yscale("log")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("load (rate scale of the trace)")
        ax.set_ylabel(label)
        ax.set_title(f"{stem}: {label} vs load, {results['fleet']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{stem}_{name}.png", dpi=110)
        plt.close(fig)
