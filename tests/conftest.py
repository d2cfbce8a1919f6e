"""Shared fixtures: simulated replicas started as real subprocesses on free ports."""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from workers import launch


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
        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return 0.0

    def wait_for(self, name: str, predicate: object, timeout: float = 10.0, **labels: str) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.sample(name, **labels)
            if callable(predicate) and predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} stayed at {value}")
            time.sleep(0.05)


def start_sim(log: Path, *args: str) -> SimProcess:
    """Start `specgate sim` on a free port and wait for its ready line."""
    proc = launch.spawn(launch.sim_argv(*args), log)
    try:
        url = asyncio.run(launch.wait_ready(proc, log))
    except launch.LaunchError:
        stop_process(proc)
        raise
    return SimProcess(url, proc, log)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    asyncio.run(launch.terminate(proc))


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
