import pytest

from specgate.gateway.body import parse_body
from specgate.gateway.errors import BadBody, GatewayError, ModelNotFound
from specgate.protocol.endpoints import Endpoint

SERVED = ("m",)


@pytest.mark.parametrize(
    ("endpoint", "raw", "expected"),
    [
        (
            Endpoint.CHAT,
            b'{"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}]}',
            ("m", False, None, 9),
        ),
        (Endpoint.CHAT, b'{"messages": [], "stream": true, "max_tokens": 7}', ("m", True, 7, 3)),
        (Endpoint.CHAT, b'{"messages": [], "max_completion_tokens": 5, "max_tokens": 9}', ("m", False, 5, 3)),
        (Endpoint.COMPLETIONS, b'{"model": "m", "prompt": "abcd"}', ("m", False, None, 1)),
        (Endpoint.COMPLETIONS, b'{"prompt": [1, 2, 3]}', ("m", False, None, 3)),
        (Endpoint.COMPLETIONS, b'{"prompt": ["abcd", "abcdefgh"]}', ("m", False, None, 3)),
        (Endpoint.COMPLETIONS, b'{"prompt": [[1, 2], [3]]}', ("m", False, None, 3)),
        (Endpoint.CHAT, b'{"messages": [], "extra": {"anything": [1, 2]}}', ("m", False, None, 3)),
    ],
)
def test_routing_fields(endpoint: Endpoint, raw: bytes, expected: tuple[str, bool, int | None, int]) -> None:
    fields = parse_body(raw, endpoint, SERVED)
    assert (fields.model, fields.stream, fields.max_tokens, fields.prompt_tokens) == expected


@pytest.mark.parametrize(
    ("endpoint", "raw", "error", "param"),
    [
        (Endpoint.CHAT, b"{oops", BadBody, None),
        (Endpoint.CHAT, b"", BadBody, None),
        (Endpoint.CHAT, b"[]", BadBody, None),
        (Endpoint.CHAT, b'{"model": 3, "messages": []}', BadBody, "model"),
        (Endpoint.CHAT, b'{"model": "other", "messages": []}', ModelNotFound, "model"),
        (Endpoint.CHAT, b'{"messages": [], "stream": "yes"}', BadBody, "stream"),
        (Endpoint.CHAT, b'{"messages": [], "max_tokens": 0}', BadBody, "max_tokens"),
        (Endpoint.CHAT, b'{"messages": [], "max_tokens": true}', BadBody, "max_tokens"),
        (Endpoint.CHAT, b'{"messages": [], "max_completion_tokens": "5"}', BadBody, "max_completion_tokens"),
        (Endpoint.CHAT, b'{"messages": "hi"}', BadBody, "messages"),
        (Endpoint.COMPLETIONS, b'{"prompt": 5}', BadBody, "prompt"),
        (Endpoint.COMPLETIONS, b'{"prompt": []}', BadBody, "prompt"),
        (Endpoint.COMPLETIONS, b'{"prompt": [1, "a"]}', BadBody, "prompt"),
    ],
)
def test_bad_bodies(endpoint: Endpoint, raw: bytes, error: type[GatewayError], param: str | None) -> None:
    with pytest.raises(error) as exc:
        parse_body(raw, endpoint, SERVED)
    assert exc.value.param == param


def test_model_required_when_several_are_served() -> None:
    with pytest.raises(BadBody, match="required"):
        parse_body(b'{"messages": []}', Endpoint.CHAT, ("a", "b"))
    assert parse_body(b'{"model": "b", "messages": []}', Endpoint.CHAT, ("a", "b")).model == "b"
