from pathlib import Path
from typing import Any

import pytest

from specgate.calibration.modes import Pool
from specgate.gateway.config import ConfigError, load_settings, parse_settings
from specgate.policies.decision import Shedding
from specgate.policies.document import parse

MINIMAL: dict[str, Any] = {
    "models": {"served": ["m"]},
    "pools": {"speculative": {"urls": ["http://a:1"]}, "plain": {"urls": ["http://b:2/", "https://c"]}},
}


def with_(section: str, **values: Any) -> dict[str, Any]:
    doc = {k: dict(v) for k, v in MINIMAL.items()}
    doc.setdefault(section, {}).update(values)
    return doc


def test_minimal_config_takes_defaults() -> None:
    s = parse_settings(MINIMAL)
    assert s.models == ("m",)
    assert s.pools[Pool.SPECULATIVE] == ("http://a:1",)
    assert s.pools[Pool.PLAIN] == ("http://b:2", "https://c")
    assert s.port == 8000
    assert s.policy.policy == "adaptive"
    assert s.store.url is None
    assert s.admin_token is None
    assert s.fleet.scrape_interval_s == 0.25
    assert s.timeouts.connect_s == 2.0
    assert not s.forward_authorization


def test_the_advisor_settings_land_where_they_are_named() -> None:
    doc = with_("advisor", interval_ms=60_000, plan_timeout_ms=90_000, window_ms=600_000, min_requests=50,
                max_requests=500)  # fmt: skip
    s = parse_settings(doc).advisor
    assert (s.interval_s, s.plan_timeout_s, s.window_s) == (60.0, 90.0, 600.0)
    assert (s.min_requests, s.max_requests) == (50, 500)
    defaults = parse_settings(MINIMAL).advisor
    assert (defaults.window_s, defaults.min_requests, defaults.max_requests) == (900.0, 100, 2000)


def test_values_convert_to_seconds() -> None:
    doc = with_("scrape", interval_ms=100, failure_window=10, eject_failure_share=0.3)
    doc["timeouts"] = {"first_byte_ms": 1500, "idle_ms": 2000.5}
    doc["policy"] = {"slo": {"default": {"ttft_ms": 300}}}
    s = parse_settings(doc)
    assert s.fleet.scrape_interval_s == pytest.approx(0.1)
    assert (s.fleet.failure_window, s.fleet.eject_failure_share) == (10, 0.3)
    assert s.timeouts.first_byte_s == pytest.approx(1.5)
    assert s.timeouts.idle_s == pytest.approx(2.0005)
    assert s.policy.slo.default.ttft_ms == 300.0
    assert s.policy.slo.default.tpot_ms is None


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ({**MINIMAL, "nonsense": {}}, "nonsense"),
        (with_("server", prot=1), "server.prot"),
        (with_("server", port="8000"), "server.port"),
        (with_("server", port=True), "server.port"),
        (with_("server", port=70000), "server.port"),
        (with_("scrape", interval_ms=0), "scrape.interval_ms"),
        (with_("scrape", eject_failure_share=0), "scrape.eject_failure_share"),
        (with_("scrape", failure_window=1), "scrape.failure_window"),
        (with_("timeouts", connect_ms=-1), "timeouts.connect_ms"),
        (with_("policy", policy="magic"), "policy.policy"),
        (with_("policy", name="adaptive"), "policy.name"),
        (with_("policy", profile="tpu"), "policy.profile"),
        (with_("policy", slo={"default": {"ttft_ms": "fast"}}), "policy.slo.default.ttft_ms"),
        (with_("policy", slo={"classes": {"batch": {"tpot_ms": 0}}}), "policy.slo.classes.batch.tpot_ms"),
        (with_("slo", ttft_ms=100), "slo"),
        (with_("policy", params={"harm_weight": -1}), "policy.params.harm_weight"),
        (with_("policy", policy="least-loaded", params={"shed": True}), "policy.params.shed"),
        (with_("policy", policy="least-loaded", shedding={"enabled": True}), "policy.shedding.enabled"),
        (with_("store", url="http://redis:6379"), "store.url"),
        (with_("store", host="redis"), "store.host"),
        (with_("store", exchange_ms=1), "store.exchange_ms"),
        (with_("store", max_gateways=1), "store.max_gateways"),
        (with_("admin", token="short"), "admin.token"),
        ({"pools": MINIMAL["pools"]}, "models.served"),
        ({"models": {"served": [""]}, "pools": MINIMAL["pools"]}, "models.served[0]"),
        ({"models": {"served": ["m"]}, "pools": {}}, "pools"),
        ({"models": {"served": ["m"]}, "pools": {"plain": {"urls": ["ftp://x"]}}}, "pools.plain.urls[0]"),
        ({"models": {"served": ["m"]}, "pools": {"plain": {"urls": [3]}}}, "pools.plain.urls[0]"),
        ({"models": {"served": ["m"]}, "pools": {"plain": {"url": ["http://x"]}}}, "pools.plain.url"),
        ({"models": {"served": ["m"]}, "pools": {"plain": {"urls": "http://x"}}}, "pools.plain.urls"),
        ({"models": "m", "pools": MINIMAL["pools"]}, "models"),
    ],
)
def test_errors_name_the_key(doc: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings(doc)
    assert str(exc.value).startswith(key)


def test_load_settings_reads_toml(tmp_path: Path) -> None:
    path = tmp_path / "specgate.toml"
    path.write_text(
        '[models]\nserved = ["m"]\n[pools.plain]\nurls = ["http://127.0.0.1:9"]\n'
        '[policy]\npolicy = "threshold"\nparams = { max_load = 4 }\n'
    )
    s = load_settings(path)
    assert s.policy.policy == "threshold"
    assert s.policy.params == {"max_load": 4}


def test_the_policy_table_is_a_policy_document() -> None:
    table = {"shedding": {"enabled": True, "below_priority": 2}, "exploration": 0.1, "params": {"harm_weight": 1.0}}
    s = parse_settings(with_("policy", **table))
    assert s.policy.shedding == Shedding(enabled=True, below_priority=2)
    assert s.policy.exploration == 0.1
    assert s.policy.params == {"harm_weight": 1.0}
    assert s.policy == parse({"schema_version": 1, **table})


def test_store_and_admin_settings() -> None:
    doc = with_("store", url="redis://127.0.0.1:6379/0", prefix="blue", cache="/tmp/p.json", refresh_ms=500)
    doc["admin"] = {"token": "t" * 32}
    s = parse_settings(doc)
    assert (s.store.url, s.store.prefix, s.store.refresh_s) == ("redis://127.0.0.1:6379/0", "blue", 0.5)
    assert s.store.cache == Path("/tmp/p.json")
    assert s.admin_token == "t" * 32
    assert (s.store.exchange.interval_s, s.store.exchange.gateways, s.store.exchanges) == (0.05, 8, True)


def test_counts_are_exchanged_only_through_a_redis_and_not_when_turned_off() -> None:
    assert not parse_settings(with_("store", exchange_ms=20)).store.exchanges  # no Redis
    assert not parse_settings(with_("store", url="redis://r:6379/0", exchange_ms=0)).store.exchanges
    three = parse_settings(with_("store", url="redis://r:6379/0", max_gateways=3, exchange_stale_ms=800))
    assert three.store.exchanges
    assert (three.store.exchange.gateways, three.store.exchange.stale_s) == (3, 0.8)


@pytest.mark.parametrize(("text", "message"), [("[models\n", "not valid TOML"), (None, "cannot read")])
def test_unreadable_files(tmp_path: Path, text: str | None, message: str) -> None:
    path = tmp_path / "specgate.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(path)
