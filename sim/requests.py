"""The OpenAI request fields the simulated replica reads, validated the way vLLM validates them.

Only what changes the replica's behaviour is read: the model, the prompt's size, the output
length controls and the streaming options. Anything else in the body is accepted and ignored,
as vLLM does for fields it does not know.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from specgate.protocol.endpoints import Endpoint
from specgate.protocol.tokens import chat_prompt_tokens, completion_prompt_tokens
from specgate.sim.text import count_words

SCRIPTED_OUTPUT_FIELD = "specgate_sim_output_tokens"


class SimRequestError(Exception):
    """A request the replica refuses, rendered in vLLM's error shape."""

    def __init__(self, message: str, *, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    @property
    def error_type(self) -> str:
        return {
            HTTPStatus.BAD_REQUEST: "BadRequestError",
            HTTPStatus.NOT_FOUND: "NotFoundError",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "BadRequestError",
        }.get(self.status, "InternalServerError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class GenerationRequest:
    endpoint: Endpoint
    model: str
    prompt_tokens: int
    max_tokens: int
    """The cap in force: the request's, or what is left of the context window."""
    max_tokens_param: int | None
    min_tokens: int
    ignore_eos: bool
    scripted_output_tokens: int | None
    """`specgate_sim_output_tokens`: how long the answer is, set by a trace replay. The gateway
    never reads it, so the replica learns the true length without the router seeing it."""
    stream: bool
    include_usage: bool
    continuous_usage: bool


def _opt(body: dict[str, Any], key: str, kind: type | tuple[type, ...], label: str) -> Any:
    value = body.get(key)
    # bool is an int in Python; an integer field must not take true/false.
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise SimRequestError(f"'{key}' must be {label}, got {type(value).__name__}", param=key)
    return value


def _count_prompt(endpoint: Endpoint, body: dict[str, Any]) -> int:
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimRequestError("'messages' must be a non-empty list of messages", param="messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise SimRequestError(f"messages[{i}] must be an object with a string 'role'", param="messages")
        last = messages[-1]
        if body.get("continue_final_message") is True and last["role"] == "assistant":
            # An answer to go on with: its text is tokenized as the replica's answers are made.
            content = last.get("content")
            return chat_prompt_tokens(messages[:-1]) + count_words(content if isinstance(content, str) else "")
        return chat_prompt_tokens(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return completion_prompt_tokens(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise SimRequestError("the simulated replica serves one prompt per request", param="prompt")
    raise SimRequestError("'prompt' must be a string or a non-empty list of token ids", param="prompt")


def parse_request(endpoint: Endpoint, body: Any, served_model: str, max_model_len: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise SimRequestError("the request body must be a JSON object")
    model = _opt(body, "model", str, "a string")
    if model is not None and model != served_model:
        raise SimRequestError(f"The model `{model}` does not exist.", param="model", status=HTTPStatus.NOT_FOUND)
    n = _opt(body, "n", int, "an integer")
    if n is not None and n != 1:
        raise SimRequestError("the simulated replica generates one choice per request (n=1)", param="n")

    max_tokens = _opt(body, "max_tokens", int, "an integer")
    max_completion = _opt(body, "max_completion_tokens", int, "an integer")
    if endpoint is Endpoint.CHAT and max_completion is not None:
        max_tokens = max_completion
    if max_tokens is not None and max_tokens < 1:
        raise SimRequestError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    min_tokens = _opt(body, "min_tokens", int, "an integer") or 0
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise SimRequestError("min_tokens must be between 0 and max_tokens", param="min_tokens")
    ignore_eos = bool(_opt(body, "ignore_eos", bool, "a boolean"))
    scripted = _opt(body, SCRIPTED_OUTPUT_FIELD, int, "an integer")
    if scripted is not None and scripted < 1:
        raise SimRequestError(f"{SCRIPTED_OUTPUT_FIELD} must be at least 1", param=SCRIPTED_OUTPUT_FIELD)
    stream = bool(_opt(body, "stream", bool, "a boolean"))
    options = _opt(body, "stream_options", dict, "an object")
    if options is not None and not stream:
        raise SimRequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
    # As in vLLM, naming stream_options at all turns usage on unless it says otherwise.
    include_usage = options is not None and _opt(options, "include_usage", bool, "a boolean") is not False
    options = options or {}
    continuous = _opt(options, "continuous_usage_stats", bool, "a boolean")

    prompt_tokens = _count_prompt(endpoint, body)
    room = max_model_len - prompt_tokens
    if room < 1 or (max_tokens is not None and max_tokens > room):
        requested = prompt_tokens + (max_tokens or 1)
        raise SimRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{requested} tokens ({prompt_tokens} in the messages, {requested - prompt_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="max_tokens" if max_tokens is not None else "messages",
        )
    return GenerationRequest(
        endpoint=endpoint,
        model=served_model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens if max_tokens is not None else room,
        max_tokens_param=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        scripted_output_tokens=scripted,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=bool(continuous),
    )
