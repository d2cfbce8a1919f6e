"""`specgate bench ...`: every benchmark, one subcommand each.

`offline` and `replay` compare policies on a trace (in the offline simulator, or through a running
gateway); `fidelity`, `overhead`, `policy-reload`, `real-vllm` and `soak` are the benchmarks of
`specgate.bench` with their own options (`specgate bench overhead --help`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from pathlib import Path

from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES, get_profile
from specgate.cli.arguments import Subcommands, common_options, float_list, positive_float, positive_int

MODULE_BENCHMARKS = {
    "daily": ("specgate.bench.daily", "fixed splits against a fleet that switches, over a day (docs/bench/daily)"),
    "herd": ("specgate.bench.herd", "one gateway against three and six in front of one fleet (docs/bench/herd)"),
    "overload": ("specgate.bench.overload", "how long an overload lasts, against each policy (docs/bench/overload)"),
    "fidelity": ("specgate.bench.fidelity", "the simulated replica against its sources (docs/fidelity.md)"),
    "cpu-fidelity": ("specgate.bench.cpu_fidelity", "calibrated simulation vs real CPU vLLM (docs/fidelity.md)"),
    "overhead": ("specgate.bench.overhead", "what the gateway adds over a direct path (docs/overhead.md)"),
    "policy-reload": ("specgate.bench.policy_reload", "policy changes reaching two gateways (docs/policy_reload.md)"),
    "real-vllm": ("specgate.bench.real_vllm", "the policies against real vLLM on this CPU (docs/real_vllm.md)"),
    "refit": ("specgate.bench.refit", "a profile of other hardware, re-fitted online (docs/bench/refit)"),
    "soak": ("specgate.bench.soak", "an hour of mixed traffic compressed: memory, fds, in flight (docs/soak.md)"),
}


def add_command(sub: Subcommands) -> None:
    bench = sub.add_parser("bench", help="benchmarks", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    commands = bench.add_subparsers(dest="bench", required=True)
    _add_offline(commands)
    _add_grid(commands)
    _add_replay(commands)
    for name, (module, help_text) in MODULE_BENCHMARKS.items():
        p = commands.add_parser(name, help=help_text, add_help=False)
        p.add_argument("passthrough", nargs=argparse.REMAINDER, help="the benchmark's own options (--help lists them)")
        p.set_defaults(func=_run_module, module=module, prog=f"specgate bench {name}")


def _run_module(args: argparse.Namespace) -> int:
    main = importlib.import_module(args.module).main
    result: int | None = main(args.passthrough, prog=args.prog)
    return result or 0


def _add_offline(commands: Subcommands) -> None:
    p = commands.add_parser(
        "offline",
        parents=[common_options("warning")],
        help="policies over a trace in the offline simulator",
        description="Every policy routes the same trace over the same simulated fleet at several loads.",
    )
    p.add_argument(
        "--trace", type=Path, required=True, help="Azure LLM trace CSV, or timestamp_s,input_tokens,output_tokens"
    )
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--profile-file", type=Path, metavar="FILE", help="a profile from a file, instead of --profile")
    p.add_argument("--spec-replicas", type=int, default=4)
    p.add_argument("--plain-replicas", type=int, default=4)
    p.add_argument(
        "--policies",
        default="adaptive,least-loaded,round-robin,threshold,speculative-only,plain-only",
        help="comma-separated; parameters after a colon, e.g. threshold:max_load=16",
    )
    p.add_argument("--rate-scale", type=float_list, default=(0.5, 1.0, 2.0, 4.0))
    p.add_argument("--slo-ttft-ms", type=positive_float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=positive_float, default=50.0)
    p.add_argument("--max-requests", type=positive_int, default=2000)
    p.add_argument("--hint", choices=["none", "exact"], default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.set_defaults(func=_run_offline)


def _run_offline(args: argparse.Namespace) -> int:
    from specgate.bench.offline import policy_document
    from specgate.bench.sweep import SweepSettings, run_sweep, write_outputs
    from specgate.bench.traces import TraceError
    from specgate.calibration import profile_file
    from specgate.validation import Invalid

    policies = tuple(p for p in args.policies.split(",") if p)
    if not policies:
        print("specgate bench: no policies given", file=sys.stderr)
        return 2
    try:
        profile = profile_file.load(args.profile_file).profile if args.profile_file else get_profile(args.profile)
    except Invalid as exc:
        print(f"specgate bench: --profile-file {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"specgate bench: {exc.args[0]}", file=sys.stderr)
        return 2
    try:
        for policy in policies:
            policy_document(policy, profile.name, {**PROFILES, profile.name: profile})
    except Invalid as exc:
        print(f"specgate bench: --policies {policy}: {exc}", file=sys.stderr)
        return 2
    except (KeyError, ValueError) as exc:
        print(f"specgate bench: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    if args.spec_replicas < 0 or args.plain_replicas < 0 or args.spec_replicas + args.plain_replicas < 1:
        print("specgate bench: the fleet needs at least one replica", file=sys.stderr)
        return 2
    settings = SweepSettings(
        trace=args.trace,
        profile=profile,
        spec_replicas=args.spec_replicas,
        plain_replicas=args.plain_replicas,
        policies=policies,
        rate_scales=args.rate_scale,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        max_requests=args.max_requests,
        hint=args.hint == "exact",
        seed=args.seed,
        out=args.out,
        jobs=args.jobs,
    )
    try:
        results = run_sweep(settings)
    except (KeyError, OSError, TraceError) as exc:
        print(f"specgate bench: {exc}", file=sys.stderr)
        return 2
    command = "specgate bench offline " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "specgate bench offline"
    write_outputs(results, args.out, command)
    print(f"specgate bench: wrote {args.out}/results.json, report.md and plots", file=sys.stderr)
    return 0


AZURE = Path("../shared/traces/azure_llm_2023")


def _add_grid(commands: Subcommands) -> None:
    p = commands.add_parser(
        "grid",
        parents=[common_options("warning")],
        help="the adaptive policy against every fixed rule over many traffics, fleets and SLOs",
        description="Cells of traffic shape, prompt mix, request classes, SLOs, fleet split and profile, "
        "each at several loads: the adaptive policy's margin to the best fixed rule at every point.",
    )
    p.add_argument("--conv", type=Path, default=AZURE / "AzureLLMInferenceTrace_conv.csv")
    p.add_argument("--code", type=Path, default=AZURE / "AzureLLMInferenceTrace_code.csv")
    p.add_argument("--loads", type=float_list, default=(0.25, 0.5, 1.0, 2.0, 4.0), help="x the fleet's capacity")
    p.add_argument("--requests", type=positive_int, default=400, help="requests per run")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="three cells: a smoke test in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--steady", action="store_true",
        help="each run's requests kept up (replayed back to back, the second round counted while the "
        "rounds after it keep coming), not from an idle fleet",
    )  # fmt: skip
    which.add_argument(
        "--held-out", action="store_true",
        help="only the cells drawn at random for --seed: with a seed other than the development ones (0, 1), "
        "traffic, fleets and SLOs the policy was not tuned to, in a minute or two",
    )  # fmt: skip
    p.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=Path("docs/bench/grid"))
    p.set_defaults(func=_run_grid)


def _run_grid(args: argparse.Namespace) -> int:
    from specgate.bench.grid import GridSettings, run_grid, write_outputs
    from specgate.bench.traces import TraceError

    settings = GridSettings(
        traces={"conv": args.conv, "code": args.code},
        loads=args.loads,
        requests=args.requests,
        seed=args.seed,
        quick=args.quick,
        jobs=args.jobs,
        steady=args.steady,
        held_out=args.held_out,
    )
    try:
        results = run_grid(settings)
    except (OSError, TraceError) as exc:
        print(f"specgate bench grid: {exc}", file=sys.stderr)
        return 2
    write_outputs(results, args.out, "specgate bench grid " + " ".join(sys.argv[3:]))
    print(f"specgate bench grid: wrote {args.out}/results.json, report.md and margin.png", file=sys.stderr)
    return 0


def _add_replay(commands: Subcommands) -> None:
    p = commands.add_parser(
        "replay",
        parents=[common_options("warning")],
        help="a trace through a running gateway, in real time",
        description="Send a trace through a gateway in real time and measure from the client side.",
    )
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--gateway", required=True, help="the gateway's base URL")
    p.add_argument("--rate-scale", type=positive_float, default=1.0)
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="the replicas' --time-scale")
    p.add_argument("--slo-ttft-ms", type=positive_float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=positive_float, default=50.0)
    p.add_argument("--max-requests", type=positive_int, default=500)
    p.add_argument("--hint", choices=["none", "exact"], default="none")
    p.add_argument("--label", default="gateway", help="the name of this run in the results")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.set_defaults(func=_run_replay)


def _run_replay(args: argparse.Namespace) -> int:
    import json

    import aiohttp

    from specgate.bench.replay import ReplaySettings, replay
    from specgate.bench.traces import TraceError, read_trace, scaled

    async def run() -> dict[str, object]:
        """The run's summary, in the shape of the offline simulator's runs."""
        trace = scaled(read_trace(args.trace, args.max_requests), args.rate_scale)
        async with aiohttp.ClientSession() as session, session.get(f"{args.gateway}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        settings = ReplaySettings(
            args.gateway.rstrip("/"), model, args.time_scale, args.slo_ttft_ms, args.slo_tpot_ms, args.hint == "exact"
        )
        result, failed = await replay(trace, settings)
        return {
            "policy": args.label,
            "fleet": "gateway",
            "rate_scale": args.rate_scale,
            **result.summary(),
            "failed": failed,
        }

    try:
        summary = asyncio.run(run())
    except (OSError, TraceError, aiohttp.ClientError, KeyError, ValueError) as exc:
        print(f"specgate bench replay: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"replay-{args.label}-x{args.rate_scale:g}.json"
    path.write_text(json.dumps({"trace": args.trace.name, "runs": [summary]}, indent=2))
    print(json.dumps(summary, indent=2))
    return 0
