"""The admin API: read and change the policy document.

    GET /admin/policy    the document in force, its version and who changed it, when and why
    PUT /admin/policy    a new document (the body); `If-Match: <version>` is required: the change
                         applies only if that is still the current version (409 otherwise), or
                         `If-Match: *` to apply it whatever the version; `x-change-reason` says why

Both need `Authorization: Bearer <token>`, compared in constant time. Without a configured token
the routes do not exist (404). Errors are in the OpenAI shape; an invalid document is a 400 whose
`param` names the offending field, and nothing changes.
"""

from __future__ import annotations

import hmac

import orjson
from aiohttp import web

from specgate.gateway.errors import BadRequest, GatewayError, Unauthorized
from specgate.gateway.policy_sync import STORE_ERRORS
from specgate.gateway.state import POLICY, SETTINGS
from specgate.gateway.store import VersionConflict
from specgate.policies.document import DocumentError, loads

MAX_DOCUMENT_BYTES = 1024 * 1024
MAX_REASON_CHARS = 500


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"


class PreconditionRequired(GatewayError):
    status = 428
    type = "invalid_request_error"


class StoreUnavailable(GatewayError):
    status = 503


def _authorize(request: web.Request) -> None:
    token = request.app[SETTINGS].admin_token
    assert token is not None
    given = request.headers.get("authorization", "")
    scheme, _, credential = given.partition(" ")
    # surrogateescape: a header of bytes that are not UTF-8 is a wrong token, not a 500
    given_bytes = credential.strip().encode("utf-8", "surrogateescape")
    ok = scheme.lower() == "bearer" and hmac.compare_digest(given_bytes, token.encode())
    if not ok:
        raise Unauthorized("a valid admin token is required: Authorization: Bearer <token>")


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def get_policy(request: web.Request) -> web.Response:
    _authorize(request)
    control = request.app[POLICY]
    return _json({**control.current.to_json(), "store": control.source})


async def put_policy(request: web.Request) -> web.Response:
    _authorize(request)
    control = request.app[POLICY]
    match = request.headers.get("if-match")
    if match is None:
        raise PreconditionRequired(
            "send If-Match with the version you read (or * to overwrite whatever is there)", param="If-Match"
        )
    expected: int | None = None
    if match.strip() != "*":
        try:
            expected = int(match.strip().strip('"'))
        except ValueError:
            raise BadRequest(f"If-Match must be a version number or *, got {match[:32]!r}", param="If-Match") from None
    raw = await request.read()  # bounded by the server's max_body_bytes (413 past it)
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise BadRequest(f"a policy document is at most {MAX_DOCUMENT_BYTES} bytes")
    try:
        document = loads(raw, control.profiles)
    except DocumentError as exc:
        raise BadRequest(f"invalid policy document: {exc}", param=exc.field) from None
    why = request.headers.get("x-change-reason", "")[:MAX_REASON_CHARS]
    who = f"admin-api@{request.remote or 'unknown'}"
    try:
        applied = await control.update(document, expected_version=expected, who=who, why=why)
    except VersionConflict as exc:
        raise Conflict(str(exc), param="If-Match") from None
    except STORE_ERRORS as exc:
        raise StoreUnavailable(f"the policy store is unreachable: {exc}") from None
    return _json({**applied.to_json(), "store": control.source})


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/policy", get_policy)
    app.router.add_put("/admin/policy", put_policy)
