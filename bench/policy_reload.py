"""Live policy changes under load: how fast every gateway follows Redis, and what fails meanwhile.

    specgate bench policy-reload [--changes 100] [--clients 8] [--refresh-ms 1000] [--out docs]

Starts a redis-server, one speculative and one plain simulated replica (`--time-scale 20`) and two
gateway processes (`specgate serve --redis URL`), and keeps a steady load of short chat requests
on both gateways. Then:

1. makes `--changes` policy changes in a row, each a compare-and-set write to the store, as
   `specgate policy set` does, cycling through documents that change the policy, the pool weights
   and which pool is drained; for each, the time from the write returning to every gateway
   answering with the new `x-policy-version` (probe requests to each gateway in a tight loop, so
   the figure includes up to one probe's round trip);
2. kills Redis outright, keeps the load on for two seconds, starts an empty Redis on the same port,
   writes a new document and measures how long the gateways take to resync.

Every request of the load and of the probes counts; any that is not a 200 is a failure. Figures,
the command and the machine go to DIR/policy_reload.md and DIR/policy_reload.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from specgate.bench.overhead import pct
from specgate.gateway.store import PolicyStore
from specgate.policies.document import PolicyDocument, parse
from specgate.testing import RedisServer, free_port, gateway_config
from specgate.workers import launch

MODEL = "m"
BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
HEADERS = {"content-type": "application/json"}
DOCUMENTS = (
    {"policy": "adaptive"},
    {"policy": "least-loaded", "pools": {"speculative": {"weight": 2}}},
    {"policy": "round-robin", "pools": {"plain": {"drain": True}}},
    {"policy": "adaptive", "exploration": 0.1, "pools": {"speculative": {"drain": True}}},
)


def documents() -> list[PolicyDocument]:
    return [parse({"schema_version": 1, **d}) for d in DOCUMENTS]


@dataclass
class Load:
    """Requests sent, and those that did not come back 200, by status (0: no response at all)."""

    sent: int = 0
    failed: dict[int, int] = field(default_factory=dict)
    round_trips: list[float] = field(default_factory=list)

    def count(self, status: int, seconds: float) -> None:
        self.sent += 1
        self.round_trips.append(seconds)
        if status != 200:
            self.failed[status] = self.failed.get(status, 0) + 1

    @property
    def failures(self) -> int:
        return sum(self.failed.values())


async def request(session: aiohttp.ClientSession, gateway: str, load: Load) -> int | None:
    """Send one request; its policy version, or None when it failed."""
    started = time.perf_counter()
    try:
        async with session.post(f"{gateway}/v1/chat/completions", data=BODY, headers=HEADERS) as r:
            await r.read()
            load.count(r.status, time.perf_counter() - started)
            return int(r.headers["x-policy-version"]) if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
        load.count(0, time.perf_counter() - started)
        return None


async def steady(session: aiohttp.ClientSession, gateways: list[str], load: Load, stop: asyncio.Event) -> None:
    for gateway in itertools.cycle(gateways):
        if stop.is_set():
            return
        await request(session, gateway, load)


async def converged(session: aiohttp.ClientSession, gateways: list[str], version: int, load: Load) -> float:
    """Seconds until every gateway has answered a request with `version`."""
    started = time.perf_counter()

    async def one(gateway: str) -> float:
        while True:
            seen = await request(session, gateway, load)
            if seen == version:
                return time.perf_counter() - started
            if time.perf_counter() - started > 30:
                raise RuntimeError(f"{gateway} still answers with version {seen}, not {version}")

    return max(await asyncio.gather(*(one(g) for g in gateways)))


@dataclass
class Figures:
    changes: int
    clients: int
    refresh_ms: float
    propagation_ms_p50: float
    propagation_ms_p99: float
    propagation_ms_max: float
    propagation_ms_mean: float
    request_round_trip_ms_p50: float
    """A request's own round trip under the same load: the resolution of the propagation figures."""
    requests_during_changes: int
    failed_during_changes: int
    resync_after_redis_restart_ms: float
    requests_during_outage: int
    failed_during_outage: int
    failed_by_status: dict[int, int]


async def run(changes: int, clients: int, refresh_ms: float, workdir: Path) -> Figures:
    redis = RedisServer(free_port(), workdir)
    redis.start()
    procs = []
    try:
        sims = []
        for mode in ("speculative", "plain"):
            log = workdir / f"{mode}.log"
            proc = launch.spawn(launch.sim_argv("--mode", mode, "--model", MODEL, "--time-scale", "20"), log)
            procs.append(proc)
            sims.append(await launch.wait_ready(proc, log))
        config = gateway_config(
            workdir / "specgate.toml", MODEL, [sims[0]], [sims[1]], f"[store]\nrefresh_ms = {refresh_ms:g}\n"
        )
        gateways = []
        for i in range(2):
            log = workdir / f"gateway-{i}.log"
            argv = launch.specgate_argv("serve", "--config", str(config), "--port", "0")
            proc = launch.spawn([*argv, "--redis", redis.url], log)
            procs.append(proc)
            gateways.append(await launch.wait_ready(proc, log))

        store = PolicyStore.connect(redis.url)
        docs = documents()
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            load, stop = Load(), asyncio.Event()
            workers = [asyncio.create_task(steady(session, gateways, load, stop)) for _ in range(clients)]
            await asyncio.sleep(1.0)  # the load is steady before the first change
            base = load.sent, load.failures

            delays = []
            current = await store.current()
            version = current.version if current else 0
            for i in range(changes):
                stored = await store.write(docs[i % len(docs)], expected_version=version, who="bench", why=f"{i}")
                version = stored.version
                delays.append(await converged(session, gateways, version, load))
            during = load.sent - base[0], load.failures - base[1]

            redis.stop()
            await asyncio.sleep(2.0)
            redis.start()  # empty: no persistence
            await store.write(docs[1], expected_version=0, who="bench", why="after the outage")
            resync = await converged(session, gateways, 1, load)
            outage = load.sent - base[0] - during[0], load.failures - base[1] - during[1]

            stop.set()
            await asyncio.gather(*workers)
        await store.close()
    finally:
        await asyncio.gather(*(launch.terminate(p) for p in procs))
        redis.stop()
    ms = [d * 1e3 for d in delays]
    return Figures(
        changes=changes,
        clients=clients,
        refresh_ms=refresh_ms,
        propagation_ms_p50=statistics.median(ms),
        propagation_ms_p99=pct(ms, 0.99),
        propagation_ms_max=max(ms),
        propagation_ms_mean=statistics.fmean(ms),
        request_round_trip_ms_p50=statistics.median(load.round_trips) * 1e3,
        requests_during_changes=during[0],
        failed_during_changes=during[1],
        resync_after_redis_restart_ms=resync * 1e3,
        requests_during_outage=outage[0],
        failed_during_outage=outage[1],
        failed_by_status=load.failed,
    )


def report(f: Figures, command: str) -> str:
    row = " | ".join(
        f"{v:.1f} ms" for v in (f.propagation_ms_p50, f.propagation_ms_p99, f.propagation_ms_max, f.propagation_ms_mean)
    )
    return f"""# Live policy changes

`{command}`

Two gateway processes follow one Redis (`specgate serve --redis URL`, re-read every {f.refresh_ms:g} ms
besides the pub/sub announcement), in front of one speculative and one plain simulated replica, with
{f.clients} clients sending short chat requests to both gateways all the while. Machine: {platform.machine()},
{os.cpu_count()} cores, Python {platform.python_version()}; gateways, replicas, Redis and clients share it.

## {f.changes} changes in a row

Each change is a compare-and-set write of a new document (cycling through: adaptive; least-loaded with the
speculative pool weighted 2; round-robin with the plain pool drained; adaptive with the speculative pool
drained). Time from the write returning to both gateways answering with the new `x-policy-version`:

| p50 | p99 | max | mean |
|---|---|---|---|
| {row} |

These include the probes' own round trips: a request under this load takes {f.request_round_trip_ms_p50:.1f} ms
(median), and a gateway is seen on the new version only when a probe it answered comes back.

Requests during the changes: {f.requests_during_changes}, failed: **{f.failed_during_changes}**.

## Redis killed and started again

Redis killed outright under the same load, two seconds without it, then an empty Redis on the same port
and a new document written: both gateways answered with it after {f.resync_after_redis_restart_ms:.0f} ms.
Requests meanwhile: {f.requests_during_outage}, failed: **{f.failed_during_outage}**.
"""


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench policy-reload") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--refresh-ms", type=float, default=1000.0)
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specgate-reload-") as tmp:
        figures = asyncio.run(run(args.changes, args.clients, args.refresh_ms, Path(tmp)))
    command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "policy_reload.json").write_text(json.dumps(asdict(figures), indent=2) + "\n")
    (args.out / "policy_reload.md").write_text(report(figures, command.strip()))
    print(report(figures, command.strip()))
    return 0 if figures.failed_during_changes == 0 and figures.failed_during_outage == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
