"""The simulated replica's HTTP face: the routes and shapes of `vllm serve`.

`POST /v1/chat/completions` and `/v1/completions` (streaming and not), `POST /tokenize`,
`GET /v1/models`, `GET /health` and `GET /metrics`. As in vLLM, a streamed response starts (status line,
headers, the role chunk) only when the first token exists, and every engine step's tokens go
out as one chunk, so a speculative replica sends its accepted runs in bursts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus

import orjson
from aiohttp import web

from specgate.protocol.endpoints import Endpoint
from specgate.protocol.serving import serve_until_cancelled
from specgate.sim import responses
from specgate.sim.metrics import CONTENT_TYPE
from specgate.sim.realtime import RealtimeEngine, SimSettings, Submission
from specgate.sim.requests import GenerationRequest, SimRequestError, parse_request
from specgate.sim.responses import ResponseIds
from specgate.sim.text import count_words

_log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", SimSettings)
ENGINE = web.AppKey("engine", RealtimeEngine)
STARTED = web.AppKey("started", int)

_ID_PREFIX = {Endpoint.CHAT: "chatcmpl-", Endpoint.COMPLETIONS: "cmpl-"}


def _error(err: SimRequestError) -> web.Response:
    return web.Response(status=err.status, body=orjson.dumps(err.body()), content_type="application/json")


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except SimRequestError as err:
        return _error(err)
    except web.HTTPException:
        raise
    except Exception as exc:  # a bug must still answer in the error shape, not drop the connection
        _log.exception("request failed")
        return _error(SimRequestError(f"internal error: {exc}", status=HTTPStatus.INTERNAL_SERVER_ERROR))


async def _replica_ctx(app: web.Application) -> AsyncIterator[None]:
    replica = RealtimeEngine(app[SETTINGS])
    app[ENGINE] = replica
    task = asyncio.create_task(replica.run(), name="sim-engine")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _read_json(request: web.Request) -> object:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].max_body_bytes
        raise SimRequestError(
            f"request body exceeds {limit} bytes", status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE
        ) from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SimRequestError(f"JSON decode error: {exc}") from None


async def _generate(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    replica = request.app[ENGINE]
    settings = request.app[SETTINGS]
    body = await _read_json(request)
    gen = parse_request(endpoint, body, settings.model, settings.profile.max_model_len)
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    ids = ResponseIds(_ID_PREFIX[endpoint] + request_id, int(time.time()), settings.model)
    headers = {"X-Request-Id": request_id}
    sub = replica.submit(gen)
    try:
        if gen.stream:
            return await _stream(request, gen, sub, ids, headers)
        return await _complete(gen, sub, ids, headers)
    finally:
        replica.release(sub)


async def _stream(
    request: web.Request, gen: GenerationRequest, sub: Submission, ids: ResponseIds, headers: dict[str, str]
) -> web.StreamResponse:
    out = await sub.outputs.get()
    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    if gen.endpoint is Endpoint.CHAT:
        await response.write(responses.role_chunk(ids))
    completion = 0
    while True:
        completion += out.new_tokens
        reason = out.finish_reason.value if out.finish_reason else None
        running = responses.usage(gen.prompt_tokens, completion) if gen.continuous_usage else None
        await response.write(responses.text_chunk(ids, gen.endpoint, sub.words.take(out.new_tokens), reason, running))
        if reason is not None:
            break
        out = await sub.outputs.get()
    if gen.include_usage:
        await response.write(responses.usage_chunk(ids, gen.endpoint, gen.prompt_tokens, completion))
    await response.write(responses.DONE)
    await response.write_eof()
    return response


async def _complete(gen: GenerationRequest, sub: Submission, ids: ResponseIds, headers: dict[str, str]) -> web.Response:
    parts: list[str] = []
    completion = 0
    reason = None
    while reason is None:
        out = await sub.outputs.get()
        completion += out.new_tokens
        parts.append(sub.words.take(out.new_tokens))
        reason = out.finish_reason
    body = responses.full_response(ids, gen.endpoint, "".join(parts), reason.value, gen.prompt_tokens, completion)
    return web.Response(body=body, content_type="application/json", headers=headers)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Endpoint.CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, Endpoint.COMPLETIONS)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's `/tokenize` for a text prompt, by the simulated tokenizer: a token per word, as the
    replica's own answers are made."""
    body = await _read_json(request)
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, str):
        raise SimRequestError("'prompt' must be a string", param="prompt")
    count = count_words(prompt)
    max_model_len = request.app[SETTINGS].profile.max_model_len
    answer = {"count": count, "max_model_len": max_model_len, "tokens": list(range(count)), "token_strs": None}
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    body = responses.models_list(settings.model, request.app[STARTED], settings.profile.max_model_len)
    return web.Response(body=body, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    replica = request.app[ENGINE]
    replica.refresh_gauges()
    return web.Response(body=replica.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})


def make_app(settings: SimSettings) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[STARTED] = int(time.time())
    app.cleanup_ctx.append(_replica_ctx)
    app.router.add_post(Endpoint.CHAT, chat_completions)
    app.router.add_post(Endpoint.COMPLETIONS, completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(settings: SimSettings, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until cancelled; a client that disconnects aborts its request in the engine."""
    await serve_until_cancelled(make_app(settings), settings.host, settings.port, on_ready)
