"""Two gateway processes following one Redis under load: they converge on every change, fail no
request, and resync after Redis is killed and comes back (bench/policy_reload.py, small)."""

from pathlib import Path

import pytest

from specgate.bench.policy_reload import run

pytestmark = pytest.mark.slow


async def test_two_gateways_converge_and_lose_no_request(tmp_path: Path) -> None:
    figures = await run(changes=8, clients=4, refresh_ms=500, workdir=tmp_path)
    assert figures.failed_during_changes == 0
    assert figures.failed_during_outage == 0
    assert figures.requests_during_changes > 0
    assert figures.requests_during_outage > 0
    # Pub/sub carries a change at once; the re-read every 500 ms is the fallback. Generous bounds
    # for a loaded two-core machine: what matters is that every change arrives everywhere.
    assert figures.propagation_ms_max < 2000
    assert figures.resync_after_redis_restart_ms < 8000
