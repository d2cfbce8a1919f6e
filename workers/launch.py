"""Starting and stopping child processes: replicas, servers and gateways under test.

A child is started with its output in a log file (a pipe nobody reads would fill and stall it),
in a process group of its own, and on Linux it is told to die with its parent, so a gateway
killed outright leaves no orphans. It is stopped with its whole group: vLLM's engine core and
its multiprocessing helpers (which ignore SIGTERM) go with the server that started them. What
shared memory the group had mapped is removed after it, unless something else still maps it: a
vLLM server stopped with its group left its message queues' segments in /dev/shm (400 MB of memory
a server, for good), the helper that would have removed them stopped with the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType

_READY = re.compile(r"listening on (http://\S+)")
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before exec: on Linux, be sent SIGTERM when the parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    detach: bool = False,
    cpus: Collection[int] = (),
) -> subprocess.Popen[bytes]:
    """Start a child with its output in `log`, in a session (and process group) of its own. It
    dies with this process unless `detach`, which leaves it running. With `cpus`, it and every
    process it starts run on those CPUs only."""

    def prepare() -> None:
        if not detach:
            die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    with log.open("wb") as out:
        return subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            preexec_fn=prepare,
            start_new_session=True,
        )


SPECGATE_MODULE = "specgate"
"""The one module path every specgate child process is started from: the command line."""


def specgate_argv(*args: str) -> list[str]:
    """The command line of a `specgate ...` child, run by this interpreter."""
    return [sys.executable, "-m", SPECGATE_MODULE, *args]


def module_argv(module: ModuleType, *args: str) -> list[str]:
    """The command line of a child that runs `module` (an imported module, so that the edge shows
    in the import graph), run by this interpreter."""
    return [sys.executable, "-m", module.__name__, *args]


def sim_argv(*args: str) -> list[str]:
    """The command line of a simulated replica on a free port."""
    return specgate_argv("sim", "--port", "0", *args)


def ready_url(log: Path) -> str | None:
    """The URL a replica printed once it listened, if it has."""
    match = _READY.search(log.read_text(errors="replace"))
    return match.group(1) if match else None


class LaunchError(RuntimeError):
    pass


def _not_started(log: Path) -> LaunchError:
    return LaunchError(f"replica did not start; its log ({log}) says:\n{log.read_text(errors='replace')[-2000:]}")


async def wait_ready(proc: subprocess.Popen[bytes], log: Path, wait_s: float = 30.0) -> str:
    """The replica's URL once it listens; LaunchError with its log if it exits or takes too long."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if url := ready_url(log):
            return url
        if proc.poll() is not None:
            break
        await asyncio.sleep(0.05)
    raise _not_started(log)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to every process of the group (none left is fine)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies awaiting their reaper do not)."""
    return any(True for _ in _members(pgid))


def _members(pgid: int) -> Iterator[Path]:
    """The /proc directories of the group's running processes."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                yield stat.parent


SHARED_MEMORY = Path("/dev/shm")


def shared_memory(pgid: int) -> set[Path]:
    """The files of /dev/shm the group's processes map (POSIX shared memory and semaphores): what
    they leave behind, in memory, if they are stopped before they unlink them."""
    return {path for member in _members(pgid) for path in _mapped(member)}


def remove_unmapped(paths: Collection[Path]) -> list[Path]:
    """Unlink those of `paths` (a stopped group's shared memory) that no running process maps;
    the paths removed."""
    if not paths:
        return []
    mapped = set().union(*(_mapped(member) for member in Path("/proc").glob("[0-9]*")))
    removed = []
    for path in sorted(set(paths) - mapped):
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


def _mapped(member: Path) -> set[Path]:
    """The files of /dev/shm a process maps, by its /proc directory (none if it is gone)."""
    found = set()
    with contextlib.suppress(OSError):
        for line in (member / "maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHARED_MEMORY}/") and not fields[5].endswith("(deleted)"):
                found.add(Path(fields[5]))
    return found


async def terminate(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM to the child's whole group, then SIGKILL to whatever of it is left after `grace_s`
    seconds (or `SETTLE_S` after the child itself is gone); returns once the child is reaped and,
    within `GROUP_GONE_S` more, the rest of its group gone and their shared memory removed."""
    mapped = shared_memory(proc.pid)
    signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    await _reaped(proc, grace_s)
    await settle(proc.pid, deadline)
    signal_group(proc.pid, signal.SIGKILL)  # stragglers: helpers that ignore SIGTERM
    await _reaped(proc, math.inf)
    await wait_until(lambda: not group_alive(proc.pid), time.monotonic() + GROUP_GONE_S)
    remove_unmapped(mapped)


GROUP_GONE_S = 5.0
"""How long after a SIGKILL the processes of a group may take to be gone (their memory freed)."""
SETTLE_S = 3.0
"""How long the rest of a group may take to leave on its own once its leader has gone."""


async def settle(pid: int, deadline: float) -> None:
    """Give the rest of a group whose leader `pid` has gone `SETTLE_S` (and no later than
    `deadline`) to leave on its own before it is killed: Python's multiprocessing resource tracker
    ignores SIGTERM and unlinks the semaphores its processes left only once they have all exited.
    Killed before that, it leaves them in /dev/shm, mapped by no one, so not among the files the
    group was seen to map when it was stopped."""
    await wait_until(lambda: not group_alive(pid), min(deadline, time.monotonic() + SETTLE_S))


async def wait_until(done: Callable[[], bool], deadline: float) -> None:
    """Until `done()`, asked every 0.1 s, or the monotonic clock reaches `deadline`."""
    while time.monotonic() < deadline:
        if done():
            return
        await asyncio.sleep(0.1)


async def _reaped(proc: subprocess.Popen[bytes], wait_s: float) -> None:
    """Until the child is reaped, or `wait_s` seconds have passed."""
    deadline = time.monotonic() + wait_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.05)
