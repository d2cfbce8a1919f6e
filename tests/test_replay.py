"""The offline simulator checked against the system: the same trace slice replayed in real time
through a real gateway in front of simulated replicas gives the same attainment within a few points."""

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.offline import Fleetspec, Scenario, simulate
from bench.replay import ReplaySettings, replay
from bench.traces import TraceRequest, read_trace, scaled
from gateway.app import make_app
from gateway.config import GatewaySettings, PolicySettings
from tests.conftest import SimProcess, running_app
from workers.pools import FleetSettings
from workers.sim.profiles import A100_CODELLAMA_34B
from workers.snapshot import Pool

pytestmark = pytest.mark.slow

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
TIME_SCALE = 2.0


def trace_slice() -> list[TraceRequest]:
    if AZURE.exists():
        return scaled(read_trace(AZURE, 160), 1.5)
    return [TraceRequest(i * 0.4, 300 + 97 * (i % 11), 40 + 23 * (i % 9)) for i in range(160)]


async def test_replay_through_the_gateway_agrees_with_the_offline_simulator(
    sim_factory: Callable[..., SimProcess],
) -> None:
    trace = trace_slice()
    slo_ttft_ms, slo_tpot_ms = 2000.0, 50.0
    scenario = Scenario(
        A100_CODELLAMA_34B, Fleetspec(1, 1), "least-loaded", slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms
    )
    offline = simulate(trace, scenario).summary()

    args = ("--model", "m", "--time-scale", f"{TIME_SCALE:g}")
    spec, plain = sim_factory("--mode", "speculative", *args), sim_factory("--mode", "plain", *args)
    settings = GatewaySettings(
        models=("m",),
        pools={Pool.SPECULATIVE: (spec.url,), Pool.PLAIN: (plain.url,)},
        port=0,
        policy=PolicySettings(name="least-loaded"),
        fleet=FleetSettings(scrape_interval_s=0.25 / TIME_SCALE),
    )
    async with running_app(make_app(settings)) as url:
        result, failed = await replay(trace, ReplaySettings(url, "m", TIME_SCALE, slo_ttft_ms, slo_tpot_ms))
    online = result.summary()

    assert 0.2 < offline["slo_attainment"] < 0.9  # a load where routing matters
    assert failed == 0
    assert online["requests"] == offline["requests"] == len(trace)
    assert online["slo_attainment"] == pytest.approx(offline["slo_attainment"], abs=0.05)
    assert online["spec_share"] == pytest.approx(offline["spec_share"], abs=0.1)
    assert online["tpot_p50_ms"] == pytest.approx(offline["tpot_p50_ms"], rel=0.1)
