"""Mid-stream failover: a stream whose replica dies or stalls goes on from another replica as one
response; one that cannot be continued ends with an error event; a stream cut by shutdown says so."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from specgate.calibration.modes import Pool
from specgate.gateway.attempt import _complete_events
from specgate.gateway.config import Timeouts
from specgate.gateway.continuation import Continuation, progress, resumable
from specgate.policies.document import PolicyDocument
from specgate.protocol.endpoints import Endpoint
from specgate.protocol.tokens import chat_prompt_tokens
from specgate.sim.text import count_words
from specgate.testing import running_app
from specgate.workers import launch
from tests.test_gateway_http import (
    MESSAGES,
    MODEL,
    SimFactory,
    client,
    running_gateway,
    scripted_replica,
    settings_for,
    sim,
)

ROUND_ROBIN = PolicyDocument(policy="round-robin")
"""Sorted by name, the first request goes to `spec-0`: the replica these tests make fail."""


async def failovers(url: str) -> dict[str, float]:
    """`specgate_stream_failovers_total` by outcome."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "specgate_stream_failovers_total"
    }


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chunk(content: str | None, *, role: bool = False, finish: str | None = None, ident: str = "chatcmpl-a") -> bytes:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return sse({"id": ident, "object": "chat.completion.chunk", "created": 7, "model": MODEL, "choices": [choice]})


def events(text: bytes) -> list[Any]:
    """The stream's events, decoded; `[DONE]` as the string."""
    out: list[Any] = []
    for block in text.split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block.removeprefix(b"data: ")
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


def content_of(stream: list[Any], endpoint: Endpoint = Endpoint.CHAT) -> str:
    key = "delta" if endpoint is Endpoint.CHAT else None
    parts = []
    for event in stream:
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            parts.append((choice[key].get("content") if key else choice.get("text")) or "")
    return "".join(parts)


def assert_one_whole_stream(stream: list[Any]) -> None:
    assert stream[-1] == "[DONE]"
    assert stream.count("[DONE]") == 1
    assert not [e for e in stream if isinstance(e, dict) and "error" in e]
    chunks = [e for e in stream if isinstance(e, dict)]
    assert len({(e["id"], e["created"]) for e in chunks}) == 1  # one response, as far as the client sees
    roles = [e for e in chunks if e["choices"] and "role" in e["choices"][0].get("delta", {})]
    assert len(roles) <= 1


@pytest.mark.parametrize(
    ("data", "ready"),
    [(b"dat", b""), (b"data: a\n\ndat", b"data: a\n\n"), (b"data: a\r\n\r\ndata: b\r\n", b"data: a\r\n\r\n"),
     (b"data: a\n\n", b"data: a\n\n")],
)  # fmt: skip
def test_only_whole_events_go_out(data: bytes, ready: bytes) -> None:
    assert _complete_events(data) == (ready, data[len(ready) :])


# --- the continuation, as data --------------------------------------------------------------


CHAT_BODY = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "min_tokens": 4, "stream": True}


def test_the_text_so_far_is_read_back_from_the_events_sent() -> None:
    sent = [chunk("", role=True) + chunk(" Hello"), chunk(" there") + chunk(" friend")]
    done = progress(sent, Endpoint.CHAT)
    assert (done.text, done.id, done.created, done.role_sent, done.finished) == (
        " Hello there friend", "chatcmpl-a", 7, True, False
    )  # fmt: skip
    assert progress([*sent, chunk(None, finish="stop")], Endpoint.CHAT).finished


def test_a_chat_continues_as_the_assistants_unfinished_message_with_the_caps_reduced() -> None:
    continuation = resumable(json.dumps(CHAT_BODY).encode(), Endpoint.CHAT, [chunk(" Hello", role=True)])
    assert continuation is not None
    body = json.loads(continuation.request_body(tokens_before=1) or b"")
    assert body["messages"] == [*MESSAGES, {"role": "assistant", "content": " Hello"}]
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    assert (body["max_tokens"], body["min_tokens"]) == (9, 3)
    assert continuation.request_body(tokens_before=10) is None  # no tokens left to ask for


def test_a_clients_own_assistant_prefix_is_extended_not_repeated() -> None:
    prefixed = {**CHAT_BODY, "messages": [*MESSAGES, {"role": "assistant", "content": "Sure:"}],
                "continue_final_message": True, "add_generation_prompt": False}  # fmt: skip
    continuation = resumable(json.dumps(prefixed).encode(), Endpoint.CHAT, [chunk(" yes", role=True)])
    assert continuation is not None
    body = json.loads(continuation.request_body(tokens_before=1) or b"")
    assert body["messages"] == [*MESSAGES, {"role": "assistant", "content": "Sure: yes"}]


def test_a_completion_continues_from_its_prompt_and_text() -> None:
    sent = [sse({"id": "cmpl-a", "object": "text_completion", "created": 7, "model": MODEL,
                 "choices": [{"index": 0, "text": " wor", "logprobs": None, "finish_reason": None}]})]  # fmt: skip
    continuation = resumable(json.dumps({"prompt": "Hello", "stream": True}).encode(), Endpoint.COMPLETIONS, sent)
    assert continuation is not None
    body = json.loads(continuation.request_body(tokens_before=1) or b"")
    assert (body["prompt"], body["max_tokens"]) == ("Hello wor", 15)  # vLLM's default cap of 16, less one


@pytest.mark.parametrize(
    "changes",
    [{"n": 2}, {"logprobs": True, "top_logprobs": 2}, {"tools": [{"type": "function"}]},
     {"response_format": {"type": "json_object"}}],
)  # fmt: skip
def test_answers_whose_state_is_not_in_their_text_are_not_continued(changes: dict[str, Any]) -> None:
    raw = json.dumps({**CHAT_BODY, **changes}).encode()
    assert resumable(raw, Endpoint.CHAT, [chunk(" Hello", role=True)]) is None


def test_finished_or_tool_calling_streams_are_not_continued() -> None:
    raw = json.dumps(CHAT_BODY).encode()
    assert resumable(raw, Endpoint.CHAT, [chunk(" Hello", role=True), chunk(None, finish="stop")]) is None
    tool = sse({"id": "a", "created": 7, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert resumable(raw, Endpoint.CHAT, [tool]) is None
    token_ids = json.dumps({"prompt": [1, 2, 3], "stream": True}).encode()
    assert resumable(token_ids, Endpoint.COMPLETIONS, [b""]) is None


def test_the_continuations_events_join_the_first_response() -> None:
    continuation = resumable(json.dumps(CHAT_BODY).encode(), Endpoint.CHAT, [chunk(" Hello", role=True)])
    assert isinstance(continuation, Continuation)
    continuation.request_body(tokens_before=1)
    usage = {"prompt_tokens": 12, "total_tokens": 21, "completion_tokens": 9}
    final = sse({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 9, "model": MODEL,
                 "choices": [], "usage": usage})  # fmt: skip
    out = continuation.rewrite(
        chunk("", role=True, ident="chatcmpl-b") + chunk(" there", ident="chatcmpl-b") + final + b"data: [DONE]\n\n"
    )
    stream = events(out)
    assert [e if e == "[DONE]" else e["id"] for e in stream] == ["chatcmpl-a", "chatcmpl-a", "[DONE]"]
    assert stream[0]["choices"][0]["delta"] == {"content": " there"}  # the second role chunk is gone
    assert stream[1]["created"] == 7
    assert stream[1]["usage"] == {"prompt_tokens": 11, "total_tokens": 21, "completion_tokens": 10}


# --- over HTTP, in front of simulated replicas ----------------------------------------------


async def read_through(url: str, path: str, body: dict[str, Any], during: Callable[[], None] | None = None,
                       headers: dict[str, str] | None = None) -> bytes:  # fmt: skip
    async with aiohttp.ClientSession() as session, session.post(f"{url}{path}", json=body, headers=headers) as r:
        assert r.status == 200
        assert r.headers["x-route-replica"] == "spec-0"
        first = await r.content.readline()
        if during is not None:
            during()
        return first + await r.content.read()


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
async def test_a_replica_killed_mid_stream_is_replaced_without_the_client_seeing_it(
    sim_factory: SimFactory, endpoint: Endpoint
) -> None:
    doomed, spare = sim(sim_factory, "speculative"), sim(sim_factory, "plain")
    settings = settings_for({Pool.SPECULATIVE: [doomed.url], Pool.PLAIN: [spare.url]}, policy=ROUND_ROBIN)
    prompt: dict[str, Any] = {"messages": MESSAGES} if endpoint is Endpoint.CHAT else {"prompt": "Route me well."}
    body = {"model": MODEL, **prompt, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with running_gateway(settings) as url:
        text = await read_through(url, endpoint.value, body, during=lambda: doomed.proc.send_signal(signal.SIGKILL))
        samples = await failovers(url)
    stream = events(text)
    assert_one_whole_stream(stream)
    assert count_words(content_of(stream, endpoint)) == 400  # every token once: none lost, none twice
    usage = stream[-2]["usage"]
    assert usage["completion_tokens"] == 400
    if endpoint is Endpoint.CHAT:
        assert usage["prompt_tokens"] == chat_prompt_tokens(list(MESSAGES))  # the client's prompt, not ours
    assert samples == {"resumed": 1.0}


def stalling_replica(sent: list[int]) -> web.Application:
    """Streams a few tokens of an answer, then says nothing more."""

    async def stall(request: web.Request) -> web.StreamResponse:
        sent.append(1)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(chunk("", role=True, ident="chatcmpl-stalled"))
        for word in (" Hello", " there", " friend"):
            await response.write(chunk(word, ident="chatcmpl-stalled"))
        await asyncio.sleep(3600)
        return response

    return scripted_replica(stall)


async def test_a_stream_that_stalls_goes_on_elsewhere_and_the_sdk_sees_one_answer(sim_factory: SimFactory) -> None:
    spare = sim(sim_factory, "plain")
    async with running_app(stalling_replica([])) as stalled:
        settings = settings_for(
            {Pool.SPECULATIVE: [stalled], Pool.PLAIN: [spare.url]}, policy=ROUND_ROBIN, timeouts=Timeouts(idle_s=0.3)
        )
        async with running_gateway(settings) as url:
            stream = await client(url).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=50, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            parts, ids, usage = [], set(), None
            async for piece in stream:
                ids.add(piece.id)
                parts += [c.delta.content or "" for c in piece.choices]
                usage = piece.usage or usage
    text = "".join(parts)
    assert text.startswith(" Hello there friend")
    assert count_words(text) == 50
    assert ids == {"chatcmpl-stalled"}
    assert usage is not None
    assert usage.completion_tokens == 50


async def test_failover_off_or_an_answer_that_cannot_be_continued_ends_with_the_error_event(
    sim_factory: SimFactory,
) -> None:
    spare = sim(sim_factory, "plain")
    tries: list[int] = []
    async with running_app(stalling_replica(tries)) as stalled:
        settings = settings_for(
            {Pool.SPECULATIVE: [stalled], Pool.PLAIN: [spare.url]}, policy=ROUND_ROBIN, timeouts=Timeouts(idle_s=0.2)
        )
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "stream": True}
        async with running_gateway(settings) as url:
            off = await read_through(url, Endpoint.CHAT.value, body, headers={"x-failover": "off"})
            await client(url).chat.completions.create(model=MODEL, messages=MESSAGES)  # round robin: the spare's turn
            with_logprobs = await read_through(url, Endpoint.CHAT.value, {**body, "logprobs": True})
            samples = await failovers(url)
    for text in (off, with_logprobs):
        stream = events(text)
        assert stream[-1]["error"]["code"] == "upstream_failed"
        assert "[DONE]" not in stream
        assert content_of(stream) == " Hello there friend"
    assert samples == {"not_resumable": 1.0}  # opting out is not counted
    assert len(tries) == 2


async def test_a_stream_cut_by_shutdown_is_told_so(sim_factory: SimFactory, tmp_path: Path) -> None:
    replica = sim_factory("--mode", "plain", "--model", MODEL)  # real time: a long answer outlives the grace
    config = tmp_path / "specgate.toml"
    config.write_text(
        f'[models]\nserved = ["{MODEL}"]\n[pools.plain]\nurls = ["{replica.url}"]\n[server]\nshutdown_grace_s = 0.5\n'
    )
    log = tmp_path / "gateway.log"
    proc = launch.spawn(launch.specgate_argv("serve", "--config", str(config), "--port", "0"), log)
    try:
        url = await launch.wait_ready(proc, log)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/chat/completions", json=body) as r:
            first = await r.content.readline()
            proc.send_signal(signal.SIGTERM)
            rest = await r.content.read()
        stream = events(first + rest)
        assert stream[-1]["error"]["code"] == "shutting_down"
        assert await asyncio.to_thread(proc.wait, 20) == 0
    finally:
        await launch.terminate(proc)


async def test_with_no_replica_left_to_go_on_the_stream_ends_with_the_error_event(sim_factory: SimFactory) -> None:
    doomed = sim(sim_factory, "speculative")
    settings = settings_for({Pool.SPECULATIVE: [doomed.url]}, policy=ROUND_ROBIN)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with running_gateway(settings) as url:
        text = await read_through(
            url, Endpoint.CHAT.value, body, during=lambda: doomed.proc.send_signal(signal.SIGKILL)
        )
        samples = await failovers(url)
        with pytest.raises(openai.APIError):
            await client(url).chat.completions.create(model=MODEL, messages=MESSAGES)
    assert events(text)[-1]["error"]["code"] == "upstream_failed"
    assert samples == {"failed": 1.0}
