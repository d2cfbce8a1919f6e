"""`specgate bench grid`: the adaptive policy against every fixed rule, on traffic it was not
developed on.

A cell is one traffic, fleet and SLO configuration: a recorded Azure trace (conversation or code),
reshaped (`bench.shapes`: arrival shape, prompt-length mix, request classes), an SLO pair, a fleet
split and a calibrated profile. Each cell runs at several loads, expressed against the fleet's
estimated capacity within the cell's TPOT target (`capacity_rps`: 1 is about where its SLOs start
to be missed), and at each load
every policy routes the same requests; the adaptive policy also runs on the two homogeneous
fleets of the same size. Per point, the margin is the adaptive policy's SLO attainment minus the
best fixed rule's on the same fleet.

A run is the cell's window of requests, from an idle fleet (the default), or, `steady`, that window
kept up (`bench.offline.steady`: back to back, the second round counted while the rounds after
it keep coming). On a fast fleet a few hundred requests at twice its capacity arrive within two
seconds and are all still running when the last arrives: alone, the window measures a burst on a
cold fleet, not a load, and kept up the same load can rank the policies otherwise.

The cells: a base configuration, every factor varied from it one at a time, the configurations
reported as hard for the adaptive policy, and random combinations of all factors.
"""

from __future__ import annotations

import json
import os
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specgate.bench import shapes
from specgate.bench.offline import Fleetspec, Scenario, attainable, max_tokens, simulate, steady
from specgate.bench.outputs import in_parallel
from specgate.bench.traces import TraceRequest, read_trace, scaled
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import PROFILES, Profile
from specgate.policies.features import SloTargets
from specgate.policies.latency_model import LatencyModel

FIXED = ("round-robin", "least-loaded", "threshold", "speculative-only", "plain-only")
ADAPTIVE = "adaptive"
POLICIES = (ADAPTIVE, *FIXED)
HOMOGENEOUS = ("all-speculative", "all-plain")
LOADS = (0.25, 0.5, 1.0, 2.0, 4.0)
SLOS = ((300.0, 20.0), (800.0, 40.0), (800.0, 60.0), (2000.0, 50.0), (5000.0, 120.0))
FLEETS = ((1, 3), (2, 2), (3, 1), (4, 4), (6, 2))
MAX_BATCH = 256
"""vLLM's default max_num_seqs: the largest batch a replica runs."""


@dataclass(frozen=True)
class Cell:
    trace: str = "conv"
    arrivals: str = "recorded"
    prompts: str = "recorded"
    classes: bool = False
    slo: tuple[float, float] = (2000.0, 50.0)
    fleet: tuple[int, int] = (2, 2)
    profile: str = "a100-codellama34b-tp2"

    @property
    def label(self) -> str:
        parts = [self.trace, self.arrivals, f"prompts-{self.prompts}", "classes" if self.classes else "one-class"]
        parts += [f"slo-{self.slo[0]:g}/{self.slo[1]:g}", f"{self.fleet[0]}+{self.fleet[1]}", self.profile]
        return " ".join(parts)


def cells(quick: bool = False, extra: int = 12, seed: int = 0, *, held_out: bool = False) -> list[Cell]:
    """The grid's cells; `held_out`: only those drawn at random for `seed` (none of the others), which
    for a seed the policy was not developed on make traffic, fleets and SLOs it was not tuned to."""
    base = Cell()
    if quick:
        return [base, Cell(arrivals="storms", classes=True, slo=(800.0, 60.0)), Cell(prompts="long", fleet=(1, 3))]
    varied = [replace(base, slo=s) for s in SLOS]
    varied += [replace(base, arrivals=a) for a in shapes.ARRIVALS]
    varied += [replace(base, prompts="long"), replace(base, classes=True), replace(base, trace="code")]
    varied += [replace(base, fleet=f) for f in FLEETS]
    varied += [replace(base, profile=p) for p in PROFILES]
    reported = [
        Cell(arrivals="storms", classes=True, slo=(800.0, 60.0), fleet=(2, 2)),
        Cell(prompts="long", fleet=(4, 4)),
        Cell(prompts="long", fleet=(4, 4), profile="h100-llama31-8b"),
    ]
    rng = random.Random(f"grid-{seed}")
    mixed = [
        Cell(
            trace=rng.choice(("conv", "code")),
            arrivals=rng.choice(shapes.ARRIVALS),
            prompts=rng.choice(shapes.PROMPTS),
            classes=rng.random() < 0.5,
            slo=rng.choice(SLOS),
            fleet=rng.choice(FLEETS),
            profile=rng.choice(list(PROFILES)),
        )
        for _ in range(extra)
    ]
    if held_out:
        shared = {*varied, *reported}
        return list(dict.fromkeys(c for c in mixed if c not in shared))
    unique: dict[Cell, None] = dict.fromkeys([*varied, *reported, *mixed])
    return list(unique)


def capacity_rps(profile: Profile, fleet: tuple[int, int], trace: Sequence[TraceRequest], tpot_ms: float) -> float:
    """Requests per second the fleet serves within a TPOT target: each replica at the batch that
    serves the most while a request's TPOT (the step time, plus the prefills of the requests that
    replace the batch's as they end, spread over its answer) stays within the target."""
    model = LatencyModel(profile)
    fitting = [r for r in trace if r.prompt_tokens < profile.max_model_len] or list(trace)
    prompt = statistics.fmean(min(r.prompt_tokens, profile.max_model_len - 1) for r in fitting)
    output = statistics.fmean(min(r.output_tokens, max_tokens(profile, r.prompt_tokens)) for r in fitting)
    total = 0.0
    for pool, count in zip(Pool, fleet, strict=True):
        per_step = profile.spec.expected_tokens_per_step() if pool is Pool.SPECULATIVE else 1.0
        stall = model.step_ms(pool, 1, prompt, round(prompt)) - model.step_ms(pool, 1, prompt)
        best = 0.0
        for batch in range(1, MAX_BATCH + 1):
            tpot = model.step_ms(pool, batch, prompt + output / 2) / per_step + batch * stall / output
            if tpot > tpot_ms and best:
                break
            best = max(best, batch * 1e3 / (output * tpot))
        total += count * best
    return total


@dataclass(frozen=True)
class Job:
    cell: Cell
    load: float
    policy: str
    """A policy on the cell's fleet, or one of `HOMOGENEOUS` (adaptive on a one-pool fleet)."""
    requests: int
    seed: int
    trace_path: str
    steady: bool = False
    """The window kept up (`bench.offline.steady`), not alone on an idle fleet."""


def traffic(cell: Cell, path: Path, requests: int, seed: int) -> list[TraceRequest]:
    """The cell's requests at the recorded rate: reshaped, not yet scaled to a load."""
    profile = PROFILES[cell.profile]
    trace = read_trace(path, requests)
    trace = shapes.prompts(trace, cell.prompts, profile.max_model_len, seed)
    trace = shapes.arrivals(trace, cell.arrivals, seed)
    return shapes.classes(trace, seed) if cell.classes else trace


def loaded(cell: Cell, path: Path, requests: int, seed: int, load: float) -> list[TraceRequest]:
    """The cell's requests at `load` times the fleet's estimated capacity (`capacity_rps`)."""
    trace = traffic(cell, path, requests, seed)
    span = max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9)
    rate = load * capacity_rps(PROFILES[cell.profile], cell.fleet, trace, cell.slo[1])
    return scaled(trace, rate * span / len(trace))


def scenario(cell: Cell, policy: str, seed: int) -> Scenario:
    profile = PROFILES[cell.profile]
    spec, plain = cell.fleet
    name = policy
    if policy in HOMOGENEOUS:
        spec, plain = (spec + plain, 0) if policy == "all-speculative" else (0, spec + plain)
        name = ADAPTIVE
    ttft, tpot = cell.slo
    classes = {k: SloTargets(*v) for k, v in shapes.class_targets(ttft, tpot).items()} if cell.classes else {}
    return Scenario(profile, Fleetspec(spec, plain), name, ttft, tpot, slo_classes=classes, seed=seed)


def run(job: Job) -> dict[str, object]:
    trace = loaded(job.cell, Path(job.trace_path), job.requests, job.seed, job.load)
    result = (steady if job.steady else simulate)(trace, scenario(job.cell, job.policy, job.seed))
    return {"cell": job.cell.label, "load": job.load, "policy": job.policy, **result.summary()}


@dataclass(frozen=True)
class GridSettings:
    traces: Mapping[str, Path]
    loads: tuple[float, ...] = LOADS
    requests: int = 400
    seed: int = 0
    quick: bool = False
    jobs: int = os.cpu_count() or 1
    steady: bool = False
    held_out: bool = False
    """Only the cells drawn at random for the seed (`cells`)."""


def run_grid(settings: GridSettings) -> dict[str, object]:
    grid = cells(settings.quick, seed=settings.seed, held_out=settings.held_out)
    jobs = [
        Job(cell, load, policy, settings.requests, settings.seed, str(settings.traces[cell.trace]), settings.steady)
        for cell in grid
        for load in settings.loads
        for policy in (*POLICIES, *HOMOGENEOUS)
    ]
    # Longest first: the overloaded runs of the big fleets take the most time.
    jobs.sort(key=lambda j: -j.load * sum(j.cell.fleet))
    runs = in_parallel(run, jobs, settings.jobs, chunksize=2)
    bounds = {}
    for cell in grid:
        trace = traffic(cell, settings.traces[cell.trace], settings.requests, settings.seed)
        bounds[cell.label] = attainable(trace, scenario(cell, ADAPTIVE, settings.seed))
    return {
        "requests_per_run": settings.requests,
        "seed": settings.seed,
        "steady": settings.steady,
        "held_out": settings.held_out,
        "loads": list(settings.loads),
        "cells": [{"label": c.label, **asdict(c)} for c in grid],
        "bounds": bounds,
        "points": points(runs),
    }


def points(runs: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """Per cell and load: every policy's attainment, the best fixed rule and the margin."""
    by_point: dict[tuple[str, float], dict[str, Mapping[str, object]]] = {}
    for r in runs:
        by_point.setdefault((str(r["cell"]), float(r["load"])), {})[str(r["policy"])] = r  # type: ignore[arg-type]
    out = []
    for (cell, load), policies in sorted(by_point.items()):
        attainment = {p: float(r["slo_attainment"]) for p, r in policies.items()}  # type: ignore[arg-type]
        best_fixed = max(FIXED, key=lambda p: attainment[p])
        out.append(
            {
                "cell": cell,
                "load": load,
                "attainment": attainment,
                "best_fixed": best_fixed,
                # (rounded: 395/400 - 399/400 is four requests, not a hair more than 1 point)
                "margin": round(attainment[ADAPTIVE] - attainment[best_fixed], 9),
                "adaptive_ttft_p99_ms": policies[ADAPTIVE]["ttft_p99_ms"],
                "adaptive_shed": policies[ADAPTIVE]["shed"],
                "too_long": policies[ADAPTIVE]["too_long"],
            }
        )
    return out


def write_outputs(results: dict[str, object], out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "report.md").write_text(report(results, command))
    heatmap(results, out / "margin.png")


def report(results: dict[str, object], command: str, worst: int = 15) -> str:
    pts: list[dict[str, object]] = results["points"]  # type: ignore[assignment]
    margins = [float(p["margin"]) for p in pts]  # type: ignore[arg-type]
    adaptive = statistics.fmean(float(p["attainment"][ADAPTIVE]) for p in pts)  # type: ignore[index]
    best = statistics.fmean(float(p["attainment"][p["best_fixed"]]) for p in pts)  # type: ignore[index]
    singles = {f: statistics.fmean(float(p["attainment"][f]) for p in pts) for f in FIXED}  # type: ignore[index]
    window = "kept up (back to back, the second round counted)" if results.get("steady") else "from an idle fleet"
    drawn = " (held out: only the cells drawn at random for the seed)" if results.get("held_out") else ""
    lines = [
        "# The grid: adaptive against every fixed rule",
        "",
        f"`{command}`",
        "",
        f"{len(results['cells'])} cells{drawn} x {len(results['loads'])} loads = {len(pts)} points, "  # type: ignore[arg-type]
        f"{results['requests_per_run']} requests per run {window}, seed {results['seed']}. Load 1 is the fleet's "
        "estimated capacity. Margin: adaptive's SLO attainment minus the best fixed rule's at that point, "
        "on the same fleet and the same requests.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| points where adaptive is more than 1 point behind | {sum(m < -0.01 for m in margins)} of {len(pts)} |",
        f"| worst margin | {min(margins) * 100:+.1f} points |",
        f"| median margin | {statistics.median(margins) * 100:+.1f} points |",
        f"| grid mean: adaptive | {adaptive:.3f} |",
        f"| grid mean: best fixed rule at each point | {best:.3f} |",
    ]
    lines += [f"| grid mean: {f} | {v:.3f} |" for f, v in sorted(singles.items(), key=lambda kv: -kv[1])]
    lines += ["", f"## The {worst} worst points", "", "| cell | load | adaptive | best fixed | margin | shed |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for p in sorted(pts, key=lambda p: float(p["margin"]))[:worst]:  # type: ignore[arg-type]
        a = p["attainment"]
        lines.append(
            f"| {p['cell']} | {p['load']:g} | {a[ADAPTIVE]:.3f} | {a[p['best_fixed']]:.3f} ({p['best_fixed']}) | "  # type: ignore[index]
            f"{float(p['margin']) * 100:+.1f} | {p['adaptive_shed']} |"  # type: ignore[arg-type]
        )
    lines += ["", "## Where a homogeneous fleet of the same size beats the mixed one", "",
              "The same requests at the same rate on the cell's fleet made all speculative or all plain, routed "
              "by the adaptive policy; the split that wins is the better one for that traffic.", "",
              "| cell | load | mixed (adaptive) | all speculative | all plain | the split that wins |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for p in pts:
        a = p["attainment"]
        if max(a["all-speculative"], a["all-plain"]) > a[ADAPTIVE] + 0.01:  # type: ignore[index]
            winner = max(("all speculative", a["all-speculative"]), ("all plain", a["all-plain"]), key=lambda w: w[1])  # type: ignore[index]
            lines.append(
                f"| {p['cell']} | {p['load']:g} | {a[ADAPTIVE]:.3f} | {a['all-speculative']:.3f} | "  # type: ignore[index]
                f"{a['all-plain']:.3f} | {winner[0]} |"  # type: ignore[index]
            )
    lines += ["", "## Every point", "", "| cell | " + " | ".join(f"x{load:g}" for load in results["loads"]) + " |",  # type: ignore[attr-defined]
              "|---|" + "---|" * len(results["loads"])]  # type: ignore[arg-type]  # fmt: skip
    by_cell: dict[str, dict[float, float]] = {}
    for p in pts:
        by_cell.setdefault(str(p["cell"]), {})[float(p["load"])] = float(p["margin"])  # type: ignore[arg-type]
    for cell, row in by_cell.items():
        lines.append(f"| {cell} | " + " | ".join(f"{row[load] * 100:+.1f}" for load in sorted(row)) + " |")
    return "\n".join(lines) + "\n"


def heatmap(results: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts: list[dict[str, object]] = results["points"]  # type: ignore[assignment]
    labels = sorted({str(p["cell"]) for p in pts})
    loads: list[float] = sorted({float(p["load"]) for p in pts})  # type: ignore[arg-type]
    grid = [[0.0] * len(loads) for _ in labels]
    for p in pts:
        grid[labels.index(str(p["cell"]))][loads.index(float(p["load"]))] = float(p["margin"]) * 100  # type: ignore[arg-type]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(labels) + 1.5))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=-10, vmax=10, aspect="auto")
    ax.set_xticks(range(len(loads)), [f"x{load:g}" for load in loads])
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:+.1f}", ha="center", va="center", fontsize=5)
    ax.set_xlabel("load (x the fleet's estimated capacity)")
    ax.set_title("adaptive minus the best fixed rule, points of SLO attainment")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
