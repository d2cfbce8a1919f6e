"""The two ways a replica decodes, and the pool each forms: with speculative decoding or plain."""

from __future__ import annotations

from enum import StrEnum


class Pool(StrEnum):
    SPECULATIVE = "speculative"
    PLAIN = "plain"

    @property
    def other(self) -> Pool:
        return Pool.PLAIN if self is Pool.SPECULATIVE else Pool.SPECULATIVE
