"""Gateway settings: a TOML file validated once at start into a frozen `GatewaySettings`.

The file's sections are declared as msgspec Structs (specgate.validation): unknown keys, wrong
types and out-of-range values are errors that name the key (`pools.speculative.urls[1]: ...`).
The [policy] table is the first policy document, the same object `specgate policy set` and the
admin API take. Example:

    [server]
    host = "127.0.0.1"
    port = 8000

    [models]
    served = ["codellama/CodeLlama-34b-Instruct-hf"]

    [pools.speculative]
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]

    [pools.plain]
    urls = ["http://10.0.0.3:8000"]
    dns = ["vllm-plain.specgate.svc:8000"]      # a headless Service: found again every 5 s

    [policy]
    policy = "threshold"
    params = { max_load = 8 }
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from specgate.calibration import profile_file
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import PROFILES, Profile
from specgate.gateway.advisor import AdvisorSettings
from specgate.gateway.clients import ClientKey, merged, parse_keys
from specgate.gateway.exchange import ExchangeSettings
from specgate.gateway.server import Limits
from specgate.gateway.tracing import TracingSettings
from specgate.policies.document import DocumentError, PolicyDocument
from specgate.policies.document import parse as parse_document
from specgate.validation import Invalid, Milliseconds, NonEmpty, Port, PositiveInt, convert
from specgate.workers.discovery import DnsName, PodSelector, Where
from specgate.workers.pools import FleetSettings
from specgate.workers.vllm_launch import LaunchPlan, parse_launch

MIN_ADMIN_TOKEN = 16


class ConfigError(Invalid):
    """A setting that cannot be used; `field` names the key and the message starts with it."""


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 2.0
    first_byte_s: float = 300.0
    """Until the response starts. A streamed vLLM response starts with its first token; a
    non-streamed one only when it is complete, so this bounds a whole non-streamed request."""
    idle_s: float = 60.0
    """Longest silence between two chunks of a streamed response."""


@dataclass(frozen=True)
class Retries:
    """Trying another replica while no byte of the answer has reached the client."""

    max_attempts: int = 3
    """Replicas tried for one request, the first included."""
    budget: float = 0.2
    """Retries in progress at once, as a share of the requests in flight (at least `min_retries`):
    when the whole fleet fails, retries must not multiply the load."""
    min_retries: int = 3
    backoff_s: float = 0.025
    """Before the n-th retry, this times 2^(n-1)."""


@dataclass(frozen=True)
class StoreSettings:
    """Where the policy document lives when it is shared: a Redis, and a local cache of it."""

    url: str | None = None
    """`redis://...`; None keeps the policy in memory."""
    prefix: str = "specgate"
    cache: Path | None = None
    """The last good document from Redis, for starting while Redis is down."""
    refresh_s: float = 1.0
    """Re-read the store this often even without an announcement (pub/sub drops messages)."""
    exchange: ExchangeSettings = field(default_factory=ExchangeSettings)
    """Counts exchanged with the other gateways through the same Redis (`gateway/exchange.py`)."""

    @property
    def exchanges(self) -> bool:
        """Whether the gateway counts the other gateways' requests through its Redis."""
        return self.exchange.on(self.url)


@dataclass(frozen=True)
class AuthSettings:
    """Client keys: off by default (a local run needs none)."""

    enabled: bool = False
    keys: Mapping[str, ClientKey] = field(default_factory=dict)
    """By SHA-256: from the config's [auth] keys and keys_file, and SPECGATE_API_KEYS; Redis adds
    its own ({prefix}:clients) while the gateway runs."""


@dataclass(frozen=True)
class GatewaySettings:
    models: tuple[str, ...]
    pools: Mapping[Pool, tuple[str, ...]]
    discovery: Mapping[Pool, tuple[Where, ...]] = field(default_factory=dict)
    """Where more of each pool's replicas are found, again every `discovery_interval_s`: DNS
    names and Kubernetes label selectors (`workers/discovery.py`)."""
    discovery_interval_s: float = 5.0
    tracing: TracingSettings = field(default_factory=TracingSettings)
    """Opt-in OpenTelemetry spans of the routing decisions ([tracing] otlp_url)."""
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 32 * 1024 * 1024
    shutdown_grace_s: float = 30.0
    access_log: bool = False
    """One log line per request (logger `specgate.access`)."""
    forward_authorization: bool = False
    """Pass the client's Authorization header to the replicas (off: replicas rarely share the
    gateway's credentials, and a leaked key is worse than a refused request)."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    retries: Retries = field(default_factory=Retries)
    policy: PolicyDocument = field(default_factory=PolicyDocument)
    """The policy to start with: the store's replaces it when there is one."""
    store: StoreSettings = field(default_factory=StoreSettings)
    admin_token: str | None = None
    """Bearer token of the admin API (/admin/policy); None turns the API off."""
    auth: AuthSettings = field(default_factory=AuthSettings)
    fleet: FleetSettings = field(default_factory=FleetSettings)
    usd_per_replica_hour: Mapping[Pool, float] = field(default_factory=dict)
    """The price of a replica-hour per pool ([pricing]): the cost per million tokens in /metrics."""
    advisor: AdvisorSettings = field(default_factory=AdvisorSettings)
    """The live advisor ([advisor]): the split the recent traffic wants, planned in the background."""
    profiles: Mapping[str, Profile] = field(default_factory=lambda: PROFILES)
    """The profiles a policy document may name: the built-in ones and those loaded from files."""
    launch: LaunchPlan | None = None
    """The vLLM servers the config's [launch] section starts (`specgate pools`)."""
    processes: ProcessGroup | None = None
    """This process's place among the gateway's processes (`specgate serve --workers N`); None alone."""


@dataclass(frozen=True)
class ProcessGroup:
    """One of the gateway's processes serving on one port (`specgate serve --workers N`)."""

    index: int
    count: int
    counts: Path
    """The file in which they count their requests on each replica (`workers/shared.py`)."""
    metrics: Path
    """The directory in which they keep their counters for /metrics to sum (Prometheus's multiprocess files)."""


# --- the file, section by section ----------------------------------------------------------------


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A table of the file: every key known, every value checked (subclasses inherit this)."""


class _Server(_Section, frozen=True):
    host: NonEmpty = "127.0.0.1"
    port: Port = 8000
    max_body_bytes: PositiveInt = 32 * 1024 * 1024
    shutdown_grace_s: Annotated[float, Meta(gt=0, le=3600)] = 30.0
    access_log: bool = False
    header_timeout_ms: Milliseconds = 10_000.0
    body_timeout_ms: Milliseconds = 60_000.0
    idle_timeout_ms: Milliseconds = 75_000.0
    max_connections: Annotated[int, Meta(ge=16, le=1_000_000)] = 4096
    max_line_bytes: Annotated[int, Meta(ge=256, le=1 << 20)] = 8190
    max_header_bytes: Annotated[int, Meta(ge=256, le=1 << 20)] = 8190
    max_headers: Annotated[int, Meta(ge=8, le=10_000)] = 128


class _Models(_Section, frozen=True):
    served: Annotated[list[NonEmpty], Meta(min_length=1)]


class _PodSelector(_Section, frozen=True):
    selector: NonEmpty
    port: Annotated[int, Meta(ge=1, le=65535)]
    namespace: NonEmpty = "default"
    api: str | None = None


class _PoolUrls(_Section, frozen=True):
    urls: list[str] = msgspec.field(default_factory=list)
    dns: list[NonEmpty] = msgspec.field(default_factory=list)
    """Names every address of which is a replica, with their port: `vllm-spec.ns.svc:8000`."""
    kubernetes: list[_PodSelector] = msgspec.field(default_factory=list)


class _Pools(_Section, frozen=True):
    speculative: _PoolUrls = _PoolUrls()
    plain: _PoolUrls = _PoolUrls()

    def of(self, pool: Pool) -> _PoolUrls:
        return self.speculative if pool is Pool.SPECULATIVE else self.plain

    def urls(self, pool: Pool) -> list[str]:
        return self.of(pool).urls


class _Tracing(_Section, frozen=True):
    otlp_url: str | None = None
    sample_ratio: Annotated[float, Meta(ge=0, le=1)] = 1.0
    service_name: NonEmpty = "specgate"


class _Discovery(_Section, frozen=True):
    interval_ms: Annotated[float, Meta(ge=100, le=3_600_000)] = 5000.0


class _Scrape(_Section, frozen=True):
    interval_ms: Milliseconds = 250.0
    timeout_ms: Milliseconds = 1000.0
    stale_after_ms: Milliseconds = 2000.0
    eject_after: PositiveInt = 3
    failure_window: Annotated[int, Meta(ge=2, le=10_000)] = 20
    eject_failure_share: Annotated[float, Meta(gt=0, le=1)] = 0.5
    base_ejection_ms: Milliseconds = 2000.0
    max_ejection_ms: Milliseconds = 60_000.0
    hang_after_ms: Milliseconds = 20_000.0


class _Timeouts(_Section, frozen=True):
    connect_ms: Milliseconds = 2000.0
    first_byte_ms: Milliseconds = 300_000.0
    idle_ms: Milliseconds = 60_000.0


class _Retries(_Section, frozen=True):
    max_attempts: Annotated[int, Meta(ge=1, le=10)] = 3
    budget_percent: Annotated[float, Meta(ge=0, le=100)] = 20.0
    backoff_ms: Annotated[float, Meta(ge=0, le=10_000)] = 25.0


class _Proxy(_Section, frozen=True):
    forward_authorization: bool = False


class _Store(_Section, frozen=True):
    url: str | None = None
    prefix: NonEmpty = "specgate"
    cache: NonEmpty | None = None
    refresh_ms: Milliseconds = 1000.0
    exchange_ms: Annotated[float, Meta(ge=0, le=10_000)] = 50.0
    """How often gateways sharing this Redis exchange their counts; 0: never."""
    max_gateways: Annotated[int, Meta(ge=2, le=64)] = 8
    exchange_stale_ms: Milliseconds = 2000.0


class _Admin(_Section, frozen=True):
    token: str


class _Auth(_Section, frozen=True):
    enabled: bool = False
    keys_file: NonEmpty | None = None
    """A TOML file of [[keys]] tables, or a JSON list of them."""
    keys: list[dict[str, Any]] = msgspec.field(default_factory=list)


class _Pricing(_Section, frozen=True):
    usd_per_replica_hour: Annotated[float, Meta(ge=0, le=1e6)] | None = None
    """What a replica costs an hour, in either pool; unset: no costs in /metrics."""
    speculative_usd_per_replica_hour: Annotated[float, Meta(ge=0, le=1e6)] | None = None
    plain_usd_per_replica_hour: Annotated[float, Meta(ge=0, le=1e6)] | None = None
    """One pool's own price, where its replicas cost otherwise."""

    def prices(self) -> dict[Pool, float]:
        own = {Pool.SPECULATIVE: self.speculative_usd_per_replica_hour, Pool.PLAIN: self.plain_usd_per_replica_hour}
        chosen = {pool: value if value is not None else self.usd_per_replica_hour for pool, value in own.items()}
        return {pool: price for pool, price in chosen.items() if price is not None}


class _Advisor(_Section, frozen=True):
    enabled: bool = True
    interval_ms: Annotated[float, Meta(ge=1000, le=86_400_000)] = 300_000.0
    plan_timeout_ms: Annotated[float, Meta(ge=1000, le=86_400_000)] = 300_000.0
    window_ms: Annotated[float, Meta(ge=1000, le=86_400_000)] = 900_000.0
    min_requests: Annotated[int, Meta(ge=1, le=1_000_000)] = 100
    max_requests: Annotated[int, Meta(ge=1, le=1_000_000)] = 2000


class _Profiles(_Section, frozen=True):
    files: list[NonEmpty] = msgspec.field(default_factory=list)
    """Profile files (`specgate calibrate` writes them), relative to the config file."""


class _File(_Section, frozen=True):
    """The config file; [policy] and [launch] are checked by their own parsers."""

    models: _Models | None = None
    pools: _Pools = _Pools()
    server: _Server = _Server()
    scrape: _Scrape = _Scrape()
    timeouts: _Timeouts = _Timeouts()
    retries: _Retries = _Retries()
    proxy: _Proxy = _Proxy()
    store: _Store = _Store()
    admin: _Admin | None = None
    auth: _Auth = _Auth()
    profiles: _Profiles = _Profiles()
    pricing: _Pricing = _Pricing()
    advisor: _Advisor = _Advisor()
    discovery: _Discovery = _Discovery()
    tracing: _Tracing = _Tracing()
    policy: dict[str, Any] = msgspec.field(default_factory=dict)
    launch: dict[str, Any] | None = None


def _url(key: str, value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(key, f"not an http(s) base URL: {value!r}")
    return value.rstrip("/")


def _dns_name(key: str, value: str) -> DnsName:
    name, _, port = value.rpartition(":")
    if not name or not port.isdigit() or not 0 < int(port) < 65536 or "/" in name:
        raise ConfigError(key, f"not a name and a port (vllm-spec.ns.svc:8000): {value!r}")
    return DnsName(name, int(port))


def _discovered(pools: _Pools) -> dict[Pool, tuple[Where, ...]]:
    found: dict[Pool, tuple[Where, ...]] = {}
    for pool in Pool:
        where, key = pools.of(pool), f"pools.{pool.value}"
        names = [_dns_name(f"{key}.dns[{i}]", v) for i, v in enumerate(where.dns)]
        selectors = [PodSelector(k.namespace, k.selector, k.port, _url(f"{key}.kubernetes[{i}].api", k.api)
                                 if k.api is not None else None) for i, k in enumerate(where.kubernetes)]  # fmt: skip
        if names or selectors:
            found[pool] = (*names, *selectors)
    return found


def store_url(key: str, url: str) -> str:
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(key, f"not a redis:// URL: {url!r}")
    return url


def admin_token(key: str, token: str) -> str:
    if len(token) < MIN_ADMIN_TOKEN:
        raise ConfigError(key, f"an admin token needs at least {MIN_ADMIN_TOKEN} characters")
    return token


def policy_document(table: Mapping[str, Any], profiles: Mapping[str, Profile] = PROFILES) -> PolicyDocument:
    """The config file's [policy] table: a policy document, `schema_version` optional."""
    try:
        return parse_document(dict(table), prefix="policy", profiles=profiles)
    except DocumentError as exc:
        raise ConfigError(exc.field, exc.message) from None


def profiles_from(paths: Sequence[Path], keys: Sequence[str]) -> Mapping[str, Profile]:
    """The built-in profiles and those of the files at `paths` (each named by its key in errors)."""
    files = []
    for path, key in zip(paths, keys, strict=True):
        try:
            files.append(profile_file.load(path))
        except Invalid as exc:
            raise ConfigError(key, str(exc)) from None
    try:
        return profile_file.with_files(files)
    except Invalid as exc:
        raise ConfigError(keys[-1] if keys else "profiles", str(exc)) from None


def parse_settings(doc: Mapping[str, Any], base: Path = Path()) -> GatewaySettings:
    """Settings from a decoded config. A [launch] section (the vLLM servers `specgate pools up`
    starts) supplies [models] and [pools] when the config does not."""
    try:
        file = convert(dict(doc), _File, root="(config)")
        launched = parse_launch(file.launch, base) if file.launch is not None else None
    except Invalid as exc:
        raise ConfigError(exc.field, exc.message) from None
    served = file.models.served if file.models is not None else None
    pools = {pool: tuple(_url(f"pools.{pool.value}.urls[{i}]", u) for i, u in enumerate(file.pools.urls(pool)))
             for pool in Pool}  # fmt: skip
    if launched is not None:
        served = served or [launched.model_name]
        if not any(pools.values()):
            pools = {pool: tuple(s.url for s in launched.servers if s.pool is pool) for pool in Pool}
    if not served:
        raise ConfigError("models.served", "list at least one served model name")
    discovered = _discovered(file.pools)
    if not any(pools.values()) and not discovered:
        raise ConfigError("pools", "configure at least one replica (urls, dns or kubernetes) in pools.speculative "
                          "or pools.plain")  # fmt: skip
    store, scrape, timeouts = file.store, file.scrape, file.timeouts
    if 0 < store.exchange_ms < 5:
        raise ConfigError("store.exchange_ms", "exchange every 5 ms at the most often, or 0 for never")
    profiles = profiles_from(
        [base / name for name in file.profiles.files], [f"profiles.files[{i}]" for i in range(len(file.profiles.files))]
    )
    return GatewaySettings(
        models=tuple(served),
        pools=pools,
        discovery=discovered,
        discovery_interval_s=file.discovery.interval_ms / 1e3,
        tracing=TracingSettings(
            otlp_url=_url("tracing.otlp_url", file.tracing.otlp_url) if file.tracing.otlp_url is not None else None,
            sample_ratio=file.tracing.sample_ratio,
            service_name=file.tracing.service_name,
        ),
        host=file.server.host,
        port=file.server.port,
        max_body_bytes=file.server.max_body_bytes,
        shutdown_grace_s=file.server.shutdown_grace_s,
        access_log=file.server.access_log,
        forward_authorization=file.proxy.forward_authorization,
        timeouts=Timeouts(timeouts.connect_ms / 1e3, timeouts.first_byte_ms / 1e3, timeouts.idle_ms / 1e3),
        limits=Limits(
            header_timeout_s=file.server.header_timeout_ms / 1e3,
            body_timeout_s=file.server.body_timeout_ms / 1e3,
            idle_timeout_s=file.server.idle_timeout_ms / 1e3,
            max_connections=file.server.max_connections,
            max_line_bytes=file.server.max_line_bytes,
            max_header_bytes=file.server.max_header_bytes,
            max_headers=file.server.max_headers,
        ),
        retries=Retries(
            max_attempts=file.retries.max_attempts,
            budget=file.retries.budget_percent / 100,
            backoff_s=file.retries.backoff_ms / 1e3,
        ),
        policy=policy_document(file.policy, profiles),
        profiles=profiles,
        launch=launched,
        store=StoreSettings(
            url=store_url("store.url", store.url) if store.url is not None else None,
            prefix=store.prefix,
            cache=Path(store.cache) if store.cache is not None else None,
            refresh_s=store.refresh_ms / 1e3,
            exchange=ExchangeSettings(store.exchange_ms / 1e3, store.max_gateways, store.exchange_stale_ms / 1e3),
        ),
        admin_token=admin_token("admin.token", file.admin.token) if file.admin is not None else None,
        auth=AuthSettings(file.auth.enabled, _client_keys(file.auth, base)),
        usd_per_replica_hour=file.pricing.prices(),
        advisor=AdvisorSettings(
            enabled=file.advisor.enabled,
            interval_s=file.advisor.interval_ms / 1e3,
            plan_timeout_s=file.advisor.plan_timeout_ms / 1e3,
            window_s=file.advisor.window_ms / 1e3,
            min_requests=file.advisor.min_requests,
            max_requests=file.advisor.max_requests,
        ),
        fleet=FleetSettings(
            scrape_interval_s=scrape.interval_ms / 1e3,
            scrape_timeout_s=scrape.timeout_ms / 1e3,
            stale_after_s=scrape.stale_after_ms / 1e3,
            eject_after=scrape.eject_after,
            failure_window=scrape.failure_window,
            eject_failure_share=scrape.eject_failure_share,
            base_ejection_s=scrape.base_ejection_ms / 1e3,
            max_ejection_s=scrape.max_ejection_ms / 1e3,
            hang_after_s=scrape.hang_after_ms / 1e3,
        ),
    )


def _client_keys(auth: _Auth, base: Path) -> dict[str, ClientKey]:
    try:
        inline = parse_keys(auth.keys, "auth.keys")
        from_file = read_keys(base / auth.keys_file) if auth.keys_file is not None else {}
    except Invalid as exc:
        raise ConfigError(exc.field, exc.message) from None
    return merged(inline, from_file)


def read_keys(path: Path) -> dict[str, ClientKey]:
    """A keys file: TOML with [[keys]] tables, or a JSON list of the same entries."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from None
    try:
        entries = msgspec.json.decode(text) if path.suffix == ".json" else tomllib.loads(text).get("keys", [])
    except (msgspec.DecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(str(path), f"not a keys file: {exc}") from None
    return parse_keys(entries, str(path))


def env_keys(name: str, value: str) -> dict[str, ClientKey]:
    """Keys from an environment variable: a JSON list of entries."""
    try:
        return parse_keys(msgspec.json.decode(value), name)
    except msgspec.DecodeError as exc:
        raise ConfigError(name, f"not a JSON list of keys: {exc}") from None


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None


def load_settings(path: Path) -> GatewaySettings:
    return parse_settings(read_toml(path), path.resolve().parent)
