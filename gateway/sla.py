"""The routing headers a client may send, validated with the vocabulary every input shares.

A malformed, out-of-range or repeated value is a 400 naming the header; an absent one takes the
policy document's default for the request's class.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from msgspec import Meta
from multidict import CIMultiDictProxy

from specgate.calibration.modes import Pool
from specgate.gateway.errors import BadHeader
from specgate.policies.features import SloTargets
from specgate.validation import ClassName, Invalid, Milliseconds, Priority, RequestId, convert

SLO_TTFT = "x-slo-ttft-ms"
SLO_TPOT = "x-slo-tpot-ms"
EXPECTED_OUTPUT = "x-expected-output-tokens"
ROUTE_POOL = "x-route-pool"
PRIORITY = "x-priority"
REQUEST_ID = "x-request-id"
REQUEST_CLASS = "x-request-class"
FAILOVER = "x-failover"

OutputTokens = Annotated[int, Meta(ge=1, le=10_000_000)]


@dataclass(frozen=True)
class RoutingHeaders:
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    expected_output_tokens: int | None
    forced_pool: Pool | None
    priority: int
    request_id: str
    request_class: str = ""
    """`x-request-class`: picks the class's default SLOs and groups learned output lengths."""
    failover: bool = True
    """`x-failover: off`: a stream whose replica fails midway ends with an error event instead
    of going on from another replica."""


def _value(headers: CIMultiDictProxy[str], name: str, kind: Any) -> Any:
    """The header's one value as `kind`; None when absent."""
    values = headers.getall(name, ())
    if not values:
        return None
    if len(values) > 1:
        raise BadHeader(f"{name} must be sent once, got {len(values)} values", param=name)
    try:
        return convert(values[0].strip(), kind, root=name, strict=False)
    except Invalid as exc:
        raise BadHeader(f"{name}: {exc.message}, got {values[0][:64]!r}", param=name) from None


def parse_routing_headers(headers: CIMultiDictProxy[str], slo_for: Callable[[str], SloTargets]) -> RoutingHeaders:
    """The request's routing headers; SLOs it does not send come from `slo_for(its class)`."""
    ttft = _value(headers, SLO_TTFT, Milliseconds)
    tpot = _value(headers, SLO_TPOT, Milliseconds)
    pool = _value(headers, ROUTE_POOL, str)
    forced = None
    if pool is not None:
        try:
            forced = Pool(pool.lower())
        except ValueError:
            raise BadHeader(
                f"{ROUTE_POOL} must be 'speculative' or 'plain', got {pool[:64]!r}", param=ROUTE_POOL
            ) from None
    request_class = _value(headers, REQUEST_CLASS, ClassName) if headers.get(REQUEST_CLASS) else ""
    defaults = slo_for(request_class)
    priority = _value(headers, PRIORITY, Priority)
    failover = _value(headers, FAILOVER, str)
    if failover is not None and failover.lower() not in ("on", "off"):
        raise BadHeader(f"{FAILOVER} must be 'on' or 'off', got {failover[:64]!r}", param=FAILOVER)
    return RoutingHeaders(
        slo_ttft_ms=ttft if ttft is not None else defaults.ttft_ms,
        slo_tpot_ms=tpot if tpot is not None else defaults.tpot_ms,
        expected_output_tokens=_value(headers, EXPECTED_OUTPUT, OutputTokens),
        forced_pool=forced,
        priority=priority if priority is not None else 0,
        request_id=_value(headers, REQUEST_ID, RequestId) or os.urandom(16).hex(),
        request_class=request_class,
        failover=failover is None or failover.lower() == "on",
    )
