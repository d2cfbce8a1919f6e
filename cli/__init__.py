"""The `specgate` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES, SOURCES, get_profile
from specgate.cli.policy import add_policy_command
from specgate.cli.pools import add_pools_command
from specgate.sim.engine import EngineConfig, kv_blocks


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text}")
    return value


def _add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sim",
        help="run one simulated vLLM replica",
        description="A calibrated model of a vLLM server, speaking vLLM's HTTP API and metrics.",
    )
    p.add_argument("--mode", choices=[m.value for m in Pool], default=Pool.PLAIN.value)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    p.add_argument("--model", help="served model name (default: the profile's model)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"one of: {', '.join(PROFILES)}")
    p.add_argument("--time-scale", type=_positive_float, default=1.0, help="run the clock S times faster")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=_positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192)
    p.add_argument("--kv-capacity-tokens", type=_positive_int, help="override the profile's KV token slots")
    p.add_argument("--num-speculative-tokens", type=_positive_int, help="override the profile's k")
    p.add_argument("--acceptance", type=_fraction, help="override the profile's mean acceptance rate")
    p.add_argument("--list-profiles", action="store_true", help="print the profiles and exit")
    p.set_defaults(func=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    if args.list_profiles:
        print("\n\n".join(p.describe() for p in PROFILES.values()))
        print("\nsources:")
        print("\n".join(f"  {key}: {text}" for key, text in SOURCES.items()))
        return 0
    import prometheus_client

    from specgate.sim.replica import SimSettings
    from specgate.sim.server import serve

    # vLLM turns off the `_created` series for its whole process; the replica matches it.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

    try:
        profile = get_profile(args.profile)
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

    _run_until_signalled(lambda: serve(settings, on_ready=ready))
    return 0


def _run_until_signalled(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a server coroutine under uvloop until SIGINT or SIGTERM, then clean up."""
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:  # uvloop does not build everywhere; asyncio's loop works too
        runner = asyncio.run

    async def guarded() -> None:
        task = asyncio.ensure_future(main())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    runner(guarded())


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Route OpenAI requests across the speculative and plain pools. Without --config, "
        "start the embedded default: two simulated replicas per pool.",
    )
    p.add_argument("--config", type=Path, help="gateway settings (TOML)")
    p.add_argument("--host", help="listen address (default: the config's, or 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default: the config's, or 8000; 0 picks one)")
    p.add_argument("--policy", help="routing policy, overriding the config's")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="embedded default: the replicas' profile")
    p.add_argument("--time-scale", type=_positive_float, default=1.0, help="embedded default: replica clock speed")
    p.add_argument("--redis", metavar="URL", help="follow the policy document in this Redis (redis://...)")
    p.add_argument("--redis-prefix", help="key prefix in Redis (default: the config's, or specgate)")
    p.add_argument("--policy-cache", type=Path, help="file keeping the last good document from Redis")
    p.set_defaults(func=_run_serve)


ADMIN_TOKEN_ENV = "SPECGATE_ADMIN_TOKEN"
"""The admin API's bearer token, from the environment (a command-line flag would show in ps)."""


def _run_serve(args: argparse.Namespace) -> int:
    from specgate.gateway.app import serve
    from specgate.gateway.config import (
        ConfigError,
        GatewaySettings,
        admin_token,
        initial_document,
        load_settings,
        store_url,
    )
    from specgate.gateway.embedded import embedded_pools
    from specgate.policies.registry import POLICY_NAMES

    def adjust(settings: GatewaySettings) -> GatewaySettings:
        changes: dict[str, Any] = {}
        if args.host is not None:
            changes["host"] = args.host
        if args.port is not None:
            changes["port"] = args.port
        if args.policy is not None:
            doc = settings.policy
            changes["policy"] = initial_document(
                args.policy, {}, profile=doc.profile, allow_pool_override=doc.allow_pool_override, slo=doc.slo
            )
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
        get_profile(args.profile)
        if args.policy is not None and args.policy not in POLICY_NAMES:
            raise ConfigError(f"unknown policy {args.policy!r}; known: {', '.join(POLICY_NAMES)}")
        if args.redis is not None:
            store_url("--redis", args.redis)
        if os.environ.get(ADMIN_TOKEN_ENV):
            admin_token(ADMIN_TOKEN_ENV, os.environ[ADMIN_TOKEN_ENV])
        configured = adjust(load_settings(args.config)) if args.config is not None else None
    except (ConfigError, KeyError, ValueError) as exc:
        print(f"specgate serve: {exc.args[0]}", file=sys.stderr)
        return 2

    async def run() -> None:
        if configured is not None:
            await serve(configured, on_ready=lambda url: ready(configured, url))
            return
        port = 8000 if args.port is None else args.port
        async with embedded_pools(
            host=args.host or "127.0.0.1", port=port, profile=args.profile, time_scale=args.time_scale
        ) as embedded:
            settings = adjust(embedded)
            await serve(settings, on_ready=lambda url: ready(settings, url))

    _run_until_signalled(run)
    return 0


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _add_replay(bench)
    p = bench.add_parser(
        "offline",
        help="policies over a trace in the offline simulator",
        description="Every policy routes the same trace over the same simulated fleet at several loads.",
    )
    p.add_argument(
        "--trace", type=Path, required=True, help="Azure LLM trace CSV, or timestamp_s,input_tokens,output_tokens"
    )
    p.add_argument("--profile", default=DEFAULT_PROFILE)
    p.add_argument("--spec-replicas", type=int, default=4)
    p.add_argument("--plain-replicas", type=int, default=4)
    p.add_argument(
        "--policies",
        default="adaptive,least-loaded,round-robin,threshold,speculative-only,plain-only",
        help="comma-separated; parameters after a colon, e.g. threshold:max_load=16",
    )
    p.add_argument("--rate-scale", type=_float_list, default=(0.5, 1.0, 2.0, 4.0))
    p.add_argument("--slo-ttft-ms", type=_positive_float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=_positive_float, default=50.0)
    p.add_argument("--max-requests", type=_positive_int, default=2000)
    p.add_argument("--hint", choices=["none", "exact"], default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.set_defaults(func=_run_bench_offline)


def _run_bench_offline(args: argparse.Namespace) -> int:
    from specgate.bench.sweep import SweepSettings, parse_policy, run_sweep, write_outputs
    from specgate.bench.traces import TraceError
    from specgate.policies.latency_model import LatencyModel
    from specgate.policies.registry import build_policy

    policies = tuple(p for p in args.policies.split(",") if p)
    if not policies:
        print("specgate bench: no policies given", file=sys.stderr)
        return 2
    try:
        model = LatencyModel(get_profile(args.profile))
        for policy in policies:
            build_policy(*parse_policy(policy), model)
    except (KeyError, ValueError) as exc:
        print(f"specgate bench: {exc}", file=sys.stderr)
        return 2
    if args.spec_replicas < 0 or args.plain_replicas < 0 or args.spec_replicas + args.plain_replicas < 1:
        print("specgate bench: the fleet needs at least one replica", file=sys.stderr)
        return 2
    settings = SweepSettings(
        trace=args.trace,
        profile=args.profile,
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
        get_profile(args.profile)
        results = run_sweep(settings)
    except (KeyError, OSError, TraceError) as exc:
        print(f"specgate bench: {exc}", file=sys.stderr)
        return 2
    command = "specgate bench offline " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else "specgate bench offline"
    write_outputs(results, args.out, command)
    print(f"specgate bench: wrote {args.out}/results.json, report.md and plots", file=sys.stderr)
    return 0


def _add_replay(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench.add_parser(
        "replay",
        help="a trace through a running gateway, in real time",
        description="Send a trace through a gateway in real time and measure from the client side.",
    )
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--gateway", required=True, help="the gateway's base URL")
    p.add_argument("--rate-scale", type=_positive_float, default=1.0)
    p.add_argument("--time-scale", type=_positive_float, default=1.0, help="the replicas' --time-scale")
    p.add_argument("--slo-ttft-ms", type=_positive_float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=_positive_float, default=50.0)
    p.add_argument("--max-requests", type=_positive_int, default=500)
    p.add_argument("--hint", choices=["none", "exact"], default="none")
    p.add_argument("--label", default="gateway", help="the name of this run in the results")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.set_defaults(func=_run_bench_replay)


def _run_bench_replay(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specgate", description="SLA-aware gateway for speculative and plain vLLM pools"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_sim(sub)
    _add_bench(sub)
    add_policy_command(sub)
    add_pools_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
