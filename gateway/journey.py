"""One client request's journey through the gateway, as one object.

What it asked for (the body's few fields, the routing headers, the features a policy reads), the
plan that routes it (one plan for the whole request, even if a new one is swapped in meanwhile),
the headers it is sent upstream with, and the replicas tried so far.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from specgate.gateway.body import BodyFields
from specgate.gateway.sla import REQUEST_ID, RoutingHeaders
from specgate.gateway.tracing import Span
from specgate.policies.drafts import Group
from specgate.policies.features import RequestFeatures
from specgate.policies.length import Pending
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
    draft_group: Group
    """The group whose speedup on speculative replicas it was predicted at, and teaches (`policies/drafts.py`)."""
    arrived: float = field(default_factory=time.monotonic)
    tried: list[str] = field(default_factory=list)
    """Names of the replicas tried so far, in order."""
    span: Span | None = None
    """Its trace span, when tracing is on and it is sampled; None once ended."""
    length: Pending | None = None
    """Its output length, for its group to learn in the order answers began (`policies/length.py`)."""

    @property
    def request_class(self) -> str:
        return self.headers.request_class


CREDENTIALS = frozenset({"authorization", "api-key", "x-api-key", "cookie"})
"""The client's credentials: passed on only when the config says the replicas share them."""
DECODED = frozenset({"content-encoding"})
"""The body is forwarded as aiohttp decoded it: its encoding no longer applies."""
_NOT_FORWARDED = DECODED | {REQUEST_ID, "x-forwarded-for"}
"""Replaced by the gateway's own."""


def handler_task(request: web.Request) -> asyncio.Task[Any]:
    """The task running `request`'s handler (aiohttp runs each in one of its own: `request.task` is
    the connection's). Looked up on the connection's loop: on Python 3.11 asyncio's own look-up of
    the running loop makes a getpid system call, and the few a request made cost about as much as
    its routing decision."""
    task = asyncio.current_task(request.task.get_loop())
    if task is None:  # pragma: no cover - aiohttp runs every handler in a task
        raise RuntimeError("a request handler runs in a task")
    return task


def hop_by_hop(headers: CIMultiDictProxy[str], also: frozenset[str] = frozenset()) -> frozenset[str]:
    """The connection-level headers of a message: the standard ones, and those its `Connection`
    header names (RFC 9110 section 7.6.1); with `also`, those too."""
    if "connection" not in headers:  # the common case: no set to build
        return _hop_by_hop_and(also)
    named = {token.strip().lower() for value in headers.getall("connection", ()) for token in value.split(",")}
    return HOP_BY_HOP | also | named


@functools.cache
def _hop_by_hop_and(also: frozenset[str]) -> frozenset[str]:
    return HOP_BY_HOP | also


def upstream_headers(request: web.Request, request_id: str, *, forward_authorization: bool) -> CIMultiDict[str]:
    """The client's headers as a replica gets them: without hop-by-hop ones (and credentials,
    unless allowed), with our request id and the client's address added to X-Forwarded-For."""
    dropped = hop_by_hop(request.headers, _NOT_FORWARDED if forward_authorization else _NOT_FORWARDED | CREDENTIALS)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in request.headers.items():
        if name.lower() not in dropped:
            out.add(name, value)
    out[REQUEST_ID] = request_id
    chain = [v for v in request.headers.getall("x-forwarded-for", ()) if v.strip()]
    if request.remote:
        chain.append(request.remote)
    if chain:
        out["X-Forwarded-For"] = ", ".join(chain)
    return out
