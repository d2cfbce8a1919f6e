"""The `specgate` command line: one module per subcommand, each with its own `add_command`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specgate.cli import bench, calibrate, keys, plan, policy, pools, serve, sim
from specgate.cli.running import configure_logging

SUBCOMMANDS = (serve, sim, bench, calibrate, plan, policy, pools, keys)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specgate", description="SLA-aware gateway for speculative and plain vLLM pools"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    """As called: `specgate serve --workers N` runs each process with them."""
    if extra and not hasattr(args, "passthrough"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.passthrough = [*extra, *args.passthrough]
    configure_logging(getattr(args, "log_level", "info"))
    result: int = args.func(args)
    return result
