"""`specgate calibrate`: a profile measured on the user's own vLLM servers.

    specgate calibrate --url URL [--url URL ...] --out FILE [--quick] [--name NAME]
                       [--base-profile NAME] [--time-scale S]

Drives the servers through a designed sweep (prompt lengths, batch sizes, contexts, fixed output
lengths), fits the engine's step costs, the draft's and the acceptance, prints each term with its
error and writes a profile file that `specgate serve|sim|bench offline --profile-file` read. Give
a plain and a speculative server of the same model for a whole profile; what is not measured
comes from --base-profile. --quick takes well under a minute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES, get_profile
from specgate.cli.arguments import Subcommands, common_options, positive_float


def add_command(sub: Subcommands) -> None:
    p = sub.add_parser("calibrate", parents=[common_options("warning")], help="a profile measured on your servers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--url", action="append", required=True, help="a running vLLM server (or specgate sim)")
    p.add_argument("--out", type=Path, required=True, help="the profile file to write")
    p.add_argument("--quick", action="store_true", help="a short sweep (well under a minute)")
    p.add_argument("--name", default="calibrated", help="the profile's name, for policy documents to use")
    p.add_argument("--base-profile", default=DEFAULT_PROFILE, help=f"for what is not measured: {', '.join(PROFILES)}")
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="the servers' --time-scale (specgate sim)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from specgate.bench.calibrate import FULL, QUICK, CalibrationError, calibrate, progress_bar
    from specgate.calibration import profile_file
    from specgate.validation import Invalid, ProfileName, convert

    try:
        base = get_profile(args.base_profile)
        convert(args.name, ProfileName, root="--name")
        if args.name in PROFILES:
            raise Invalid("--name", f"{args.name!r} is a built-in profile's name")
    except (KeyError, Invalid) as exc:
        print(f"specgate calibrate: {exc.args[0]}", file=sys.stderr)
        return 2
    sweep = QUICK if args.quick else FULL
    try:
        result = asyncio.run(calibrate(args.url, sweep, base, args.name, args.time_scale, args.seed, progress_bar))
    except (CalibrationError, ValueError, OSError) as exc:
        print(f"\nspecgate calibrate: {exc}", file=sys.stderr)
        return 1
    print(file=sys.stderr)
    f = result.file
    args.out.write_bytes(profile_file.dumps(f.profile, f.source, f.created))
    print(result.report())
    print(f"specgate calibrate: wrote {args.out}")
    return 0
