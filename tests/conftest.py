"""Shared fixtures: simulated replicas and a real redis-server, started as subprocesses on free ports
(the helpers behind them live in specgate.testing, shared with the benchmarks)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from specgate.testing import RedisServer, SimProcess, free_port, start_sim, stop_process


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


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup --dev (the README's test command does)")
    server = RedisServer(free_port(), tmp_path)
    server.start()
    yield server
    server.stop()
