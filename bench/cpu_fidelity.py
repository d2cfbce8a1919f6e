"""The simulated replica against the real CPU vLLM servers it was calibrated on.

    specgate bench cpu-fidelity [--sweep full|quick] [--concurrency 1,2,4,8] [--prompt-tokens 256]
                                [--output-tokens 64] [--rounds 3] [--out docs/bench/cpu-fidelity]

Starts one n-gram speculative and one plain vLLM server of SmolLM2-135M-Instruct on this CPU
(scripts/setup-vllm), calibrates them (`specgate calibrate`), and measures each at every
concurrency: as many requests at each, each its own (prompts of random token ids of one length,
as the calibration's: nothing for n-gram speculation to copy; a fixed answer length, `ignore_eos`;
`rounds` times as many as the highest concurrency), that many in flight in a closed loop whose
clients start spread over one request's time alone; TTFT and TPOT are the medians over the
requests, as the client sees them. Then the servers stop, a `specgate sim` per server runs
the calibrated profile in real time, and it is measured the same way. The figures go to
DIR/results.json, and `specgate bench fidelity` renders them into docs/fidelity.md (it is
rewritten here too).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import aiohttp

from specgate.bench import fidelity
from specgate.bench.calibrate import FULL, QUICK, Server, Timing, calibrate, drafting, one, probe, progress_bar
from specgate.calibration import profile_file
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES
from specgate.testing import cpu_pools, setup_vllm
from specgate.workers import launch
from specgate.workers.vllm_launch import start, stop, wait_healthy

PROFILE_NAME = "cpu-smollm2"
TOLERANCE = 0.2
"""How far the simulated replica may be from the real server: the issue's bar, ±20%."""


@dataclass(frozen=True)
class Workload:
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    prompt_tokens: int = 256
    output_tokens: int = FULL.output_tokens
    """As long as the calibration's answers: n-gram speculation on a small model accepts more as its
    answer goes on (it starts repeating itself), so the calibration's acceptance holds for these."""
    rounds: int = 3
    seed: int = 0


@dataclass(frozen=True)
class Point:
    mode: str
    """speculative or plain."""
    clients: int
    ttft_ms: float
    tpot_ms: float
    tokens_per_step: float
    """Tokens per streamed event after the first (one event per engine step): on a speculative
    server, 1 + the drafts it accepted."""
    acceptance: float | None = None
    """On a speculative server, the per-token acceptance its counters show over these requests."""
    label: str = ""
    """What the simulated replica was given, when it is not just the calibrated profile."""


async def load_point(
    session: aiohttp.ClientSession, server: Server, clients: int, prompts: Sequence[list[int]], output_tokens: int,
    stagger_s: float = 0.0,
) -> tuple[float, float, float]:  # fmt: skip
    """Median TTFT and TPOT (ms) and tokens per step of `prompts` with `clients` requests in flight:
    a closed loop (each client sends its next request when its last one ends), the clients starting
    `stagger_s` apart. Sent in one burst, whether a request joins the others' prefill or waits for
    the next step is a race between the server's HTTP front and its engine, which a server with its
    front on its own core and one without run differently; arriving spread out, as independent
    clients' requests do, each meets the batch the load makes."""
    queue = list(reversed(prompts))
    timings: list[Timing] = []

    async def client(index: int) -> None:
        await asyncio.sleep(index * stagger_s)
        while queue:
            timings.append(await one(session, server, queue.pop(), output_tokens))

    await asyncio.gather(*(client(i) for i in range(clients)))
    ttfts = [t.ttft_s * 1e3 for t in timings]
    tpots = [(t.events[-1] - t.events[0]) * 1e3 / max(output_tokens - 1, 1) for t in timings]
    per_step = [(output_tokens - 1) / max(len(t.events) - 1, 1) for t in timings]
    return statistics.median(ttfts), statistics.median(tpots), statistics.median(per_step)


def prompts_of(work: Workload, clients: int) -> list[list[int]]:
    """The requests of one load point, `rounds` times as many as the highest concurrency sends at
    once: as many at every point, so that what a speculative server accepts (a property of the
    content) averages over as many prompts at each, but fresh ones at each, so that no point finds
    another's prompts in the server's prefix cache."""
    rng = random.Random(f"{work.seed}-{clients}")
    count = work.rounds * max(work.concurrency)
    return [[rng.randrange(1000, 9000) for _ in range(work.prompt_tokens)] for _ in range(count)]


async def measure(urls: Sequence[str], work: Workload, mode_of: dict[str, str]) -> list[Point]:
    """Every server at every concurrency of `work`, one after the other."""
    points = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for url in urls:
            server = await probe(session, url)
            warm = await one(session, server, prompts_of(work, 0)[0], work.output_tokens)  # warms it, times one alone
            alone_s = warm.events[-1] - warm.events[0] + warm.ttft_s
            for clients in work.concurrency:
                prompts = prompts_of(work, clients)
                before = await drafting(session, server) if server.speculative else None
                ttft, tpot, per_step = await load_point(
                    session, server, clients, prompts, work.output_tokens, alone_s / clients
                )
                after = await drafting(session, server) if before is not None else None
                alpha = None
                if before is not None and after is not None and (delta := after - before).counters.drafts > 0:
                    alpha, _ = delta.decoded(len(prompts)).acceptance()
                points.append(Point(mode_of[url], clients, ttft, tpot, per_step, alpha))
                print(f"cpu-fidelity: {url} ({mode_of[url]}) x{clients}: TTFT {ttft:.1f} ms, TPOT {tpot:.1f} ms, "
                      f"{per_step:.2f} tokens a step", file=sys.stderr)  # fmt: skip
    return points


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    work = Workload(tuple(args.concurrency), args.prompt_tokens, args.output_tokens, args.rounds, args.seed)
    python, model = setup_vllm()
    plan = cpu_pools(python, model, workdir)
    servers = start(plan)
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(wait_healthy(s, 600, session) for s in servers))
        urls = [s.spec.url for s in servers]
        mode_of = {s.spec.url: s.spec.pool.value for s in servers}
        sweep = QUICK if args.sweep == "quick" else FULL
        result = await calibrate(urls, sweep, PROFILES[DEFAULT_PROFILE], PROFILE_NAME, progress=progress_bar)
        print(file=sys.stderr)
        print(result.report(), file=sys.stderr)
        real = await measure(urls, work, mode_of)
    finally:
        await stop(servers)
    path = workdir / f"{PROFILE_NAME}.json"
    path.write_bytes(profile_file.dumps(result.file.profile, result.file.source, datetime.date.today()))
    # The simulated replicas: each on the calibrated profile; the speculative one also with the
    # acceptance the real server showed on these requests (acceptance is the content's, and the
    # calibration's prompts are not these), which isolates the step costs' share of the error.
    shown = [p.acceptance for p in real if p.acceptance is not None]
    variants: list[tuple[str, tuple[str, ...], str]] = [(mode, (), "") for mode in dict.fromkeys(mode_of.values())]
    if shown:
        alpha = statistics.fmean(shown)
        variants.append((Pool.SPECULATIVE.value, ("--acceptance", f"{alpha:.3f}"), f"a = {alpha:.2f}, as measured"))
    simulated: list[Point] = []
    for mode, extra, label in variants:
        log = workdir / f"sim-{mode}-{len(simulated)}.log"
        argv = launch.sim_argv("--profile-file", str(path), "--mode", mode, "--seed", str(args.seed), *extra)
        sim = launch.spawn(argv, log)
        try:
            url = await launch.wait_ready(sim, log)
            simulated += [replace(p, label=label) for p in await measure([url], work, {url: mode})]
        finally:
            await launch.terminate(sim)
    return {
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "rounds": args.rounds,
        "sweep": args.sweep,
        "calibration": result.report(),
        "profile": json.loads(path.read_bytes()),
        "real": [asdict(p) for p in real],
        "simulated": [asdict(p) for p in simulated],
    }


def rows(results: dict[str, object]) -> list[dict[str, object]]:
    """Per mode and concurrency: real and simulated TTFT and TPOT, and the simulation's deviation."""
    real = {(p["mode"], p["clients"]): p for p in results["real"]}  # type: ignore[attr-defined]
    out = []
    for s in results["simulated"]:  # type: ignore[attr-defined]
        r = real.get((s["mode"], s["clients"]))
        if r is None:
            continue
        out.append(
            {
                "mode": s["mode"],
                "label": s.get("label", ""),
                "acceptance_real": r.get("acceptance"),
                "clients": s["clients"],
                "ttft_real_ms": r["ttft_ms"],
                "ttft_sim_ms": s["ttft_ms"],
                "ttft_deviation": s["ttft_ms"] / r["ttft_ms"] - 1,
                "tpot_real_ms": r["tpot_ms"],
                "tpot_sim_ms": s["tpot_ms"],
                "tpot_deviation": s["tpot_ms"] / r["tpot_ms"] - 1,
                "tokens_per_step_real": r["tokens_per_step"],
                "tokens_per_step_sim": s["tokens_per_step"],
            }
        )
    return out


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench cpu-fidelity") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", choices=("full", "quick"), default="full")
    default = Workload()
    parser.add_argument("--concurrency", type=lambda t: [int(v) for v in t.split(",")], default=default.concurrency)
    parser.add_argument("--prompt-tokens", type=int, default=default.prompt_tokens)
    parser.add_argument("--output-tokens", type=int, default=default.output_tokens)
    parser.add_argument("--rounds", type=int, default=default.rounds)
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/cpu-fidelity"))
    parser.add_argument("--report", type=Path, default=Path("docs/fidelity.md"), help="where fidelity.md goes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="specgate-cpu-fidelity-") as tmp:
        results = asyncio.run(run(args, Path(tmp)))
    results["command"] = " ".join([prog, *(sys.argv[1:] if argv is None else argv)]).strip()
    results["rows"] = rows(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = fidelity.report(cpu=results)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(text)
    print(fidelity.cpu_section(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
