"""`specgate bench herd`: one gateway against three and six in front of the same fleet, in the
offline simulator.

A gateway knows its own dispatches at once and everyone else's only at its next scrape of the
replicas. Several gateways behind a load balancer (each request reaching the next in turn) each
see a fraction of what the fleet is asked, and between scrapes they can all send to the replica
that looked idle: the herd effect. Each gateway here has its own accounting, scrapes at moments of
its own, its own step-cost fits, learned lengths and admission queue, as separate processes do.
Measured with each gateway counting its requests as its share of the fleet's (`workers.pools.Share`,
the default without a Redis), counting only its own (the gateway before it), counting every
gateway's as they are sent through shared counts (`workers.shared`, as the processes of one
`specgate serve --workers` gateway do), and as last exchanged through a Redis (`gateway/exchange.py`,
the default with one), on grid cells (`bench.grid`) at three loads and several seeds: the
adaptive policy's SLO attainment, and its difference to one gateway, per point and on average.

With `--http`, the same over HTTP: 1, 3 and 6 `specgate serve` processes in front of 2+2
`specgate sim` replicas (the base cell's fleet and profile, in real time), a slice of the
conversation trace replayed by the client in turn through each gateway (`bench.replay`), at about
the fleet's capacity; 3 and 6 each counting their share, and sharing a Redis through which they
exchange their counts (`gateway/exchange.py`). With `--workers`, one gateway of 1 and of 4
processes on one port (`specgate serve --workers 4`, counting each other's requests through shared
memory) in front of the same fleet, over HTTP likewise. Single runs in real time on a shared machine
move by a few points: `--rounds N` runs every configuration once a round, on a trace window of
its own (round r, seed r), and reports each one's medians and its difference to one gateway in
the same round. Writes results.json and report.md (http.json, http.md; workers.json, workers.md)
to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from specgate.bench.grid import Cell, loaded, scenario
from specgate.bench.offline import simulate
from specgate.bench.outputs import in_parallel, write
from specgate.bench.replay import ReplaySettings, replay
from specgate.calibration.modes import Pool
from specgate.gateway.exchange import ExchangeSettings
from specgate.testing import RedisServer, free_port, gateway_config, start_sim, stop_process
from specgate.workers import launch

TRACES = Path("../shared/traces/azure_llm_2023")
CELLS = (
    Cell(),
    Cell(arrivals="storms", classes=True, slo=(800.0, 60.0)),
    Cell(fleet=(4, 4)),
    Cell(trace="code", fleet=(6, 2), profile="h100-llama31-8b"),
)
LOADS = (0.5, 1.0, 2.0)
GATEWAYS = (1, 3, 6)
PROCESSES = (1, 4)
COUNTING = ("shared", "exchange", "share", "own")
"""How a gateway counts the requests on a replica: with every other gateway's as they are sent
(shared counts, as the processes of one gateway keep them), with every other gateway's as last
exchanged (as often as a gateway does by default, through the policy's Redis), its own as its
share of the fleet's, or its own alone."""
EXCHANGE_S = ExchangeSettings().interval_s


@dataclass(frozen=True)
class Job:
    cell: Cell
    load: float
    gateways: int
    counting: str
    policy: str
    seed: int
    requests: int
    traces: str


def trace_path(traces: Path, cell: Cell) -> Path:
    return traces / f"AzureLLMInferenceTrace_{cell.trace}.csv"


def run(job: Job) -> dict[str, Any]:
    trace = loaded(job.cell, trace_path(Path(job.traces), job.cell), job.requests, job.seed, job.load)
    setting = replace(scenario(job.cell, job.policy, job.seed), gateways=job.gateways,
                      count_share=job.counting != "own", shared_counts=job.counting == "shared",
                      exchange_s=EXCHANGE_S if job.counting == "exchange" else None)  # fmt: skip
    summary = simulate(trace, setting).summary()
    return {"cell": job.cell.label, "load": job.load, "gateways": job.gateways, "counting": job.counting,
            "policy": job.policy, "seed": job.seed, **summary}  # fmt: skip


def jobs(requests: int, seeds: int, policies: Sequence[str], traces: Path, quick: bool = False) -> list[Job]:
    cells = CELLS[:1] if quick else CELLS
    out = []
    for cell in cells:
        for load in LOADS:
            for seed in range(seeds):
                for policy in policies:
                    out.append(Job(cell, load, 1, "share", policy, seed, requests, str(traces)))
                    for n in GATEWAYS[1:]:
                        out += [Job(cell, load, n, c, policy, seed, requests, str(traces)) for c in COUNTING]
    return out


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell, load, policy, gateways and counting: attainment over the seeds, and its
    difference to one gateway's (seed by seed, then averaged)."""
    one = {(r["cell"], r["load"], r["policy"], r["seed"]): r["slo_attainment"] for r in runs if r["gateways"] == 1}
    groups: dict[tuple[str, float, str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["cell"], r["load"], r["policy"], r["gateways"], r["counting"]), []).append(r)
    rows = []
    for (cell, load, policy, gateways, counting), rs in groups.items():
        diffs = [r["slo_attainment"] - one[(cell, load, policy, r["seed"])] for r in rs]
        rows.append({"cell": cell, "load": load, "policy": policy, "gateways": gateways, "counting": counting,
                     "slo_attainment": statistics.fmean(r["slo_attainment"] for r in rs),
                     "to_one_gateway": statistics.fmean(diffs), "seeds": len(rs)})  # fmt: skip
    return rows


def report(results: dict[str, Any], command: str) -> str:
    rows = results["rows"]
    lines = [
        "# Many gateways in front of one fleet",
        "",
        f"`{command}`",
        "",
        f"{results['requests']} requests a run, {results['seeds']} seeds; loads against each cell's capacity "
        "within its TPOT target. Attainment difference to one gateway in points (seed by seed, then the mean).",
        "",
    ]
    for policy in results["policies"]:
        lines += [f"## {policy}", "", "| counting | gateways | mean difference | worst point |", "|---|---|---|---|"]
        for counting in COUNTING:
            for n in GATEWAYS[1:]:
                mine = [r for r in rows if (r["policy"], r["gateways"], r["counting"]) == (policy, n, counting)]
                if mine:
                    mean = statistics.fmean(r["to_one_gateway"] for r in mine) * 100
                    worst = min(mine, key=lambda r: r["to_one_gateway"])
                    where = f"{worst['cell']}, load {worst['load']:g}"
                    lines.append(f"| {counting} | {n} | {mean:+.1f} | {worst['to_one_gateway'] * 100:+.1f} ({where}) |")
        lines += ["", "| cell | load | 1 gateway | " + " | ".join(f"{c} x{n}" for c in COUNTING for n in GATEWAYS[1:])
                  + " |", "|---|---|---|" + "---|" * (len(COUNTING) * (len(GATEWAYS) - 1))]  # fmt: skip
        points = dict.fromkeys((r["cell"], r["load"]) for r in rows if r["policy"] == policy)
        for cell, load in points:
            at = {
                (r["gateways"], r["counting"]): r
                for r in rows
                if (r["cell"], r["load"], r["policy"]) == (cell, load, policy)
            }
            cells = [f"{at[(n, c)]['to_one_gateway'] * 100:+.1f}" for c in COUNTING for n in GATEWAYS[1:]]
            lines.append(
                f"| {cell} | {load:g} | {at[(1, 'share')]['slo_attainment']:.3f} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    return "\n".join(lines)


MODEL = "herd-model"


async def over_http(
    cell: Cell, gateways: int, requests: int, load: float, traces: Path, folder: Path, processes: int = 1,
    exchange: bool = False, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """One run through `gateways` gateways of `processes` processes each in front of simulated
    replicas (logs in `folder`); with `exchange`, the gateways share a Redis (policy and counts);
    `seed` picks the trace's window and the replicas' draws."""
    trace = loaded(cell, trace_path(traces, cell), requests, seed, load)
    modes = [Pool.SPECULATIVE] * cell.fleet[0] + [Pool.PLAIN] * cell.fleet[1]
    sims = []
    procs = []
    redis = RedisServer(free_port(), folder) if exchange else None
    try:
        store = ""
        if redis is not None:
            await asyncio.to_thread(redis.start)
            store = f'[store]\nurl = "{redis.url}"\n'
        for i, mode in enumerate(modes):
            sims.append(await asyncio.to_thread(
                start_sim, folder / f"sim-{i}.log", "--port", "0", "--mode", mode.value, "--profile", cell.profile,
                "--model", MODEL, "--seed", str(seed * len(modes) + i),
            ))  # fmt: skip
        pools = {pool: [s.url for s, m in zip(sims, modes, strict=True) if m is pool] for pool in Pool}
        config = await asyncio.to_thread(
            gateway_config, folder / "gateway.toml", MODEL, pools[Pool.SPECULATIVE], pools[Pool.PLAIN],
            f'{store}[policy]\npolicy = "adaptive"\nprofile = "{cell.profile}"\n',
        )  # fmt: skip
        argv = launch.specgate_argv("serve", "--config", str(config), "--port", "0", "--workers", str(processes))
        for g in range(gateways):
            procs.append(launch.spawn(argv, folder / f"gateway-{g}.log"))
        urls = [await launch.wait_ready(p, folder / f"gateway-{g}.log") for g, p in enumerate(procs)]
        settings = ReplaySettings(urls[0], MODEL, 1.0, cell.slo[0], cell.slo[1], more_gateways=tuple(urls[1:]))
        result, failed = await replay(trace, settings)
    finally:
        for p in procs:
            await launch.terminate(p)
        for s in sims:
            await asyncio.to_thread(stop_process, s.proc)
        if redis is not None:
            redis.stop()
    return {"cell": cell.label, "load": load, "gateways": gateways, "processes": processes, "seed": seed,
            "counting": "exchange" if exchange else "share", **result.summary(), "failed": failed}  # fmt: skip


def http_report(runs: Sequence[dict[str, Any]], command: str, by: str = "gateways") -> str:
    """The runs side by side, by number of `gateways` (in turn) or of `processes` (of one gateway).
    Run in several rounds (a trace window each, `seed`), each configuration gives the median over
    the rounds of its attainment and of its difference to one gateway (or process) in the same
    round, then each round's, and the median of its p99s; one round, its run's figures."""
    first = runs[0]
    how = "in turn through each gateway" if by == "gateways" else "through one gateway of that many processes"
    seeds = sorted({r.get("seed", 0) for r in runs})
    one = {r.get("seed", 0): r["slo_attainment"] for r in runs if r[by] == 1}
    configs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in runs:
        configs.setdefault((r[by], r["counting"] if r[by] > 1 else "-"), []).append(r)
    rounds = f" in {len(seeds)} rounds (trace windows {', '.join(map(str, seeds))}), medians first"
    lines = [
        f"# Many {by} in front of one fleet, over HTTP", "", f"`{command}`", "",
        f"{first['cell']}, load {first['load']:g}, {first['requests']} requests replayed in real time, {how}"
        f"{rounds if len(seeds) > 1 else ''}.", "",
        f"| {by} |{' counting |' if by == 'gateways' else ''} SLO attainment | difference to one | TTFT p99 ms "
        "| TPOT p99 ms | failed |",
        "|---|---|---|---|---|---|" + ("---|" if by == "gateways" else ""),
    ]  # fmt: skip
    for (n, counting), group in configs.items():
        attained = [r["slo_attainment"] for r in group]
        to_one = [(r["slo_attainment"] - one[r.get("seed", 0)]) * 100 for r in group]
        shown_attained, shown_to_one = f"{statistics.median(attained):.3f}", f"{statistics.median(to_one):+.1f}"
        if len(group) > 1:
            shown_attained += f" ({', '.join(f'{a:.3f}' for a in attained)})"
            shown_to_one += f" ({', '.join(f'{d:+.1f}' for d in to_one)})"
        ttft = statistics.median(r["ttft_p99_ms"] for r in group)
        tpot = statistics.median(r["tpot_p99_ms"] for r in group)
        failed = sum(r["failed"] for r in group)
        shown_counting = f" {counting} |" if by == "gateways" else ""
        lines.append(f"| {n} |{shown_counting} {shown_attained} | {shown_to_one} | {ttft:.0f} | {tpot:.1f} "
                     f"| {failed} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench herd") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--traces", type=Path, default=TRACES, help="folder of the Azure LLM trace CSVs")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--policies", default="adaptive,least-loaded", help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="the base cell only")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/herd"))
    parser.add_argument("--http", action="store_true", help="over HTTP with gateway processes, not offline")
    parser.add_argument("--workers", action="store_true", help="over HTTP: one gateway of 1 and of 4 processes")
    parser.add_argument("--load", type=float, default=1.0, help="--http, --workers: against the fleet's capacity")
    parser.add_argument("--gateways", default="1,3,6", help="--http: comma-separated gateway counts (1 among them)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="--http, --workers: each configuration once a round, on a window of its own",
    )
    args = parser.parse_args(argv)
    logging.getLogger("specgate").setLevel(logging.WARNING)
    command = " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
    rounds = range(max(args.rounds, 1))
    if args.workers:
        runs = []
        for seed in rounds:  # a configuration after another, round after round: the machine's drift spread over all
            for n in PROCESSES:
                logs = Path("logs") / "herd-workers" / f"x{n}-{seed}"  # (gitignored)
                logs.mkdir(parents=True, exist_ok=True)
                runs.append(asyncio.run(over_http(CELLS[0], 1, args.requests, args.load, args.traces, logs, n,
                                                  seed=seed)))  # fmt: skip
                print(f"round {seed}, {n} process(es): {runs[-1]['slo_attainment']:.3f}", file=sys.stderr)
        write(args.out, "workers", runs, http_report(runs, command, by="processes"))
        return 0
    if args.http:
        runs = []
        counts = sorted({1, *(int(n) for n in args.gateways.split(",") if n)})
        for seed in rounds:
            for n, exchange in [(1, False), *((n, e) for n in counts[1:] for e in (False, True))]:
                logs = Path("logs") / "herd-http" / f"x{n}-{'exchange' if exchange else 'share'}-{seed}"  # (gitignored)
                logs.mkdir(parents=True, exist_ok=True)
                runs.append(asyncio.run(over_http(CELLS[0], n, args.requests, args.load, args.traces, logs,
                                                  exchange=exchange, seed=seed)))  # fmt: skip
                print(f"round {seed}, {n} gateway(s), {runs[-1]['counting']}: {runs[-1]['slo_attainment']:.3f}",
                      file=sys.stderr)  # fmt: skip
        write(args.out, "http", runs, http_report(runs, command))
        return 0
    policies = [p for p in args.policies.split(",") if p]
    todo = jobs(args.requests, args.seeds, policies, args.traces, args.quick)
    todo.sort(key=lambda j: -j.load * j.gateways)
    runs = in_parallel(run, todo, args.jobs)
    results = {"requests": args.requests, "seeds": args.seeds, "policies": policies,
               "cells": [asdict(c) for c in (CELLS[:1] if args.quick else CELLS)], "runs": runs,
               "rows": summarize(runs)}  # fmt: skip
    write(args.out, "results", results, report(results, command), report_name="report")
    return 0
