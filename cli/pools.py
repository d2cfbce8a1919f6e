"""`specgate pools`: start and stop the real vLLM servers a config's [launch] section describes.

    specgate pools up   --config specgate.toml [--detach]
    specgate pools down --config specgate.toml

`up` starts every server, each with its log in [launch] log_dir, waits until all answer /health,
and prints the gateway config that routes to them. It then stays in the foreground until Ctrl-C
or SIGTERM, and stops them all; with `--detach` it leaves them running and records them, and
`down` stops them. A server that fails to start stops the others: no orphans either way.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

from specgate.cli.arguments import Subcommands, common_options
from specgate.gateway.config import ConfigError, read_toml
from specgate.workers import launch
from specgate.workers.vllm_launch import (
    LaunchConfigError,
    LaunchPlan,
    parse_launch,
    start,
    stop,
    stop_recorded,
    wait_healthy,
)


def add_command(sub: Subcommands) -> None:
    pools = sub.add_parser("pools", help="real vLLM servers for both pools", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    commands = pools.add_subparsers(dest="pools_command", required=True)
    up = commands.add_parser(
        "up", parents=[common_options()], help="start the servers, wait until healthy, print the gateway config"
    )
    up.add_argument("--config", type=Path, required=True)
    up.add_argument("--detach", action="store_true", help="leave them running; stop them with `pools down`")
    up.set_defaults(func=_up)
    down = commands.add_parser(
        "down", parents=[common_options()], help="stop the servers a detached `pools up` started"
    )
    down.add_argument("--config", type=Path, required=True)
    down.set_defaults(func=_down)


def load_plan(path: Path) -> LaunchPlan | None:
    """The config's launch plan, or None after saying why there is none."""
    try:
        doc = read_toml(path)
        if "launch" not in doc:
            raise LaunchConfigError(str(path), "no [launch] section: nothing to start")
        return parse_launch(doc["launch"], path.resolve().parent)
    except (ConfigError, LaunchConfigError) as exc:
        print(f"specgate pools: {exc}", file=sys.stderr)
        return None


async def _run_up(plan: LaunchPlan, detach: bool) -> int:
    try:
        servers = start(plan, detach=detach)
    except launch.LaunchError as exc:  # nothing started
        print(f"specgate pools: {exc}", file=sys.stderr)
        return 1
    print(f"specgate pools: starting {len(servers)} vLLM servers; logs in {plan.log_dir}", file=sys.stderr)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    try:
        async with aiohttp.ClientSession() as session:
            waits = asyncio.gather(*(wait_healthy(s, plan.ready_timeout_s, session) for s in servers))
            stop_wait = asyncio.ensure_future(stopping.wait())
            racing: set[asyncio.Future[Any]] = {waits, stop_wait}
            done, _ = await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            if stop_wait in done:
                waits.cancel()
                await stop(servers)
                return 130
            stop_wait.cancel()
            waits.result()
        for s in servers:
            print(f"specgate pools: {s.spec.name} healthy at {s.spec.url}", file=sys.stderr)
        print(plan.gateway_config(), end="", flush=True)
        if detach:
            return 0
        print("specgate pools: Ctrl-C stops them", file=sys.stderr, flush=True)
        await stopping.wait()
        await stop(servers)
        return 0
    except launch.LaunchError as exc:
        print(f"specgate pools: {exc}", file=sys.stderr)
        await stop(servers)
        if detach:
            stop_recorded(plan.log_dir)
        return 1


def _up(args: argparse.Namespace) -> int:
    plan = load_plan(args.config)
    return 2 if plan is None else asyncio.run(_run_up(plan, args.detach))


def _down(args: argparse.Namespace) -> int:
    plan = load_plan(args.config)
    if plan is None:
        return 2
    stopped = stop_recorded(plan.log_dir)
    print(f"specgate pools: stopped {', '.join(stopped) if stopped else 'nothing (none recorded running)'}")
    return 0
