"""The simulated replica over real HTTP, driven by the official OpenAI client."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Callable

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from specgate.testing import SimProcess
from specgate.workers.acceptance import SpecCounters, acceptance

SimFactory = Callable[..., SimProcess]
MODEL = "sim-model"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about speculative decoding."}]
ONE_MESSAGE = b'{"messages": [{"role": "user", "content": "x"}]'


@pytest.fixture(scope="module")
def plain(sim_factory: SimFactory) -> SimProcess:
    return sim_factory("--mode", "plain", "--model", MODEL, "--time-scale", "20", "--seed", "1")


@pytest.fixture(scope="module")
def spec(sim_factory: SimFactory) -> SimProcess:
    return sim_factory("--mode", "speculative", "--model", MODEL, "--time-scale", "20", "--acceptance", "0.6")


def client(sim: SimProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0, timeout=30)


def aclient(sim: SimProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_chat_completion_with_usage(mode: str, request: pytest.FixtureRequest) -> None:
    sim: SimProcess = request.getfixturevalue(mode)
    reply = client(sim).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    assert reply.id.startswith("chatcmpl-")
    (choice,) = reply.choices
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 40
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 40
    assert choice.message.content is not None
    assert len(choice.message.content.split()) == 40  # one word per token


@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_chat_stream_relays_every_token_with_usage_last(mode: str, request: pytest.FixtureRequest) -> None:
    sim: SimProcess = request.getfixturevalue(mode)
    stream = client(sim).chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=60,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    words = [len((c.choices[0].delta.content or "").split()) for c in content]
    assert sum(words) == 60
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    usage = chunks[-1]
    assert usage.choices == []
    assert usage.usage is not None
    assert usage.usage.completion_tokens == 60
    if mode == "spec":
        assert max(words) > 1, "a speculative replica sends accepted runs as bursts"
    else:
        assert max(words) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_completions(plain: SimProcess, stream: bool) -> None:
    prompt = [1] * 512  # token ids count exactly
    if stream:
        chunks = list(
            client(plain).completions.create(
                model=MODEL, prompt=prompt, max_tokens=16, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == 512
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        reply = client(plain).completions.create(model=MODEL, prompt=prompt, max_tokens=16)
        assert reply.object == "text_completion"
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == 512
        text = reply.choices[0].text
        finish = reply.choices[0].finish_reason
    # Without ignore_eos the replica stops on its own before max_tokens, or hits it.
    assert 1 <= len(text.split()) <= 16
    assert finish in ("stop", "length")
    assert (finish == "length") == (len(text.split()) == 16)


def test_lone_request_latency_matches_the_profile_in_virtual_time(sim_factory: SimFactory) -> None:
    sim = sim_factory("--mode", "plain", "--model", MODEL, "--time-scale", "20")
    client(sim).completions.create(model=MODEL, prompt=[1] * 512, max_tokens=64, extra_body={"ignore_eos": True})
    ttft = sim.sample("vllm:time_to_first_token_seconds_sum")
    tpot = sim.sample("vllm:request_time_per_output_token_seconds_sum")
    # Measured profile: prefill(512) 98.7 ms + 7.7 ms overhead; batch-1 decode 30.8 + 7.7 ms.
    assert ttft == pytest.approx(0.1064, rel=0.02)
    assert tpot == pytest.approx(0.0385, rel=0.02)


def test_models_and_health(plain: SimProcess) -> None:
    models = client(plain).models.list()
    (card,) = models.data
    assert card.id == MODEL
    assert card.owned_by == "vllm"
    with urllib.request.urlopen(f"{plain.url}/health", timeout=5) as response:
        assert response.status == 200


def post(sim: SimProcess, path: str, body: bytes) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(f"{sim.url}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", b"[1, 2]", 400, None),
        ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
        ("/v1/chat/completions", ONE_MESSAGE + b', "max_tokens": "9"}', 400, "max_tokens"),
        ("/v1/chat/completions", ONE_MESSAGE + b', "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/chat/completions", ONE_MESSAGE + b', "max_tokens": true}', 400, "max_tokens"),
        ("/v1/chat/completions", ONE_MESSAGE + b', "max_tokens": 99999}', 400, "max_tokens"),
        ("/v1/chat/completions", ONE_MESSAGE + b', "max_completion_tokens": -1}', 400, "max_tokens"),
        ("/v1/chat/completions", ONE_MESSAGE + b', "stream": "yes"}', 400, "stream"),
        ("/v1/chat/completions", ONE_MESSAGE + b', "n": 3}', 400, "n"),
        ("/v1/chat/completions", ONE_MESSAGE + b', "stream_options": {"include_usage": true}}', 400, "stream_options"),
        ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": ["a", "b"]}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": []}', 400, "prompt"),
    ],
)
def test_bad_requests_get_vllm_error_shape(
    plain: SimProcess, path: str, body: bytes, status: int, param: str | None
) -> None:
    code, payload = post(plain, path, body)
    assert code == status
    error = payload["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["param"] == param
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert error["message"]


def test_oversized_body_is_413(plain: SimProcess) -> None:
    huge = b'{"prompt": "' + b"x" * (33 * 1024 * 1024) + b'"}'
    code, payload = post(plain, "/v1/completions", huge)
    assert code == 413
    assert isinstance(payload["error"], dict)
    assert payload["error"]["code"] == 413


def test_openai_client_raises_typed_errors(plain: SimProcess) -> None:
    with pytest.raises(openai.NotFoundError):
        client(plain).chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client(plain).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10**6)


def test_metrics_have_vllm_names_and_labels(spec: SimProcess) -> None:
    client(spec).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(spec.metrics_text())}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ):
        assert name in families, name
        for sample in families[name].samples:
            assert sample.labels["model_name"] == MODEL
            assert sample.labels["engine"] == "0"
            assert not sample.name.endswith("_created")
    positions = {s.labels["position"] for s in families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert positions == {"0", "1", "2", "3", "4"}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}


def test_plain_replica_has_no_spec_counters(plain: SimProcess) -> None:
    assert "vllm:spec_decode" not in plain.metrics_text()


async def test_metrics_move_with_load(plain: SimProcess) -> None:
    generated_before = plain.sample("vllm:generation_tokens_total")
    done_before = plain.sample("vllm:request_success_total", finished_reason="length")

    async with aclient(plain) as api:

        async def one() -> None:
            await api.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=300, extra_body={"ignore_eos": True}
            )

        tasks = [asyncio.create_task(one()) for _ in range(12)]
        running = await asyncio.to_thread(plain.wait_for, "vllm:num_requests_running", lambda v: v >= 12)
        assert running == 12
        assert plain.sample("vllm:kv_cache_usage_perc") > 0
        await asyncio.gather(*tasks)
    assert plain.sample("vllm:num_requests_running") == 0
    assert plain.sample("vllm:kv_cache_usage_perc") == 0
    assert plain.sample("vllm:generation_tokens_total") - generated_before == 12 * 300
    assert plain.sample("vllm:request_success_total", finished_reason="length") - done_before == 12


@pytest.mark.parametrize("stream", [True, False])
async def test_client_that_disconnects_aborts_its_request(sim_factory: SimFactory, stream: bool) -> None:
    sim = sim_factory("--mode", "plain", "--model", MODEL, "--time-scale", "5")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "ignore_eos": True, "stream": stream}
    async with aiohttp.ClientSession() as session:
        response_task = asyncio.create_task(session.post(f"{sim.url}/v1/chat/completions", json=body))
        await asyncio.to_thread(sim.wait_for, "vllm:num_requests_running", lambda v: v == 1)
        if stream:
            response = await response_task
            await response.content.readline()  # the stream has started
            response.close()
        else:
            response_task.cancel()
    await asyncio.to_thread(sim.wait_for, "vllm:num_requests_running", lambda v: v == 0)
    assert sim.sample("vllm:request_success_total", finished_reason="abort") == 1
    assert sim.sample("vllm:kv_cache_usage_perc") == 0
    assert sim.sample("vllm:generation_tokens_total") < 4000


async def test_spec_counters_give_the_configured_acceptance(spec: SimProcess) -> None:
    def counters() -> SpecCounters:
        return SpecCounters(
            spec.sample("vllm:spec_decode_num_drafts_total"),
            spec.sample("vllm:spec_decode_num_draft_tokens_total"),
            spec.sample("vllm:spec_decode_num_accepted_tokens_total"),
            tuple(spec.sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(5)),
        )

    before = counters()
    sem = asyncio.Semaphore(32)

    async with aclient(spec) as api:

        async def one() -> None:
            async with sem:
                await api.completions.create(
                    model=MODEL, prompt="copy this", max_tokens=200, extra_body={"ignore_eos": True}
                )

        await asyncio.gather(*(one() for _ in range(96)))
    est = acceptance(counters() - before)
    assert est is not None
    assert est.drafts > 1000
    # Each request draws its own rate around the configured mean (--acceptance 0.6); the
    # per-position counts give the per-token rate back.
    assert est.per_token_alpha == pytest.approx(0.6, abs=0.03)
    # vLLM's own figures follow: tokens per step is 1 + accepted per draft, and the draft
    # acceptance rate is accepted over k drafted per step.
    assert est.mean_tokens_per_step == pytest.approx(1 + est.draft_acceptance_rate * 5)
