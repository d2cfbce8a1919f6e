"""Where a pool's replicas are, found again every few seconds: a DNS name or a Kubernetes label
selector beside (or instead of) the configured URLs.

- DNS: a name and a port, as a headless Service gives them (`vllm-spec.ns.svc:8000`): every A and
  AAAA record is a replica. Resolved through the event loop's resolver (a thread of the loop's
  executor, never blocking the loop), or one given (tests).
- Kubernetes: the pods of a namespace that match a label selector, read from the API server
  with kubernetes-asyncio (`pip install 'specgate[kubernetes]'`): a pod is a replica while it is
  Ready, has an IP and is not being deleted. In a cluster the pod's service account is used; `api`
  names another server (`kubectl proxy`, a test's).

A source that cannot be read keeps the replicas it last found: a DNS server or an API server that
is down must not empty the fleet. One that answers with nothing empties it (a pool scaled to zero).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from specgate.calibration.modes import Pool

_log = logging.getLogger(__name__)

Resolve = Callable[[str, int], Awaitable[Sequence[str]]]
"""A name and a port to the addresses they resolve to."""


class DiscoveryError(Exception):
    """A source that could not be read this time."""


def url_of(address: str, port: int, scheme: str = "http") -> str:
    """A replica's base URL from an IP address (IPv6 in brackets)."""
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}"


async def resolve_with_loop(name: str, port: int) -> Sequence[str]:
    """The addresses of `name`, by the event loop's resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class Source(Protocol):
    @property
    def described(self) -> str:
        """What it reads, for logs: `dns vllm-spec.ns.svc:8000`."""
        ...

    async def urls(self) -> list[str]:
        """The replicas' URLs now; raises DiscoveryError when they cannot be read."""
        ...


@dataclass(frozen=True)
class DnsName:
    """A name whose every address is a replica (a headless Service), and their port."""

    name: str
    port: int

    @property
    def described(self) -> str:
        return f"dns {self.name}:{self.port}"


@dataclass(frozen=True)
class PodSelector:
    """The Ready pods of `namespace` that match `selector`, and their port; read from the API
    server at `api` (None: the cluster the gateway runs in, with its service account)."""

    namespace: str
    selector: str
    port: int
    api: str | None = None

    @property
    def described(self) -> str:
        return f"kubernetes {self.namespace}/{self.selector}:{self.port}"


Where = DnsName | PodSelector


def source(where: Where, resolve: Resolve = resolve_with_loop) -> Source:
    """What reads `where`."""
    return DnsSource(where, resolve) if isinstance(where, DnsName) else KubernetesSource(where)


@dataclass
class DnsSource:
    where: DnsName
    resolve: Resolve = resolve_with_loop

    @property
    def described(self) -> str:
        return self.where.described

    async def urls(self) -> list[str]:
        try:
            addresses = await self.resolve(self.where.name, self.where.port)
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            raise DiscoveryError(f"{self.described}: {exc}") from None
        return sorted({url_of(a, self.where.port) for a in addresses})


def ready_pod_ips(pods: Sequence[Any]) -> list[str]:
    """The IPs of the pods that serve: Ready, with an IP, not being deleted."""
    ips = []
    for pod in pods:
        if pod.metadata is not None and pod.metadata.deletion_timestamp is not None:
            continue
        status = pod.status
        if status is None or not status.pod_ip:
            continue
        if any(c.type == "Ready" and c.status == "True" for c in status.conditions or ()):
            ips.append(str(status.pod_ip))
    return ips


class KubernetesSource:
    """Ready pods matching a label selector, read from the Kubernetes API."""

    def __init__(self, where: PodSelector) -> None:
        self.where = where
        self._client: Any = None
        self._core: Any = None

    @property
    def described(self) -> str:
        return self.where.described

    def _api(self) -> Any:
        """The client's core API, made on first use."""
        if self._core is None:
            try:
                from kubernetes_asyncio import client, config  # the [kubernetes] extra
            except ImportError:
                raise DiscoveryError(
                    "kubernetes discovery needs kubernetes-asyncio: pip install 'specgate[kubernetes]'"
                ) from None
            conf = client.Configuration()
            if self.where.api is None:
                try:
                    config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
                except config.ConfigException as exc:
                    raise DiscoveryError(f"{self.described}: not in a cluster ({exc}); set `api`") from None
            else:
                conf.host = self.where.api
            self._client = client.ApiClient(conf)
            self._core = client.CoreV1Api(self._client)
        return self._core

    async def urls(self) -> list[str]:
        core = self._api()
        try:
            pods = await core.list_namespaced_pod(
                self.where.namespace, label_selector=self.where.selector, _request_timeout=5
            )
        except Exception as exc:  # the client raises its own ApiException, aiohttp's and timeouts
            raise DiscoveryError(f"{self.described}: {exc!r}") from None
        return sorted({url_of(ip, self.where.port) for ip in ready_pod_ips(pods.items)})

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = self._core = None


@dataclass(frozen=True)
class PoolSources:
    """Where one pool's replicas are: fixed URLs and sources read again and again."""

    urls: tuple[str, ...] = ()
    sources: tuple[Source, ...] = ()


class Discovery:
    """Each pool's replicas, read from its sources every `interval_s`."""

    def __init__(self, pools: Mapping[Pool, PoolSources], interval_s: float) -> None:
        self.pools = pools
        self.interval_s = interval_s
        self._last: dict[tuple[Pool, int], list[str]] = {}
        self.errors: dict[str, str] = {}
        """The sources whose last read failed, and why."""

    async def find(self) -> dict[Pool, list[str]]:
        """Every pool's replica URLs now (a source that fails gives what it gave last)."""
        found: dict[Pool, list[str]] = {}
        for pool, where in self.pools.items():
            urls = list(where.urls)
            reads = await asyncio.gather(*(s.urls() for s in where.sources), return_exceptions=True)
            for i, (source, read) in enumerate(zip(where.sources, reads, strict=True)):
                if isinstance(read, Exception):  # DiscoveryError, or a failure nobody foresaw
                    if source.described not in self.errors:
                        _log.warning("discovery: %s (keeping the %d replicas it gave last)", read,
                                     len(self._last.get((pool, i), [])),
                                     exc_info=not isinstance(read, DiscoveryError))  # fmt: skip
                    self.errors[source.described] = str(read)
                    read = self._last.get((pool, i), [])
                elif isinstance(read, BaseException):  # cancelled
                    raise read
                else:
                    if self.errors.pop(source.described, None) is not None:
                        _log.info("discovery: %s read again", source.described)
                    self._last[(pool, i)] = read
                urls.extend(read)
            found[pool] = list(dict.fromkeys(u.rstrip("/") for u in urls))
        return found

    async def run(self, apply: Callable[[dict[Pool, list[str]]], None]) -> None:
        """Finds the replicas every interval and hands them to `apply` (the fleet's)."""
        while True:
            apply(await self.find())
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        for where in self.pools.values():
            for source in where.sources:
                if isinstance(source, KubernetesSource):
                    await source.close()
