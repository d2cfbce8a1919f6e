"""The admin API: the fleet as the gateway sees it; the policy document, read and changed.

    GET /admin/fleet     every replica as the gateway sees it, and each pool's step costs as its
                         answers re-fitted them: scales over the profile with their standard
                         errors, the overhead before a first token, step and prefill times by the
                         profile and as fitted, the factors the fitted steps still miss, and how
                         far recent predictions were off
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
import time

import orjson
from aiohttp import web

from specgate.calibration.modes import Pool
from specgate.gateway.errors import BadRequest, GatewayError, Unauthorized
from specgate.gateway.policy_sync import STORE_ERRORS
from specgate.gateway.state import ADVISOR, FLEET, POLICY, SETTINGS
from specgate.gateway.store import VersionConflict
from specgate.policies.document import DocumentError, loads
from specgate.policies.latency_model import LatencyModel
from specgate.workers.latency_fit import LatencyFit
from specgate.workers.snapshot import ReplicaState, Scales

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
    settings = request.app[SETTINGS]
    if settings.processes is not None and settings.store.url is None:
        raise Conflict(
            f"this gateway runs {settings.processes.count} processes (--workers), and this request reached one: "
            "a policy document reaches them all only through the store (start the gateway with --redis)"
        )
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


REFERENCE_CONTEXT = 1024
REFERENCE_BATCHES = (1, 8, 32)
REFERENCE_PROMPT = 1024


def _fit(fit: LatencyFit, model: LatencyModel, pool: Pool) -> dict[str, object]:
    report = fit.report()
    scales = report.scales

    def both(decode_seqs: int, prefill_tokens: int = 0) -> dict[str, float]:
        def at(s: Scales) -> float:
            ms = model.fitted_step_ms(pool, s, decode_seqs, REFERENCE_CONTEXT, prefill_tokens)
            return ms - (model.fitted_step_ms(pool, s, 0, REFERENCE_CONTEXT) if prefill_tokens else 0.0)

        return {"profile": round(at(Scales()), 4), "fitted": round(at(scales), 4)}

    return {
        "answers": report.answers,
        "fitted": report.fitted,
        "basis": fit.basis,
        "scales": {term: round(getattr(scales, term), 4) for term in ("fixed", "decode", "prefill")},
        "stderr": dict(zip(("fixed", "decode", "prefill"), (round(e, 4) for e in report.stderr[:3]), strict=True)),
        "ttft_overhead_ms": round(scales.overhead_ms, 3),
        "ttft_overhead_stderr_ms": round(report.stderr[3], 3),
        "ttft_wait_steps": round(scales.wait, 3),
        "ttft_wait_steps_stderr": round(report.stderr[4], 3),
        "factors": {"ttft": round(scales.ttft_factor, 4), "tpot": round(scales.tpot_factor, 4)},
        "prediction_log_error": {"ttft": report.ttft_error, "tpot": report.tpot_error},
        "tpot_spread": round(scales.tpot_spread, 4),
        f"step_ms_at_context_{REFERENCE_CONTEXT}": {f"batch {b}": both(b) for b in REFERENCE_BATCHES},
        f"prefill_ms_of_{REFERENCE_PROMPT}_tokens": both(0, REFERENCE_PROMPT),
    }


def _replica(r: ReplicaState) -> dict[str, object]:
    return {
        "name": r.name, "url": r.url, "pool": r.pool.value, "available": r.healthy, "in_flight": r.in_flight,
        "running": r.running, "waiting": r.waiting, "kv_usage": r.kv_usage, "tokens_per_step": r.tokens_per_step,
        "max_model_len": r.max_model_len, "scrape_age_s": r.scrape_age_s,
    }  # fmt: skip


async def get_fleet(request: web.Request) -> web.Response:
    _authorize(request)
    fleet, plan = request.app[FLEET], request.app[POLICY].plan
    snapshot = fleet.snapshot(time.monotonic(), plan.profile)
    replicas = [{**_replica(r), "drained": fleet.replicas[r.name].drained, "retired": fleet.replicas[r.name].retired}
                for r in snapshot.replicas]  # fmt: skip
    pools = {pool.value: _fit(fit, plan.model, pool) for pool, fit in fleet.fits.items()}
    advice = request.app[ADVISOR].advice
    advisor = {**advice.view(), "streak": request.app[ADVISOR].governor.view()} if advice is not None else None
    group = request.app[SETTINGS].processes
    process = {"index": group.index + 1, "count": group.count} if group is not None else None
    shared = fleet.shared
    exchange = {"gateways_counted": shared.gateways_counted()} if shared and shared.others else None
    return _json({"profile": plan.profile, "replicas": replicas, "pools": pools, "advisor": advisor,
                  "process": process, "exchange": exchange})  # fmt: skip


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/fleet", get_fleet)
    app.router.add_get("/admin/policy", get_policy)
    app.router.add_put("/admin/policy", put_policy)
