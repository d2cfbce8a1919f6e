"""The few request-body fields a routing decision needs, read without touching the bytes sent on.

Only `model`, `stream`, `max_tokens` / `max_completion_tokens` and the prompt's size are read,
declared as a msgspec Struct in the vocabulary every input shares (any other field is skipped
unread); the body itself is forwarded exactly as received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from specgate.gateway.errors import BadBody, ModelNotFound
from specgate.protocol.endpoints import Endpoint
from specgate.protocol.repetition import TAIL_BYTES, repetition, text_repetition
from specgate.protocol.tokens import chat_prompt_tokens, completion_prompt_tokens, content_text
from specgate.validation import invalid

Tokens = Annotated[int, Meta(ge=1)]


class _RoutingFields(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    max_tokens: Tokens | None = None
    max_completion_tokens: Tokens | None = None
    messages: Any = None
    prompt: Any = None


_DECODER = msgspec.json.Decoder(_RoutingFields)


@dataclass(frozen=True)
class BodyFields:
    model: str
    stream: bool
    max_tokens: int | None
    prompt_tokens: int
    repetition: float = 0.0
    """How much of the prompt repeats itself (`protocol/repetition.py`)."""


def _prompt_tokens(endpoint: Endpoint, body: _RoutingFields) -> int:
    if endpoint is Endpoint.CHAT:
        if not isinstance(body.messages, list):
            raise BadBody("'messages' must be a list of messages", param="messages")
        return chat_prompt_tokens(body.messages)
    prompt = body.prompt
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


def _prompt_repetition(endpoint: Endpoint, body: _RoutingFields) -> float:
    """Of a body `_prompt_tokens` has accepted: the repetition of the prompt's end."""
    if endpoint is Endpoint.CHAT:
        # each message's end only: the joined text is as bounded as what is looked at
        texts = [content_text(m.get("content"))[-TAIL_BYTES:] for m in body.messages[-8:] if isinstance(m, dict)]
        return text_repetition("\n".join(texts))
    prompt = body.prompt
    if isinstance(prompt, str):
        return text_repetition(prompt)
    last = prompt[-1]
    if isinstance(last, str):
        return text_repetition(last)
    return repetition(last if isinstance(last, list) else prompt)


def parse_body(raw: bytes, endpoint: Endpoint, served: tuple[str, ...]) -> BodyFields:
    try:
        body = _DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        error = invalid(exc, _RoutingFields, root="")
        message = f"'{error.field}' {error.message}" if error.field else f"request body: {error.message}"
        raise BadBody(message, param=error.field or None) from None
    except msgspec.DecodeError as exc:
        raise BadBody(f"request body is not valid JSON: {exc}") from None
    model = body.model
    if model is None:
        if len(served) != 1:
            raise BadBody("'model' is required", param="model")
        model = served[0]
    if model not in served:
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt_tokens = _prompt_tokens(endpoint, body)
    return BodyFields(model, bool(body.stream), max_tokens, prompt_tokens, _prompt_repetition(endpoint, body))
