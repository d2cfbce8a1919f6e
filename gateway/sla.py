"""The routing headers a client may send, validated.

A malformed value is a 400 naming the header; an absent one takes the configured default.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from specgate.calibration.modes import Pool
from specgate.gateway.errors import BadHeader
from specgate.policies.registry import SloTargets

SLO_TTFT = "x-slo-ttft-ms"
SLO_TPOT = "x-slo-tpot-ms"
EXPECTED_OUTPUT = "x-expected-output-tokens"
ROUTE_POOL = "x-route-pool"
PRIORITY = "x-priority"
REQUEST_ID = "x-request-id"
REQUEST_CLASS = "x-request-class"

MAX_SLO_MS = 3_600_000.0  # an hour: anything longer is a mistake, not a target
MAX_OUTPUT_TOKENS = 10_000_000
MAX_PRIORITY = 1_000_000
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_REQUEST_CLASS = re.compile(r"[A-Za-z0-9._\-]{1,64}")


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


def _milliseconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise BadHeader(f"{name} must be a number of milliseconds, got {raw[:64]!r}", param=name) from None
    if not math.isfinite(value) or not 0 < value <= MAX_SLO_MS:
        raise BadHeader(f"{name} must be a positive number of milliseconds up to {MAX_SLO_MS:.0f}", param=name)
    return value


def _integer(name: str, raw: str, low: int, high: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise BadHeader(f"{name} must be an integer, got {raw[:64]!r}", param=name) from None
    if not low <= value <= high:
        raise BadHeader(f"{name} must lie between {low} and {high}, got {value}", param=name)
    return value


def parse_routing_headers(headers: Mapping[str, str], slo_for: Callable[[str], SloTargets]) -> RoutingHeaders:
    """The request's routing headers; SLOs it does not send come from `slo_for(its class)`."""
    ttft = headers.get(SLO_TTFT)
    tpot = headers.get(SLO_TPOT)
    expected = headers.get(EXPECTED_OUTPUT)
    pool = headers.get(ROUTE_POOL)
    priority = headers.get(PRIORITY)
    request_id = headers.get(REQUEST_ID)
    forced = None
    if pool is not None:
        try:
            forced = Pool(pool.strip().lower())
        except ValueError:
            raise BadHeader(
                f"{ROUTE_POOL} must be 'speculative' or 'plain', got {pool[:64]!r}", param=ROUTE_POOL
            ) from None
    if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
        raise BadHeader(f"{REQUEST_ID} must be 1-128 characters of letters, digits and ._:-", param=REQUEST_ID)
    request_class = headers.get(REQUEST_CLASS, "")
    if request_class and not _REQUEST_CLASS.fullmatch(request_class):
        raise BadHeader(f"{REQUEST_CLASS} must be 1-64 characters of letters, digits and ._-", param=REQUEST_CLASS)
    defaults = slo_for(request_class)
    return RoutingHeaders(
        slo_ttft_ms=_milliseconds(SLO_TTFT, ttft) if ttft is not None else defaults.ttft_ms,
        slo_tpot_ms=_milliseconds(SLO_TPOT, tpot) if tpot is not None else defaults.tpot_ms,
        expected_output_tokens=_integer(EXPECTED_OUTPUT, expected, 1, MAX_OUTPUT_TOKENS)
        if expected is not None
        else None,
        forced_pool=forced,
        priority=_integer(PRIORITY, priority, -MAX_PRIORITY, MAX_PRIORITY) if priority is not None else 0,
        request_id=request_id or os.urandom(16).hex(),
        request_class=request_class,
    )
