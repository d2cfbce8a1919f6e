"""Request traces: arrival time, prompt tokens and output tokens per request.

Reads the Azure LLM inference traces (`TIMESTAMP,ContextTokens,GeneratedTokens`, published with
Patel et al., "Splitwise", ISCA 2024, CC-BY-4.0) and a plain `timestamp_s,input_tokens,output_tokens`
CSV. Arrivals are returned in seconds from the first request.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    request_class: str = ""
    """The `x-request-class` the request is sent with (traffic shapes assign one)."""


class TraceError(ValueError):
    pass


def _azure_time(text: str) -> float:
    # Seven fractional digits: more than datetime takes; microseconds are plenty.
    head, _, frac = text.partition(".")
    stamp = datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
    return stamp.timestamp() + (float("0." + frac) if frac else 0.0)


def read_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        parse_time: Callable[[str], float]
        if header == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            parse_time = _azure_time
        elif header == ["timestamp_s", "input_tokens", "output_tokens"]:
            parse_time = float
        else:
            raise TraceError(f"{path}: unknown trace columns {header}")
        rows: list[tuple[float, int, int]] = []
        for line, row in enumerate(reader, start=2):
            if limit is not None and len(rows) >= limit:
                break
            try:
                t, prompt, output = parse_time(row[0]), int(row[1]), int(row[2])
            except (IndexError, ValueError) as exc:
                raise TraceError(f"{path}:{line}: {exc}") from None
            if prompt < 1 or output < 1:
                continue  # a request with no prompt or no output cannot be replayed
            rows.append((t, prompt, output))
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort()
    start = rows[0][0]
    return [TraceRequest(t - start, p, o) for t, p, o in rows]


def scaled(trace: list[TraceRequest], rate_scale: float) -> list[TraceRequest]:
    """The same requests arriving `rate_scale` times as fast."""
    return [replace(r, arrival_s=r.arrival_s / rate_scale) for r in trace]
