"""Shared fixtures: simulated replicas and a real redis-server, started as subprocesses on free ports."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from specgate.testing import RedisServer, free_port
from specgate.workers import launch


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a Prometheus exposition, matched by name and labels; None when absent."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


@dataclass
class SimProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            body: bytes = response.read()
            return body.decode()

    def sample(self, name: str, **labels: str) -> float:
        """The value of one sample on /metrics (0.0 when absent), matched by name and labels."""
        value = sample_value(self.metrics_text(), name, **labels)
        return 0.0 if value is None else value

    def wait_for(self, name: str, predicate: object, timeout: float = 10.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.sample(name, **labels)
            if callable(predicate) and predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed at {value}")
            time.sleep(0.05)


def start_sim(log: Path, *args: str, wait_s: float = 30.0) -> SimProcess:
    """Start `specgate sim` on a free port and wait for its ready line (blocking: async tests call it too)."""
    proc = launch.spawn(launch.sim_argv(*args), log)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        if url := launch.ready_url(log):
            return SimProcess(url, proc, log)
        time.sleep(0.05)
    stop_process(proc)
    raise launch.LaunchError(f"simulated replica did not start:\n{log.read_text(errors='replace')}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def sim_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., SimProcess]]:
    started: list[SimProcess] = []

    def factory(*args: str) -> SimProcess:
        sim = start_sim(tmp_path_factory.mktemp("sim") / "sim.log", *args)
        started.append(sim)
        return sim

    yield factory
    for sim in started:
        stop_process(sim.proc)


@contextlib.asynccontextmanager
async def running_app(app: web.Application) -> AsyncIterator[str]:
    """Serve an application in this event loop on a free port; yield its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup --dev (the README's test command does)")
    server = RedisServer(free_port(), tmp_path)
    server.start()
    yield server
    server.stop()
