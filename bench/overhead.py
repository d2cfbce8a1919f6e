"""What the gateway adds: the same load sent direct to an upstream and through the gateway, in one run.

    specgate bench overhead [--seconds 5] [--out docs]

The upstream is `specgate.bench.upstream` (answers at once), so the difference is the gateway's: routing
decision, header and body handling, relay. On a machine with two or more cores the gateway is
pinned to the last core and the upstream and this load generator to the first, as the peers'
figures in PEERS.md were measured. The load generator is Python, so absolute request rates are
bounded by it; the gateway's own CPU time per request (read from /proc) is the figure that does
not depend on the generator. Figures and the exact command go to DIR/overhead.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from specgate.bench import bare_relay
from specgate.bench import upstream as upstream_server
from specgate.workers import launch

BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
STREAM_BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True}
).encode()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class PathFigures:
    """One path (direct or through the gateway) under each load."""

    rps_closed_loop: float = 0.0
    p50_ms_at_rate: float = 0.0
    p99_ms_at_rate: float = 0.0
    errors_at_rate: int = 0
    chunks_per_s: float = 0.0
    ttfc_p50_ms_256: float = 0.0
    ttfc_p99_ms_256: float = 0.0
    ttfc_p50_ms_8: float = 0.0
    ttfc_p99_ms_8: float = 0.0
    router_cpu_us_per_request: float | None = None
    router_cpu_us_per_chunk: float | None = None
    router_rss_mb_idle: float | None = None
    router_rss_mb_256_streams: float | None = None


async def closed_loop(session: aiohttp.ClientSession, url: str, workers: int, seconds: float) -> int:
    done = 0
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            async with session.post(url, data=BODY, headers={"content-type": "application/json"}) as r:
                await r.read()
                if r.status == 200:
                    done += 1

    await asyncio.gather(*(worker() for _ in range(workers)))
    return done


async def fixed_rate(session: aiohttp.ClientSession, url: str, rate: float, seconds: float) -> tuple[list[float], int]:
    """Latency measured from each request's scheduled send time, so a stalled sender shows.

    Times come from time.monotonic(): uvloop's loop clock has millisecond resolution.
    """
    start = time.monotonic() + 0.05
    latencies: list[float] = []
    errors = 0

    async def one(at: float) -> None:
        nonlocal errors
        await asyncio.sleep(max(at - time.monotonic(), 0))
        try:
            async with session.post(url, data=BODY, headers={"content-type": "application/json"}) as r:
                await r.read()
                ok = r.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            latencies.append((time.monotonic() - at) * 1e3)
        else:
            errors += 1

    await asyncio.gather(*(one(start + i / rate) for i in range(int(rate * seconds))))
    return latencies, errors


async def streams(
    session: aiohttp.ClientSession, url: str, workers: int, seconds: float, delay_ms: float
) -> tuple[int, list[float]]:
    """(chunks received, time to first chunk in ms) over `seconds` of `workers` streams at a time."""
    chunks = 0
    ttfc: list[float] = []
    deadline = time.monotonic() + seconds
    headers = {"content-type": "application/json", "x-chunk-delay-ms": str(delay_ms)}

    async def worker() -> None:
        nonlocal chunks
        while time.monotonic() < deadline:
            sent = time.monotonic()
            first = True
            async with session.post(url, data=STREAM_BODY, headers=headers) as r:
                async for data in r.content.iter_any():
                    if first:
                        ttfc.append((time.monotonic() - sent) * 1e3)
                        first = False
                    chunks += data.count(b"data: ")

    await asyncio.gather(*(worker() for _ in range(workers)))
    return chunks, ttfc


async def measure(base: str, seconds: float, router_pid: int | None) -> PathFigures:
    url = f"{base}/v1/chat/completions"
    fig = PathFigures()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await closed_loop(session, url, 8, 0.5)  # warm-up: connections, caches
        if router_pid:
            fig.router_rss_mb_idle = rss_mb(router_pid)
        cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
        done = await closed_loop(session, url, 32, seconds)
        fig.rps_closed_loop = done / seconds
        if router_pid and done:
            fig.router_cpu_us_per_request = (cpu_seconds(router_pid) - cpu0) / done * 1e6
        latencies, fig.errors_at_rate = await fixed_rate(session, url, 500, seconds)
        fig.p50_ms_at_rate, fig.p99_ms_at_rate = pct(latencies, 0.5), pct(latencies, 0.99)
        cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
        chunks, _ = await streams(session, url, 16, seconds, 0)
        fig.chunks_per_s = chunks / seconds
        if router_pid and chunks:
            fig.router_cpu_us_per_chunk = (cpu_seconds(router_pid) - cpu0) / chunks * 1e6

        async def sample_rss() -> None:
            await asyncio.sleep(seconds / 2)
            if router_pid:
                fig.router_rss_mb_256_streams = rss_mb(router_pid)

        (_, ttfc), _ = await asyncio.gather(streams(session, url, 256, seconds, 10), sample_rss())
        fig.ttfc_p50_ms_256, fig.ttfc_p99_ms_256 = pct(ttfc, 0.5), pct(ttfc, 0.99)
        _, ttfc = await streams(session, url, 8, seconds, 10)
        fig.ttfc_p50_ms_8, fig.ttfc_p99_ms_8 = pct(ttfc, 0.5), pct(ttfc, 0.99)
    return fig


def _pin(pid: int, core: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(pid, {core})


async def run(seconds: float, workdir: Path) -> dict[str, PathFigures]:
    last_core = (os.cpu_count() or 1) - 1
    _pin(0, 0)
    upstream_log = workdir / "upstream.log"
    upstream = launch.spawn(launch.module_argv(upstream_server, "--port", "0"), upstream_log)
    procs = [upstream]
    try:
        upstream_url = await launch.wait_ready(upstream, upstream_log)
        _pin(upstream.pid, 0)
        config = workdir / "specgate.toml"
        config.write_text(f'[models]\nserved = ["bench"]\n[pools.plain]\nurls = ["{upstream_url}"]\n')
        gateway_log = workdir / "gateway.log"
        gateway = launch.spawn(launch.specgate_argv("serve", "--config", str(config), "--port", "0"), gateway_log)
        procs.append(gateway)
        gateway_url = await launch.wait_ready(gateway, gateway_log)
        _pin(gateway.pid, last_core)
        bare_log = workdir / "bare.log"
        bare = launch.spawn(launch.module_argv(bare_relay, "--upstream", upstream_url), bare_log)
        procs.append(bare)
        bare_url = await launch.wait_ready(bare, bare_log)
        _pin(bare.pid, last_core)
        results = {}
        paths = (
            ("direct", upstream_url, None),
            ("bare relay", bare_url, bare.pid),
            ("gateway", gateway_url, gateway.pid),
        )
        for name, base, pid in paths:
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            results[name] = await measure(base, seconds, pid)
        return results
    finally:
        await asyncio.gather(*(launch.terminate(p) for p in procs))


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(results: dict[str, PathFigures], seconds: float, command: str) -> str:
    d, b, g = results["direct"], results["bare relay"], results["gateway"]
    paths = (d, b, g)

    def row(label: str, values: list[str], adds: str = "") -> str:
        return f"| {label} | {' | '.join(values)} | {adds} |"

    def per_core(cpu: float | None) -> str:
        return "-" if not cpu else f"{cpu:.0f} us (~{1e6 / cpu:,.0f}/s per core)"

    lines = [
        "# Gateway overhead",
        "",
        f"Measured by `{command}` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; {seconds:g} s per measurement, all paths in one run. The upstream "
        "(`specgate.bench.upstream`) answers at once. The load generator (Python) shares the first core with the "
        "upstream; the relays run on the last core. `bare relay` (`specgate.bench.bare_relay`) is the simplest "
        "aiohttp relay, the yardstick for what Python and aiohttp cost before any routing work. The "
        "machine is shared and noisy: read ratios and medians.",
        "",
        "| measure | direct | bare relay | gateway | gateway adds over direct |",
        "|---|---|---|---|---|",
        row("non-stream req/s, 32 connections (bounded by the Python client)",
            [f"{p.rps_closed_loop:,.0f}" for p in paths], f"{g.rps_closed_loop / d.rps_closed_loop:.2f}x"),
        row("relay CPU per non-stream request", ["-", per_core(b.router_cpu_us_per_request),
            per_core(g.router_cpu_us_per_request)]),
        row("latency at 500 req/s, p50 ms", [f"{p.p50_ms_at_rate:.2f}" for p in paths],
            f"+{g.p50_ms_at_rate - d.p50_ms_at_rate:.2f} ms"),
        row("latency at 500 req/s, p99 ms", [f"{p.p99_ms_at_rate:.2f}" for p in paths],
            f"+{g.p99_ms_at_rate - d.p99_ms_at_rate:.2f} ms"),
        row("failed requests at 500 req/s", [str(p.errors_at_rate) for p in paths]),
        row("chunks/s, 64-chunk streams, 16 at a time", [f"{p.chunks_per_s:,.0f}" for p in paths],
            f"{g.chunks_per_s / d.chunks_per_s:.2f}x"),
        row("relay CPU per streamed chunk", ["-", _num(b.router_cpu_us_per_chunk, ".1f") + " us",
            _num(g.router_cpu_us_per_chunk, ".1f") + " us"]),
        row("first chunk, 256 streams, 10 ms apart: p50 ms", [f"{p.ttfc_p50_ms_256:.2f}" for p in paths],
            f"+{g.ttfc_p50_ms_256 - d.ttfc_p50_ms_256:.2f} ms"),
        row("first chunk, 256 streams: p99 ms", [f"{p.ttfc_p99_ms_256:.2f}" for p in paths],
            f"+{g.ttfc_p99_ms_256 - d.ttfc_p99_ms_256:.2f} ms"),
        row("first chunk, 8 streams: p50 ms", [f"{p.ttfc_p50_ms_8:.2f}" for p in paths],
            f"+{g.ttfc_p50_ms_8 - d.ttfc_p50_ms_8:.2f} ms"),
        row("first chunk, 8 streams: p99 ms", [f"{p.ttfc_p99_ms_8:.2f}" for p in paths],
            f"+{g.ttfc_p99_ms_8 - d.ttfc_p99_ms_8:.2f} ms"),
        row("relay RSS MB, idle -> under 256 streams", ["-"] + [
            f"{_num(p.router_rss_mb_idle, '.0f')} -> {_num(p.router_rss_mb_256_streams, '.0f')}" for p in (b, g)]),
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench overhead") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="gateway overhead: direct vs. through the gateway")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    command = prog + (f" --seconds {args.seconds:g}" if args.seconds != 5.0 else "")
    import uvloop

    with tempfile.TemporaryDirectory(prefix="specgate-bench-") as workdir:
        results = uvloop.run(run(args.seconds, Path(workdir)))
    text = report(results, args.seconds, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.md").write_text(text)
    (args.out / "overhead.json").write_text(json.dumps({k: asdict(v) for k, v in results.items()}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
