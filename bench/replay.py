"""`specgate bench replay`: a trace sent through a running gateway in real time, measured by the client.

Each request is a streamed chat completion whose prompt has the trace's size (by the estimate the
gateway and the simulated replica share), sent at its (rate-scaled) arrival time, with the
client's SLO headers and a realistic `max_tokens` cap. Its true output length travels in the
body field `specgate_sim_output_tokens`, which the simulated replica obeys and the gateway never
reads. With replicas running `--time-scale T`, pass the same T: the trace is sent T times faster,
the SLO headers are divided by T (the gateway measures the replicas in real time), and the
latencies measured are scaled back, so results come out in the profile's units, in the same
shape as the offline simulator's. The gateway's latency model, predicting in the profile's units,
has to learn T through its per-replica corrections, and decides worse meanwhile (at T = 1.5 the
adaptive policy held and refused about three times as many requests as at T = 1 on the same
slice): compare with the offline simulator at T = 1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from specgate.bench.offline import MAX_TOKENS, RunResult, Served
from specgate.bench.traces import TraceRequest
from specgate.calibration.modes import Pool
from specgate.policies.features import SloTargets
from specgate.protocol.tokens import BYTES_PER_TOKEN, CHAT_TOKENS_PER_MESSAGE, CHAT_TOKENS_PER_REPLY, completion_tokens
from specgate.sim.requests import SCRIPTED_OUTPUT_FIELD

_TEMPLATE_TOKENS = CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_REPLY


@dataclass(frozen=True)
class ReplaySettings:
    gateway: str
    model: str
    time_scale: float = 1.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    hint: bool = False
    more_gateways: tuple[str, ...] = ()
    """Other gateways in front of the same fleet: requests go to each in turn, as a load
    balancer sends them."""


def request_body(model: str, request: TraceRequest) -> bytes:
    """A chat request whose estimated prompt size is the trace's."""
    content = "x" * (BYTES_PER_TOKEN * max(request.prompt_tokens - _TEMPLATE_TOKENS, 1))
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
            SCRIPTED_OUTPUT_FIELD: min(request.output_tokens, MAX_TOKENS),
        }
    )


async def _one(
    session: aiohttp.ClientSession, settings: ReplaySettings, request: TraceRequest, gateway: str
) -> Served | int:
    """The request's latencies, or the HTTP status it failed with."""
    headers = {"content-type": "application/json"}
    # The gateway sees the replicas' real (scaled) time: so must the SLOs it routes by.
    if settings.slo_ttft_ms is not None:
        headers["x-slo-ttft-ms"] = f"{settings.slo_ttft_ms / settings.time_scale:g}"
    if settings.slo_tpot_ms is not None:
        headers["x-slo-tpot-ms"] = f"{settings.slo_tpot_ms / settings.time_scale:g}"
    if settings.hint:
        headers["x-expected-output-tokens"] = str(request.output_tokens)
    sent = time.monotonic()
    first = last = 0.0
    tail = b""
    async with session.post(
        f"{gateway}/v1/chat/completions", data=request_body(settings.model, request), headers=headers
    ) as response:
        if response.status != 200:
            await response.read()
            return response.status
        pool = Pool(response.headers["x-route-pool"])
        async for chunk in response.content.iter_any():
            if b'"content":"' in chunk:
                last = time.monotonic()
                first = first or last
            tail = (tail + chunk)[-4096:]
    tokens = completion_tokens(tail) or request.output_tokens
    scale = settings.time_scale
    ttft = (first - sent) * scale
    tpot = (last - first) * scale / (tokens - 1) if tokens > 1 else None
    slo = SloTargets(settings.slo_ttft_ms, settings.slo_tpot_ms)
    return Served(ttft, tpot, (last - sent) * scale, pool, request.prompt_tokens, tokens, slo)


async def replay(trace: Sequence[TraceRequest], settings: ReplaySettings) -> tuple[RunResult, int]:
    """Send the trace; returns the run and the number of requests that failed outright."""
    served: list[Served] = []
    shed = failed = 0
    start = time.monotonic() + 0.1
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        gateways = (settings.gateway, *settings.more_gateways)

        async def at_arrival(index: int, request: TraceRequest) -> None:
            nonlocal shed, failed
            await asyncio.sleep(max(start + request.arrival_s / settings.time_scale - time.monotonic(), 0.0))
            try:
                outcome = await _one(session, settings, request, gateways[index % len(gateways)])
            except aiohttp.ClientError:
                outcome = 0
            if isinstance(outcome, Served):
                served.append(outcome)
            elif outcome == 429:
                shed += 1
            else:
                failed += 1

        await asyncio.gather(*(at_arrival(i, r) for i, r in enumerate(trace)))
    span = trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 1.0
    refused = {"shed": shed, "failed": failed}
    return RunResult(tuple(served), {k: n for k, n in refused.items() if n}, span), failed
