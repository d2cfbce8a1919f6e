"""`specgate serve --workers N`: processes on one port that count each other's requests, supervised."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from specgate.cli.serve import ADMIN_TOKEN_ENV
from specgate.testing import SimProcess, gateway_config
from specgate.workers import launch

MODEL = "sim-model"
TOKEN = "processes-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def children(pid: int) -> set[int]:
    """The live child processes of `pid`, from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(stat.parent.name))
    return found


async def stream(url: str, started: asyncio.Event) -> bool:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/chat/completions", json=body) as r:
        text = b""
        async for chunk in r.content.iter_any():
            text += chunk
            started.set()
        return r.status == 200 and text.rstrip().endswith(b"data: [DONE]")


async def fleet_view(url: str) -> dict[str, object]:
    """/admin/fleet on a connection of its own: the kernel may hand it to either process."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/admin/fleet", headers=AUTH) as r:
        assert r.status == 200
        view: dict[str, object] = await r.json()
        return view


@pytest.mark.slow
async def test_processes_share_the_port_and_count_each_others_requests(
    sim_factory: Callable[..., SimProcess], tmp_path: Path
) -> None:
    sims = [sim_factory("--mode", mode, "--model", MODEL, "--time-scale", "2") for mode in ("speculative", "plain")]
    config = gateway_config(tmp_path / "specgate.toml", MODEL, [sims[0].url], [sims[1].url])
    log = tmp_path / "gateway.log"
    argv = launch.specgate_argv("serve", "--config", str(config), "--port", "0", "--workers", "2")
    supervisor = launch.spawn(argv, log, env={ADMIN_TOKEN_ENV: TOKEN})
    try:
        url = await launch.wait_ready(supervisor, log)  # once both processes listen
        assert "gateway process 1/2 serving on" in log.read_text()
        assert "gateway process 2/2 serving on" in log.read_text()
        first = children(supervisor.pid)
        assert len(first) == 2
        argv = (await asyncio.to_thread(Path(f"/proc/{min(first)}/cmdline").read_text)).split("\0")
        counts = Path(argv[argv.index("--shared-counts") + 1])

        started = [asyncio.Event() for _ in range(12)]
        streams = [asyncio.create_task(stream(url, e)) for e in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=30)
        answered_by = set()
        for _ in range(16):  # each process, whichever connections it got, counts all twelve
            view = await fleet_view(url)
            process = view["process"]
            assert isinstance(process, dict)
            answered_by.add(process["index"])
            replicas = view["replicas"]
            assert isinstance(replicas, list)
            assert sum(r["in_flight"] for r in replicas) == 12, replicas
        assert answered_by == {1, 2}
        assert all(await asyncio.gather(*streams))

        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/admin/policy", headers=AUTH) as r:
                document = await r.json()
            headers = {**AUTH, "If-Match": "*"}
            async with session.put(f"{url}/admin/policy", headers=headers, json=document) as r:
                assert r.status == 409  # it would reach one process of two: through the store only
                assert "--redis" in (await r.json())["error"]["message"]

            doomed = min(first)
            os.kill(doomed, signal.SIGKILL)
            for _ in range(100):  # until it is gone (connections the kernel queued for it broke with it)
                if "exited with -9" in log.read_text():
                    break
                await asyncio.sleep(0.05)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            for _ in range(10):  # the other process serves meanwhile (on new connections: the dead one's broke)
                async with aiohttp.ClientSession() as fresh, fresh.post(f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200
            for _ in range(100):
                now = children(supervisor.pid)
                if len(now) == 2 and doomed not in now:
                    break
                await asyncio.sleep(0.1)
            assert len(now) == 2  # restarted
            assert doomed not in now
            assert "exited with -9; restarting it in 1 s" in log.read_text()

        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/metrics") as r:  # counters summed over the processes, the dead one's too
                text = await r.text()
            served = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("specgate_requests_total{"))  # fmt: skip
            assert served == 22
    finally:
        await launch.terminate(supervisor, grace_s=20)
    assert not launch.group_alive(supervisor.pid)
    assert not await asyncio.to_thread(counts.exists)  # the supervisor leaves nothing behind


def test_several_processes_need_pools_of_their_own() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "specgate", "serve", "--workers", "2", "--port", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--workers" in done.stderr
    assert "--config" in done.stderr


# A process that makes a POSIX shared memory segment, says its name, and waits, deaf to SIGTERM:
# killed with its group, its resource tracker (which would unlink the segment) goes too, as with
# vLLM's helpers.
_HOLDS_SHARED_MEMORY = """
import signal, sys, time
from multiprocessing import shared_memory
signal.signal(signal.SIGTERM, signal.SIG_IGN)
segment = shared_memory.SharedMemory(create=True, size=1 << 20)
if len(sys.argv) > 1:  # and maps one made by someone else
    other = shared_memory.SharedMemory(name=sys.argv[1])
print(segment.name, flush=True)
time.sleep(600)
"""


def _words(log: Path) -> list[str]:
    return log.read_text().split()


async def said(log: Path) -> str:
    """The first word a process started with `log` as its output writes there."""
    for _ in range(200):
        if words := _words(log):
            return words[0]
        await asyncio.sleep(0.05)
    raise AssertionError(_words(log))


async def started_holding(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"{name}.log"
    proc = launch.spawn([sys.executable, "-c", _HOLDS_SHARED_MEMORY, *args], log)
    return proc, launch.SHARED_MEMORY / (await said(log)).lstrip("/")


@pytest.mark.skipif(not launch.SHARED_MEMORY.is_dir(), reason="no /dev/shm")
async def test_a_stopped_group_leaves_no_shared_memory_but_what_others_still_map(tmp_path: Path) -> None:
    outside, kept = await started_holding(tmp_path, "outside")
    try:
        inside, left = await started_holding(tmp_path, "inside", kept.name)
        try:
            assert launch.shared_memory(inside.pid) >= {left, kept}
        finally:
            await launch.terminate(inside, grace_s=0.5)  # SIGTERM ignored: SIGKILL to the group
        assert not left.exists()  # its own, gone with it
        assert kept.exists()  # mapped by a process still running: not its to remove
    finally:
        await launch.terminate(outside, grace_s=0.5)
    assert not kept.exists()


# A server whose helper takes a moment to leave on SIGTERM, and a semaphore of the kind vLLM's
# multiprocessing makes: unlinked by the resource tracker once every process of the group is gone.
_HOLDS_SEMAPHORE = """
import multiprocessing, signal, sys, time

def linger():
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5), sys.exit(0)))
    time.sleep(600)

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    lock = context.Lock()
    context.Process(target=linger).start()
    print(lock._semlock.name, flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not launch.SHARED_MEMORY.is_dir(), reason="no /dev/shm")
async def test_a_stopped_group_leaves_no_semaphore_behind(tmp_path: Path) -> None:
    """The leader dies at SIGTERM, leaving its semaphore to the resource tracker, which unlinks it
    once the helper has left too: killed as soon as the leader was gone, the tracker left it."""
    script = tmp_path / "holds_semaphore.py"
    script.write_text(_HOLDS_SEMAPHORE)
    log = tmp_path / "semaphore.log"
    proc = launch.spawn([sys.executable, str(script)], log)
    semaphore = launch.SHARED_MEMORY / f"sem.{(await said(log)).lstrip('/')}"
    assert semaphore.exists()
    await launch.terminate(proc, grace_s=10.0)
    assert not launch.group_alive(proc.pid)
    assert not semaphore.exists()
