"""The Grafana dashboard and the Prometheus alert rules ask only for metrics, and labels, that a
gateway exports."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from specgate.calibration.modes import Pool
from specgate.gateway.app import make_app
from specgate.gateway.config import GatewaySettings, StoreSettings
from specgate.testing import RedisServer, SimProcess, running_app
from specgate.workers.pools import FleetSettings

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "specgate.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
MODEL = "sim-model"
ADDED = {"job", "instance", "le"}
"""Labels Prometheus adds to every series it scrapes, and histograms' bucket bound."""
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return queries


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def metric_names(query: str) -> set[str]:
    return set(re.findall(r"\b(specgate_[a-z0-9_]+)", query))


def label_names(query: str) -> set[str]:
    """Labels a query matches on or groups by."""
    matched = re.findall(r"[{,]\s*([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", query)
    grouped = [name.strip() for clause in re.findall(r"\b(?:by|on|without)\s*\(([^)]*)\)", query)
               for name in clause.split(",") if name.strip()]  # fmt: skip
    return set(matched) | set(grouped)


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@pytest.fixture(scope="module")
def pools(sim_factory: Callable[..., SimProcess]) -> dict[Pool, tuple[str, ...]]:
    args = ("--model", MODEL, "--time-scale", "20")
    spec, plain = sim_factory("--mode", "speculative", *args), sim_factory("--mode", "plain", *args)
    return {Pool.SPECULATIVE: (spec.url,), Pool.PLAIN: (plain.url,)}


@pytest.fixture
async def exported(pools: dict[Pool, tuple[str, ...]], redis_server: RedisServer) -> dict[str, set[str]]:
    """Each metric family the gateway exports after answering a few requests, with the labels of
    its samples."""
    settings = GatewaySettings(
        models=(MODEL,), pools=pools, port=0, fleet=FleetSettings(scrape_interval_s=0.05),
        store=StoreSettings(url=redis_server.url), usd_per_replica_hour={Pool.SPECULATIVE: 3.0, Pool.PLAIN: 2.0},
    )  # fmt: skip
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    headers = {"x-slo-ttft-ms": "5000", "x-slo-tpot-ms": "500", "x-request-class": "chat"}
    async with running_app(make_app(settings)) as url, aiohttp.ClientSession() as session:
        for pool in ("speculative", "plain"):
            for _ in range(3):
                async with session.post(f"{url}/v1/chat/completions", json=body,
                                        headers={**headers, "x-route-pool": pool}) as r:  # fmt: skip
                    assert r.status == 200
                    await r.read()
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
    families: dict[str, set[str]] = {}
    for metric in text_string_to_metric_families(text):
        labels = families.setdefault(metric.name, set())
        for sample in metric.samples:
            labels.update(sample.labels)
    return families


def queries() -> Iterator[tuple[str, str]]:
    for query in dashboard_queries():
        yield "dashboard", query
    for rule in rules():
        yield rule.get("alert") or rule["record"], rule["expr"]


async def test_every_query_names_an_exported_metric_and_its_labels(exported: dict[str, set[str]]) -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    checked = 0
    for where, query in queries():
        names = metric_names(query)
        assert names or any(r in query for r in recorded), (where, query)
        assert {family(n) for n in names} <= set(exported), (where, names - {n for n in names if family(n) in exported})
        # every label it matches on or groups by is one of its metrics' (once they have samples)
        known = set().union(*(exported[family(n)] for n in names)) if names else set()
        if all(exported[family(n)] for n in names):
            assert label_names(query) - ADDED <= known, (where, query, label_names(query) - ADDED - known)
            checked += 1
    assert checked > 20


def test_the_dashboard_covers_what_operators_watch() -> None:
    wanted = {"specgate_slo_total", "specgate_ttft_prediction_error_seconds_bucket",
              "specgate_tpot_prediction_error_seconds_bucket", "specgate_replica_tokens_per_step",
              "specgate_queue_depth", "specgate_retries_total", "specgate_replica_ejections_total",
              "specgate_policy_version"}  # fmt: skip
    named = set().union(*(metric_names(q) for q in dashboard_queries()))
    assert wanted <= named
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert len(titles) == len(set(titles))


def test_the_alert_rules_are_well_formed() -> None:
    for rule in rules():
        assert ("alert" in rule) != ("record" in rule), rule
        if "alert" in rule:
            assert re.fullmatch(r"Specgate[A-Za-z]+", rule["alert"])
            assert rule["labels"]["severity"] in ("page", "ticket")
            assert rule["annotations"]["summary"]
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"])
        assert rule["expr"].count("(") == rule["expr"].count(")")
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert {"SpecgateSLOBurnFast", "SpecgateSLOBurnSlow", "SpecgateReplicaEjected"} <= alerts
