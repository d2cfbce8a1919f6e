"""One client request's journey through the gateway, as one object.

What it asked for (the body's few fields, the routing headers, the features a policy reads), the
plan that routes it (one plan for the whole request, even if a new one is swapped in meanwhile),
the headers it is sent upstream with, and the replicas tried so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web
from multidict import CIMultiDict

from specgate.gateway.body import BodyFields
from specgate.gateway.sla import REQUEST_ID, RoutingHeaders
from specgate.policies.features import RequestFeatures
from specgate.policies.registry import RoutingPlan
from specgate.protocol.endpoints import Endpoint

# Connection-level headers (RFC 9110 section 7.6.1) and the ones aiohttp sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
        "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
    }
)  # fmt: skip


@dataclass
class Journey:
    request: web.Request
    endpoint: Endpoint
    raw: bytes
    """The body as received: forwarded byte for byte."""
    fields: BodyFields
    headers: RoutingHeaders
    features: RequestFeatures
    plan: RoutingPlan
    upstream_headers: CIMultiDict[str]
    arrived: float = field(default_factory=time.monotonic)
    tried: list[str] = field(default_factory=list)
    """Names of the replicas tried so far, in order."""

    @property
    def request_class(self) -> str:
        return self.headers.request_class


def upstream_headers(request: web.Request, request_id: str, *, forward_authorization: bool) -> CIMultiDict[str]:
    """The client's headers as a replica gets them: without hop-by-hop ones, with our request id."""
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in request.headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower == REQUEST_ID:
            continue
        if lower == "authorization" and not forward_authorization:
            continue
        out.add(name, value)
    out[REQUEST_ID] = request_id
    return out
