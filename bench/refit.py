"""`specgate bench refit`: a gateway whose profile is of other hardware learns its replicas' costs.

The replicas run a built-in profile on other hardware (`Profile.elsewhere`: twice as slow, twice
as fast, or off in shape: decoding 1.5x, prefill 0.6x, the CPU time per step 3x); the adaptive
policy predicts with the built-in profile as it is. Each run replays the Azure conversation trace
on a 2+2 fleet at a load against the replicas' own capacity, with SLOs in proportion to their
speed, three ways on the same requests: the policy predicting with the profile as it is, frozen
(nothing learned); the same, re-fitting each pool's step costs online (`workers/latency_fit.py`);
and an oracle predicting with the replicas' true profile (re-fitting too). Per run: SLO attainment,
and how far predictions were off (median |log(measured / predicted)| of TTFT and TPOT) for the
first 100 requests and for those that arrived from 60% to 90% of the way through the trace.

    specgate bench refit [--trace FILE] [--requests 1500] [--loads 0.5,1] [--out docs/bench/refit]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specgate.bench.grid import capacity_rps
from specgate.bench.offline import Fleetspec, Scenario, Served, simulate
from specgate.bench.outputs import in_parallel, write
from specgate.bench.traces import read_trace, scaled
from specgate.calibration.profiles import PROFILES

TRACE = Path("../shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv")
BASE_SLO = (2000.0, 50.0)
FLEET = (2, 2)
FIRST = 100
LATE = (0.6, 0.9)
"""The requests whose answers show what was learned: those that arrived in this span of the trace
(not its end, where arrivals stop and the rates the model sees fall away under the requests)."""
BELIEFS = ("frozen", "refitted", "oracle")


@dataclass(frozen=True)
class Hardware:
    """The replicas' hardware against the profile's: how much dearer each part of a step is."""

    name: str
    decode: float
    prefill: float
    fixed: float

    @property
    def slower(self) -> float:
        """How much slower the replicas are, for their SLOs: their decoding."""
        return self.decode


HARDWARE = (
    Hardware("as profiled", 1.0, 1.0, 1.0),
    Hardware("2x slower", 2.0, 2.0, 2.0),
    Hardware("2x faster", 0.5, 0.5, 0.5),
    Hardware("other shape", 1.5, 0.6, 3.0),
)


@dataclass(frozen=True)
class Job:
    hardware: Hardware
    load: float
    belief: str
    profile: str
    requests: int
    trace: str
    seed: int


def off(served: Sequence[Served]) -> dict[str, float]:
    """Median |log(measured / predicted)| of TTFT and TPOT."""
    out = {}
    for kind in ("ttft", "tpot"):
        logs = []
        for s in served:
            if kind == "ttft":
                measured: float | None = (s.ttft_s - s.held_s) * 1e3  # the replica's, as predicted
            else:
                measured = s.tpot_s * 1e3 if s.tpot_s is not None else None
            predicted = s.predicted_ttft_ms if kind == "ttft" else s.predicted_tpot_ms
            if measured and predicted:
                logs.append(abs(math.log(measured / predicted)))
        out[kind] = statistics.median(logs) if logs else float("nan")
    return out


def late(served: Sequence[Served]) -> list[Served]:
    start, end = min(s.arrival_s for s in served), max(s.arrival_s for s in served)
    low, high = (start + share * (end - start) for share in LATE)
    return [s for s in served if low <= s.arrival_s < high]


def run(job: Job) -> dict[str, object]:
    profile = PROFILES[job.profile]
    h = job.hardware
    truth = profile.elsewhere(f"{profile.name}-{h.name.replace(' ', '-')}", h.decode, h.prefill, h.fixed)
    trace = read_trace(Path(job.trace), limit=job.requests)
    span = max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9)
    ttft, tpot = (target * h.slower for target in BASE_SLO)
    rate = job.load * capacity_rps(truth, FLEET, trace, tpot)
    believed = truth if job.belief == "oracle" else profile
    scenario = Scenario(truth, Fleetspec(*FLEET), "adaptive", ttft, tpot, seed=job.seed, believed=believed,
                        refit=job.belief != "frozen")  # fmt: skip
    result = simulate(scaled(trace, rate * span / len(trace)), scenario)
    summary = result.summary()
    return {
        "hardware": h.name,
        "load": job.load,
        "belief": job.belief,
        "slo_ms": [ttft, tpot],
        "slo_attainment": summary["slo_attainment"],
        "off_first": off(sorted(result.served, key=lambda s: s.arrival_s)[:FIRST]),
        "off_late": off(late(result.served)),
        "scales": {pool.value: vars(scales) for pool, scales in result.scales.items()},
    }


def report(results: dict[str, object]) -> str:
    runs: list[dict[str, object]] = results["runs"]  # type: ignore[assignment]
    by = {(r["hardware"], r["load"], r["belief"]): r for r in runs}
    lines = [
        "# Step costs re-fitted online: a profile of other hardware",
        "",
        f"`{results['command']}`",
        "",
        f"Azure conversation trace, {results['requests']} requests a run, {FLEET[0]}+{FLEET[1]} fleet, the adaptive "
        f"policy predicting with `{results['profile']}`; the replicas run it on other hardware. SLOs "
        f"{BASE_SLO[0]:g}/{BASE_SLO[1]:g} ms times the replicas' slowdown; load against their capacity. "
        "Prediction error: median |log(measured / predicted)| (0.69 is a factor of 2), of the first "
        f"{FIRST} requests -> of those arriving {LATE[0]:.0%}-{LATE[1]:.0%} of the way through.",
        "",
        "| replicas | load | attainment frozen | refitted | oracle | TTFT off (refitted) "
        "| TPOT off (refitted) | TTFT, TPOT off late (frozen) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for h in HARDWARE:
        for load in results["loads"]:  # type: ignore[attr-defined]
            frozen, refit, oracle = (by[(h.name, load, b)] for b in BELIEFS)
            first, last, still = refit["off_first"], refit["off_late"], frozen["off_late"]
            lines.append(
                f"| {h.name} | {load:g} | {frozen['slo_attainment']:.3f} | {refit['slo_attainment']:.3f} | "
                f"{oracle['slo_attainment']:.3f} | {first['ttft']:.2f} -> {last['ttft']:.2f} | "  # type: ignore[index]
                f"{first['tpot']:.2f} -> {last['tpot']:.2f} | {still['ttft']:.2f}, {still['tpot']:.2f} |"  # type: ignore[index]
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench refit") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="h100-llama31-8b")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--loads", type=lambda t: [float(v) for v in t.split(",")], default=[0.5, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/refit"))
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}")
    jobs = [Job(h, load, belief, args.profile, args.requests, str(args.trace), args.seed)
            for h in HARDWARE for load in args.loads for belief in BELIEFS]  # fmt: skip
    runs = in_parallel(run, jobs, args.jobs)
    command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)]).strip()
    results: dict[str, object] = {
        "command": command, "profile": args.profile, "requests": args.requests, "loads": args.loads, "runs": runs,
    }  # fmt: skip
    write(args.out, "results", results, report(results), "report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
