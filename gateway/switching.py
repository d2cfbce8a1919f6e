"""Switching a running vLLM server between the pools: with speculation, or without.

vLLM cannot turn speculation on or off in a running server, so a switch is a restart, made
invisible to clients:

1. drain: the policy document (in Redis, which every gateway follows) says the server takes no new
   requests; the switch waits `settle_s` for every gateway to have read it (they re-read the store
   every `[store] refresh_ms` even when an announcement is lost);
2. wait: until the server itself reports nothing running and nothing waiting (its own
   `/metrics`: whatever any gateway sent it, streams included), twice in a row;
3. restart: stop its process group and start it again with, or without, `--speculative-config`;
   wait for its `/health`;
4. re-admit: the document moves it to the other pool and lifts the drain; each gateway starts a
   fresh record of it (acceptance, latencies, health) and admits it at its next good scrape.

A server that does not come back in its new mode is started again in the old one and re-admitted
there; one whose requests do not finish in `drain_timeout_s` is not restarted at all; one found
down (a switch cut short, a crash) is started in the new mode. Either way
the switch fails (`SwitchError`) and says why. The servers must have been started by a detached
`specgate pools up`, whose record (`pools.json` in the log folder) says which process each is;
the record follows the switch, so `pools down` stops the new process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import Profile
from specgate.gateway.store import PolicyStore, VersionConflict
from specgate.policies.document import PolicyDocument, ReplicaControl
from specgate.workers import launch
from specgate.workers.scrape import MetricsFormatError, parse_vllm_metrics
from specgate.workers.vllm_launch import (
    LaunchConfigError,
    LaunchPlan,
    Record,
    ServerSpec,
    in_mode,
    ours,
    records,
    restart,
    stop_group,
    wait_healthy,
)

_log = logging.getLogger(__name__)

WRITE_ATTEMPTS = 5
"""Read-modify-write rounds on the document before giving up to other writers."""


class SwitchError(Exception):
    """A switch that could not be made; the message says how far it got and where the server is."""


@dataclass(frozen=True)
class SwitchSettings:
    settle_s: float = 2.0
    """After the drain is written, before the server's own counts are trusted: every gateway has
    read the store by then (twice its refresh interval)."""
    drain_timeout_s: float = 600.0
    """How long its requests in flight may take to finish."""
    poll_s: float = 0.25
    stop_grace_s: float = 30.0


@dataclass(frozen=True)
class Switched:
    server: str
    url: str
    to: Pool
    drained_s: float
    """From the drain written to the server idle."""
    restarted_s: float
    """From its stop to its /health answering in the new mode."""
    total_s: float
    version: int
    """The policy version that re-admitted it."""


class Switcher:
    """Switches the servers of one launch plan, through one policy store."""

    def __init__(
        self,
        plan: LaunchPlan,
        store: PolicyStore,
        base: PolicyDocument,
        profiles: Mapping[str, Profile],
        settings: SwitchSettings = SwitchSettings(),
        say: Callable[[str], None] = _log.info,
    ) -> None:
        self.plan = plan
        self.store = store
        self.base = base
        """The document the gateways run when the store holds none yet (their configuration's)."""
        self.profiles = profiles
        self.settings = settings
        self.say = say

    def server(self, name: str) -> tuple[ServerSpec, Record]:
        """A server of the plan by name (`plain-0`) or URL, and its record."""
        spec = next((s for s in self.plan.servers if name in (s.name, s.url)), None)
        if spec is None:
            known = ", ".join(s.name for s in self.plan.servers)
            raise SwitchError(f"no server {name!r} in the config's [launch] section; known: {known}")
        record = next((r for r in records(self.plan.log_dir) if r.name == spec.name), None)
        if record is None:
            raise SwitchError(
                f"{spec.name} was not started by a detached `specgate pools up` (no record of it in "
                f"{self.plan.log_dir}): only servers started that way can be switched"
            )
        return spec, record

    def speculative_config(self, spec: ServerSpec) -> Mapping[str, Any] | None:
        """What the server speculates with: its own config, else the first speculative server's."""
        if spec.speculative_config is not None:
            return spec.speculative_config
        return next((s.speculative_config for s in self.plan.servers if s.speculative_config is not None), None)

    def modes(self) -> dict[str, Pool]:
        """Each running server's mode now, by URL."""
        return {r.url: r.pool for r in records(self.plan.log_dir) if ours(r.pid)}

    async def switch(self, name: str, to: Pool, speculative_config: Mapping[str, Any] | None = None) -> Switched | None:
        """Move the server to pool `to`; None when it is there already (the document is made to
        say so)."""
        spec, record = self.server(name)
        config = speculative_config if speculative_config is not None else self.speculative_config(spec)
        try:
            target = in_mode(spec, to, config)
        except LaunchConfigError as exc:
            raise SwitchError(f"{spec.name}: {exc}; give one (--speculative-config)") from None
        served_in = None if record.pool is spec.pool else record.pool
        if record.pool is to and ours(record.pid):
            await self._write(spec.url, ReplicaControl(pool=served_in), f"{spec.name} serves in the {to.value} pool")
            return None
        started = time.monotonic()
        await self._write(
            spec.url, ReplicaControl(pool=served_in, drain=True), f"pools switch: draining {spec.name} to restart it"
        )
        self.say(f"{spec.name}: drained; waiting for its requests to finish")
        async with aiohttp.ClientSession() as session:
            try:
                await asyncio.sleep(self.settings.settle_s)
                await self._idle(session, spec.url, record.pid)
            except SwitchError:
                await self._write(spec.url, ReplicaControl(pool=served_in), f"pools switch: {spec.name} kept as it was")
                raise
            drained = time.monotonic()
            self.say(f"{spec.name}: idle after {drained - started:.1f} s; restarting it {_mode(to)}")
            if ours(record.pid):  # (not when a switch cut short, or a crash, left it down)
                await stop_group(record.pid, self.settings.stop_grace_s)
            try:
                await wait_healthy(restart(self.plan, target, record), self.plan.ready_timeout_s, session)
            except launch.LaunchError as exc:
                await self._recover(session, spec, record, config, served_in, str(exc))
            ready = time.monotonic()
        pool = None if to is spec.pool else to
        version = await self._write(spec.url, ReplicaControl(pool=pool), f"pools switch: {spec.name} {_mode(to)}")
        self.say(
            f"{spec.name}: healthy after {ready - drained:.1f} s; serves in the {to.value} pool (version {version})"
        )
        return Switched(
            spec.name, spec.url, to, drained - started, ready - drained, time.monotonic() - started, version
        )

    async def _recover(
        self,
        session: aiohttp.ClientSession,
        spec: ServerSpec,
        record: Record,
        config: Mapping[str, Any] | None,
        served_in: Pool | None,
        why: str,
    ) -> None:
        """The server did not come back in its new mode: back in the old one, re-admitted there."""
        self.say(f"{spec.name}: not healthy in its new mode; restarting it as it was")
        latest = next(r for r in records(self.plan.log_dir) if r.name == spec.name)
        await stop_group(latest.pid, self.settings.stop_grace_s)
        try:
            old = restart(self.plan, in_mode(spec, record.pool, config), latest)
            await wait_healthy(old, self.plan.ready_timeout_s, session)
        except launch.LaunchError as exc:
            raise SwitchError(f"{spec.name} is down and left drained: {why}\nand as it was: {exc}") from None
        await self._write(spec.url, ReplicaControl(pool=served_in), f"pools switch: {spec.name} back as it was")
        raise SwitchError(f"{spec.name} serves as it did; its new mode failed: {why}")

    async def _idle(self, session: aiohttp.ClientSession, url: str, pid: int) -> None:
        """Until the server reports no request running or waiting, twice in a row (a busy server
        may be slow to answer its metrics: it has until the deadline), or is down."""
        if not ours(pid):
            return
        deadline = time.monotonic() + self.settings.drain_timeout_s
        quiet, why = 0, "requests running"
        while quiet < 2:
            if time.monotonic() > deadline:
                raise SwitchError(f"{url} not idle after {self.settings.drain_timeout_s:g} s ({why}): not restarted")
            await asyncio.sleep(self.settings.poll_s)
            try:
                async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    load = parse_vllm_metrics(await r.text())
            except (aiohttp.ClientError, TimeoutError, MetricsFormatError) as exc:
                quiet, why = 0, f"its metrics unread: {exc!r}"
                continue
            quiet = quiet + 1 if (load.running or 0.0) + (load.waiting or 0.0) == 0 else 0

    async def _write(self, url: str, control: ReplicaControl, why: str) -> int:
        """Set `url`'s entry of the stored document; the version written."""
        for _ in range(WRITE_ATTEMPTS):
            stored = await self.store.current()
            document = stored.parsed(self.profiles) if stored is not None else self.base
            revised = document.with_replica(url, control)
            if stored is not None and revised == document:
                return stored.version
            try:
                written = await self.store.write(
                    revised, expected_version=stored.version if stored else 0, who="pools switch", why=why
                )
            except VersionConflict:
                continue  # another writer came between: read again
            return written.version
        raise SwitchError(f"the policy document kept changing under {WRITE_ATTEMPTS} attempts to write it")


def _mode(pool: Pool) -> str:
    return "with speculation" if pool is Pool.SPECULATIVE else "without speculation"
