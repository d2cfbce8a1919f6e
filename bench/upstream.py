"""A fixed, fast OpenAI upstream for measuring what a router adds, and nothing else.

Not a model of vLLM (that is `specgate sim`): it answers at once, so every microsecond measured
through the gateway is the gateway's. Non-streaming requests get a small fixed chat completion;
streaming ones get `chunks` SSE chunks (64 by default) spaced `x-chunk-delay-ms` apart. It also
answers `/metrics` with vLLM's load gauges, `/health` and `/v1/models`, as vLLM does, so a gateway admits it.

    python -m specgate.bench.upstream --port 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import orjson
from aiohttp import web

from specgate.protocol.serving import serve_until_cancelled

_COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "logprobs": None, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1},
    }
)
_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":" tok"},"logprobs":null,"finish_reason":null}]}\n\n'
)
_METRICS = (
    b'vllm:num_requests_running{engine="0",model_name="bench"} 0\n'
    b'vllm:num_requests_waiting{engine="0",model_name="bench"} 0\n'
)


async def chat(request: web.Request) -> web.StreamResponse:
    body = orjson.loads(await request.read())
    if not body.get("stream"):
        return web.Response(body=_COMPLETION, content_type="application/json")
    delay = float(request.headers.get("x-chunk-delay-ms", "0")) / 1e3
    chunks = int(request.headers.get("x-chunks", "64"))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(chunks):
        if delay:
            await asyncio.sleep(delay)
        await response.write(_CHUNK)
    await response.write(b"data: [DONE]\n\n")
    return response


_MODELS = orjson.dumps({"object": "list", "data": [{"id": "bench", "object": "model", "max_model_len": 4096}]})


async def metrics(_: web.Request) -> web.Response:
    return web.Response(body=_METRICS, content_type="text/plain")


async def health(_: web.Request) -> web.Response:
    return web.Response()


async def models(_: web.Request) -> web.Response:
    return web.Response(body=_MODELS, content_type="application/json")


def make_app() -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="fixed fast OpenAI upstream for overhead benchmarks")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()

    def ready(url: str) -> None:
        print(f"bench upstream listening on {url}", flush=True)

    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve_until_cancelled(make_app(), args.host, args.port, ready, shutdown_timeout=1))


if __name__ == "__main__":
    main()
