"""Speculation that loses, on real vLLM: a draft-model server whose 4-layer draft accepts next to
nothing, beside a plain server (scripts/setup-vllm builds both once). Where the n-gram server wins
copy-heavy prompts (tests/test_real_vllm.py), this one loses them: the gateway must read that from
the server's own counters and send them to the plain server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from specgate.calibration.modes import Pool
from specgate.gateway.app import make_app
from specgate.gateway.config import GatewaySettings
from specgate.gateway.state import FLEET
from specgate.policies.document import PolicyDocument
from specgate.testing import VLLM_MODEL, cpu_pools, draft_model, running_app, setup_vllm
from specgate.workers.pools import FleetSettings
from specgate.workers.vllm_launch import start, stop, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 4
COPY = {
    "model": VLLM_MODEL, "max_tokens": 48, "temperature": 0,
    "messages": [{"role": "user", "content": f"Repeat the following code exactly, with no changes:\n\n{CODE}"}],
}  # fmt: skip


async def test_a_draft_model_that_loses_gets_no_copy_prompts(tmp_path: Path) -> None:
    python, model = setup_vllm()
    plan = cpu_pools(python, model, tmp_path, draft_model(model))
    assert plan.servers[0].speculative_config is not None
    assert plan.servers[0].speculative_config["method"] == "draft_model"
    servers = start(plan)
    try:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(wait_healthy(s, 600, session) for s in servers))
        urls = {s.spec.pool: (s.spec.url,) for s in servers}
        settings = GatewaySettings(
            models=(VLLM_MODEL,), pools=urls, port=0, policy=PolicyDocument(policy="adaptive"),
            fleet=FleetSettings(scrape_interval_s=0.1, hang_after_s=120.0),
        )  # fmt: skip
        app = make_app(settings)
        async with running_app(app) as url, aiohttp.ClientSession() as session:

            async def send(headers: dict[str, str]) -> str:
                async with session.post(f"{url}/v1/chat/completions", json=COPY, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                    return r.headers["x-route-pool"]

            for _ in range(3):  # each server serves a few, so its counters and timings speak
                assert await send({"x-route-pool": "speculative"}) == "speculative"
                assert await send({"x-route-pool": "plain"}) == "plain"
            spec = app[FLEET].replicas["spec-0"]
            for _ in range(50):  # a scrape after the last of them
                if spec.tokens_per_step is not None and spec.load is not None and spec.load.running == 0:
                    break
                await asyncio.sleep(0.1)
            # The draft guesses almost nothing: about one token a step, where n-gram copies several.
            assert spec.tokens_per_step is not None
            assert spec.tokens_per_step < 1.3
            chosen = [await send({}) for _ in range(4)]
            slo = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "10000"}
            chosen += [await send(slo) for _ in range(4)]
    finally:
        await stop(servers)
    assert chosen.count(Pool.PLAIN.value) >= 7, chosen  # one may explore the other pool
