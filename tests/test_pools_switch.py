"""`specgate pools switch` on real vLLM: a server restarted with speculation and back without it,
under steady traffic through a gateway that follows the policy store, and not one request lost."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from specgate.gateway.app import make_app
from specgate.gateway.config import load_settings
from specgate.testing import VLLM_MODEL, RedisServer, cpu_args, free_port, running_app, sample_value, setup_vllm
from specgate.workers import launch
from specgate.workers.vllm_launch import alive, records

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TOKEN = "admin-token-0123456789"
JSON = {"content-type": "application/json"}
PROMPT = "Repeat exactly: " + "the quick brown fox jumps over the lazy dog. " * 6


def config(tmp_path: Path, redis_url: str) -> Path:
    python, model = setup_vllm()
    cpus = sorted(os.sched_getaffinity(0))  # a core each where there are two: a restart beside a busy server
    path = tmp_path / "specgate.toml"
    path.write_text(
        f'[launch]\npython = "{python}"\nmodel = "{model}"\nserved_model_name = "{VLLM_MODEL}"\n'
        f"args = {json.dumps(cpu_args(1024))}\n"
        'env = { VLLM_CPU_KVCACHE_SPACE = "1" }\nlog_dir = "logs"\n'
        f"[[launch.speculative]]\nport = {free_port()}\ncpus = [{cpus[0]}]\n"
        'speculative_config = { method = "ngram", num_speculative_tokens = 3, prompt_lookup_max = 3, '
        "prompt_lookup_min = 2 }\n"
        f"[[launch.plain]]\nport = {free_port()}\ncpus = [{cpus[-1]}]\n"
        f'[store]\nurl = "{redis_url}"\nrefresh_ms = 200\n'
        '[policy]\npolicy = "round-robin"\n'
    )
    return path


async def traffic(url: str, stop: asyncio.Event, seen: Counter[tuple[int, str, str]]) -> None:
    """One client, streamed and whole answers in turn, until `stop`: every answer's status, pool and
    replica counted (a stream counts as 200 only when it ended with [DONE])."""
    async with aiohttp.ClientSession() as session:
        n = 0
        while not stop.is_set():
            n += 1
            stream = n % 2 == 0
            body = {"model": VLLM_MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
                    "stream": stream}  # fmt: skip
            try:
                async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps(body), headers=JSON) as r:
                    text = await r.text()
                    if r.status != 200:
                        sys.stderr.write(f"{r.status}: {text[:300]}\n")
                    ok = r.status == 200 and (not stream or text.rstrip().endswith("data: [DONE]"))
                    seen[(200 if ok else r.status, r.headers.get("x-route-pool", ""),
                          r.headers.get("x-route-replica", ""))] += 1  # fmt: skip
            except aiohttp.ClientError as exc:
                seen[(599, repr(exc), "")] += 1


async def switch(config_path: Path, server: str, to: str) -> dict[str, object]:
    proc = await asyncio.create_subprocess_exec(
        *launch.specgate_argv("pools", "switch", server, "--to", to, "--config", str(config_path), "--settle-s", "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=600)
    assert proc.returncode == 0, err.decode()
    sys.stderr.write(err.decode())
    result: dict[str, object] = json.loads(out)
    return result


@pytest.fixture
def detached(tmp_path: Path) -> Iterator[Path]:
    """Both servers started by a detached `pools up`, a Redis for the policy, the config; after
    the test, `pools down` stops whatever process each server is then, and nothing is left."""
    redis = RedisServer(free_port(), tmp_path)
    redis.start()
    path = config(tmp_path, redis.url)
    cli = launch.specgate_argv("pools")
    try:
        argv = [*cli, "up", "--config", str(path), "--detach"]
        up = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        assert up.returncode == 0, up.stderr
        yield path
    finally:
        pids = [r.pid for r in records(tmp_path / "logs")]
        down = subprocess.run([*cli, "down", "--config", str(path)], capture_output=True, text=True, timeout=120)
        redis.stop()
    assert down.returncode == 0, down.stderr
    assert not any(alive(pid) or launch.group_alive(pid) for pid in pids)


@pytest.mark.timeout(900)
async def test_a_server_switches_mode_under_traffic_without_a_failed_request(detached: Path) -> None:
    path = detached
    settings = dataclasses.replace(load_settings(path), port=0, admin_token=TOKEN)
    assert settings.launch is not None
    plain = next(s for s in settings.launch.servers if s.name == "plain-0")
    async with running_app(make_app(settings)) as url, aiohttp.ClientSession() as session:
        drafts = "vllm:spec_decode_num_drafts_total"
        async with session.get(f"{plain.url}/metrics") as r:
            assert sample_value(await r.text(), drafts) is None  # a plain server has no drafts to count
        stop = asyncio.Event()
        seen: Counter[tuple[int, str, str]] = Counter()
        clients = [asyncio.create_task(traffic(url, stop, seen)) for _ in range(3)]
        await asyncio.sleep(2)
        to_spec = await switch(path, "plain-0", "speculative")
        assert to_spec["to"] == "speculative"
        for _ in range(100):  # re-admitted at the gateway's next scrapes
            if seen[(200, "speculative", "plain-0")] >= 3:
                break
            await asyncio.sleep(0.2)
        async with session.get(f"{url}/admin/fleet", headers={"authorization": f"Bearer {TOKEN}"}) as r:
            fleet = {rep["name"]: rep for rep in (await r.json())["replicas"]}
        assert fleet["plain-0"]["pool"] == "speculative"
        assert fleet["plain-0"]["available"]
        async with session.get(f"{plain.url}/metrics") as r:
            assert sample_value(await r.text(), drafts) is not None  # the server itself speculates now
        served_switched = seen[(200, "speculative", "plain-0")]
        await switch(path, "plain-0", "plain")
        await asyncio.sleep(2)
        stop.set()
        await asyncio.gather(*clients)
    failed = {k: n for k, n in seen.items() if k[0] != 200}
    assert not failed, failed
    assert served_switched > 0  # it served in the speculative pool between the switches
    assert seen[(200, "plain", "plain-0")] > 0
    assert sum(seen.values()) > 30
    assert [r.pool.value for r in records(settings.launch.log_dir)] == ["speculative", "plain"]
