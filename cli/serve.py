"""`specgate serve`: the gateway, in front of configured pools or the embedded simulated ones."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specgate.calibration.profiles import DEFAULT_PROFILE, get_profile
from specgate.cli.arguments import Subcommands, common_options, positive_float, positive_int
from specgate.cli.running import run_until_signalled

if TYPE_CHECKING:
    from collections.abc import Callable

    from specgate.gateway.config import GatewaySettings, ProcessGroup

ADMIN_TOKEN_ENV = "SPECGATE_ADMIN_TOKEN"
"""The admin API's bearer token, from the environment (a command-line flag would show in ps)."""
API_KEYS_ENV = "SPECGATE_API_KEYS"
"""Client keys (a JSON list of entries, hashed), from the environment: turns client keys on."""


def add_command(sub: Subcommands) -> None:
    p = sub.add_parser(
        "serve",
        parents=[common_options()],
        help="run the gateway",
        description="Route OpenAI requests across the speculative and plain pools. Without --config, "
        "start the embedded default: two simulated replicas per pool.",
    )
    p.add_argument("--config", type=Path, help="gateway settings (TOML)")
    p.add_argument("--host", help="listen address (default: the config's, or 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default: the config's, or 8000; 0 picks one)")
    p.add_argument("--policy", help="routing policy, overriding the config's")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="embedded default: the replicas' profile")
    p.add_argument("--profile-file", type=Path, action="append", default=[], metavar="FILE",
                   help="a profile from a file, for policy documents to name (embedded: the replicas')")  # fmt: skip
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="embedded default: replica clock speed")
    p.add_argument("--redis", metavar="URL", help="follow the policy document in this Redis (redis://...)")
    p.add_argument("--redis-prefix", help="key prefix in Redis (default: the config's, or specgate)")
    p.add_argument("--policy-cache", type=Path, help="file keeping the last good document from Redis")
    p.add_argument("--access-log", action="store_true", help="log one line per request (logger specgate.access)")
    p.add_argument("--workers", type=positive_int, default=1, metavar="N",
                   help="processes serving on the port, a core each (default 1; more need --config)")  # fmt: skip
    # A process of several (--workers), as the supervisor starts it.
    p.add_argument("--process", type=int, help=argparse.SUPPRESS)
    p.add_argument("--shared-counts", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--metrics-dir", type=Path, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from specgate.calibration import profile_file
    from specgate.gateway.app import serve
    from specgate.gateway.clients import merged
    from specgate.gateway.config import (
        AuthSettings,
        ConfigError,
        ProcessGroup,
        admin_token,
        env_keys,
        load_settings,
        store_url,
    )
    from specgate.gateway.embedded import embedded_pools
    from specgate.policies.document import DocumentError, revised
    from specgate.policies.registry import policy_kind
    from specgate.validation import Invalid

    def adjust(settings: GatewaySettings, *, embedded: bool = False) -> GatewaySettings:
        changes: dict[str, Any] = {}
        if files:
            try:
                profiles = profile_file.with_files(files, settings.profiles)  # the config's files too
            except Invalid as exc:
                raise ConfigError("--profile-file", str(exc)) from None
            changes["profiles"] = profiles
            if embedded:  # the replicas run the file's profile: so does the latency model
                settings = dataclasses.replace(
                    settings, policy=revised(settings.policy, profiles, profile=files[0].profile.name)
                )
        if args.host is not None:
            changes["host"] = args.host
        if args.port is not None:
            changes["port"] = args.port
        if args.access_log:
            changes["access_log"] = True
        if args.policy is not None:
            try:
                changes["policy"] = revised(settings.policy, changes.get("profiles", settings.profiles),
                                            policy=args.policy, params={})  # fmt: skip
            except DocumentError as exc:
                raise ConfigError(f"--policy {args.policy}: {exc.field}", exc.message) from None
        store = settings.store
        if args.redis is not None:
            store = dataclasses.replace(store, url=store_url("--redis", args.redis))
        if args.redis_prefix is not None:
            store = dataclasses.replace(store, prefix=args.redis_prefix)
        if args.policy_cache is not None:
            store = dataclasses.replace(store, cache=args.policy_cache)
        changes["store"] = store
        token = os.environ.get(ADMIN_TOKEN_ENV)
        if token:
            changes["admin_token"] = admin_token(ADMIN_TOKEN_ENV, token)
        keys = os.environ.get(API_KEYS_ENV)
        if keys:
            changes["auth"] = AuthSettings(True, merged(settings.auth.keys, env_keys(API_KEYS_ENV, keys)))
        return dataclasses.replace(settings, **changes)

    def ready(settings: GatewaySettings, url: str) -> None:
        source = f", following {settings.store.url}" if settings.store.url else ""
        print(f"specgate: gateway listening on {url} with policy {settings.policy.policy}{source}", flush=True)
        for pool, urls in settings.pools.items():
            print(f"  {pool.value}: {', '.join(urls) or '-'}", flush=True)
        print(
            f"try: curl {url}/v1/chat/completions -H 'content-type: application/json' -H 'x-slo-ttft-ms: 500' "
            f"""-d '{{"model": "{settings.models[0]}", "messages": [{{"role": "user", "content": "Hello!"}}], """
            """"max_tokens": 32}' -i""",
            flush=True,
        )

    try:
        files, _ = profile_file.load_all(args.profile_file)  # no two of one name, none named like a built-in one
        if args.config is None and len(files) > 1:
            raise ConfigError("--profile-file", "the embedded default runs one profile: give one file at most")
        get_profile(args.profile)
        if args.policy is not None:
            policy_kind(args.policy)
        if args.redis is not None:
            store_url("--redis", args.redis)
        if os.environ.get(ADMIN_TOKEN_ENV):
            admin_token(ADMIN_TOKEN_ENV, os.environ[ADMIN_TOKEN_ENV])
        if os.environ.get(API_KEYS_ENV):
            env_keys(API_KEYS_ENV, os.environ[API_KEYS_ENV])
        configured = adjust(load_settings(args.config)) if args.config is not None else None
        if args.workers > 1 and configured is None:
            raise ConfigError("--workers", "the embedded default runs its simulated replicas inside the gateway: "
                              "give --config with pools of their own for several processes")  # fmt: skip
    except Invalid as exc:
        print(f"specgate serve: {exc}", file=sys.stderr)
        return 2
    except (KeyError, ValueError) as exc:
        print(f"specgate serve: {exc.args[0]}", file=sys.stderr)
        return 2

    if configured is not None and args.workers > 1:
        if args.process is None:
            return _supervise(args, configured, ready)
        group = ProcessGroup(args.process, args.workers, args.shared_counts, args.metrics_dir)
        configured = dataclasses.replace(configured, processes=group)
        ready = partial(_process_ready, group)

    async def main() -> None:
        if configured is not None:
            await serve(configured, on_ready=lambda url: ready(configured, url))
            return
        port = 8000 if args.port is None else args.port
        replicas = files[0] if files else None
        async with embedded_pools(
            host=args.host or "127.0.0.1", port=port, profile=args.profile, time_scale=args.time_scale, file=replicas
        ) as embedded:
            settings = adjust(embedded, embedded=True)
            await serve(settings, on_ready=lambda url: ready(settings, url))

    run_until_signalled(main)
    return 0


def _supervise(
    args: argparse.Namespace, settings: GatewaySettings, ready: Callable[[GatewaySettings, str], None]
) -> int:
    """Several processes on one port (`cli/processes.py`), each this command with its place added."""
    from specgate.cli.processes import Supervisor
    from specgate.workers import launch

    argv = launch.specgate_argv(*args.argv)
    supervisor = Supervisor(
        argv, args.workers, settings.host, settings.port, settings.shutdown_grace_s, settings.store.exchanges
    )
    run_until_signalled(partial(supervisor.run, lambda url: ready(settings, url)))
    return 0


def _process_ready(group: ProcessGroup, _: GatewaySettings, url: str) -> None:
    from specgate.cli.processes import ready_line

    print(ready_line(group.index, group.count, url), flush=True)
