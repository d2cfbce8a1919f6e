"""`specgate sim`: one simulated vLLM replica, speaking vLLM's HTTP API and metrics."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES, SOURCES, get_profile
from specgate.cli.arguments import Subcommands, common_options, fraction, positive_float, positive_int
from specgate.cli.running import run_until_signalled


def add_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "sim",
        parents=[common_options()],
        help="run one simulated vLLM replica",
        description="A calibrated model of a vLLM server, speaking vLLM's HTTP API and metrics.",
    )
    p.add_argument("--mode", choices=[m.value for m in Pool], default=Pool.PLAIN.value)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    p.add_argument("--model", help="served model name (default: the profile's model)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"one of: {', '.join(PROFILES)}")
    p.add_argument("--profile-file", type=Path, action="append", default=[], metavar="FILE",
                   help="a profile from a file; given once, the replica runs it")  # fmt: skip
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="run the clock S times faster")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    p.add_argument("--kv-capacity-tokens", type=positive_int, help="override the profile's KV token slots")
    p.add_argument("--num-speculative-tokens", type=positive_int, help="override the profile's k")
    p.add_argument("--acceptance", type=fraction, help="override the profile's mean acceptance rate")
    p.add_argument("--list-profiles", action="store_true", help="print the profiles and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specgate.calibration import profile_file
    from specgate.validation import Invalid

    try:
        files, _ = profile_file.load_all(args.profile_file)
    except Invalid as exc:
        print(f"specgate sim: --profile-file {exc}", file=sys.stderr)
        return 2
    if args.list_profiles:
        print("\n\n".join([*(p.describe() for p in PROFILES.values()), *(f.describe() for f in files)]))
        print("\nsources:")
        print("\n".join(f"  {key}: {text}" for key, text in SOURCES.items()))
        return 0
    if len(files) > 1:
        print("specgate sim: one --profile-file at most: a replica has one profile", file=sys.stderr)
        return 2
    import prometheus_client

    from specgate.sim.engine import EngineConfig, kv_blocks
    from specgate.sim.realtime import SimSettings
    from specgate.sim.server import serve

    # vLLM turns off the `_created` series for its whole process; the replica matches it.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

    try:
        profile = files[0].profile if files else get_profile(args.profile)
        settings = SimSettings(
            mode=Pool(args.mode),
            profile=profile,
            model=args.model or profile.model,
            host=args.host,
            port=args.port,
            time_scale=args.time_scale,
            seed=args.seed,
            engine=EngineConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                kv_capacity_tokens=args.kv_capacity_tokens,
                num_speculative_tokens=args.num_speculative_tokens,
                acceptance_mean=args.acceptance,
            ),
        )
        kv_blocks(settings.profile, settings.mode, settings.engine)
    except (KeyError, ValueError) as exc:
        print(f"specgate sim: {exc.args[0]}", file=sys.stderr)
        return 2

    def ready(url: str) -> None:
        print(
            f"specgate sim: {settings.mode.value} replica of {settings.model} "
            f"(profile {profile.name}, time scale {settings.time_scale:g}) listening on {url}",
            flush=True,
        )

    run_until_signalled(lambda: serve(settings, on_ready=ready))
    return 0
