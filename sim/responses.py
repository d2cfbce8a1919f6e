"""Response bodies and SSE chunks with vLLM's field names, in vLLM's field order.

Streaming chunks carry only the fields vLLM sets on them (it serializes chat chunks with
`exclude_unset`); non-streaming bodies carry every field of vLLM's response models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from specgate.protocol.endpoints import Endpoint

DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass(frozen=True)
class ResponseIds:
    id: str
    created: int
    model: str


def _head(ids: ResponseIds, endpoint: Endpoint, chunk: bool) -> dict[str, Any]:
    kind = "text_completion"
    if endpoint is Endpoint.CHAT:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": ids.model}


def role_chunk(ids: ResponseIds) -> bytes:
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    return sse({**_head(ids, Endpoint.CHAT, True), "choices": [choice]})


def text_chunk(
    ids: ResponseIds,
    endpoint: Endpoint,
    text: str,
    finish_reason: str | None,
    running_usage: dict[str, Any] | None = None,
) -> bytes:
    choice: dict[str, Any]
    if endpoint is Endpoint.CHAT:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
    payload = {**_head(ids, endpoint, True), "choices": [choice]}
    if running_usage is not None:
        payload["usage"] = running_usage
    elif endpoint is Endpoint.COMPLETIONS:
        payload["usage"] = None
    return sse(payload)


def usage_chunk(ids: ResponseIds, endpoint: Endpoint, prompt_tokens: int, completion_tokens: int) -> bytes:
    # vLLM drops unset fields from the final usage chunk.
    final = {k: v for k, v in usage(prompt_tokens, completion_tokens).items() if v is not None}
    return sse({**_head(ids, endpoint, True), "choices": [], "usage": final})


def full_response(
    ids: ResponseIds, endpoint: Endpoint, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> bytes:
    choice: dict[str, Any]
    if endpoint is Endpoint.CHAT:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        }
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
    body = {
        **_head(ids, endpoint, False),
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(prompt_tokens, completion_tokens),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
    return orjson.dumps(body)


def models_list(model: str, created: int, max_model_len: int) -> bytes:
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{model.replace('/', '-')}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
    return orjson.dumps({"object": "list", "data": [card]})
