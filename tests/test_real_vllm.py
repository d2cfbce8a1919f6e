"""The whole system against real vLLM: one n-gram speculative and one plain server of SmolLM2-135M
on this CPU (scripts/setup-vllm builds them once), the gateway in front, the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from specgate.bench.calibrate import QUICK, calibrate
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import PROFILES
from specgate.gateway.app import make_app
from specgate.gateway.config import GatewaySettings
from specgate.gateway.state import FLEET, RELAY
from specgate.policies.document import PolicyDocument
from specgate.testing import VLLM_MODEL, cpu_args, cpu_pools, free_port, running_app, sample_value, setup_vllm
from specgate.workers import launch
from specgate.workers.pools import FleetSettings
from specgate.workers.vllm_launch import Running, alive, start, stop, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MODEL = VLLM_MODEL
CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 4
COPY = f"Repeat the following code exactly, with no changes:\n\n{CODE}"


def test_pools_up_detached_and_down(tmp_path: Path) -> None:
    """The command line as an operator runs it: first in this module, before the shared servers start."""
    python, model = setup_vllm()
    port = free_port()
    config = tmp_path / "specgate.toml"
    config.write_text(
        f'[launch]\npython = "{python}"\nmodel = "{model}"\nserved_model_name = "{MODEL}"\n'
        f"args = {json.dumps(cpu_args(1024))}\n"
        'env = { VLLM_CPU_KVCACHE_SPACE = "1" }\nlog_dir = "logs"\n'
        f"[[launch.plain]]\nport = {port}\n"
    )
    cli = launch.specgate_argv("pools")
    up = subprocess.run([*cli, "up", "--config", str(config), "--detach"], capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stderr
    assert f'urls = ["http://127.0.0.1:{port}"]' in up.stdout  # the gateway config that routes to it
    assert (tmp_path / "logs" / "plain-0.log").stat().st_size > 0
    pid = json.loads((tmp_path / "logs" / "pools.json").read_text())[0]["pid"]
    assert alive(pid)  # still running after `pools up` returned
    mapped = launch.shared_memory(pid)
    down = subprocess.run([*cli, "down", "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert "plain-0" in down.stdout
    assert not alive(pid)
    assert not launch.group_alive(pid)  # the engine core and its helpers went with it
    assert not [path for path in mapped if path.exists()]  # and their shared memory (vLLM's queues)


@dataclass
class RealPools:
    spec: Running
    plain: Running

    def urls(self) -> dict[Pool, tuple[str, ...]]:
        return {Pool.SPECULATIVE: (self.spec.spec.url,), Pool.PLAIN: (self.plain.spec.url,)}


@pytest.fixture(scope="module")
def real_pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealPools]:
    python, model = setup_vllm()
    servers = start(cpu_pools(python, model, tmp_path_factory.mktemp("vllm")))

    async def ready() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(wait_healthy(s, 600, session) for s in servers))
            # The first request to a server is slow (compilation, caches): pay it here.
            body = {"model": MODEL, "messages": [{"role": "user", "content": COPY}], "max_tokens": 16}
            for s in servers:
                async with session.post(f"{s.spec.url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()

    try:
        asyncio.run(ready())
        yield RealPools(*servers)
    finally:
        asyncio.run(stop(servers))


@contextlib.asynccontextmanager
async def gateway(pools: RealPools, policy: str = "adaptive") -> AsyncIterator[tuple[str, web.Application]]:
    settings = GatewaySettings(
        models=(MODEL,),
        pools=pools.urls(),
        port=0,
        policy=PolicyDocument(policy=policy),
        # Two CPU servers sharing two cores have been seen to answer nothing for over 20 s (the default
        # for ejecting a replica as hung); what these tests check is routing, not hang detection.
        fleet=FleetSettings(scrape_interval_s=0.1, hang_after_s=120.0),
    )
    app = make_app(settings)
    async with running_app(app) as url:
        yield url, app


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


async def server_gauge(server: Running, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{server.spec.url}/metrics") as r:
        value = sample_value(await r.text(), name)
    assert value is not None, f"{name} not on {server.spec.url}/metrics"
    return value


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_through_the_gateway(real_pools: RealPools, stream: bool) -> None:
    messages: Any = [{"role": "user", "content": "Name three colours."}]
    async with gateway(real_pools) as (url, _), client(url) as api:
        if stream:
            text, usage = "", None
            async with api.chat.completions.with_streaming_response.create(
                model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
                stream_options={"include_usage": True},
            ) as raw:  # fmt: skip
                headers = raw.headers
                async for chunk in await raw.parse():
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                    usage = chunk.usage or usage
        else:
            raw_reply = await api.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=24, temperature=0
            )
            headers, reply = raw_reply.headers, raw_reply.parse()
            text, usage = reply.choices[0].message.content or "", reply.usage
    assert text.strip()
    assert usage is not None
    assert 0 < usage.completion_tokens <= 24
    assert headers["x-route-pool"] in ("speculative", "plain")
    assert headers["x-route-replica"] in ("spec-0", "plain-0")
    assert float(headers["x-predicted-ttft-ms"]) > 0


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_through_the_gateway(real_pools: RealPools, stream: bool) -> None:
    async with gateway(real_pools) as (url, _), client(url) as api:
        if stream:
            pieces = [c.choices[0].text async for c in await api.completions.create(
                model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True,
            ) if c.choices]  # fmt: skip
            text = "".join(pieces)
        else:
            reply = await api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12)
            text = reply.choices[0].text
            assert reply.usage is not None
            assert reply.usage.completion_tokens <= 12
    assert text.strip()


async def test_routing_follows_slo_headers(real_pools: RealPools) -> None:
    messages: Any = [{"role": "user", "content": "Say hello."}]

    async def reason(headers: dict[str, str]) -> tuple[str, str]:
        raw = await api.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, extra_headers=headers
        )
        return raw.headers["x-route-reason"], raw.headers["x-route-pool"]

    async with gateway(real_pools) as (url, _), client(url) as api:
        assert (await reason({}))[0] == "fastest"
        assert (await reason({"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "10000"}))[0] in ("meets-slo", "explore")
        with pytest.raises(openai.BadRequestError, match=r"x-slo-ttft-ms 0\.01 even idle") as refused:
            await reason({"x-slo-ttft-ms": "0.01"})  # out of reach of any replica: refused, not served late
        assert refused.value.code == "slo_infeasible"
        assert await reason({"x-route-pool": "plain"}) == ("forced", "plain")
        assert await reason({"x-route-pool": "speculative"}) == ("forced", "speculative")


async def test_routing_follows_load(real_pools: RealPools) -> None:
    """Long streams held open on the speculative server send the next requests to the plain one."""
    async with gateway(real_pools, "least-loaded") as (url, _), aiohttp.ClientSession() as session:
        long = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1500,
                "ignore_eos": True, "stream": True}  # fmt: skip
        held = []
        for _ in range(3):
            r = await session.post(f"{url}/v1/chat/completions", json=long, headers={"x-route-pool": "speculative"})
            await r.content.readany()  # streaming has begun: the server holds the request
            held.append(r)
        try:
            short = {"model": MODEL, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
            slo = {"x-slo-ttft-ms": "30000", "x-slo-tpot-ms": "5000"}
            for _ in range(3):
                sent = time.monotonic()
                async with session.post(f"{url}/v1/chat/completions", json=short, headers=slo) as r:
                    assert r.status == 200
                    took = f"{r.headers['x-route-reason']} after {time.monotonic() - sent:.1f} s"
                    assert r.headers["x-route-pool"] == "plain", took
        finally:
            for r in held:
                r.close()


async def test_the_scraper_reads_real_metrics_and_acceptance(real_pools: RealPools) -> None:
    async with gateway(real_pools) as (url, app), client(url) as api:
        await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": COPY}], max_tokens=96, temperature=0,
            extra_headers={"x-route-pool": "speculative"},
        )  # fmt: skip
        fleet = app[FLEET]
        for _ in range(50):  # a few scrape intervals, until one after the request finished
            spec = fleet.replicas["spec-0"]
            if spec.tokens_per_step is not None and spec.load is not None and spec.load.running == 0:
                break
            await asyncio.sleep(0.1)
        spec, plain = fleet.replicas["spec-0"], fleet.replicas["plain-0"]
        assert spec.healthy
        assert plain.healthy
        # n-gram drafts on a copy-heavy prompt: several tokens a step, read from vLLM's counters
        assert spec.tokens_per_step is not None
        assert spec.tokens_per_step > 1.5
        assert plain.tokens_per_step is None  # no spec_decode counters on a plain server
        for replica in (spec, plain):
            assert replica.load is not None
            assert replica.load.running == 0.0
            assert replica.load.kv_usage is not None


async def test_calibrating_the_real_servers(real_pools: RealPools) -> None:
    result = await calibrate(
        [real_pools.plain.spec.url, real_pools.spec.spec.url], QUICK, PROFILES["h100-llama31-8b"], "cpu-smollm2"
    )
    profile = result.file.profile
    assert (profile.model, profile.max_model_len) == (MODEL, 2048)
    assert profile.spec.num_speculative_tokens == 5  # deploy/cpu.toml's n-gram k, read from vLLM's counters
    assert 0.0 < profile.spec.acceptance_mean < 1.0
    assert profile.kv_capacity_tokens > 0
    # The fitted step model describes the plain server's decode steps (RMS relative error over the
    # quick sweep's few runs, on two cores the servers share with the test: 0.15 on the CI
    # machine, where one slow run weighs); its prefill on this CPU is not linear in the prompt
    # (attention dominates), which the printed fit error shows.
    assert result.target is not None
    assert result.target.errors["decode"] < 0.25
    assert "fit error over prefill steps" in result.report()


async def test_a_client_that_disconnects_frees_the_real_server(real_pools: RealPools) -> None:
    async with gateway(real_pools) as (url, _), aiohttp.ClientSession() as session:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 1800,
                "ignore_eos": True, "stream": True}  # fmt: skip
        r = await session.post(f"{url}/v1/chat/completions", json=body, headers={"x-route-pool": "plain"})
        await r.content.readany()
        assert await server_gauge(real_pools.plain, "vllm:num_requests_running") == 1.0
        r.close()  # the client goes away mid-stream
        for _ in range(100):
            if await server_gauge(real_pools.plain, "vllm:num_requests_running") == 0.0:
                break
            await asyncio.sleep(0.1)
        assert await server_gauge(real_pools.plain, "vllm:num_requests_running") == 0.0


async def test_the_n_gram_server_s_acceptance_is_predicted_per_request(real_pools: RealPools) -> None:
    """The n-gram server drafts much of a prompt asking to copy code that repeats and next to nothing
    of free text; after a few of each through the gateway, it predicts their TPOT apart."""
    copy = {"model": MODEL, "messages": [{"role": "user", "content": COPY}], "max_tokens": 64, "temperature": 0}
    free = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story about a dragon."}],
            "max_tokens": 64, "ignore_eos": True}  # fmt: skip
    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    spec = {"x-route-pool": "speculative"}
    async with gateway(real_pools) as (url, app), aiohttp.ClientSession() as session:

        async def run(body: dict[str, Any]) -> tuple[float, float]:
            """The TPOT predicted for it, and the TPOT it got (ms)."""
            async with session.post(f"{url}/v1/chat/completions", json={**body, **streamed}, headers=spec) as r:
                assert r.status == 200, await r.text()
                predicted = float(r.headers["x-predicted-tpot-ms"])
                first, tokens = None, 0
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = time.monotonic()
            assert first is not None
            assert tokens > 1
            return predicted, (time.monotonic() - first) * 1e3 / (tokens - 1)

        for _ in range(4):
            await run(copy)
            await run(free)
        (copy_predicted, copy_got), (free_predicted, free_got) = await run(copy), await run(free)
        speedups = app[RELAY].drafts
    assert copy_got < 0.8 * free_got  # the server does draft the copy, and not the story
    assert copy_predicted < 0.8 * free_predicted  # and the gateway knows which is which
    assert len(speedups.groups.counts) == 2
    # by about as much (the pool's mean would predict them alike)
    assert 0.5 < (copy_predicted / free_predicted) / (copy_got / free_got) < 2.0


async def test_killing_a_server_fails_no_request_that_had_not_started_and_its_stream_goes_on(
    real_pools: RealPools,
) -> None:
    """Last in this module: it kills the plain server, in the middle of a stream it is sending."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a haiku."}], "max_tokens": 24}
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Count slowly."}], "max_tokens": 400,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with gateway(real_pools, "round-robin") as (url, _), aiohttp.ClientSession() as session:

        async def one(delay: float) -> int:
            await asyncio.sleep(delay)
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status

        assert await one(0) == 200  # round robin: the next request goes to the plain server
        stream = await session.post(f"{url}/v1/chat/completions", json=long)
        assert stream.headers["x-route-replica"] == "plain-0"
        before = await stream.content.readuntil(b"\n\n")
        requests = [asyncio.create_task(one(0.15 * i)) for i in range(16)]
        await asyncio.sleep(0.8)  # some requests are on the plain server, not yet answered
        os.kill(real_pools.plain.proc.pid, signal.SIGKILL)
        statuses = await asyncio.gather(*requests)
        text = before + await stream.content.read()
        async with session.get(f"{url}/metrics") as r:
            resumed = sample_value(await r.text(), "specgate_stream_failovers_total", outcome="resumed")
    assert resumed == 1.0
    assert statuses == [200] * len(statuses)
    events = [e.removeprefix(b"data: ") for e in text.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    assert len({c["id"] for c in chunks}) == 1  # one response, though two servers wrote it
    assert chunks[-1]["usage"]["completion_tokens"] == 400  # every token once, by the servers' tokenizer
    assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
