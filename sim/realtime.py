"""Runs the engine model against the wall clock and hands each request its tokens.

Virtual time runs `time_scale` times faster than the wall clock. Steps are played back to
back in virtual time, each one sleeping until the wall-clock moment its outputs exist; if the
event loop falls behind, virtual time simply runs slower for a while, so every time the
engine reports stays exact in the profile's units. An arrival is stamped with the virtual
moment it reached the replica, never later than the end of the step in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass, field

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import Profile
from specgate.sim.engine import Engine, EngineConfig
from specgate.sim.metrics import VllmMetrics
from specgate.sim.outcomes import FinishReason, TokenOutput
from specgate.sim.requests import GenerationRequest
from specgate.sim.text import Words, draw_output_length


@dataclass(frozen=True)
class SimSettings:
    mode: Pool
    profile: Profile
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    time_scale: float = 1.0
    seed: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_body_bytes: int = 32 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError("time_scale must be positive")


@dataclass
class Submission:
    """One request's place in the replica: its engine id, its token feed and its text."""

    engine_id: str
    output_tokens: int
    finish_reason: FinishReason
    words: Words
    outputs: asyncio.Queue[TokenOutput] = field(default_factory=asyncio.Queue)


class RealtimeEngine:
    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.engine = Engine(settings.profile, settings.mode, settings.engine, seed=settings.seed)
        self.metrics = VllmMetrics(self.engine, settings.model)
        self._rng = random.Random(settings.seed ^ 0x5EED)
        self._ids = itertools.count()
        self._feeds: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._origin = self._loop.time()

    def virtual_now(self) -> float:
        wall = (self._loop.time() - self._origin) * self.settings.time_scale
        if self.engine.has_work():
            return min(wall, self.engine.now)
        return max(wall, self.engine.now)

    def submit(self, request: GenerationRequest) -> Submission:
        if request.scripted_output_tokens is not None:
            length = min(request.scripted_output_tokens, request.max_tokens)
            reason = FinishReason.LENGTH if length >= request.max_tokens else FinishReason.STOP
        elif request.ignore_eos:
            length, reason = request.max_tokens, FinishReason.LENGTH
        else:
            length = max(draw_output_length(self._rng, request.max_tokens), request.min_tokens)
            reason = FinishReason.LENGTH if length >= request.max_tokens else FinishReason.STOP
        sub = Submission(
            engine_id=f"sim-{next(self._ids)}",
            output_tokens=length,
            finish_reason=reason,
            words=Words(random.Random(self._rng.getrandbits(64))),
        )
        self.engine.add_request(
            sub.engine_id,
            request.prompt_tokens,
            length,
            finish_reason=reason,
            arrival=self.virtual_now(),
            max_tokens=request.max_tokens_param,
        )
        self._feeds[sub.engine_id] = sub.outputs
        self.refresh_gauges()
        self._wake.set()
        return sub

    def release(self, sub: Submission) -> None:
        """Forget a request; if the engine still holds it (the client left), abort it."""
        self._feeds.pop(sub.engine_id, None)
        aborted = self.engine.abort(sub.engine_id)
        if aborted is not None:
            self.metrics.observe_finished(aborted)
            self.refresh_gauges()

    def refresh_gauges(self) -> None:
        self.metrics.set_queues(self.engine.num_running, self.engine.num_waiting, self.engine.kv_usage)

    async def run(self) -> None:
        scale = self.settings.time_scale
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            step = self.engine.step()
            # Always yield, even when behind, so handlers keep running under load.
            await asyncio.sleep(max(self._origin + step.end / scale - self._loop.time(), 0.0))
            self.metrics.observe_step(step)
            self.refresh_gauges()
            for out in step.outputs:
                feed = self._feeds.get(out.request_id)
                if feed is not None:
                    feed.put_nowait(out)
