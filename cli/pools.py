"""`specgate pools`: start and stop the real vLLM servers a config's [launch] section describes.

    specgate pools up     --config specgate.toml [--detach]
    specgate pools down   --config specgate.toml
    specgate pools switch SERVER --to speculative|plain --config specgate.toml [--redis URL]

`up` starts every server, each with its log in [launch] log_dir, waits until all answer /health,
and prints the gateway config that routes to them. It then stays in the foreground until Ctrl-C
or SIGTERM, and stops them all; with `--detach` it leaves them running and records them, and
`down` stops them. A server that fails to start stops the others: no orphans either way.
`switch` restarts one server of a detached `up` in the other mode, drained and re-admitted in
every gateway through the policy store, with no request lost (`gateway/switching.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from specgate.calibration.modes import Pool
from specgate.cli.arguments import Subcommands, common_options, positive_float
from specgate.gateway import switching
from specgate.gateway.config import ConfigError, load_settings, read_toml, store_url
from specgate.gateway.policy_sync import STORE_ERRORS
from specgate.gateway.store import PolicyStore
from specgate.gateway.switching import Switcher, SwitchError, SwitchSettings
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
    switch = commands.add_parser(
        "switch", parents=[common_options()],
        help="restart one server with speculation or without, moving it to the other pool in every gateway",
        description=switching.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    switch.add_argument("server", help="the server's name (spec-0, plain-1) or URL")
    switch.add_argument("--to", required=True, type=Pool, choices=list(Pool), help="the pool it serves in after")
    switch.add_argument("--config", type=Path, required=True, help="the config `pools up --detach` started it from")
    switch.add_argument("--redis", help="the policy store every gateway follows (default: the config's [store] url)")
    switch.add_argument("--redis-prefix", help="its key prefix (default: the config's)")
    switch.add_argument(
        "--speculative-config", type=_json_object, metavar="JSON",
        help="what to speculate with (default: the server's own, else the first speculative server's)",
    )  # fmt: skip
    switch.add_argument("--settle-s", type=positive_float, default=SwitchSettings.settle_s,
                        help="after the drain, for every gateway to read it (twice their [store] refresh)")  # fmt: skip
    switch.add_argument("--drain-timeout-s", type=positive_float, default=SwitchSettings.drain_timeout_s)
    switch.set_defaults(func=_switch)


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
            await stop_recorded(plan.log_dir)
        return 1


def _up(args: argparse.Namespace) -> int:
    plan = load_plan(args.config)
    return 2 if plan is None else asyncio.run(_run_up(plan, args.detach))


def _down(args: argparse.Namespace) -> int:
    plan = load_plan(args.config)
    if plan is None:
        return 2
    stopped = asyncio.run(stop_recorded(plan.log_dir))
    print(f"specgate pools: stopped {', '.join(stopped) if stopped else 'nothing (none recorded running)'}")
    return 0


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _switch(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"specgate pools: {exc}", file=sys.stderr)
        return 2
    try:
        url = store_url("--redis", args.redis) if args.redis else settings.store.url
    except ConfigError as exc:
        print(f"specgate pools switch: {exc}", file=sys.stderr)
        return 2
    if settings.launch is None or url is None:
        missing = "a [launch] section" if settings.launch is None else "a policy store (--redis or [store] url)"
        print(f"specgate pools switch: needs {missing}: the gateways learn of the switch from it", file=sys.stderr)
        return 2
    store = PolicyStore.connect(url, args.redis_prefix or settings.store.prefix)
    say = partial(print, file=sys.stderr, flush=True)
    switcher = Switcher(settings.launch, store, settings.policy, settings.profiles,
                        SwitchSettings(settle_s=args.settle_s, drain_timeout_s=args.drain_timeout_s), say)  # fmt: skip

    async def run() -> int:
        try:
            done = await switcher.switch(args.server, args.to, args.speculative_config)
        except SwitchError as exc:
            print(f"specgate pools switch: {exc}", file=sys.stderr)
            return 1
        except STORE_ERRORS as exc:
            print(f"specgate pools switch: the policy store cannot be reached: {exc}", file=sys.stderr)
            return 1
        finally:
            await store.close()
        if done is None:
            print(f"{args.server} serves in the {args.to.value} pool already")
        else:
            print(json.dumps(dataclasses.asdict(done) | {"to": done.to.value}))
        return 0

    return asyncio.run(run())
