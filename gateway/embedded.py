"""The embedded default: simulated speculative and plain pools started by the gateway itself."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from specgate.calibration.modes import Pool
from specgate.calibration.profile_file import ProfileFile
from specgate.calibration.profiles import DEFAULT_PROFILE, get_profile
from specgate.gateway.config import GatewaySettings
from specgate.workers import launch

REPLICAS_PER_POOL = 2


@contextlib.asynccontextmanager
async def embedded_pools(
    *, host: str, port: int, profile: str = DEFAULT_PROFILE, time_scale: float = 1.0, file: ProfileFile | None = None
) -> AsyncIterator[GatewaySettings]:
    """Start two simulated replicas per pool (of the profile in `file` when given); yield gateway
    settings that route to them."""
    model = file.profile.model if file is not None else get_profile(profile).model
    chosen = ("--profile-file", str(file.path)) if file is not None and file.path else ("--profile", profile)
    with tempfile.TemporaryDirectory(prefix="specgate-embedded-") as logs:
        procs = []
        try:
            for pool in Pool:
                for i in range(REPLICAS_PER_POOL):
                    args = ("--mode", pool.value, *chosen, "--time-scale", f"{time_scale:g}")
                    log = Path(logs) / f"{pool.value}-{i}.log"
                    procs.append((pool, log, launch.spawn(launch.sim_argv(*args, "--seed", str(i)), log)))
            urls = await asyncio.gather(*(launch.wait_ready(proc, log) for _, log, proc in procs))
            pools = {pool: tuple(url for (p, _, _), url in zip(procs, urls, strict=True) if p is pool) for pool in Pool}
            yield GatewaySettings(models=(model,), pools=pools, host=host, port=port)
        finally:
            await asyncio.gather(*(launch.terminate(proc) for _, _, proc in procs))
