"""An hour of mixed traffic, compressed: the gateway's memory, file descriptors and in-flight counts stay flat.

    specgate bench soak [--hours 1] [--time-scale 40] [--rate 2] [--seed 0] [--out docs]

Starts one speculative and one plain simulated replica running `--time-scale T` and a gateway
process in front of them, and sends `--hours` of Poisson traffic at `--rate` requests per second
of simulated time, T times faster in real time. The mix is what a gateway meets in a day: chat and
completions, mostly streamed, some with SLO headers (loose or too tight to meet), priorities and
request classes (a few invented for one request), streams the client abandons after their first
event, non-streamed requests it abandons before the answer, and bad requests (malformed JSON, an
unknown model, an absurd header). Every second it samples the gateway process: resident memory
and open file descriptors from /proc, and from its /metrics the requests in flight on the
replicas and held in its admission queue.

The gateway must end where it began: memory flat after warm-up (the medians of the second and the
last tenth of the run compared, and a least-squares slope over the last nine tenths), descriptors
back to their idle count once the clients have gone, nothing in flight, and no request lost: every
well-formed request answered 200 or refused by the policy with its reason, every bad one answered
4xx. Figures, the command and the machine go to DIR/soak.md, DIR/soak.json and DIR/soak.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from specgate.bench.overhead import cpu_seconds, rss_mb
from specgate.sim.requests import SCRIPTED_OUTPUT_FIELD
from specgate.testing import gateway_config, sample_value
from specgate.workers import launch

MODEL = "m"
REFUSALS = frozenset({"slo_infeasible", "slo_unattainable", "deadline", "queue_full"})
"""Error codes with which the policy refuses a request it cannot serve in time: answers, not losses."""
BAD_REQUESTS: tuple[tuple[str, bytes, dict[str, str]], ...] = (
    ("malformed JSON", b'{"model": "m", "messages": [', {}),
    ("unknown model", json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(), {}),
    ("absurd header", json.dumps({"model": MODEL, "prompt": "hi"}).encode(), {"x-slo-ttft-ms": "-1e309"}),
)
SLOS: tuple[dict[str, str], ...] = (
    {},
    {"x-slo-ttft-ms": "2000", "x-slo-tpot-ms": "100"},
    {"x-slo-ttft-ms": "20", "x-slo-tpot-ms": "1"},
)
"""No targets, loose ones, and ones too tight for any replica (real-time milliseconds)."""
IDLE_WAIT_S = 45.0
"""How long after the load the gateway has to let go of its connections and requests (its idle
connections to the replicas close 4 to 6 s after their last use)."""
FLAT_RSS_GROWTH = 0.05
"""Memory is flat when the last tenth's median is within this fraction of the second tenth's."""


@dataclass(frozen=True)
class Planned:
    """One request of the run, drawn before it starts."""

    at_s: float
    """When it is sent, in real seconds from the start."""
    kind: str
    """`chat`, `completion` or a bad request's name."""
    stream: bool
    abandon_after_s: float | None
    """The client leaves early: a stream after its first event, another request after this long."""
    body: bytes
    headers: dict[str, str]


def plan(hours: float, rate: float, time_scale: float, seed: int) -> list[Planned]:
    """The run's requests, the same for the same arguments."""
    rng = random.Random(seed)
    requests: list[Planned] = []
    t = rng.expovariate(rate)
    while t < hours * 3600:
        at = t / time_scale
        t += rng.expovariate(rate)
        if rng.random() < 0.03:
            kind, body, headers = rng.choice(BAD_REQUESTS)
            requests.append(Planned(at, kind, False, None, body, dict(headers)))
            continue
        chat, stream = rng.random() < 0.7, rng.random() < 0.7
        abandon = rng.uniform(0.0, 0.05) if rng.random() < (0.05 if stream else 0.02) else None
        words = " ".join(rng.choice(("gateway", "token", "replica", "draft")) for _ in range(rng.randint(5, 400)))
        payload: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 512,
            "stream": stream,
            SCRIPTED_OUTPUT_FIELD: int(min(rng.lognormvariate(4.5, 0.9), 500)) + 1,
        }
        if chat:
            payload["messages"] = [{"role": "user", "content": words}]
        else:
            payload["prompt"] = words
        headers = {"content-type": "application/json", **rng.choices(SLOS, weights=(5, 4, 1))[0]}
        if rng.random() < 0.2:
            headers["x-priority"] = str(rng.randint(0, 2))
        if (draw := rng.random()) < 0.02:
            headers["x-request-class"] = f"invented-{len(requests)}"  # a class never seen again
        elif draw < 0.2:
            headers["x-request-class"] = rng.choice(("chat", "code", "batch"))
        kind = "chat" if chat else "completion"
        requests.append(Planned(at, kind, stream, abandon, json.dumps(payload).encode(), headers))
    return requests


@dataclass
class Outcomes:
    """What became of the requests, by kind of outcome and by status."""

    by_outcome: Counter[str] = field(default_factory=Counter)
    by_status: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    """A line for each request lost: one that could have been served and was not, or a bad request
    not answered 4xx."""

    def count(self, outcome: str, status: int | None, why: str | None = None) -> None:
        self.by_outcome[outcome] += 1
        self.by_status[str(status) if status is not None else "none"] += 1
        if outcome == "lost" and why is not None and len(self.lost) < 20:
            self.lost.append(why)


def _code(body: bytes) -> str | None:
    try:
        error = json.loads(body)["error"]
        return str(error.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def _send(session: aiohttp.ClientSession, url: str, request: Planned, outcomes: Outcomes) -> None:
    path = "/v1/chat/completions" if request.kind == "chat" else "/v1/completions"
    bad = request.kind not in ("chat", "completion")
    status: int | None = None
    deadline = asyncio.timeout(None)
    try:
        async with deadline:
            if request.abandon_after_s is not None and not request.stream:
                deadline.reschedule(asyncio.get_running_loop().time() + request.abandon_after_s)
            async with session.post(url + path, data=request.body, headers=request.headers) as response:
                status = response.status
                if request.abandon_after_s is not None and request.stream and status == 200:
                    await response.content.readuntil(b"\n\n")
                    response.close()  # the client leaves after the first event, closing its connection
                    outcomes.count("abandoned", status)
                    return
                body = await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        if deadline.expired():
            outcomes.count("abandoned", status)
            return
        outcomes.count("lost", status, f"{request.kind}: {exc!r}")
        return
    if bad:
        ok = status is not None and 400 <= status < 500
        outcomes.count("rejected" if ok else "lost", status, f"{request.kind} answered {status}")
        return
    if status != 200:
        code = _code(body)
        outcome = "refused" if code in REFUSALS else "lost"
        outcomes.count(outcome, status, f"{request.kind} answered {status} {code}")
    elif request.stream and (not body.rstrip().endswith(b"data: [DONE]") or b'"error"' in body):
        outcomes.count("lost", status, f"a {request.kind} stream ended without [DONE] or with an error")
    else:
        outcomes.count("served", status)


@dataclass(frozen=True)
class Sample:
    t_s: float
    """Real seconds from the start of the load."""
    rss_mb: float
    fds: int
    cpu_s: float
    in_flight: float
    queued: float
    sent: int


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _gauges(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """Requests in flight on the replicas and held in the admission queue, from the gateway's /metrics."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    in_flight = 0.0
    for line in text.splitlines():
        if line.startswith("specgate_replica_in_flight{"):
            in_flight += float(line.rsplit(" ", 1)[1])
    return in_flight, sample_value(text, "specgate_queue_depth") or 0.0


async def _sample(session: aiohttp.ClientSession, url: str, pid: int, started: float, sent: int) -> Sample:
    in_flight, queued = await _gauges(session, url)
    return Sample(time.monotonic() - started, rss_mb(pid), open_fds(pid), cpu_seconds(pid), in_flight, queued, sent)


@dataclass
class Run:
    requests: int
    seconds: float
    outcomes: Outcomes
    samples: list[Sample]
    idle_before: Sample
    idle_after: Sample


async def run(requests: list[Planned], url: str, pid: int, sample_s: float) -> Run:
    outcomes = Outcomes()
    probe_session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        await asyncio.sleep(1.0)  # a few scrapes: the gateway is at rest
        idle_before = await _sample(probe_session, url, pid, time.monotonic(), 0)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            started = time.monotonic()
            sent = 0
            samples: list[Sample] = []
            tasks: set[asyncio.Task[None]] = set()

            async def sampler() -> None:
                while True:
                    samples.append(await _sample(probe_session, url, pid, started, sent))
                    await asyncio.sleep(sample_s)

            sampling = asyncio.create_task(sampler())
            for request in requests:
                await asyncio.sleep(max(started + request.at_s - time.monotonic(), 0.0))
                task = asyncio.create_task(_send(session, url, request, outcomes))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1
            await asyncio.gather(*tasks)
            seconds = time.monotonic() - started
            sampling.cancel()
        # The clients have gone: the gateway must let go of everything they held.
        ended = time.monotonic()
        while True:
            idle_after = await _sample(probe_session, url, pid, ended, sent)
            settled = not idle_after.in_flight and not idle_after.queued and idle_after.fds <= idle_before.fds
            if settled or idle_after.t_s > IDLE_WAIT_S:
                break
            await asyncio.sleep(0.5)
    finally:
        await probe_session.close()
    return Run(len(requests), seconds, outcomes, samples, idle_before, idle_after)


def slope_per_hour(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (hours): units per hour."""
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def tenth_medians(values: Sequence[float]) -> tuple[float, float]:
    """The medians of the second and the last tenth (the first is warm-up)."""
    n = len(values)
    tenth = max(n // 10, 1)
    return statistics.median(values[tenth : 2 * tenth]), statistics.median(values[n - tenth :])


def summarize(result: Run, time_scale: float) -> dict[str, Any]:
    samples = result.samples
    warm = samples[max(len(samples) // 10, 1) :]
    hours = [s.t_s * time_scale / 3600 for s in warm]
    rss_early, rss_late = tenth_medians([s.rss_mb for s in samples])
    fds_early, fds_late = tenth_medians([float(s.fds) for s in samples])
    served = result.outcomes.by_outcome["served"]
    cpu = samples[-1].cpu_s - samples[0].cpu_s if len(samples) > 1 else float("nan")
    figures: dict[str, Any] = {
        "requests": result.requests,
        "real_seconds": result.seconds,
        "simulated_hours": result.seconds * time_scale / 3600,
        "outcomes": dict(result.outcomes.by_outcome),
        "statuses": dict(result.outcomes.by_status),
        "lost": result.outcomes.lost,
        "rss_mb_idle_before": result.idle_before.rss_mb,
        "rss_mb_second_tenth": rss_early,
        "rss_mb_last_tenth": rss_late,
        "rss_growth": rss_late / rss_early - 1,
        "rss_mb_per_simulated_hour": slope_per_hour(hours, [s.rss_mb for s in warm]),
        "rss_mb_idle_after": result.idle_after.rss_mb,
        "fds_idle_before": result.idle_before.fds,
        "fds_second_tenth": fds_early,
        "fds_last_tenth": fds_late,
        "fds_per_simulated_hour": slope_per_hour(hours, [float(s.fds) for s in warm]),
        "fds_idle_after": result.idle_after.fds,
        "idle_after_s": result.idle_after.t_s,
        "in_flight_max": max((s.in_flight for s in samples), default=0.0),
        "queued_max": max((s.queued for s in samples), default=0.0),
        "in_flight_after": result.idle_after.in_flight,
        "queued_after": result.idle_after.queued,
        "gateway_cpu_ms_per_request": cpu / result.requests * 1e3 if result.requests else float("nan"),
        "served": served,
    }
    figures["flat"] = bool(
        abs(figures["rss_growth"]) <= FLAT_RSS_GROWTH
        and result.idle_after.fds <= result.idle_before.fds
        and not result.idle_after.in_flight
        and not result.idle_after.queued
        and not result.outcomes.by_outcome["lost"]
    )
    return figures


def report(figures: dict[str, Any], command: str, time_scale: float, rate: float) -> str:
    f = figures
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(f["outcomes"].items(), key=lambda kv: -kv[1]))
    statuses = ", ".join(f"{k}: {n}" for k, n in sorted(f["statuses"].items()))
    verdict = "flat, nothing lost" if f["flat"] else "NOT flat or requests lost: see below"
    lines = [
        "# Soak",
        "",
        f"Measured by `{command}` on {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}: {f['simulated_hours']:.2f} simulated hours at {rate:g} requests/s "
        f"({f['requests']:,} requests), run {time_scale:g}x faster in {f['real_seconds']:.0f} s against one "
        "speculative and one plain simulated replica. Mixed traffic: chat and completions, 70% streamed, SLO "
        "headers loose or impossible, priorities, request classes (2% of requests with a class of their own), "
        "5% of streams and 2% of other requests abandoned by their client, 3% bad requests. The gateway "
        "process sampled every second.",
        "",
        f"**Verdict: {verdict}.**",
        "",
        f"Outcomes: {outcomes}. Statuses: {statuses}.",
        "",
        "| measure | idle before | second tenth (median) | last tenth (median) | slope per simulated hour "
        "| idle after |",
        "|---|---|---|---|---|---|",
        f"| RSS MB | {f['rss_mb_idle_before']:.1f} | {f['rss_mb_second_tenth']:.1f} | {f['rss_mb_last_tenth']:.1f} "
        f"({f['rss_growth']:+.1%}) | {f['rss_mb_per_simulated_hour']:+.2f} MB | {f['rss_mb_idle_after']:.1f} |",
        f"| open file descriptors | {f['fds_idle_before']} | {f['fds_second_tenth']:.0f} | "
        f"{f['fds_last_tenth']:.0f} | {f['fds_per_simulated_hour']:+.1f} | {f['fds_idle_after']} |",
        f"| requests in flight on replicas | 0 | max {f['in_flight_max']:.0f} during the run | | | "
        f"{f['in_flight_after']:.0f} |",
        f"| requests in the admission queue | 0 | max {f['queued_max']:.0f} during the run | | | "
        f"{f['queued_after']:.0f} |",
        "",
        f"Idle after: sampled {f['idle_after_s']:.1f} s after the last answer (the gateway closes an idle "
        "connection to a replica 4 to 6 s after its last use). Gateway CPU: "
        f"{f['gateway_cpu_ms_per_request']:.2f} ms per request (all kinds, streams included).",
        "",
    ]
    if f["lost"]:
        lines += ["Requests lost (first 20):", "", *(f"- {why}" for why in f["lost"]), ""]
    return "\n".join(lines)


def plot(samples: list[Sample], time_scale: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = [s.t_s * time_scale / 3600 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    series: tuple[tuple[str, list[float]], ...] = (
        ("gateway RSS (MB)", [s.rss_mb for s in samples]),
        ("open file descriptors", [float(s.fds) for s in samples]),
        ("in flight / queued", [s.in_flight for s in samples]),
    )
    for ax, (label, values) in zip(axes, series, strict=True):
        ax.plot(hours, values, linewidth=1)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[2].plot(hours, [s.queued for s in samples], linewidth=1, label="queued")
    axes[2].legend(["in flight", "queued"], fontsize=8)
    axes[-1].set_xlabel("simulated hours")
    axes[0].set_title("Soak: the gateway process under an hour of mixed traffic")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)
    plt.close(fig)


async def soak(args: argparse.Namespace, workdir: Path) -> tuple[Run, list[Planned]]:
    requests = plan(args.hours, args.rate, args.time_scale, args.seed)
    procs = []
    try:
        sims = []
        for mode in ("speculative", "plain"):
            log = workdir / f"{mode}.log"
            argv = launch.sim_argv("--mode", mode, "--model", MODEL, "--time-scale", f"{args.time_scale:g}")
            procs.append(launch.spawn(argv, log))
            sims.append(await launch.wait_ready(procs[-1], log))
        config = gateway_config(
            workdir / "specgate.toml", MODEL, [sims[0]], [sims[1]], f'[policy]\npolicy = "{args.policy}"\n'
        )
        log = workdir / "gateway.log"
        gateway = launch.spawn(launch.specgate_argv("serve", "--config", str(config), "--port", "0"), log)
        procs.append(gateway)
        url = await launch.wait_ready(gateway, log)
        return await run(requests, url, gateway.pid, args.sample_s), requests
    finally:
        await asyncio.gather(*(launch.terminate(p) for p in procs))


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench soak") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="an hour of mixed traffic, compressed")
    parser.add_argument("--hours", type=float, default=1.0, help="simulated hours of traffic")
    parser.add_argument("--time-scale", type=float, default=40.0, help="how much faster than real time")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per simulated second")
    parser.add_argument("--policy", default="adaptive")
    parser.add_argument("--sample-s", type=float, default=1.0, help="real seconds between samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    command = " ".join([prog, *(argv if argv is not None else sys.argv[1:])])
    import uvloop

    with tempfile.TemporaryDirectory(prefix="specgate-soak-") as workdir:
        result, _ = uvloop.run(soak(args, Path(workdir)))
    figures = summarize(result, args.time_scale)
    text = report(figures, command, args.time_scale, args.rate)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.md").write_text(text)
    (args.out / "soak.json").write_text(
        json.dumps({"figures": figures, "samples": [asdict(s) for s in result.samples]}, indent=1)
    )
    plot(result.samples, args.time_scale, args.out)
    print(text)
    return 0 if figures["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
