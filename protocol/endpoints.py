"""The OpenAI endpoints vLLM serves and specgate routes, by path."""

from __future__ import annotations

from enum import StrEnum


class Endpoint(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
