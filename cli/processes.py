"""`specgate serve --workers N`: N gateway processes on one port, and the supervisor that keeps them.

One Python process routes on one core. N processes listen on the same port (SO_REUSEPORT: the
kernel spreads connections over them), each a whole gateway. They count each other's requests on
every replica through a small shared file (`workers/shared.py`), so that together they route as one
gateway; their counters and histograms are summed in /metrics (Prometheus's multiprocess files);
a policy document reaches them all through the store (Redis), as it reaches several gateways.

The supervisor serves nothing. It keeps the port bound for its life (so that a restarted process
finds it free), starts the processes (`specgate serve ... --process I`) with their output passed
through as theirs, restarts one that dies (after 1 s, doubling up to 30 s while it keeps dying),
and on SIGTERM or SIGINT passes the signal on and waits for them to finish their requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specgate.workers.launch import die_with_parent
from specgate.workers.shared import SharedCounts

_log = logging.getLogger("specgate.processes")

RESTART_S = (1.0, 30.0)
"""The first delay before restarting a process that died, and the longest (doubling between)."""
STEADY_S = 60.0
"""A process that ran this long before dying is restarted after the first delay again."""


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, not listening: the port stays this gateway's
    (0 picks one) while its processes listen on it beside."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class Supervisor:
    def __init__(
        self, argv: Sequence[str], count: int, host: str, port: int, grace_s: float, others: bool = False
    ) -> None:
        self.argv = list(argv)
        """`specgate serve` as it was called: each process runs it with its place added."""
        self.count = count
        self.host = host
        self.port = port
        self.grace_s = grace_s
        self.others = others
        """The shared counts keep a row for other gateways' (`gateway/exchange.py`)."""
        self.stopping = False
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.ready: dict[int, asyncio.Event] = {i: asyncio.Event() for i in range(count)}

    async def run(self, on_ready: Callable[[str], None]) -> None:
        sock = reserve_port(self.host, self.port)
        port = sock.getsockname()[1]
        counts = SharedCounts.create(self.count, others=self.others)
        metrics = Path(tempfile.mkdtemp(prefix="specgate-metrics-"))
        tasks = [
            asyncio.create_task(self._keep(i, port, counts, metrics), name=f"process-{i}") for i in range(self.count)
        ]
        try:
            await asyncio.gather(*(event.wait() for event in self.ready.values()))
            host = f"[{self.host}]" if ":" in self.host else self.host
            on_ready(f"http://{host}:{port}")
            await asyncio.gather(*tasks)
        finally:
            self.stopping = True
            await asyncio.gather(*(self._stop(proc) for proc in self.procs.values()))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sock.close()
            counts.unlink(missing_ok=True)
            shutil.rmtree(metrics, ignore_errors=True)

    async def _keep(self, index: int, port: int, counts: Path, metrics: Path) -> None:
        """Process `index`, restarted whenever it dies, until the supervisor stops."""
        delay = RESTART_S[0]
        while not self.stopping:
            argv = [*self.argv, "--port", str(port), "--process", str(index), "--shared-counts", str(counts),
                    "--metrics-dir", str(metrics)]  # fmt: skip
            env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics)}
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, env={**os.environ, **env}, preexec_fn=die_with_parent,
            )  # fmt: skip
            self.procs[index] = proc
            assert proc.stdout is not None
            async for line in proc.stdout:
                if PROCESS_READY in line:
                    self.ready[index].set()
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
            code = await proc.wait()
            if self.stopping:
                return
            # Its requests died with it: none counted meanwhile (the first's exchange too: nor the others').
            SharedCounts(counts, self.count, index, self.others).close()
            if time.monotonic() - started > STEADY_S:
                delay = RESTART_S[0]
            _log.error(
                "gateway process %d/%d (pid %d) exited with %s; restarting it in %g s",
                index + 1,
                self.count,
                proc.pid,
                code,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_S[1])

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.grace_s + 5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


PROCESS_READY = b"specgate: gateway process "
"""How a process's first line begins once it listens (`ready_line`)."""


def ready_line(index: int, count: int, url: str) -> str:
    return f"{PROCESS_READY.decode()}{index + 1}/{count} serving on {url}"
