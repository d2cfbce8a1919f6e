"""`specgate plan`: the split of N replicas between the speculative and the plain pool that serves
a traffic best, from every split simulated with the routing policy.

    specgate plan --trace FILE --replicas N --slo-ttft-ms T --slo-tpot-ms P
                  [--profile NAME | --profile-file FILE] [--price-per-hour USD]
                  [--policy adaptive] [--rate-scale 1] [--max-requests 2000]
                  [--json FILE|-] [--plot FILE] [--jobs J]

Prints a table (SLO attainment, goodput, TTFT and TPOT p50/p99, tokens a second, and with a price
the cost per million tokens, all and of requests that met their SLOs) and the recommended split.
One process per split, every core by default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES, get_profile
from specgate.cli.arguments import Subcommands, common_options, positive_float, positive_int


def add_command(sub: Subcommands) -> None:
    p = sub.add_parser("plan", parents=[common_options("warning")], help="the best split of a fleet for a traffic",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--trace", type=Path, required=True, help="Azure LLM trace CSV, or timestamp_s,input_tokens,output_tokens"
    )
    p.add_argument("--replicas", type=positive_int, required=True, help="replicas in the fleet, both pools")
    p.add_argument("--slo-ttft-ms", type=positive_float, required=True)
    p.add_argument("--slo-tpot-ms", type=positive_float, required=True)
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"one of {', '.join(PROFILES)}")
    p.add_argument("--profile-file", type=Path, metavar="FILE", help="a profile from a file (specgate calibrate)")
    p.add_argument("--price-per-hour", type=positive_float, metavar="USD", help="what a replica costs an hour")
    p.add_argument("--policy", default="adaptive", help="the routing policy, as `bench offline --policies` names one")
    p.add_argument(
        "--rate-scale", type=positive_float, default=1.0, help="the trace's requests this many times as fast"
    )
    p.add_argument("--max-requests", type=positive_int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warm-up", action="store_true", help="replay the trace back to back and report the second "
        "round (a short trace met by a fleet it keeps loaded while it finishes, not an idle one)",
    )  # fmt: skip
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument(
        "--json", metavar="FILE", help="write every split's figures here (-: to stdout, instead of the table)"
    )
    p.add_argument("--plot", type=Path, metavar="FILE", help="write a plot (PNG) here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specgate.bench.offline import policy_document
    from specgate.bench.plan import PlanSettings, plan, plot, table
    from specgate.bench.traces import TraceError
    from specgate.calibration import profile_file

    try:
        profile = profile_file.load(args.profile_file).profile if args.profile_file else get_profile(args.profile)
        policy_document(args.policy, profile.name, {**PROFILES, profile.name: profile})
    except (KeyError, ValueError) as exc:  # an unknown profile or policy, a profile file that is not one
        print(f"specgate plan: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    settings = PlanSettings(
        trace=args.trace, replicas=args.replicas, profile=profile, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, price_per_hour=args.price_per_hour, policy=args.policy,
        rate_scale=args.rate_scale, max_requests=args.max_requests, seed=args.seed, jobs=args.jobs,
        warm_up=args.warm_up,
    )  # fmt: skip
    try:
        results = plan(settings)
    except (OSError, TraceError, ValueError) as exc:
        print(f"specgate plan: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(results))
    else:
        print(table(results))
        chosen = next(r for r in results["splits"] if r["speculative"] == results["recommended"])
        print(f"recommended: {chosen['fleet']} (SLO attainment {chosen['slo_attainment']:.3f})")
    if args.json and args.json != "-":
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0
