"""The few request-body fields a routing decision needs, read without touching the bytes sent on.

Only `model`, `stream`, `max_tokens` / `max_completion_tokens` and the prompt's size are read;
anything else is the replica's business, and the body is forwarded exactly as received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from specgate.gateway.errors import BadBody, ModelNotFound
from specgate.protocol.endpoints import Endpoint
from specgate.protocol.tokens import chat_prompt_tokens, completion_prompt_tokens


@dataclass(frozen=True)
class BodyFields:
    model: str
    stream: bool
    max_tokens: int | None
    prompt_tokens: int


def _prompt_tokens(endpoint: Endpoint, body: dict[str, Any]) -> int:
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadBody("'messages' must be a list of messages", param="messages")
        return chat_prompt_tokens(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return completion_prompt_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if all(isinstance(p, str) for p in prompt):
            return sum(completion_prompt_tokens(p) for p in prompt)
        if all(isinstance(p, list) for p in prompt):
            return sum(len(p) for p in prompt)
    raise BadBody("'prompt' must be a string, a list of strings or a list of token ids", param="prompt")


def parse_body(raw: bytes, endpoint: Endpoint, served: tuple[str, ...]) -> BodyFields:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadBody(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadBody("request body must be a JSON object")
    model = body.get("model")
    if model is None:
        if len(served) != 1:
            raise BadBody("'model' is required", param="model")
        model = served[0]
    if not isinstance(model, str):
        raise BadBody("'model' must be a string", param="model")
    if model not in served:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadBody("'stream' must be a boolean", param="stream")
    max_tokens = None
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadBody(f"'{key}' must be a positive integer", param=key)
        max_tokens = value if max_tokens is None else max_tokens
    return BodyFields(model, bool(stream), max_tokens, _prompt_tokens(endpoint, body))
