"""Running a server: logging set up once per process, and a coroutine served until a signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is when a record comes (a test may have replaced it since)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure_logging(level: str) -> None:
    """Timestamped, levelled lines on stderr for the whole process; aiohttp's access logger stays
    quiet (the gateway writes its own access log when asked)."""
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def run_until_signalled(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a server coroutine under uvloop until SIGINT or SIGTERM, then let it clean up."""
    try:
        import uvloop

        runner: Callable[..., Any] = uvloop.run
    except ImportError:  # uvloop does not build everywhere; asyncio's loop works too
        runner = asyncio.run

    async def guarded() -> None:
        task = asyncio.ensure_future(main())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    runner(guarded())
