"""Local services that benchmarks and tests start for themselves: a real redis-server."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from workers import launch


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
