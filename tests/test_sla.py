import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from specgate.calibration.modes import Pool
from specgate.gateway.errors import BadHeader
from specgate.gateway.sla import RoutingHeaders, parse_routing_headers
from specgate.policies.features import SloTargets

CLASSES = {"batch": SloTargets(ttft_ms=30000.0, tpot_ms=None)}


def DEFAULTS(request_class: str) -> SloTargets:
    return CLASSES.get(request_class, SloTargets(ttft_ms=800.0, tpot_ms=60.0))


def parse(headers: dict[str, str] | list[tuple[str, str]]) -> RoutingHeaders:
    return parse_routing_headers(CIMultiDictProxy(CIMultiDict(headers)), DEFAULTS)


@pytest.mark.parametrize(
    ("headers", "field", "expected"),
    [
        ({}, "slo_ttft_ms", 800.0),
        ({}, "slo_tpot_ms", 60.0),
        ({}, "forced_pool", None),
        ({}, "priority", 0),
        ({}, "expected_output_tokens", None),
        ({"x-slo-ttft-ms": "250"}, "slo_ttft_ms", 250.0),
        ({"x-slo-tpot-ms": "12.5"}, "slo_tpot_ms", 12.5),
        ({"x-expected-output-tokens": " 300 "}, "expected_output_tokens", 300),
        ({"x-route-pool": "speculative"}, "forced_pool", Pool.SPECULATIVE),
        ({"x-route-pool": "PLAIN"}, "forced_pool", Pool.PLAIN),
        ({"x-priority": "-3"}, "priority", -3),
        ({"x-request-id": "abc-123.x:y_z"}, "request_id", "abc-123.x:y_z"),
        ({"x-request-class": "batch"}, "request_class", "batch"),
        ({"x-request-class": "batch"}, "slo_ttft_ms", 30000.0),
        ({"x-request-class": "batch"}, "slo_tpot_ms", None),
        ({"x-request-class": "batch", "x-slo-tpot-ms": "90"}, "slo_tpot_ms", 90.0),
        ({"x-request-class": "chat"}, "slo_ttft_ms", 800.0),
        ({"x-request-class": ""}, "request_class", ""),
    ],
)
def test_valid_headers(headers: dict[str, str], field: str, expected: object) -> None:
    assert getattr(parse(headers), field) == expected


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("x-slo-ttft-ms", "fast"),
        ("x-slo-ttft-ms", "0"),
        ("x-slo-ttft-ms", "-5"),
        ("x-slo-ttft-ms", "nan"),
        ("x-slo-ttft-ms", "inf"),
        ("x-slo-ttft-ms", "1e300"),
        ("x-slo-tpot-ms", ""),
        ("x-expected-output-tokens", "12.5"),
        ("x-expected-output-tokens", "0"),
        ("x-expected-output-tokens", "99999999999"),
        ("x-route-pool", "gpu"),
        ("x-priority", "high"),
        ("x-priority", "10000000000"),
        ("x-request-id", "has space"),
        ("x-request-id", "x" * 129),
        ("x-request-id", ""),
        ("x-request-class", "has space"),
        ("x-request-class", "c" * 65),
    ],
)
def test_bad_header_names_itself(name: str, value: str) -> None:
    with pytest.raises(BadHeader) as exc:
        parse({name: value})
    assert exc.value.param == name
    assert exc.value.status == 400
    assert name in exc.value.message


def test_request_id_is_generated_when_absent() -> None:
    a = parse({}).request_id
    b = parse({}).request_id
    assert a != b
    assert len(a) == 32


@pytest.mark.parametrize("name", ["x-slo-ttft-ms", "X-Priority", "x-route-pool", "x-request-id"])
def test_a_repeated_header_is_refused_not_resolved(name: str) -> None:
    value = {"x-route-pool": "plain", "x-request-id": "abc"}.get(name.lower(), "100")
    with pytest.raises(BadHeader) as exc:
        parse([(name, value), (name.upper(), value)])
    assert exc.value.param == name.lower()
    assert "once" in exc.value.message
