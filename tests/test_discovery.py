"""Replicas found by DNS and by a Kubernetes label selector: joining and leaving a live fleet."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from specgate.calibration.modes import Pool
from specgate.gateway.app import make_app
from specgate.gateway.config import ConfigError, GatewaySettings, parse_settings
from specgate.testing import free_port, running_app, sample_value, start_sim, stop_process
from specgate.workers.discovery import (
    Discovery,
    DiscoveryError,
    DnsName,
    DnsSource,
    KubernetesSource,
    PodSelector,
    PoolSources,
    resolve_with_loop,
    url_of,
)
from specgate.workers.pools import Fleet, FleetSettings

MODEL = "sim-model"


def resolver(answers: dict[str, list[str] | Exception]) -> Callable[[str, int], Any]:
    async def resolve(name: str, port: int) -> Sequence[str]:
        answer = answers[name]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return resolve


async def test_a_name_gives_a_replica_per_address() -> None:
    answers: dict[str, list[str] | Exception] = {"vllm": ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::7"]}
    source = DnsSource(DnsName("vllm", 8000), resolver(answers))
    assert await source.urls() == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://[fd00::7]:8000"]
    answers["vllm"] = OSError("Name or service not known")
    with pytest.raises(DiscoveryError, match="dns vllm:8000"):
        await source.urls()


async def test_the_loops_resolver_reads_a_real_name() -> None:
    addresses = await resolve_with_loop("localhost", 80)
    assert "127.0.0.1" in addresses or "::1" in addresses
    assert url_of("::1", 80) == "http://[::1]:80"


async def test_a_source_that_fails_keeps_what_it_gave_and_one_that_answers_nothing_empties() -> None:
    answers: dict[str, list[str] | Exception] = {"spec": ["10.0.0.1"], "plain": ["10.0.0.2", "10.0.0.3"]}
    resolve = resolver(answers)
    discovery = Discovery(
        {
            Pool.SPECULATIVE: PoolSources(("http://10.9.9.9:8000",), (DnsSource(DnsName("spec", 80), resolve),)),
            Pool.PLAIN: PoolSources((), (DnsSource(DnsName("plain", 80), resolve),)),
        },
        interval_s=1.0,
    )
    first = await discovery.find()
    assert first == {
        Pool.SPECULATIVE: ["http://10.9.9.9:8000", "http://10.0.0.1:80"],
        Pool.PLAIN: ["http://10.0.0.2:80", "http://10.0.0.3:80"],
    }
    answers["plain"] = OSError("SERVFAIL")
    answers["spec"] = []
    second = await discovery.find()
    assert second == {Pool.SPECULATIVE: ["http://10.9.9.9:8000"], Pool.PLAIN: first[Pool.PLAIN]}
    assert discovery.errors == {"dns plain:80": "dns plain:80: SERVFAIL"}
    answers["plain"] = ["10.0.0.3"]
    assert (await discovery.find())[Pool.PLAIN] == ["http://10.0.0.3:80"]
    assert discovery.errors == {}


def test_the_fleet_takes_new_replicas_and_lets_gone_ones_finish() -> None:
    fleet = Fleet({Pool.SPECULATIVE: ["http://s0:80"], Pool.PLAIN: []}, FleetSettings())
    joined, removed = fleet.reconcile(
        {Pool.SPECULATIVE: ["http://s0:80", "http://s1:80"], Pool.PLAIN: ["http://p0:80"]}
    )
    assert sorted(r.name for r in joined) == ["plain-0", "spec-1"]
    assert removed == []
    busy = fleet.replicas["spec-0"]
    busy.dispatched_one()
    joined, removed = fleet.reconcile({Pool.SPECULATIVE: ["http://s1:80"], Pool.PLAIN: []})
    assert (joined, [r.name for r in removed]) == ([], ["plain-0"])  # idle: gone at once
    assert busy.retired
    assert busy.drained
    assert "spec-0" in fleet.replicas
    busy.finished(got_first_byte=True)
    joined, removed = fleet.reconcile({Pool.SPECULATIVE: ["http://s1:80"], Pool.PLAIN: []})
    assert [r.name for r in removed] == ["spec-0"]
    assert set(fleet.replicas) == {"spec-1"}
    # found again: a new replica (a new name: metrics of the old one are not continued by accident)
    joined, _ = fleet.reconcile({Pool.SPECULATIVE: ["http://s1:80"], Pool.PLAIN: ["http://p0:80"]})
    assert [r.name for r in joined] == ["plain-1"]
    assert not joined[0].healthy  # admitted at its first good scrape


def test_a_replica_found_again_before_it_went_takes_requests_and_the_document_still_drains() -> None:
    fleet = Fleet({Pool.SPECULATIVE: [], Pool.PLAIN: []}, FleetSettings())
    fleet.reconcile({Pool.PLAIN: ["http://p0:80", "http://p1:80"]})
    p0 = fleet.replicas["plain-0"]
    p0.dispatched_one()
    fleet.reconcile({Pool.PLAIN: ["http://p1:80"]})
    assert p0.retired
    assert p0.drained
    fleet.reconcile({Pool.PLAIN: ["http://p0:80", "http://p1:80"]})
    assert not p0.retired
    assert not p0.drained
    fleet.arrange({"http://p1:80": Pool.SPECULATIVE}, {"http://p0:80"})
    fleet.reconcile({Pool.PLAIN: ["http://p0:80", "http://p1:80"]})
    assert p0.drained  # the document's drain outlasts a discovery round
    assert fleet.replicas["plain-1"].pool is Pool.SPECULATIVE
    # the same URL listed in both pools serves in the first
    joined, _ = fleet.reconcile({Pool.SPECULATIVE: ["http://x:80"], Pool.PLAIN: ["http://x:80", "http://p0:80"]})
    assert [(r.name, r.pool) for r in joined] == [("spec-0", Pool.SPECULATIVE)]


def test_the_config_reads_names_and_selectors() -> None:
    settings = parse_settings({
        "models": {"served": [MODEL]},
        "pools": {
            "speculative": {"dns": ["vllm-spec.specgate.svc.cluster.local:8000"]},
            "plain": {"urls": ["http://10.0.0.3:8000"], "kubernetes": [
                {"namespace": "specgate", "selector": "app=vllm,pool=plain", "port": 8000}]},
        },
        "discovery": {"interval_ms": 2000},
    })  # fmt: skip
    assert settings.discovery == {
        Pool.SPECULATIVE: (DnsName("vllm-spec.specgate.svc.cluster.local", 8000),),
        Pool.PLAIN: (PodSelector("specgate", "app=vllm,pool=plain", 8000),),
    }
    assert settings.discovery_interval_s == 2.0
    assert settings.pools[Pool.PLAIN] == ("http://10.0.0.3:8000",)
    for bad, key in (
        ({"speculative": {"dns": ["vllm-spec"]}}, "pools.speculative.dns[0]"),
        ({"plain": {"dns": ["http://vllm:80"]}}, "pools.plain.dns[0]"),
        ({"plain": {"kubernetes": [{"selector": "app=vllm"}]}}, "pools.plain.kubernetes[0]"),
        ({"plain": {"kubernetes": [{"selector": "a=b", "port": 80, "api": "kube"}]}}, "pools.plain.kubernetes[0].api"),
    ):
        with pytest.raises(ConfigError) as caught:
            parse_settings({"models": {"served": [MODEL]}, "pools": bad})
        assert caught.value.field.startswith(key), caught.value


# --- a stub of the Kubernetes API, and a gateway that follows it ---------------------------------


class StubApi:
    """The pods endpoint of a Kubernetes API server: pods by IP, Ready or not."""

    def __init__(self) -> None:
        self.pods: dict[str, bool] = {}
        self.selectors: list[str] = []
        self.down = False

    async def list_pods(self, request: web.Request) -> web.Response:
        if self.down:
            return web.json_response({"kind": "Status", "code": 503, "message": "unavailable"}, status=503)
        self.selectors.append(request.query.get("labelSelector", ""))
        items = [self.pod(ip, ready) for ip, ready in self.pods.items()]
        leaving = {"name": "leaving", "namespace": "specgate", "deletionTimestamp": "2026-12-01T00:00:00Z"}
        items.append({**self.pod("10.1.1.1", True), "metadata": leaving})
        items.append({"metadata": {"name": "pending", "namespace": "specgate"}, "status": {"phase": "Pending"}})
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

    @staticmethod
    def pod(ip: str, ready: bool) -> dict[str, Any]:
        return {
            "metadata": {"name": f"vllm-{ip}", "namespace": "specgate"},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }  # fmt: skip

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self.list_pods)
        return app


@contextlib.asynccontextmanager
async def stub_api() -> AsyncIterator[tuple[str, StubApi]]:
    stub = StubApi()
    async with running_app(stub.app()) as url:
        yield url, stub


async def test_kubernetes_source_reads_ready_pods_of_the_selector() -> None:
    async with stub_api() as (url, stub):
        stub.pods = {"10.0.0.5": True, "10.0.0.6": False, "10.0.0.4": True}
        source = KubernetesSource(PodSelector("specgate", "app=vllm,pool=plain", 8000, url))
        try:
            assert await source.urls() == ["http://10.0.0.4:8000", "http://10.0.0.5:8000"]
            assert stub.selectors == ["app=vllm,pool=plain"]
            stub.down = True
            with pytest.raises(DiscoveryError, match="kubernetes specgate/app=vllm,pool=plain:8000"):
                await source.urls()
        finally:
            await source.close()


async def test_outside_a_cluster_without_an_api_the_source_says_so() -> None:
    source = KubernetesSource(PodSelector("specgate", "app=vllm", 8000))
    with pytest.raises(DiscoveryError, match="not in a cluster"):
        await source.urls()


@pytest.fixture(scope="module")
def sims_on_two_addresses(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Two simulated plain replicas on one port, at 127.0.0.2 and 127.0.0.3 (as pods are: one
    port, their own addresses)."""
    port = free_port()
    started = [start_sim(tmp_path_factory.mktemp("sim") / "sim.log", "--host", host, "--port", str(port),
                         "--mode", "plain", "--model", MODEL, "--time-scale", "20")
               for host in ("127.0.0.2", "127.0.0.3")]  # fmt: skip
    yield port
    for sim in started:
        stop_process(sim.proc)


@pytest.mark.slow
async def test_a_gateway_follows_the_pods_without_a_restart(sims_on_two_addresses: int, tmp_path: Path) -> None:
    port = sims_on_two_addresses
    async with stub_api() as (api, stub):
        stub.pods = {"127.0.0.2": True}
        settings = GatewaySettings(
            models=(MODEL,), pools={}, port=0, fleet=FleetSettings(scrape_interval_s=0.05),
            discovery={Pool.PLAIN: (PodSelector("specgate", "app=vllm", port, api),)}, discovery_interval_s=0.1,
        )  # fmt: skip
        body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        async with running_app(make_app(settings)) as url, aiohttp.ClientSession() as session:

            async def replicas_used(n: int) -> set[str]:
                used = set()
                for _ in range(n):
                    async with session.post(f"{url}/v1/chat/completions", data=body,
                                            headers={"content-type": "application/json"}) as r:  # fmt: skip
                        assert r.status == 200, await r.text()
                        await r.read()
                        used.add(r.headers["x-route-replica"])
                return used

            async def wait_until(check: Callable[[str], bool]) -> str:
                for _ in range(100):
                    async with session.get(f"{url}/metrics") as r:
                        text = await r.text()
                    if check(text):
                        return text
                    await asyncio.sleep(0.05)
                raise AssertionError(text)

            assert await replicas_used(4) == {"plain-0"}
            stub.pods["127.0.0.3"] = True  # scaled up
            await wait_until(lambda t: sample_value(t, "specgate_replica_up", replica="plain-1") == 1.0)
            assert await replicas_used(8) == {"plain-0", "plain-1"}
            stub.down = True  # the API server goes away: the fleet stays as it was
            await asyncio.sleep(0.3)
            assert await replicas_used(8) == {"plain-0", "plain-1"}
            stub.down = False
            stub.pods["127.0.0.2"] = False  # no longer Ready: it leaves
            await wait_until(lambda t: sample_value(t, "specgate_replica_up", replica="plain-0") is None)
            assert await replicas_used(4) == {"plain-1"}
            async with session.get(f"{url}/ready") as r:
                assert set((await r.json())["replicas"]) == {"plain-1"}
            stub.pods = {}  # scaled to zero: a clear 503, not a hang
            await wait_until(lambda t: sample_value(t, "specgate_replica_up", replica="plain-1") is None)
            async with session.post(f"{url}/v1/chat/completions", data=body,
                                    headers={"content-type": "application/json"}) as r:  # fmt: skip
                assert r.status == 503
                assert (await r.json())["error"]["type"]
