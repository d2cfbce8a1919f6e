"""The gateway's own errors, rendered in the OpenAI error shape by one middleware.

    GatewayError                       {"error": {"message", "type", "param", "code"}}
     ├── BadRequest            400     invalid_request_error
     │    ├── BadHeader        400     a routing header with a bad value (param: the header)
     │    ├── BadBody          400     a body that is not JSON, or a field of the wrong type
     │    ├── SloInfeasible    400     no replica could meet the request's SLOs even idle
     │    └── ContextTooLong   400     the prompt does not fit any replica's max_model_len
     ├── Unauthorized          401     no known API key (client keys on), or a wrong admin token
     ├── Forbidden             403     the key may not force a pool or claim that priority
     ├── ModelNotFound         404     model_not_found
     ├── UnsupportedMediaType  415     a form or text/plain body (what a cross-site page can send)
     ├── BodyTooLarge          413     body_too_large
     ├── Overloaded            429     the request cannot meet its SLO now, its wait in the admission queue
     │                                 ran out, or the queue is full (Retry-After says when to retry)
     ├── NoHealthyReplica      503     no_healthy_replica
     ├── UpstreamUnavailable   502     every replica tried failed before answering
     ├── UpstreamBusy          429     (a retry's reason: a replica answered 429)
     └── UpstreamTimeout       504     no first byte within the first-byte timeout

Errors a replica returns are not these: they pass through unchanged, status and body.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

_log = logging.getLogger(__name__)


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.reason = reason or self.code or self.type
        """Short and machine-readable, for metrics and the access log: the error's code, or why
        the routing decision refused the request."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class BadHeader(BadRequest):
    code = "invalid_header"


class BadBody(BadRequest):
    code = "invalid_body"


class SloInfeasible(BadRequest):
    """No replica could meet the request's SLOs even idle: a retry cannot help, relaxing them can."""

    code = "slo_infeasible"


class ContextTooLong(BadRequest):
    """The prompt does not fit any replica's context window (vLLM's `max_model_len`)."""

    code = "context_length_exceeded"


class BodyTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class UnsupportedMediaType(GatewayError):
    """A body declared as a browser form or plain text: a cross-site request, not an API client."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "body_too_large"


class Overloaded(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "slo_unattainable"

    def __init__(self, message: str, *, retry_after_s: float, reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retry_after_s = retry_after_s
        if reason is not None:
            self.code = reason.replace("-", "_")  # slo_unattainable, deadline, queue_full


class NoHealthyReplica(GatewayError):
    status = 503
    type = "server_error"
    code = "no_healthy_replica"


class ShuttingDown(GatewayError):
    status = 503
    type = "server_error"
    code = "shutting_down"


class UpstreamUnavailable(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_unavailable"


class UpstreamBusy(GatewayError):
    """Every replica tried answered 429 (the last one's answer goes to the client as it is)."""

    status = 429
    type = "rate_limit_error"
    code = "upstream_busy"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"


def error_response(err: GatewayError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=err.status, body=orjson.dumps(err.body()), content_type="application/json", headers=headers
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Counted = Callable[[web.Request, int, str], None]
"""Told of each error the gateway answers with: the request, the status and the error's code."""


def openai_errors(counted: Counted | None = None) -> Middleware:
    """The middleware through which every error leaves in the OpenAI shape (ours, aiohttp's own
    404 and 405, and bugs alike), each told to `counted`."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Overloaded as err:
            code, response = err.reason, error_response(err, {"Retry-After": str(max(round(err.retry_after_s), 1))})
        except GatewayError as err:
            code, response = err.reason, error_response(err)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code, response = exc.reason.lower().replace(" ", "_"), http_error_response(exc)
        except Exception:
            _log.exception("unhandled error on %s %s", request.method, request.path)
            failure = GatewayError("internal gateway error")
            code, response = failure.reason, error_response(failure)
        if counted is not None:
            counted(request, response.status, code)
        return response

    return middleware


SERVER = "specgate"
"""The `Server` header of every answer: the product, not the framework and its version under it."""


def http_error_response(exc: web.HTTPException) -> web.Response:
    """aiohttp's own error (404, 405, 417, ...) in the OpenAI shape."""
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    default = not exc.text or exc.text.startswith(f"{exc.status}:")  # aiohttp's "404: Not Found"
    body = {"error": {"message": exc.reason if default else exc.text, "type": kind, "param": None, "code": None}}
    return web.Response(
        status=exc.status, body=orjson.dumps(body), content_type="application/json", headers={"Server": SERVER}
    )
