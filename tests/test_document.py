"""The policy document: strict validation that names the field, canonical JSON, and the plan it compiles to."""

from dataclasses import replace
from typing import Any

import pytest

from specgate.calibration.modes import Pool
from specgate.policies.decision import Decision
from specgate.policies.document import DocumentError, PolicyDocument, ReplicaControl, loads, parse
from specgate.policies.features import RequestFeatures, SloTargets
from specgate.workers.pools import FleetSettings, Replica
from specgate.workers.snapshot import ReplicaState, Snapshot

FULL: dict[str, Any] = {
    "schema_version": 1,
    "policy": "adaptive",
    "params": {"harm_weight": 1.0},
    "profile": "h100-llama31-8b",
    "slo": {"default": {"ttft_ms": 1000, "tpot_ms": 50}, "classes": {"batch": {"ttft_ms": 30000, "tpot_ms": None}}},
    "allow_pool_override": False,
    "shedding": {"enabled": True, "below_priority": 1, "retry_after_s": 2},
    "exploration": 0.05,
    "pools": {"speculative": {"weight": 2, "drain": False}, "plain": {"weight": 1, "drain": True}},
}


def with_(path: str, value: object) -> dict[str, Any]:
    """FULL with one key (dotted path) set; a value of ... removes it."""
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in FULL.items()}
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node[key] = dict(node[key])
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return doc


def test_full_document_parses_and_round_trips() -> None:
    doc = parse(FULL)
    assert doc.policy == "adaptive"
    assert doc.profile == "h100-llama31-8b"
    assert doc.slo.default == SloTargets(1000.0, 50.0)
    assert doc.slo.classes == {"batch": SloTargets(30000.0, None)}
    assert doc.shedding.enabled
    assert doc.shedding.below_priority == 1
    assert doc.pools[Pool.PLAIN].drain
    assert doc.pools[Pool.SPECULATIVE].weight == 2.0
    assert loads(doc.dumps()) == doc
    assert loads(doc.dumps()).dumps() == doc.dumps()  # canonical: same document, same bytes


def test_the_minimal_document_is_the_default() -> None:
    assert parse({"schema_version": 1}) == PolicyDocument()


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({}, "schema_version"),
        (with_("schema_version", 2), "schema_version"),
        (with_("schema_version", True), "schema_version"),
        ({**FULL, "colour": "blue"}, "colour"),
        (with_("policy", "magic"), "policy"),
        (with_("policy", 3), "policy"),
        (with_("params", {"harm_weight": -1}), "params.harm_weight"),
        (with_("params", {"wings": 2}), "params.wings"),
        (with_("params", {"shed": True}), "params.shed"),
        (with_("params", []), "params"),
        (with_("profile", "tpu-v9"), "profile"),
        (with_("slo.default", {"ttft_ms": 0}), "slo.default.ttft_ms"),
        (with_("slo.default", {"ttft_ms": "fast"}), "slo.default.ttft_ms"),
        (with_("slo.default", {"latency": 3}), "slo.default.latency"),
        (with_("slo.classes", {"has space": {}}), "slo.classes.has space"),
        (with_("slo.classes", {"batch": {"tpot_ms": -1}}), "slo.classes.batch.tpot_ms"),
        (with_("slo.flavour", 1), "slo.flavour"),
        (with_("allow_pool_override", "yes"), "allow_pool_override"),
        (with_("shedding.enabled", 1), "shedding.enabled"),
        (with_("shedding.below_priority", 0.5), "shedding.below_priority"),
        (with_("shedding.retry_after_s", 1e9), "shedding.retry_after_s"),
        ({**with_("policy", "least-loaded"), "params": {}}, "shedding.enabled"),
        (with_("exploration", 0.9), "exploration"),
        (with_("exploration", float("nan")), "exploration"),
        (with_("pools.plain", {"weight": 0}), "pools.plain.weight"),
        (with_("pools.plain", {"weight": 1000}), "pools.plain.weight"),
        (with_("pools.plain", {"drain": "no"}), "pools.plain.drain"),
        (with_("pools.gpu", {}), "pools.gpu"),
        (with_("pools", {"speculative": {"drain": True}, "plain": {"drain": True}}), "pools"),
        (with_("replicas", {"10.0.0.1:80": {}}), "replicas.10.0.0.1:80"),
        (with_("replicas", {"http://a:80/v1": {}}), "replicas.http://a:80/v1"),
        (with_("replicas", {"http://a:80": {"pool": "gpu"}}), "replicas.http://a:80.pool"),
        (with_("replicas", {"http://a:80": {"drain": 1}}), "replicas.http://a:80.drain"),
        (with_("replicas", {"http://a:80": {"weight": 2}}), "replicas.http://a:80.weight"),
        (with_("replicas", [1]), "replicas"),
        ([1, 2], "(document)"),
    ],
)
def test_errors_name_the_field(doc: object, field: str) -> None:
    with pytest.raises(DocumentError) as exc:
        parse(doc)
    assert exc.value.field == field
    assert str(exc.value).startswith(field)


def test_replicas_move_between_pools_and_drain_by_url() -> None:
    doc = parse({**FULL, "replicas": {"http://a:8000": {"pool": "speculative"}, "https://b:443": {"drain": True}}})
    assert doc.replica_pools() == {"http://a:8000": Pool.SPECULATIVE}
    assert doc.drained_replicas() == {"https://b:443"}
    moved = doc.with_replica("https://b:443", ReplicaControl(pool=Pool.PLAIN))
    assert moved.replica_pools() == {"http://a:8000": Pool.SPECULATIVE, "https://b:443": Pool.PLAIN}
    assert not moved.drained_replicas()
    assert loads(moved.dumps()) == moved  # the document round-trips as any other
    # An entry that says nothing is dropped: the replica is as the configuration says.
    assert doc.with_replica("http://a:8000", ReplicaControl()).with_replica("https://b:443", ReplicaControl()) == (
        parse(FULL)
    )


@pytest.mark.parametrize("raw", [b"", b"{", b"null", b'"text"', b"[]"])
def test_not_a_document(raw: bytes) -> None:
    with pytest.raises(DocumentError):
        loads(raw)


def state(name: str, pool: Pool, in_flight: int) -> ReplicaState:
    base = Replica(name, f"http://{name}", pool, FleetSettings()).state(0.0)
    return replace(base, healthy=True, in_flight=in_flight)


FLEET = Snapshot((state("spec-0", Pool.SPECULATIVE, 3), state("plain-0", Pool.PLAIN, 2)))
FEATURES = RequestFeatures(
    model="m", stream=True, prompt_tokens=100, max_tokens=None, expected_output_tokens=50, slo_ttft_ms=None,
    slo_tpot_ms=None, forced_pool=None, priority=0, sequence=0,
)  # fmt: skip


def plan(**changes: object) -> Any:
    doc = {"schema_version": 1, "policy": "least-loaded", **changes}
    return parse(doc).compile("7")


@pytest.mark.parametrize(
    ("changes", "features", "chosen"),
    [
        ({}, FEATURES, "plain-0"),  # fewest in flight
        ({"pools": {"speculative": {"weight": 2}}}, FEATURES, "spec-0"),  # 3 / 2 < 2 / 1
        ({"pools": {"plain": {"drain": True}}}, FEATURES, "spec-0"),
        # a drained pool takes no request, not even a forced one
        ({"pools": {"plain": {"drain": True}}}, replace(FEATURES, forced_pool=Pool.PLAIN), "spec-0"),
        ({}, replace(FEATURES, forced_pool=Pool.SPECULATIVE), "spec-0"),
        ({"allow_pool_override": False}, replace(FEATURES, forced_pool=Pool.SPECULATIVE), "plain-0"),
    ],
)
def test_compiled_plan_steers_by_weight_and_drain(
    changes: dict[str, object], features: RequestFeatures, chosen: str
) -> None:
    decision = plan(**changes).decide(features, FLEET)
    assert isinstance(decision, Decision)
    assert decision.replica.name == chosen


def test_compiled_plan_carries_version_and_slo_classes() -> None:
    p = parse(FULL).compile("12")
    assert p.version == "12"
    assert p.slo_for("batch") == SloTargets(30000.0, None)
    assert p.slo_for("anything else") == SloTargets(1000.0, 50.0)
    assert p.policy.name == "adaptive"
    assert p.drained == frozenset({Pool.PLAIN})


def test_weighted_round_robin_splits_by_weight() -> None:
    fleet = Snapshot((state("spec-0", Pool.SPECULATIVE, 0), state("plain-0", Pool.PLAIN, 0)))
    p = parse({"schema_version": 1, "policy": "round-robin", "pools": {"speculative": {"weight": 3}}}).compile("1")
    chosen = [p.decide(replace(FEATURES, sequence=i), fleet) for i in range(1000)]
    spec = sum(isinstance(d, Decision) and d.replica.pool is Pool.SPECULATIVE for d in chosen)
    assert spec == pytest.approx(750, abs=3)
