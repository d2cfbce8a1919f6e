"""Gateways in front of one fleet: one killed under load loses only its own requests; gateways
sharing a Redis count each other's requests."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from specgate.cli.serve import ADMIN_TOKEN_ENV
from specgate.testing import RedisServer, SimProcess, equals, gateway_config, sample_value, until
from specgate.workers import launch

MODEL = "sim-model"
TOKEN = "gateways-test-token-0123456789"


async def stream(session: aiohttp.ClientSession, url: str, started: asyncio.Event) -> bool:
    """A long streamed answer: True when it ends with [DONE], False when its connection broke."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "ignore_eos": True,
            "stream": True}  # fmt: skip
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200
            text = b""
            async for chunk in r.content.iter_any():
                text += chunk
                started.set()
            return text.rstrip().endswith(b"data: [DONE]")
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return False


async def running(session: aiohttp.ClientSession, sim: SimProcess) -> float:
    async with session.get(f"{sim.url}/metrics") as r:
        return sample_value(await r.text(), "vllm:num_requests_running") or 0.0


@pytest.mark.slow
async def test_a_gateway_killed_under_load_loses_only_its_own_requests(
    sim_factory: Callable[..., SimProcess], tmp_path: Path
) -> None:
    sims = [sim_factory("--mode", mode, "--model", MODEL, "--time-scale", "10") for mode in ("speculative", "plain")]
    config = gateway_config(
        tmp_path / "specgate.toml", MODEL, [sims[0].url], [sims[1].url], "[scrape]\ninterval_ms = 100\n"
    )
    procs = [launch.spawn(launch.specgate_argv("serve", "--config", str(config), "--port", "0"), tmp_path / f"{n}.log")
             for n in ("doomed", "survivor")]  # fmt: skip
    try:
        doomed_url, survivor_url = [await launch.wait_ready(p, tmp_path / f"{n}.log")
                                    for p, n in zip(procs, ("doomed", "survivor"), strict=True)]  # fmt: skip
        async with aiohttp.ClientSession() as session:
            started = [asyncio.Event() for _ in range(16)]
            doomed = [asyncio.create_task(stream(session, doomed_url, e)) for e in started[:8]]
            survivor = [asyncio.create_task(stream(session, survivor_url, e)) for e in started[8:]]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=30)
            launch.signal_group(procs[0].pid, signal.SIGKILL)  # mid-stream, no chance to clean up
            lost = await asyncio.gather(*doomed)
            kept = await asyncio.gather(*survivor)
            assert not any(lost)
            assert all(kept), kept  # every one of the survivor's streams ended whole
            # the survivor still routes to both replicas, none ejected for what the other did
            async with session.get(f"{survivor_url}/ready") as r:
                ready = await r.json()
            assert {name: rep["healthy"] for name, rep in ready["replicas"].items()} == {
                "spec-0": True,
                "plain-0": True,
            }
            more = [asyncio.Event() for _ in range(4)]
            assert all(await asyncio.gather(*(stream(session, survivor_url, e) for e in more)))
            # and the replicas let go of the dead gateway's requests: nothing left running
            for _ in range(100):
                if sum([await running(session, s) for s in sims]) == 0:
                    break
                await asyncio.sleep(0.1)
            assert sum([await running(session, s) for s in sims]) == 0
    finally:
        for p in procs:
            await launch.terminate(p)


async def counted(url: str) -> tuple[int, float | None]:
    """What a gateway counts in flight on the fleet, and how many other gateways it counts."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as session:  # a connection of its own: either process may answer
        async with session.get(f"{url}/admin/fleet", headers=headers) as r:
            view = await r.json()
            replicas = view["replicas"]
            assert view["exchange"]["gateways_counted"] in (0, 1)
        async with session.get(f"{url}/metrics") as r:
            others = sample_value(await r.text(), "specgate_gateways_counted")
    return sum(rep["in_flight"] for rep in replicas), others


@pytest.mark.slow
async def test_gateways_on_one_redis_count_each_others_requests(
    sim_factory: Callable[..., SimProcess], redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two gateways sharing the policy's Redis, one of two processes: each counts the other's
    requests as they are sent; a gateway that dies stops being counted once its counts are stale."""
    sims = [sim_factory("--mode", mode, "--model", MODEL, "--time-scale", "10") for mode in ("speculative", "plain")]
    store = f'[store]\nurl = "{redis_server.url}"\nexchange_ms = 20\nexchange_stale_ms = 500\n'
    config = gateway_config(tmp_path / "specgate.toml", MODEL, [sims[0].url], [sims[1].url], store)
    env = {ADMIN_TOKEN_ENV: TOKEN}
    alone = launch.spawn(launch.specgate_argv("serve", "--config", str(config), "--port", "0"), tmp_path / "a.log",
                         env=env)  # fmt: skip
    pair = launch.spawn(launch.specgate_argv("serve", "--config", str(config), "--port", "0", "--workers", "2"),
                        tmp_path / "b.log", env=env)  # fmt: skip
    try:
        alone_url = await launch.wait_ready(alone, tmp_path / "a.log")
        pair_url = await launch.wait_ready(pair, tmp_path / "b.log")
        async with aiohttp.ClientSession() as session:
            started = [asyncio.Event() for _ in range(8)]
            streams = [asyncio.create_task(stream(session, alone_url, e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=30)
            assert await until(lambda: equals(counted(pair_url), (8, 1.0)), timeout_s=5.0), await counted(pair_url)
            for _ in range(6):  # whichever of its processes answers
                assert await counted(pair_url) == (8, 1.0)
            assert await counted(alone_url) == (8, 1.0)  # its own; the pair, with nothing in flight, counted
            launch.signal_group(alone.pid, signal.SIGKILL)
            assert not any(await asyncio.gather(*streams))
            assert await until(lambda: equals(counted(pair_url), (0, 0.0)), timeout_s=5.0), await counted(pair_url)
            assert all(await asyncio.gather(*(stream(session, pair_url, asyncio.Event()) for _ in range(2))))
            redis_server.stop()  # the exchange fails, the gateway serves on
            assert await until(lambda: equals(failures(pair_url), True), timeout_s=5.0)
            assert all(await asyncio.gather(*(stream(session, pair_url, asyncio.Event()) for _ in range(2))))
    finally:
        for p in (alone, pair):
            await launch.terminate(p)


async def failures(url: str) -> bool:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        return (sample_value(await r.text(), "specgate_count_exchange_failures_total") or 0.0) > 0
