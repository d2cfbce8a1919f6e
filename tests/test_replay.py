"""The offline simulator checked against the system: the same trace slice replayed in real time
through a real gateway in front of simulated replicas gives the same attainment within a few points."""

import gc
import random
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from specgate.bench.offline import Fleetspec, Scenario, simulate
from specgate.bench.replay import ReplaySettings, replay
from specgate.bench.traces import TraceRequest, read_trace
from specgate.calibration.profiles import A100_CODELLAMA_34B
from specgate.testing import SimProcess, gateway_config
from specgate.workers import launch

pytestmark = pytest.mark.slow

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
TIME_SCALE = 1.0
"""Real time: replicas run faster than their profile would make the gateway's latency model learn
the compression first (at 1.5, the adaptive policy met 11 points fewer SLOs online than offline)."""


def trace_slice() -> list[TraceRequest]:
    if AZURE.exists():
        return read_trace(AZURE, 250)
    # Without the shared traces: a synthetic slice at a comparable load (offline attainment ~0.73).
    return [TraceRequest(i * 0.15, 300 + 97 * (i % 11), 40 + 23 * (i % 9)) for i in range(250)]


def jittered(trace: list[TraceRequest], seed: int, jitter_s: float = 0.005) -> list[TraceRequest]:
    """The trace with every arrival moved by up to a few milliseconds, as a real client and its
    HTTP stack move them."""
    rng = random.Random(seed)
    moved = (replace(r, arrival_s=max(0.0, r.arrival_s + rng.uniform(-jitter_s, jitter_s))) for r in trace)
    return sorted(moved, key=lambda r: r.arrival_s)


@pytest.mark.parametrize("policy", ["adaptive", "least-loaded"])
async def test_replay_through_the_gateway_agrees_with_the_offline_simulator(
    policy: str, sim_factory: Callable[..., SimProcess], tmp_path: Path
) -> None:
    trace = trace_slice()
    slo_ttft_ms, slo_tpot_ms = 2000.0, 60.0
    scenario = Scenario(A100_CODELLAMA_34B, Fleetspec(1, 1), policy, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms)
    offline = simulate(trace, scenario).summary()
    # A policy's attainment on one trace is a distribution, not a number: a few milliseconds of
    # timing moved least-loaded's offline attainment from 0.68 to 0.77 (its ties, broken by load
    # scraped a moment earlier, cascade), the adaptive policy's from 0.89 to 0.92.
    spread = [simulate(jittered(trace, seed), scenario).summary()["slo_attainment"] for seed in range(8)]

    args = ("--model", "m", "--time-scale", f"{TIME_SCALE:g}")
    spec, plain = sim_factory("--mode", "speculative", *args), sim_factory("--mode", "plain", *args)
    # The gateway in a process of its own, as deployed: sharing the client's event loop would
    # add the client's delays to every latency it measures.
    config = gateway_config(
        tmp_path / "specgate.toml", "m", [spec.url], [plain.url],
        f'[policy]\npolicy = "{policy}"\n[scrape]\ninterval_ms = {250 / TIME_SCALE:g}\n',
    )  # fmt: skip
    log = tmp_path / "gateway.log"
    gateway = launch.spawn([*launch.sim_argv()[:3], "serve", "--config", str(config), "--port", "0"], log)
    try:
        url = await launch.wait_ready(gateway, log)
        # The client measures every latency: a full garbage collection of this test process's heap
        # (grown over the whole suite) would stall every stream it reads and count as TPOT.
        gc.collect()
        gc.freeze()
        try:
            result, failed = await replay(trace, ReplaySettings(url, "m", TIME_SCALE, slo_ttft_ms, slo_tpot_ms))
        finally:
            gc.unfreeze()
    finally:
        await launch.terminate(gateway)
    online = result.summary()

    both = f"offline {offline} (under timing noise: {spread}), online {online}"
    assert 0.2 < offline["slo_attainment"] < 0.95, both  # a load where routing matters
    assert failed == 0
    assert online["requests"] == offline["requests"] == len(trace)
    # Online within three of the simulator's own standard deviations under timing noise, and 4
    # points for the HTTP and relay delays it does not model (measured online: adaptive 0.900 to
    # 0.916 against 0.908 offline; least-loaded 0.728 to 0.812 against 0.728).
    tolerance = 0.04 + 3 * statistics.stdev(spread)
    assert online["slo_attainment"] == pytest.approx(statistics.median(spread), abs=tolerance), both
    assert online["spec_share"] == pytest.approx(offline["spec_share"], abs=0.12), both
    assert online["tpot_p50_ms"] == pytest.approx(offline["tpot_p50_ms"], rel=0.12), both
