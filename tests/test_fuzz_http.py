"""The gateway's HTTP surface, fuzzed (Hypothesis): whatever bytes a client sends (methods, paths,
headers, bodies, framing), the answer is a success or a well-formed OpenAI error, and the gateway
keeps serving. The gateway runs as its own process in front of two simulated replicas; requests
go over raw sockets, so framing itself can be wrong."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgate.testing import gateway_config, stop_process
from specgate.workers import launch
from tests.test_gateway_http import MESSAGES, MODEL, SimFactory, sim

pytestmark = pytest.mark.slow

PATHS = (
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics", "/admin/policy",
    "/admin/fleet",
)  # fmt: skip
ROUTING = ("x-slo-ttft-ms", "x-slo-tpot-ms", "x-route-pool", "x-priority", "x-request-id", "x-request-class",
           "x-expected-output-tokens", "x-failover")  # fmt: skip
OTHER = ("content-type", "content-encoding", "transfer-encoding", "connection", "authorization", "expect", "host",
         "x-forwarded-for", "te", "upgrade", "cookie")  # fmt: skip


@pytest.fixture(scope="module")
def gateway(sim_factory: SimFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    spec, plain = sim(sim_factory, "speculative"), sim(sim_factory, "plain")
    folder = tmp_path_factory.mktemp("fuzz")
    config = gateway_config(
        folder / "specgate.toml", MODEL, [spec.url], [plain.url],
        "[server]\nheader_timeout_ms = 1000\nbody_timeout_ms = 500\nmax_body_bytes = 65536\n"
        '[admin]\ntoken = "fuzz-admin-token-0123456789"\n',
    )  # fmt: skip
    proc = launch.spawn(launch.specgate_argv("serve", "--config", str(config), "--port", "0"), folder / "gw.log")
    try:
        url = _wait_ready(proc, folder / "gw.log")
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)
    finally:
        stop_process(proc)


def _wait_ready(proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        if url := launch.ready_url(log):
            return url
        time.sleep(0.05)
    raise RuntimeError(log.read_text(errors="replace"))


def exchange(address: tuple[str, int], data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data` on a fresh connection (its head asks to close after the answer) and read until
    the gateway closes it."""
    with socket.create_connection(address, timeout=timeout) as conn:
        with contextlib.suppress(OSError):  # it may answer and close before reading it all: that counts
            conn.sendall(data)
        chunks = []
        while True:
            try:
                chunk = conn.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def dechunk(body: bytes) -> bytes:
    out, rest = [], body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2 :]
    return b"".join(out)


def assert_well_formed(method: str, path: str, answer: bytes) -> None:
    assert answer, "no answer at all"
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    if headers.get(b"transfer-encoding") == b"chunked":
        body = dechunk(body)
    if method == "HEAD" or status in (204, 304):
        return
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str)
        assert isinstance(error["type"], str)
        assert "param" in error
        assert "code" in error
        return
    assert 200 <= status < 300, status
    if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
        events = [e for e in body.split(b"\n\n") if e]
        last = events[-1]
        assert last == b"data: [DONE]" or "error" in json.loads(last.removeprefix(b"data: "))
        for event in events[:-1]:
            json.loads(event.removeprefix(b"data: "))
    elif path in ("/v1/chat/completions", "/v1/completions"):
        assert json.loads(body)["choices"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from([MODEL, "other-model", ""]) | json_values,
        "messages": st.just(MESSAGES) | json_values,
        "prompt": st.sampled_from(["Hello", "", "x" * 5000]) | json_values,
        "max_tokens": st.integers(-5, 60) | json_values,
        "max_completion_tokens": st.integers(-5, 60) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": st.just({"include_usage": True}) | json_values,
        "n": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "logprobs": st.booleans(),
        "temperature": json_values,
    },
)
bodies = (
    fields.map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=300)
    | st.sampled_from([b"", b"{", b'{"model": "sim-model", "messages": [', b"\xff\xfe{}", b"null"])
)
header_values = st.sampled_from(
    ["", "0", "-1", "1e309", "nan", "speculative", "plain", "off", "on", "gzip", "chunked", "close", "Bearer x",
     "application/json", "text/plain", "a" * 9000]
) | st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)  # fmt: skip
headers = st.lists(st.tuples(st.sampled_from(ROUTING + OTHER), header_values), max_size=6)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "BREW", "G ET"])
paths = st.sampled_from(PATHS) | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=60).map(
    lambda p: "/" + p
)
framings = st.sampled_from(["length", "length", "length", "short", "long", "none", "chunked", "bad-chunked"])


def request_bytes(method: str, path: str, pairs: list[tuple[str, str]], body: bytes, framing: str) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: fuzz", "Connection: close"]
    if not any(name == "content-type" for name, _ in pairs):
        head.append("Content-Type: application/json")
    head += [f"{name}: {value}" for name, value in pairs if name not in ("connection", "host", "transfer-encoding")]
    if framing == "length":
        head.append(f"Content-Length: {len(body)}")
    elif framing == "short":
        head.append(f"Content-Length: {max(len(body) - 1, 0)}")
    elif framing == "long":
        head.append(f"Content-Length: {len(body) + 10}")
    elif framing in ("chunked", "bad-chunked"):
        head.append("Transfer-Encoding: chunked")
        size = f"{len(body):x}" if framing == "chunked" else "zz"
        body = size.encode() + b"\r\n" + body + b"\r\n0\r\n\r\n"
    return "\r\n".join(head).encode("latin-1", "replace") + b"\r\n\r\n" + body


@settings(max_examples=150, deadline=None, derandomize=True)
@given(method=methods, path=paths, pairs=headers, body=bodies, framing=framings)
def test_every_answer_is_a_success_or_an_openai_error(
    gateway: tuple[str, int], method: str, path: str, pairs: list[tuple[str, str]], body: bytes, framing: str
) -> None:
    answer = exchange(gateway, request_bytes(method, path, pairs, body, framing))
    assert_well_formed(method.split(" ")[0], path, answer)
    health = exchange(gateway, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert health.startswith(b"HTTP/1.1 200"), "the gateway stopped serving"


def test_a_valid_request_passes_the_fuzz_oracle(gateway: tuple[str, int]) -> None:
    """The oracle itself: a good request is a success, a broken one an error, both well formed."""
    good = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 5}).encode()
    answer = exchange(gateway, request_bytes("POST", "/v1/chat/completions", [], good, "length"))
    assert answer.startswith(b"HTTP/1.1 200")
    assert_well_formed("POST", "/v1/chat/completions", answer)
    stream = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": True}).encode()
    assert_well_formed(
        "POST",
        "/v1/chat/completions",
        exchange(gateway, request_bytes("POST", "/v1/chat/completions", [], stream, "chunked")),
    )
    bad = exchange(gateway, request_bytes("POST", "/v1/chat/completions", [], b"{", "length"))
    assert bad.startswith(b"HTTP/1.1 400")
    assert_well_formed("POST", "/v1/chat/completions", bad)
