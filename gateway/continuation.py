"""Mid-stream failover: a stream whose replica dies or stalls after part of the answer reached the
client goes on from another replica, as one response with one `[DONE]`.

The events the client already has are kept as they went out (`ClientStream`). When the replica
fails they are read back for the text so far, and the request is sent again as its own
continuation (`Continuation`): a chat with that text as the assistant's unfinished last message
(vLLM's `continue_final_message`), a completion with the text appended to its prompt, and the
output caps less the tokens already produced (counted by the new replica's `/tokenize`). The
continuation's events are rewritten to the first response's `id` and `created`, its role chunk
dropped and its usage counted for the whole answer.

Some answers cannot be continued from their text alone; those end with the error event as
before: several choices, log-probabilities, tool calls, structured output, reasoning output,
`echo`, a prompt of token ids, and any request sent with `x-failover: off`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from specgate.protocol.endpoints import Endpoint
from specgate.protocol.tokens import text_tokens

MID_STREAM_ERROR = (
    b'data: {"error": {"message": "the replica failed mid-stream", "type": "server_error", '
    b'"param": null, "code": "upstream_failed"}}\n\n'
)
SHUTDOWN_ERROR = (
    b'data: {"error": {"message": "the gateway is shutting down", "type": "server_error", '
    b'"param": null, "code": "shutting_down"}}\n\n'
)
SHUTDOWN = "specgate: shutting down"
"""The message of the cancellation that cuts requests still in flight past the shutdown grace."""
DONE = b"data: [DONE]"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""vLLM's (and OpenAI's) `max_tokens` for a completion that does not set it."""
TOKENIZE_TIMEOUT_S = 2.0
FAREWELL_TIMEOUT_S = 1.0
"""How long the last words of a failing stream may take to write."""

# Request fields whose answer cannot be rebuilt from its text: the state they carry (a grammar's
# position, per-token probabilities, a tool call's arguments, other choices) is not in the text.
_NOT_RESUMABLE = (
    "tools", "functions", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs", "logprobs", "top_logprobs", "echo", "prompt_logprobs",
)  # fmt: skip


def shutting_down(cancel: asyncio.CancelledError) -> bool:
    """Whether a cancellation is the gateway's shutdown (not a client that left)."""
    return cancel.args == (SHUTDOWN,)


@dataclass
class ClientStream:
    """A streamed answer the client is receiving: its response, and the complete events that went
    out, whichever replica they came from."""

    response: web.StreamResponse
    sent: list[bytes] = field(default_factory=list)
    failovers: int = 0

    async def send(self, events: bytes) -> None:
        self.sent.append(events)
        await self.response.write(events)

    async def fail(self, error_event: bytes = MID_STREAM_ERROR) -> None:
        """End the stream with an error event (the client may have left: then there is no one to tell)."""
        try:
            async with asyncio.timeout(FAREWELL_TIMEOUT_S):
                await self.response.write(error_event)
                await self.response.write_eof()
        except (ConnectionError, RuntimeError, TimeoutError):
            pass


@dataclass(frozen=True)
class Progress:
    """What the client has of the answer, read back from the events sent."""

    text: str
    id: str | None
    created: int | None
    role_sent: bool
    finished: bool
    resumable: bool
    content_events: int


def _events(data: bytes) -> Iterator[bytes]:
    """The data of each SSE event in `data` (its `data:` lines joined)."""
    for block in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines:
            yield b"\n".join(lines)


def progress(sent: list[bytes], endpoint: Endpoint) -> Progress:
    parts: list[str] = []
    ident: str | None = None
    created: int | None = None
    role_sent = finished = False
    resumable = True
    content_events = 0
    for data in _events(b"".join(sent)):
        if data == b"[DONE]":
            continue
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return Progress("", None, None, False, False, False, 0)
        if not isinstance(event, dict) or "error" in event:
            return Progress("", None, None, False, False, False, 0)
        ident = ident if ident is not None else event.get("id")
        created = created if created is not None else event.get("created")
        choices = event.get("choices") or []
        if len(choices) > 1:
            resumable = False
        for choice in choices[:1]:
            if not isinstance(choice, dict):
                resumable = False
                continue
            finished = finished or choice.get("finish_reason") is not None
            resumable = resumable and choice.get("logprobs") is None
            if endpoint is Endpoint.CHAT:
                delta = choice.get("delta") or {}
                role_sent = role_sent or "role" in delta
                if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                    resumable = False
                text = delta.get("content")
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                parts.append(text)
                content_events += 1
    return Progress("".join(parts), ident, created, role_sent, finished, resumable, content_events)


@dataclass
class Continuation:
    """A request to send again from where its answer broke off, and how to pass its answer on."""

    endpoint: Endpoint
    body: dict[str, Any]
    progress: Progress
    include_usage: bool
    tokens_before: int = 0

    def request_body(self, tokens_before: int) -> bytes | None:
        """The continuation request, given how many tokens the text so far is; None when the
        answer has no tokens left to give."""
        self.tokens_before = tokens_before
        body, text = dict(self.body), self.progress.text
        if self.endpoint is Endpoint.CHAT:
            messages = list(body["messages"])
            if body.get("continue_final_message") and messages and isinstance(messages[-1], dict):
                last = dict(messages[-1])  # the client sent a prefix of its own: extend it
                last["content"] = str(last.get("content") or "") + text
                messages[-1] = last
            else:
                messages.append({"role": "assistant", "content": text})
            body["messages"] = messages
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
            caps = [key for key in ("max_tokens", "max_completion_tokens") if body.get(key) is not None]
        else:
            body["prompt"] = body["prompt"] + text
            body.setdefault("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
            caps = ["max_tokens"] if body["max_tokens"] is not None else []
        for key in caps:
            body[key] = body[key] - tokens_before
            if body[key] < 1:
                return None
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(body["min_tokens"] - tokens_before, 0)
        return orjson.dumps(body)

    def rewrite(self, events: bytes) -> bytes:
        """The continuation's complete events as the client's stream goes on: the first response's
        id and created, no second role chunk, usage counted for the whole answer."""
        out: list[bytes] = []
        for data in _events(events):
            if data == b"[DONE]":
                out.append(DONE + b"\n\n")
                continue
            try:
                event = orjson.loads(data)
            except orjson.JSONDecodeError:
                out.append(b"data: " + data + b"\n\n")
                continue
            if isinstance(event, dict) and "error" not in event and not self._rewritten(event):
                continue
            out.append(b"data: " + orjson.dumps(event) + b"\n\n")
        return b"".join(out)

    def _rewritten(self, event: dict[str, Any]) -> bool:
        """Rewrite one chunk in place; False when the client must not see it at all."""
        progress = self.progress
        if progress.id is not None:
            event["id"] = progress.id
        if progress.created is not None:
            event["created"] = progress.created
        choices = event.get("choices")
        if self.endpoint is Endpoint.CHAT and isinstance(choices, list):
            for choice in choices:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict) and "role" in delta and progress.role_sent:
                    del delta["role"]
                    if not delta.get("content") and choice.get("finish_reason") is None and not event.get("usage"):
                        return False  # the role chunk: the client had it from the first replica
        usage = event.get("usage")
        if isinstance(usage, dict):
            before = self.tokens_before
            prompt = max(int(usage.get("prompt_tokens") or 0) - before, 0)
            completion = int(usage.get("completion_tokens") or 0) + before
            usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        return True


def resumable(raw: bytes, endpoint: Endpoint, sent: list[bytes]) -> Continuation | None:
    """The continuation of a stream that broke after `sent` went out; None when its answer cannot
    be continued from its text."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or any(body.get(key) for key in _NOT_RESUMABLE):
        return None
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return None
    if endpoint is Endpoint.CHAT and not isinstance(body.get("messages"), list):
        return None
    if endpoint is Endpoint.COMPLETIONS and not isinstance(body.get("prompt"), str):
        return None
    done = progress(sent, endpoint)
    if not done.resumable or done.finished:
        return None
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    return Continuation(endpoint, body, done, include_usage)


async def count_tokens(session: aiohttp.ClientSession, url: str, model: str, text: str, events: int) -> int:
    """Tokens in `text` by the replica's own tokenizer (vLLM's `/tokenize`); estimated when it
    cannot say (at least one per event that carried text)."""
    if not text:
        return 0
    try:
        async with session.post(
            f"{url}/tokenize",
            json={"model": model, "prompt": text, "add_special_tokens": False},
            timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S),
        ) as answer:
            if answer.status == 200:
                count = (await answer.json()).get("count")
                if isinstance(count, int) and count >= 0:
                    return count
    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
        pass
    return max(text_tokens(text), events)
