"""What a router adds over going direct: specgate, a bare aiohttp relay and, when installed,
vllm-router (Rust), side by side in one run.

    specgate bench overhead [--seconds 5] [--out docs]

Two fast fixed upstreams (`specgate.bench.upstream`, answering at once) stand for the two pools,
one replica each: specgate routes over both with its default (adaptive) policy, vllm-router round
robin; the bare relay forwards to one. Every microsecond measured is the router's. The routers run
on the last core, the upstreams and the load generators on the first, as in PEERS.md.

Throughput and CPU are measured with wrk (compiled; `apt-get install wrk`): 32 connections sending
a small chat request, then 16 sending streamed ones of 64 chunks. The router's CPU time, read from
/proc before and after, divided by what wrk counted, is the figure that does not depend on the load
generator. Latency at a fixed rate (500 requests/s, from each request's scheduled send time) and
the time to the first chunk of 256 and 8 concurrent streams come from an open-loop asyncio client,
which keeps up at those rates. An answer other than a 200 is counted: a router that fails fast is
not fast. Figures and the exact command go to DIR/overhead.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from pathlib import Path
from statistics import median

import aiohttp

from specgate.bench import bare_relay
from specgate.bench import upstream as upstream_server
from specgate.testing import gateway_config
from specgate.workers import launch

BODY = json.dumps({"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
JSON = {"content-type": "application/json"}
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
    """One path (direct, or through a router) under each load."""

    rps_wrk: float = 0.0
    failed_wrk: int = 0
    """Answers other than a 200, and socket errors, under wrk (both runs)."""
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


WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
"""
CHUNKS_PER_STREAM = 65
"""SSE events relayed per streamed answer: 64 chunks and [DONE]."""


@dataclass(frozen=True)
class Wrk:
    """What one wrk run counted."""

    requests: int
    failed: int
    seconds: int

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds


async def wrk(url: str, script: Path, connections: int, seconds: float, core: int) -> Wrk:
    """`seconds` of wrk (whole seconds: wrk counts no fraction)."""
    whole = max(round(seconds), 1)
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{whole}s", "-s", str(script), url]
    proc = await asyncio.create_subprocess_exec(
        *_pinned(argv, core), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0 or b"requests in" not in out:
        raise RuntimeError(f"wrk failed: {out.decode(errors='replace')[-500:]}")
    requests = failed = 0
    for line in out.decode().splitlines():
        words = line.split()
        if "requests in" in line:
            requests = int(words[0])
        elif line.strip().startswith("Non-2xx"):
            failed += int(words[-1])
        elif line.strip().startswith("Socket errors"):  # connect N, read N, write N, timeout N
            failed += sum(int(w.rstrip(",")) for w in words[3::2])
    return Wrk(requests, failed, whole)


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
            async with session.post(url, data=BODY, headers=JSON) as r:
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
    headers = {**JSON, "x-chunk-delay-ms": str(delay_ms)}

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


@dataclass
class _Rounds:
    """One path's wrk figures, a value per round."""

    rps: list[float] = field(default_factory=list)
    cpu_us_per_request: list[float] = field(default_factory=list)
    chunks_per_s: list[float] = field(default_factory=list)
    cpu_us_per_chunk: list[float] = field(default_factory=list)
    failed: int = 0


async def under_wrk(url: str, seconds: float, router_pid: int | None, scripts: dict[str, Path], into: _Rounds) -> None:
    """One round of wrk on one path: requests, then streams, and the router's CPU for each."""

    def cpu() -> float:
        return cpu_seconds(router_pid) if router_pid else 0.0

    cpu0 = cpu()
    run = await wrk(url, scripts["whole"], 32, seconds, 0)
    into.rps.append(run.per_s)
    into.failed += run.failed
    if router_pid and run.requests:
        into.cpu_us_per_request.append((cpu() - cpu0) / run.requests * 1e6)
    cpu0 = cpu()
    run = await wrk(url, scripts["stream"], 16, seconds, 0)
    chunks = run.requests * CHUNKS_PER_STREAM
    into.chunks_per_s.append(chunks / run.seconds)
    into.failed += run.failed
    if router_pid and chunks:
        into.cpu_us_per_chunk.append((cpu() - cpu0) / chunks * 1e6)


async def measure(
    paths: Sequence[tuple[str, str, int | None]], seconds: float, rounds: int, scripts: dict[str, Path]
) -> dict[str, PathFigures]:
    """Every path: rounds of wrk taking turns (the machine's noise falls on all alike; medians
    reported), then the latencies, one path at a time."""
    figures = {name: PathFigures() for name, _, _ in paths}
    counted = {name: _Rounds() for name, _, _ in paths}
    for name, base, pid in paths:
        await wrk(f"{base}/v1/chat/completions", scripts["whole"], 32, 1, 0)  # warm-up: connections, caches
        if pid:
            figures[name].router_rss_mb_idle = rss_mb(pid)
    for number in range(rounds):
        for name, base, pid in paths:
            print(f"round {number + 1}/{rounds}: {name} under wrk ...", file=sys.stderr, flush=True)
            await under_wrk(f"{base}/v1/chat/completions", seconds, pid, scripts, counted[name])
    for name, base, pid in paths:
        fig, got = figures[name], counted[name]
        fig.rps_wrk, fig.chunks_per_s, fig.failed_wrk = median(got.rps), median(got.chunks_per_s), got.failed
        fig.router_cpu_us_per_request = median(got.cpu_us_per_request) if got.cpu_us_per_request else None
        fig.router_cpu_us_per_chunk = median(got.cpu_us_per_chunk) if got.cpu_us_per_chunk else None
        print(f"{name}: latencies ...", file=sys.stderr, flush=True)
        await latencies(f"{base}/v1/chat/completions", seconds, pid, fig)
    return figures


async def latencies(url: str, seconds: float, router_pid: int | None, fig: PathFigures) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        at_rate, fig.errors_at_rate = await fixed_rate(session, url, 500, seconds)
        fig.p50_ms_at_rate, fig.p99_ms_at_rate = pct(at_rate, 0.5), pct(at_rate, 0.99)

        async def sample_rss() -> None:
            await asyncio.sleep(seconds / 2)
            if router_pid:
                fig.router_rss_mb_256_streams = rss_mb(router_pid)

        (_, ttfc), _ = await asyncio.gather(streams(session, url, 256, seconds, 10), sample_rss())
        fig.ttfc_p50_ms_256, fig.ttfc_p99_ms_256 = pct(ttfc, 0.5), pct(ttfc, 0.99)
        _, ttfc = await streams(session, url, 8, seconds, 10)
        fig.ttfc_p50_ms_8, fig.ttfc_p99_ms_8 = pct(ttfc, 0.5), pct(ttfc, 0.99)


def _pinned(argv: Sequence[str], core: int) -> list[str]:
    """`argv` run on `core` only, threads included (on a machine with more than one)."""
    if (os.cpu_count() or 1) > 1 and shutil.which("taskset"):
        return ["taskset", "-c", str(core), *argv]
    return list(argv)


async def _answering(url: str, proc: subprocess.Popen[bytes], log: Path, wait_s: float = 30.0) -> None:
    """Until a chat request through `url` is answered 200 (for a router that does not print its URL)."""
    deadline = time.monotonic() + wait_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(f"{url}/v1/chat/completions", data=BODY, headers=JSON) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise launch.LaunchError(f"the router did not answer: see {log}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def run(seconds: float, rounds: int, workdir: Path) -> dict[str, PathFigures]:
    if not shutil.which("wrk"):
        raise SystemExit("specgate bench overhead needs wrk: apt-get install wrk")
    last_core = (os.cpu_count() or 1) - 1
    if hasattr(os, "sched_setaffinity") and last_core:
        os.sched_setaffinity(0, {0})
    scripts = {}
    for name, body in (("whole", BODY), ("stream", STREAM_BODY)):
        scripts[name] = workdir / f"{name}.lua"
        scripts[name].write_text(WRK_SCRIPT.format(body=body.decode()))
    procs: list[subprocess.Popen[bytes]] = []

    async def start(name: str, argv: Sequence[str], core: int) -> tuple[subprocess.Popen[bytes], str]:
        log = workdir / f"{name}.log"
        proc = launch.spawn(_pinned(argv, core), log)
        procs.append(proc)
        return proc, await launch.wait_ready(proc, log)

    try:
        upstreams = [
            await start(f"upstream-{i}", launch.module_argv(upstream_server, "--port", "0"), 0) for i in (1, 2)
        ]
        spec_url, plain_url = (url for _, url in upstreams)
        config = gateway_config(workdir / "specgate.toml", "bench", [spec_url], [plain_url])
        gateway, gateway_url = await start(
            "gateway", launch.specgate_argv("serve", "--config", str(config), "--port", "0"), last_core
        )
        bare, bare_url = await start("bare", launch.module_argv(bare_relay, "--upstream", plain_url), last_core)
        paths: list[tuple[str, str, int | None]] = [
            ("direct", plain_url, None), ("bare relay", bare_url, bare.pid), ("specgate", gateway_url, gateway.pid)
        ]  # fmt: skip
        if router := shutil.which("vllm-router"):
            port, log = _free_port(), workdir / "vllm-router.log"
            argv = [router, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                    "--worker-urls", spec_url, plain_url]  # fmt: skip
            proc = launch.spawn(_pinned(argv, last_core), log)
            procs.append(proc)
            await _answering(f"http://127.0.0.1:{port}", proc, log)
            paths.append(("vllm-router", f"http://127.0.0.1:{port}", proc.pid))
        return await measure(paths, seconds, rounds, scripts)
    finally:
        await asyncio.gather(*(launch.terminate(p) for p in procs))


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(results: dict[str, PathFigures], seconds: float, rounds: int, command: str) -> str:
    names = list(results)
    paths = [results[n] for n in names]
    d, g = results["direct"], results["specgate"]

    def row(label: str, values: list[str], adds: str = "") -> str:
        return f"| {label} | {' | '.join(values)} | {adds} |"

    def per_core(cpu: float | None) -> str:
        return "-" if not cpu else f"{cpu:.0f} us (~{1e6 / cpu:,.0f}/s per core)"

    def rss(p: PathFigures) -> str:
        return (
            "-"
            if p.router_rss_mb_idle is None
            else (f"{_num(p.router_rss_mb_idle, '.0f')} -> {_num(p.router_rss_mb_256_streams, '.0f')}")
        )

    def ms(label: str, field: str) -> str:
        value = attrgetter(field)
        return row(label, [f"{value(p):.2f}" for p in paths], f"{value(g) - value(d):+.2f} ms")

    lines = [
        "# Router overhead",
        "",
        f"Measured by `{command}` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; {seconds:g} s per measurement, every path in one run, wrk figures the median of "
        f"{rounds} rounds taking turns. Two upstreams "
        "(`specgate.bench.upstream`) answer at once, one per pool; specgate routes over both with its adaptive "
        "policy, vllm-router round robin, the bare relay (`specgate.bench.bare_relay`, the simplest aiohttp relay) "
        "forwards to one. Routers on the last core; upstreams and load generators on the first. Throughput and CPU "
        "under wrk (32 connections; streams: 16, 64 chunks each); CPU per request or per SSE event relayed from "
        "/proc. Fixed-rate latency and first chunks from an open-loop asyncio client. The machine is shared and "
        "noisy: compare within a run.",
        "",
        f"| measure | {' | '.join(names)} | specgate over direct |",
        "|---|" + "---|" * (len(names) + 1),
        row("router CPU per non-streamed request", [per_core(p.router_cpu_us_per_request) for p in paths]),
        row("router CPU per streamed chunk", [_num(p.router_cpu_us_per_chunk, ".1f") + " us" for p in paths]),
        row("requests/s under wrk, 32 connections", [f"{p.rps_wrk:,.0f}" for p in paths],
            f"{g.rps_wrk / d.rps_wrk:.2f}x"),
        row("chunks/s under wrk, 16 streams", [f"{p.chunks_per_s:,.0f}" for p in paths],
            f"{g.chunks_per_s / d.chunks_per_s:.2f}x"),
        row("answers other than 200 under wrk", [str(p.failed_wrk) for p in paths]),
        ms("latency at 500 req/s, p50 ms", "p50_ms_at_rate"),
        ms("latency at 500 req/s, p99 ms", "p99_ms_at_rate"),
        row("failed requests at 500 req/s", [str(p.errors_at_rate) for p in paths]),
        ms("first chunk, 256 streams, 10 ms apart: p50 ms", "ttfc_p50_ms_256"),
        ms("first chunk, 256 streams: p99 ms", "ttfc_p99_ms_256"),
        ms("first chunk, 8 streams: p50 ms", "ttfc_p50_ms_8"),
        ms("first chunk, 8 streams: p99 ms", "ttfc_p99_ms_8"),
        row("router RSS MB, idle -> under 256 streams", [rss(p) for p in paths]),
        "",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench overhead") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="router overhead: direct, specgate and other routers")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of wrk per path, taking turns (medians)")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    command = prog + (f" --seconds {args.seconds:g}" if args.seconds != 5.0 else "")
    command += f" --rounds {args.rounds}" if args.rounds != 3 else ""
    import uvloop

    with tempfile.TemporaryDirectory(prefix="specgate-bench-") as workdir:
        results = uvloop.run(run(args.seconds, args.rounds, Path(workdir)))
    text = report(results, args.seconds, args.rounds, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.md").write_text(text)
    (args.out / "overhead.json").write_text(json.dumps({k: asdict(v) for k, v in results.items()}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
