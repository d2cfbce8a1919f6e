"""`specgate bench overload`: how long an overload lasts, against which policy meets the most SLOs.

Past its capacity a fleet cannot meet every request's SLOs, and which policy meets the most depends
on how long the overload lasts. A fixed rule sends every request at once. A storm shorter than the
answers it lands on is absorbed: its prefills stall the steps of answers that go on decoding after
it, and a TPOT is a mean over the whole answer. A sustained overload grows the replicas' queues
without end, and every TTFT with them. The adaptive policy prices each request as if a storm went
on about as long again as it has lasted (the replicas' recent rates of arriving prompts, then the
rates from before the storm), holds what it predicts cannot meet its targets, and refuses it when
its TTFT target has passed.

Each cell runs at each load for several durations: the cell's trace (`bench.grid`) over that many
seconds at that load, on an idle fleet. The requests arriving in the middle third are counted: a
third of the duration loads the fleet before them, and a third keeps it loaded after. Every policy
routes the same requests. Per point, the adaptive policy's margin to the best fixed rule. Writes
results.json, report.md and overload.png to `--out`.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specgate.bench.grid import ADAPTIVE, FIXED, Cell, capacity_rps, loaded, scenario, traffic
from specgate.bench.offline import simulate
from specgate.bench.outputs import in_parallel, write
from specgate.calibration.profiles import PROFILES

TRACES = Path("../shared/traces/azure_llm_2023")
CELLS = (Cell(profile="h100-llama31-8b"), Cell())
"""The kept-up grid's worst cell (conversation, SLO 2000/50, 2+2 H100 Llama 3.1 8B) and the grid's
base cell (the same on the A100 CodeLlama 34B)."""
LOADS = (2.0, 4.0)
DURATIONS_S = (5.0, 10.0, 20.0, 40.0)
PROBE_REQUESTS = 1000
"""Requests whose mean prompt and answer size the fleet's capacity (`capacity_rps`)."""


@dataclass(frozen=True)
class Job:
    cell: Cell
    load: float
    duration_s: float
    policy: str
    seed: int
    traces: str


def run(job: Job) -> dict[str, Any]:
    path = Path(job.traces) / f"AzureLLMInferenceTrace_{job.cell.trace}.csv"
    probe = traffic(job.cell, path, PROBE_REQUESTS, job.seed)
    rate = job.load * capacity_rps(PROFILES[job.cell.profile], job.cell.fleet, probe, job.cell.slo[1])
    trace = loaded(job.cell, path, math.ceil(job.duration_s * rate) + 1, job.seed, job.load)
    start = trace[0].arrival_s
    span = trace[-1].arrival_s - start
    result = simulate(trace, scenario(job.cell, job.policy, job.seed)).between(start + span / 3, start + 2 * span / 3)
    return {"cell": job.cell.label, "load": job.load, "duration_s": job.duration_s, "span_s": span,
            "policy": job.policy, **result.summary()}  # fmt: skip


def points(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell, load and duration: every policy's attainment, the best fixed rule and the margin."""
    by_point: dict[tuple[str, float, float], dict[str, float]] = {}
    for r in runs:
        by_point.setdefault((r["cell"], r["load"], r["duration_s"]), {})[r["policy"]] = r["slo_attainment"]
    out = []
    for (cell, load, duration), attained in sorted(by_point.items()):
        fixed = {p: a for p, a in attained.items() if p != ADAPTIVE}
        best = max(fixed, key=lambda p: fixed[p]) if fixed else None
        margin = (attained[ADAPTIVE] - fixed[best]) * 100 if best is not None and ADAPTIVE in attained else None
        out.append({"cell": cell, "load": load, "duration_s": duration, "attainment": attained,
                    "best_fixed": best, "margin": margin})  # fmt: skip
    return out


def report(results: dict[str, Any], command: str) -> str:
    policies: list[str] = results["policies"]
    lines = [
        "# How long the overload lasts", "", f"`{command}`", "",
        "SLO attainment of the requests arriving in the middle third of each run (the trace at that load "
        "for that many seconds on an idle fleet); margin: adaptive less the best fixed rule, in points.", "",
    ]  # fmt: skip
    cells = dict.fromkeys((p["cell"], p["load"]) for p in results["points"])
    for cell, load in cells:
        lines += [f"## {cell}, load {load:g}", "",
                  f"| seconds | {' | '.join(policies)} | best fixed rule | margin |",
                  "|---" * (len(policies) + 3) + "|"]  # fmt: skip
        for p in results["points"]:
            if (p["cell"], p["load"]) != (cell, load):
                continue
            shown = " | ".join(f"{p['attainment'][name]:.3f}" if name in p["attainment"] else "-" for name in policies)
            margin = f"{p['margin']:+.1f}" if p["margin"] is not None else "-"
            lines.append(f"| {p['duration_s']:g} | {shown} | {p['best_fixed'] or '-'} | {margin} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((p["cell"], p["load"]) for p in results["points"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (cell, load) in zip(axes[0], panels, strict=True):
        mine = [p for p in results["points"] if (p["cell"], p["load"]) == (cell, load)]
        for name in results["policies"]:
            xs = [p["duration_s"] for p in mine if name in p["attainment"]]
            ax.plot(xs, [p["attainment"][name] for p in mine if name in p["attainment"]], marker="o",
                    label=name, linewidth=2.5 if name == ADAPTIVE else 1.0)  # fmt: skip
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(results["durations_s"], [f"{d:g}" for d in results["durations_s"]])
        ax.set_xlabel("seconds of overload")
        ax.set_ylabel("SLO attainment")
        ax.set_title(f"{' '.join(cell.split()[-2:])}, load {load:g}", fontsize=9)
        ax.set_ylim(0, 1)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench overload") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder of the Azure LLM trace CSVs")
    parser.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS), help="against the fleet's capacity")
    parser.add_argument("--durations", default=",".join(f"{x:g}" for x in DURATIONS_S), help="seconds of overload")
    parser.add_argument("--policies", default=",".join((ADAPTIVE, *FIXED)), help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="the first cell only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/overload"))
    args = parser.parse_args(argv)
    logging.getLogger("specgate").setLevel(logging.WARNING)  # (each simulated replica says it is up)
    command = " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
    policies = [p for p in args.policies.split(",") if p]
    loads = [float(x) for x in args.loads.split(",") if x]
    durations = [float(x) for x in args.durations.split(",") if x]
    cells = CELLS[:1] if args.quick else CELLS
    todo = [Job(c, load, d, p, args.seed, str(args.traces)) for c in cells for load in loads for d in durations
            for p in policies]  # fmt: skip
    todo.sort(key=lambda j: -j.load * j.duration_s * (10 if j.policy == ADAPTIVE else 1))  # the longest first
    runs = in_parallel(run, todo, args.jobs)
    results = {"policies": policies, "loads": loads, "durations_s": durations, "seed": args.seed,
               "cells": [asdict(c) for c in cells], "runs": runs, "points": points(runs)}  # fmt: skip
    write(args.out, "results", results, report(results, command), report_name="report")
    plot(results, args.out / "overload.png")
    return 0
