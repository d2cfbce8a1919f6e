"""Reading a vLLM replica's `/metrics`: the few series a routing decision needs.

A vLLM exposition runs to tens of kilobytes, mostly histogram buckets; scraped several times a
second per replica, a full Prometheus parser would cost a real share of a core. This reader
looks only at the samples it needs, sums them across label sets (several engines), and keeps
the per-position acceptance counts by position. V1 names first; the V0 names vLLM dropped are
read only when the V1 ones are absent.
"""

from __future__ import annotations

from dataclasses import dataclass

from specgate.workers.acceptance import SpecCounters

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV = "vllm:kv_cache_usage_perc"
_KV_V0 = "vllm:gpu_cache_usage_perc"
_PREEMPTIONS = "vllm:num_preemptions_total"
_PROMPT = "vllm:prompt_tokens_total"
_GENERATION = "vllm:generation_tokens_total"
_DRAFTS = "vllm:spec_decode_num_drafts_total"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"
_WANTED = frozenset(
    {_RUNNING, _WAITING, _KV, _KV_V0, _PREEMPTIONS, _PROMPT, _GENERATION, _DRAFTS, _DRAFT_TOKENS, _ACCEPTED, _PER_POS,
     _FIRST_TOKENS}
)  # fmt: skip


class MetricsFormatError(ValueError):
    """The body is not a vLLM metrics exposition."""


@dataclass(frozen=True)
class VllmLoad:
    running: float
    waiting: float
    kv_usage: float | None
    preemptions: float | None
    prompt_tokens: float | None
    generation_tokens: float | None
    spec: SpecCounters | None
    """None on a replica that does not speculate (vLLM publishes no spec counters there)."""
    first_tokens: float | None = None
    """Requests that got their first token (the TTFT histogram's count): tokens of the prefill's
    step, not of a decode step."""


def _position(labels: str) -> int | None:
    start = labels.find('position="')
    if start < 0:
        return None
    start += len('position="')
    end = labels.find('"', start)
    try:
        return int(labels[start:end])
    except ValueError:
        return None


def _mean(sums: dict[str, float], counts: dict[str, int], name: str) -> float | None:
    # KV usage is a fraction per engine: several engines average, they do not add up.
    return sums[name] / counts[name] if name in sums else None


def parse_vllm_metrics(text: str) -> VllmLoad:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        name = line[:brace] if 0 <= brace < space else line[:space]
        if name not in _WANTED:
            continue
        labels = ""
        if 0 <= brace < space:
            close = line.rfind("}")
            labels, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            rest = line[space:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if name == _PER_POS:
            pos = _position(labels)
            if pos is not None:
                per_pos[pos] = per_pos.get(pos, 0.0) + value
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1

    if _RUNNING not in sums or _WAITING not in sums:
        raise MetricsFormatError("no vllm:num_requests_running / vllm:num_requests_waiting in /metrics")
    spec = None
    if _DRAFTS in sums and _DRAFT_TOKENS in sums and _ACCEPTED in sums:
        positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
        spec = SpecCounters(sums[_DRAFTS], sums[_DRAFT_TOKENS], sums[_ACCEPTED], positions)
    return VllmLoad(
        running=sums[_RUNNING],
        waiting=sums[_WAITING],
        kv_usage=_mean(sums, counts, _KV) if _KV in sums else _mean(sums, counts, _KV_V0),
        preemptions=sums.get(_PREEMPTIONS),
        prompt_tokens=sums.get(_PROMPT),
        generation_tokens=sums.get(_GENERATION),
        spec=spec,
        first_tokens=sums.get(_FIRST_TOKENS),
    )
