"""Gateway settings: a TOML file validated once at start into a frozen `GatewaySettings`.

Every key is checked: unknown keys, wrong types and out-of-range values are errors that name the
key (`pools.speculative.urls[1]: ...`). Example:

    [server]
    host = "127.0.0.1"
    port = 8000

    [models]
    served = ["codellama/CodeLlama-34b-Instruct-hf"]

    [pools.speculative]
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]

    [pools.plain]
    urls = ["http://10.0.0.3:8000"]

    [policy]
    name = "threshold"
    params = { max_load = 8 }
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import DEFAULT_PROFILE, PROFILES
from specgate.policies.document import SCHEMA_VERSION, DocumentError, PolicyDocument
from specgate.policies.document import parse as parse_document
from specgate.policies.registry import POLICY_NAMES, SloTargets
from specgate.workers.pools import FleetSettings
from specgate.workers.vllm_launch import LaunchConfigError, LaunchPlan, parse_launch


class ConfigError(ValueError):
    """A setting that cannot be used; the message starts with the key."""


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 2.0
    first_byte_s: float = 300.0
    """Until the response starts. A streamed vLLM response starts with its first token; a
    non-streamed one only when it is complete, so this bounds a whole non-streamed request."""
    idle_s: float = 60.0
    """Longest silence between two chunks of a streamed response."""


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


@dataclass(frozen=True)
class GatewaySettings:
    models: tuple[str, ...]
    pools: Mapping[Pool, tuple[str, ...]]
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 32 * 1024 * 1024
    shutdown_grace_s: float = 30.0
    forward_authorization: bool = False
    """Pass the client's Authorization header to the replicas (off: replicas rarely share the
    gateway's credentials, and a leaked key is worse than a refused request)."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    policy: PolicyDocument = field(default_factory=PolicyDocument)
    """The policy to start with: the store's replaces it when there is one."""
    store: StoreSettings = field(default_factory=StoreSettings)
    admin_token: str | None = None
    """Bearer token of the admin API (/admin/policy); None turns the API off."""
    fleet: FleetSettings = field(default_factory=FleetSettings)


_SCHEMA: Mapping[str, Mapping[str, Any]] = {
    "server": {"host": str, "port": int, "max_body_bytes": int, "shutdown_grace_s": float},
    "models": {"served": list},
    "pools": {"speculative": dict, "plain": dict},
    "scrape": {"interval_ms": float, "timeout_ms": float, "stale_after_ms": float, "eject_after": int},
    "timeouts": {"connect_ms": float, "first_byte_ms": float, "idle_ms": float},
    "slo": {"ttft_ms": float, "tpot_ms": float},
    "policy": {"name": str, "params": dict, "allow_pool_override": bool, "profile": str},
    "proxy": {"forward_authorization": bool},
    "store": {"url": str, "prefix": str, "cache": str, "refresh_ms": float},
    "admin": {"token": str},
}


def _check(key: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise ConfigError(f"{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _positive(key: str, value: float) -> float:
    if not value > 0:
        raise ConfigError(f"{key}: must be positive, got {value}")
    return value


def _url(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a URL string, got {type(value).__name__}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"{key}: not an http(s) base URL: {value!r}")
    return value.rstrip("/")


def store_url(key: str, url: str) -> str:
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"{key}: not a redis:// URL: {url!r}")
    return url


def admin_token(key: str, token: str) -> str:
    if len(token) < 16:
        raise ConfigError(f"{key}: an admin token needs at least 16 characters")
    return token


def initial_document(
    name: str,
    params: dict[str, Any],
    *,
    profile: str = DEFAULT_PROFILE,
    allow_pool_override: bool = True,
    slo: SloTargets | None = None,
) -> PolicyDocument:
    """The policy document a config file's [policy] and [slo] describe.

    The adaptive policy's shedding and exploration, parameters in the config file, are top-level
    settings of the document."""
    obj: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "policy": name, "profile": profile}
    obj["allow_pool_override"] = allow_pool_override
    if slo is not None:
        obj["slo"] = {"default": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}}
    if name == "adaptive":
        moved = {"shed": "enabled", "shed_below_priority": "below_priority", "retry_after_s": "retry_after_s"}
        shedding = {moved[k]: params.pop(k) for k in list(params) if k in moved}
        if shedding:
            obj["shedding"] = shedding
        if "exploration" in params:
            obj["exploration"] = params.pop("exploration")
    obj["params"] = params
    try:
        return parse_document(obj)
    except DocumentError as exc:
        raise ConfigError(f"policy: {exc}") from None


def parse_settings(doc: Mapping[str, Any], base: Path = Path()) -> GatewaySettings:
    """Settings from a decoded config. A [launch] section (the vLLM servers `specgate pools up`
    starts) supplies [models] and [pools] when the config does not."""
    sections: dict[str, dict[str, Any]] = {}
    launched: LaunchPlan | None = None
    for name, section in doc.items():
        if name == "launch":
            try:
                launched = parse_launch(section, base)
            except LaunchConfigError as exc:
                raise ConfigError(str(exc)) from None
            continue
        if name not in _SCHEMA:
            raise ConfigError(f"{name}: unknown section; known: {', '.join(_SCHEMA)}")
        if not isinstance(section, dict):
            raise ConfigError(f"{name}: expected a table")
        checked: dict[str, Any] = {}
        for key, value in section.items():
            if key not in _SCHEMA[name]:
                raise ConfigError(f"{name}.{key}: unknown key; known: {', '.join(_SCHEMA[name])}")
            checked[key] = _check(f"{name}.{key}", value, _SCHEMA[name][key])
        sections[name] = checked

    def get(section: str, key: str, default: Any) -> Any:
        return sections.get(section, {}).get(key, default)

    def seconds(section: str, key: str, default_ms: float) -> float:
        return _positive(f"{section}.{key}", get(section, key, default_ms)) / 1e3

    if launched is not None:
        sections.setdefault("models", {"served": [launched.model_name]})
        if not sections.get("pools"):
            sections["pools"] = {
                pool.value: {"urls": [s.url for s in launched.servers if s.pool is pool]} for pool in Pool
            }
    served = get("models", "served", [])
    for i, model in enumerate(served):
        if not isinstance(model, str) or not model:
            raise ConfigError(f"models.served[{i}]: expected a non-empty string")
    if not served:
        raise ConfigError("models.served: list at least one served model name")

    pools: dict[Pool, tuple[str, ...]] = {}
    for pool in Pool:
        table = get("pools", pool.value, {})
        for key in table:
            if key != "urls":
                raise ConfigError(f"pools.{pool.value}.{key}: unknown key; known: urls")
        urls = table.get("urls", [])
        if not isinstance(urls, list):
            raise ConfigError(f"pools.{pool.value}.urls: expected a list of URLs")
        pools[pool] = tuple(_url(f"pools.{pool.value}.urls[{i}]", u) for i, u in enumerate(urls))
    if not any(pools.values()):
        raise ConfigError("pools: configure at least one replica in pools.speculative or pools.plain")

    port = get("server", "port", 8000)
    if not 0 <= port <= 65535:
        raise ConfigError(f"server.port: out of range: {port}")
    policy_name = get("policy", "name", "adaptive")
    if policy_name not in POLICY_NAMES:
        raise ConfigError(f"policy.name: unknown policy {policy_name!r}; known: {', '.join(POLICY_NAMES)}")
    profile = get("policy", "profile", DEFAULT_PROFILE)
    if profile not in PROFILES:
        raise ConfigError(f"policy.profile: unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    slo_ttft, slo_tpot = get("slo", "ttft_ms", None), get("slo", "tpot_ms", None)
    policy = initial_document(
        policy_name,
        dict(get("policy", "params", {})),
        profile=profile,
        allow_pool_override=get("policy", "allow_pool_override", True),
        slo=SloTargets(
            ttft_ms=_positive("slo.ttft_ms", slo_ttft) if slo_ttft is not None else None,
            tpot_ms=_positive("slo.tpot_ms", slo_tpot) if slo_tpot is not None else None,
        ),
    )
    url = get("store", "url", None)
    cache = get("store", "cache", None)
    token = get("admin", "token", None)
    return GatewaySettings(
        models=tuple(served),
        pools=pools,
        host=get("server", "host", "127.0.0.1"),
        port=port,
        max_body_bytes=int(_positive("server.max_body_bytes", get("server", "max_body_bytes", 32 * 1024 * 1024))),
        shutdown_grace_s=_positive("server.shutdown_grace_s", get("server", "shutdown_grace_s", 30.0)),
        forward_authorization=get("proxy", "forward_authorization", False),
        timeouts=Timeouts(
            connect_s=seconds("timeouts", "connect_ms", 2000.0),
            first_byte_s=seconds("timeouts", "first_byte_ms", 300_000.0),
            idle_s=seconds("timeouts", "idle_ms", 60_000.0),
        ),
        policy=policy,
        store=StoreSettings(
            url=store_url("store.url", url) if url is not None else None,
            prefix=get("store", "prefix", "specgate"),
            cache=Path(cache) if cache is not None else None,
            refresh_s=seconds("store", "refresh_ms", 1000.0),
        ),
        admin_token=admin_token("admin.token", token) if token is not None else None,
        fleet=FleetSettings(
            scrape_interval_s=seconds("scrape", "interval_ms", 250.0),
            scrape_timeout_s=seconds("scrape", "timeout_ms", 1000.0),
            stale_after_s=seconds("scrape", "stale_after_ms", 2000.0),
            eject_after=int(_positive("scrape.eject_after", get("scrape", "eject_after", 3))),
        ),
    )


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def load_settings(path: Path) -> GatewaySettings:
    return parse_settings(read_toml(path), path.resolve().parent)
