"""A gateway whose profile is three times too fast for its replicas learns their step costs from
their answers: its predictions converge to those of a gateway that knows the replicas' true costs,
and /admin/fleet and /metrics say what it learned."""

from __future__ import annotations

import asyncio
import datetime
import math
import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
import pytest

from specgate.calibration import profile_file
from specgate.calibration.costs import LinearStepModel
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import H100_LLAMA31_8B, Profile
from specgate.gateway.app import make_app
from specgate.gateway.config import GatewaySettings
from specgate.policies.document import parse
from specgate.testing import SimProcess, running_app, sample_value, start_sim, stop_process
from specgate.workers.pools import FleetSettings

MODEL = "sim-model"
TOKEN = "admin-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SLOWER = 3.0


def truth() -> profile_file.ProfileFile:
    """What the simulated replicas really cost: the gateway's profile, SLOWER times dearer."""
    return profile_file.ProfileFile(slower(SLOWER), "a test", datetime.date(2026, 12, 1))


def slower(factor: float) -> Profile:
    """The gateway's profile, every cost `factor` times dearer: other hardware."""
    steps = H100_LLAMA31_8B.steps
    assert isinstance(steps, LinearStepModel)
    draft = H100_LLAMA31_8B.spec.draft
    return replace(
        H100_LLAMA31_8B,
        name="h100-slower",
        steps=replace(steps, base_ms=steps.base_ms * factor, per_token_us=steps.per_token_us * factor,
                      per_kv_token_ns=steps.per_kv_token_ns * factor, step_overhead_ms=steps.step_overhead_ms * factor),
        spec=replace(H100_LLAMA31_8B.spec, draft=replace(draft, step_fixed_ms=draft.step_fixed_ms * factor,
                                                         pass_ms=draft.pass_ms * factor)),
    )  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Pool, tuple[str, ...]]]:
    root = tmp_path_factory.mktemp("fit")
    real = truth()
    path = root / "slower.json"
    path.write_bytes(profile_file.dumps(real.profile, real.source, real.created))
    sims: list[SimProcess] = []
    try:
        for mode in ("speculative", "plain"):
            sims.append(start_sim(root / f"{mode}.log", "--mode", mode, "--model", MODEL, "--profile-file", str(path)))
        yield {Pool.SPECULATIVE: (sims[0].url,), Pool.PLAIN: (sims[1].url,)}
    finally:
        for sim in sims:
            stop_process(sim.proc)


@dataclass(frozen=True)
class Seen:
    pool: str
    ttft_ms: float
    tpot_ms: float
    predicted_ttft_ms: float
    predicted_tpot_ms: float


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> Seen:
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta")) for _ in range(rng.randrange(10, 400)))
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": rng.randrange(12, 40)}  # fmt: skip
    loop = asyncio.get_running_loop()
    started = loop.time()
    times, tokens = [], 0
    async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps(body)) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                if chunk["choices"]:
                    times.append(loop.time())
                elif chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        headers = r.headers
    ttft = (times[0] - started) * 1e3
    tpot = (times[-1] - times[0]) * 1e3 / max(tokens - 1, 1)  # a speculative step sends several tokens
    return Seen(headers["x-route-pool"], ttft, tpot, float(headers["x-predicted-ttft-ms"]),
                float(headers["x-predicted-tpot-ms"]))  # fmt: skip


def _log_ratios(seen: list[Seen], kind: str) -> list[float]:
    """log(measured / predicted) of each request's `kind` (ttft, tpot)."""
    return [math.log(getattr(s, f"{kind}_ms") / getattr(s, f"predicted_{kind}_ms")) for s in seen]


def off(seen: list[Seen], kind: str) -> float:
    """Median |log(measured / predicted)|: how far single predictions miss, either way."""
    return statistics.median(abs(r) for r in _log_ratios(seen, kind))


def bias(seen: list[Seen], kind: str) -> float:
    """Median log(measured / predicted): how far the predictions miss on the whole."""
    return statistics.median(_log_ratios(seen, kind))


async def drive(settings: GatewaySettings) -> tuple[list[Seen], dict[str, Any], str]:
    """240 requests, 4 at once, through a gateway of `settings`; what they saw, and then the
    gateway's /admin/fleet and /metrics."""
    rng = random.Random(3)
    seen: list[Seen] = []
    async with running_app(make_app(settings)) as url, aiohttp.ClientSession() as session:
        for _ in range(60):
            seen += await asyncio.gather(*(one(session, url, rng) for _ in range(4)))
        async with session.get(f"{url}/admin/fleet", headers=AUTH) as r:
            assert r.status == 200
            report: dict[str, Any] = await r.json()
        async with session.get(f"{url}/metrics") as r:
            metrics = await r.text()
        async with session.get(f"{url}/admin/fleet") as r:
            assert r.status == 401  # the admin token guards it
    return seen, report, metrics


@pytest.mark.slow
async def test_a_profile_three_times_too_fast_is_refitted(fleet: dict[Pool, tuple[str, ...]]) -> None:
    real = truth()
    profiles = profile_file.with_files([real])
    base = GatewaySettings(models=(MODEL,), pools=fleet, port=0, admin_token=TOKEN, profiles=profiles,
                           fleet=FleetSettings(scrape_interval_s=0.05))  # fmt: skip

    def routing_on(profile: str) -> GatewaySettings:
        document = parse({"schema_version": 1, "policy": "adaptive", "profile": profile}, profiles=profiles)
        return replace(base, policy=document)

    # What the model misses when it knows the replicas' true costs (the same requests, on the same
    # machine as loaded): the most a refit can hope for.
    oracle, _, _ = await drive(routing_on(real.profile.name))
    seen, report, metrics = await drive(routing_on(H100_LLAMA31_8B.name))
    first, last = seen[:4], seen[-80:]  # the first four went out before any answer came back
    for kind in ("ttft", "tpot"):
        assert off(first, kind) > 0.6, kind  # a profile 3x too fast: predictions off by about log 3
        assert abs(bias(last, kind)) < 0.1, kind  # converged: off by under 10% on the whole
        # and about as sharp as the truth's: the oracle's own TTFT error moved from 0.085 to 0.21
        # between runs of this test on one machine (the refit's from 0.165 to 0.19), by the moments
        # its requests met the simulated replicas' steps
        assert off(last, kind) < off(oracle[-80:], kind) + 0.1, kind
    assert report["profile"] == H100_LLAMA31_8B.name
    busiest = max(report["pools"], key=lambda pool: report["pools"][pool]["answers"])
    fit = report["pools"][busiest]
    assert fit["answers"] >= 100
    step = fit["step_ms_at_context_1024"]["batch 1"]
    assert 2.0 < step["fitted"] / step["profile"] < 4.0
    assert {r["name"] for r in report["replicas"]} == {"spec-0", "plain-0"}
    scale = sample_value(metrics, "specgate_step_cost_scale", pool=busiest, term="fixed")
    assert scale == pytest.approx(fit["scales"]["fixed"], rel=0.05)
    assert sample_value(metrics, "specgate_step_cost_answers", pool=busiest, use="all") == fit["answers"]
    assert sample_value(metrics, "specgate_step_cost_answers", pool=busiest, use="fitted") == fit["fitted"]
