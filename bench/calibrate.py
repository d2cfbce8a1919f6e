"""`specgate calibrate`: a profile measured on running vLLM servers (or `specgate sim`s).

Each server is asked what it serves (`/v1/models`: the model, its context window), whether it
speculates (its `vllm:spec_decode_*` counters) and how much KV cache it has
(`vllm:cache_config_info`). Then a designed sweep, one measurement at a time so that each is one
kind of step:

- prefill: one request at a time, prompts of several lengths, one output token: its TTFT is the
  step that prefills the prompt;
- decode: B requests at once (several B), each with a prompt of C tokens (several C) and a fixed
  output length (`ignore_eos`): the time between their tokens is a step of B sequences at about
  C tokens of context; on a speculative server, times the tokens each step emits, read from its
  spec-decode counters over the run.

Prompts are token ids drawn at random, so their length is exact and n-gram speculation finds no
repetition to exploit. The target model's forward pass is fitted on the plain servers' steps, the
draft's cost on what the speculative servers' steps take beyond it, the acceptance from their
counters (`calibration/fit.py`); the fit error of every term is printed and the profile written as
a profile file (`calibration/profile_file.py`). What a sweep does not measure (a plain server's or
a speculative server's half, when only one kind is given; the KV cache of a server that does not
publish it) comes from `--base-profile`, and the profile's notes say so.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from specgate.calibration.fit import (
    DraftFit,
    Step,
    TargetFit,
    Term,
    acceptance_from_tokens_per_step,
    fit_draft,
    fit_target,
)
from specgate.calibration.profile_file import ProfileFile
from specgate.calibration.profiles import Profile
from specgate.workers.acceptance import SpecCounters, decode_steps
from specgate.workers.scrape import parse_vllm_metrics


@dataclass(frozen=True)
class Sweep:
    prompts: tuple[int, ...]
    """Prompt lengths of the prefill measurements."""
    batches: tuple[int, ...]
    """Requests decoding at once."""
    contexts: tuple[int, ...]
    """Prompt lengths of the decode measurements."""
    output_tokens: int
    repeats: int


QUICK = Sweep(prompts=(32, 256, 1024), batches=(1, 4, 8), contexts=(32, 512), output_tokens=24, repeats=1)
FULL = Sweep(prompts=(32, 128, 256, 512, 1024, 1536, 2048, 4096), batches=(1, 2, 4, 8, 16), contexts=(32, 1024, 3072),
             output_tokens=64, repeats=2)  # fmt: skip


@dataclass(frozen=True)
class Server:
    url: str
    model: str
    max_model_len: int
    speculative: bool
    kv_capacity_tokens: int | None


class CalibrationError(RuntimeError):
    pass


async def _text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as response:
        if response.status != 200:
            raise CalibrationError(f"{url} answered {response.status}")
        return await response.text()


def _kv_capacity(metrics: str) -> int | None:
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                try:
                    return int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
                except (KeyError, ValueError):
                    return None
    return None


async def probe(session: aiohttp.ClientSession, url: str) -> Server:
    try:
        models = orjson.loads(await _text(session, f"{url}/v1/models"))
        first = models["data"][0]
        metrics = await _text(session, f"{url}/metrics")
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise CalibrationError(f"{url} is not a vLLM server that answers: {exc!r}") from None
    load = parse_vllm_metrics(metrics)
    max_model_len = int(first.get("max_model_len") or 2048)
    return Server(url, str(first["id"]), max_model_len, load.spec is not None, _kv_capacity(metrics))


@dataclass(frozen=True)
class Drafting:
    """What a speculative server's counters say over some requests: its spec-decode counters and
    the output tokens it generated meanwhile (None where it does not publish them)."""

    counters: SpecCounters
    generated: float | None = None

    def __add__(self, other: Drafting) -> Drafting:
        generated = None if self.generated is None or other.generated is None else self.generated + other.generated
        return Drafting(self.counters + other.counters, generated)

    def __sub__(self, other: Drafting) -> Drafting:
        generated = None if self.generated is None or other.generated is None else self.generated - other.generated
        return Drafting(self.counters - other.counters, generated)

    def decoded(self, requests: int) -> Drafting:
        """Without the first token of each of `requests` (the prefill's, not a decode step's)."""
        return replace(self, generated=None if self.generated is None else self.generated - requests)

    def acceptance(self) -> tuple[float, int]:
        """The per-token acceptance and k of a proposer drafting k tokens every step that emits as
        many tokens a step as these counters show (over the decode steps, not the drafts: an n-gram
        proposer drafts only where it finds a match). vLLM counts acceptances per draft position, k
        of them."""
        c = self.counters
        k = len(c.accepted_per_pos) or max(round(c.draft_tokens / c.drafts), 1)
        steps = decode_steps(c, self.generated) or c.drafts
        return acceptance_from_tokens_per_step(1.0 + c.accepted_tokens / steps, k), k


async def drafting(session: aiohttp.ClientSession, server: Server) -> Drafting | None:
    """The server's drafting counters now; None when it does not speculate."""
    load = parse_vllm_metrics(await _text(session, f"{server.url}/metrics"))
    return Drafting(load.spec, load.generation_tokens) if load.spec is not None else None


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    events: tuple[float, ...]
    """When each streamed event carrying tokens arrived: vLLM streams one per engine step."""


async def one(session: aiohttp.ClientSession, server: Server, prompt: list[int], output_tokens: int) -> Timing:
    """One streamed completion of exactly `output_tokens` tokens, timed as the client sees it."""
    body = {
        "model": server.model, "prompt": prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
    }  # fmt: skip
    sent = time.perf_counter()
    events: list[float] = []
    async with session.post(f"{server.url}/v1/completions", data=orjson.dumps(body),
                            headers={"content-type": "application/json"}) as response:  # fmt: skip
        if response.status != 200:
            raise CalibrationError(f"{server.url} answered {response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if orjson.loads(line[6:]).get("choices"):
                events.append(time.perf_counter())
    if not events:
        raise CalibrationError(f"{server.url} streamed no token")
    return Timing(events[0] - sent, tuple(events))


def steady_step_s(timings: Sequence[Timing]) -> float | None:
    """The step time while every request of a batch decodes: between the last of them to start
    and the first to end (before, steps also prefill the others' prompts), the median over the
    requests of the time per streamed event."""
    start, end = max(t.events[0] for t in timings), min(t.events[-1] for t in timings)
    gaps = []
    for t in timings:
        inside = [e for e in t.events if start <= e <= end]
        if len(inside) >= 3:
            gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return statistics.median(gaps) if gaps else None


Progress = Callable[[str], None]


async def measure(
    session: aiohttp.ClientSession, server: Server, sweep: Sweep, time_scale: float, rng: random.Random,
    progress: Progress,
) -> tuple[list[Step], Drafting | None]:  # fmt: skip
    """The server's steps over the sweep, in the profile's milliseconds; with its spec counters'
    change over the decode runs when it speculates."""
    room = server.max_model_len - sweep.output_tokens - 1

    def prompt(tokens: int) -> list[int]:
        return [rng.randrange(1000, 9000) for _ in range(tokens)]

    steps: list[Step] = []
    for length in sweep.prompts:
        if length > room:
            continue
        # A single request's TTFT carries the HTTP round trip's jitter too: the median of three.
        ttfts = [(await one(session, server, prompt(length), 1)).ttft_s for _ in range(max(sweep.repeats, 1) * 3)]
        steps.append(Step("prefill", 0, 1, 0.0, length, statistics.median(ttfts) * 1e3 * time_scale))
        progress(f"{server.url} prefill {length}")
    total: Drafting | None = None
    for context in sweep.contexts:
        if context > room:
            continue
        for batch in sweep.batches:
            for _ in range(sweep.repeats):
                before = await drafting(session, server) if server.speculative else None
                runs = [one(session, server, prompt(context), sweep.output_tokens) for _ in range(batch)]
                step_s = steady_step_s(await asyncio.gather(*runs))
                query = 1
                if before is not None:
                    after = await drafting(session, server)
                    delta = after - before if after is not None else None
                    if delta is None or delta.counters.drafts <= 0:
                        raise CalibrationError(f"{server.url} speculates but its counters did not move")
                    delta = delta.decoded(batch)
                    total = delta if total is None else total + delta
                    # k drafts verified with the next token
                    query = 1 + round(delta.counters.draft_tokens / delta.counters.drafts)
                if step_s is None:
                    continue
                step_ms = step_s * 1e3 * time_scale
                steps.append(Step("decode", batch, query, context + sweep.output_tokens / 2, 0, step_ms))
            progress(f"{server.url} decode B={batch} C={context}")
    return steps, total


@dataclass(frozen=True)
class Calibration:
    file: ProfileFile
    target: TargetFit | None
    draft: DraftFit | None
    acceptance: float | None
    k: int | None
    steps: int

    def report(self) -> str:
        lines = [f"profile {self.file.profile.name}: {self.steps} steps measured"]

        def table(title: str, terms: Sequence[Term], errors: dict[str, float]) -> None:
            lines.append(f"{title}:")
            for t in terms:
                rel = "" if math.isnan(t.relative_error) else f" ({t.relative_error:.0%})"
                lines.append(f"  {t.name:<34} {t.value:10.4g} +- {t.stderr:.3g}{rel}")
            lines.extend(f"  fit error over {kind} steps (RMS)   {e:.1%}" for kind, e in sorted(errors.items()))

        if self.target is not None:
            table("target model (plain servers)", self.target.terms, self.target.errors)
        if self.draft is not None:
            table(f"draft (speculative servers, k={self.k})", self.draft.terms, self.draft.errors)
        if self.acceptance is not None:
            lines.append(f"acceptance: a = {self.acceptance:.3f} per draft token")
        lines += [f"note: {n}" for n in self.file.profile.notes]
        return "\n".join(lines)


def assemble(
    servers: Sequence[Server], plain: Sequence[Step], spec: Sequence[Step], counters: Drafting | None,
    base: Profile, name: str, source: str,
) -> Calibration:  # fmt: skip
    """The profile the measurements give, with `base` for what they do not."""
    notes: list[str] = []
    target = fit_target(plain) if plain else None
    steps = target.model if target is not None else base.steps
    if target is None:
        notes.append(f"target step costs from {base.name}: no plain server was measured")
    spec_profile, draft, alpha, k = base.spec, None, None, None
    if spec and counters is not None and counters.counters.drafts > 0:
        alpha, k = counters.acceptance()
        if target is not None:
            draft = fit_draft(spec, target.model, k)
            spec_profile = replace(spec_profile, draft=draft.cost)
            steps = draft.target  # with what a verified draft token costs
        else:
            notes.append(f"draft costs from {base.name}: without a plain server they cannot be told from the target's")
        spec_profile = replace(spec_profile, num_speculative_tokens=k, acceptance_mean=min(alpha, 0.99))
    else:
        notes.append(f"speculation from {base.name}: no speculative server was measured")
    kv = {s.speculative: s.kv_capacity_tokens for s in servers if s.kv_capacity_tokens}
    if True in kv:
        spec_profile = replace(spec_profile, kv_capacity_tokens=kv[True])
    if False not in kv:
        notes.append(f"plain KV capacity from {base.name}: not published by the servers")
    first = servers[0]
    profile = Profile(
        name=name,
        title=f"calibrated: {first.model}, {len(servers)} server(s)",
        model=first.model,
        hardware="measured by specgate calibrate",
        steps=steps,
        kv_capacity_tokens=kv.get(False, base.kv_capacity_tokens),
        spec=spec_profile,
        max_model_len=min(s.max_model_len for s in servers),
        sources=("specgate calibrate",),
        notes=tuple(notes),
    )
    file = ProfileFile(profile, source, datetime.datetime.now(datetime.UTC).date())
    return Calibration(file, target, draft, alpha, k, len(plain) + len(spec))


async def calibrate(
    urls: Sequence[str], sweep: Sweep, base: Profile, name: str, time_scale: float = 1.0, seed: int = 0,
    progress: Progress | None = None,
) -> Calibration:  # fmt: skip
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        servers = [await probe(session, url.rstrip("/")) for url in urls]
        models = {s.model for s in servers}
        if len(models) > 1:
            raise CalibrationError(f"one profile is one model; these servers serve {', '.join(sorted(models))}")
        done = 0
        total = len(servers) * (len(sweep.prompts) + len(sweep.contexts) * len(sweep.batches))

        def step(what: str) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(f"[{'#' * (30 * done // total):<30}] {done}/{total} {what}")

        plain: list[Step] = []
        spec: list[Step] = []
        counters: Drafting | None = None
        for server in servers:
            steps, delta = await measure(session, server, sweep, time_scale, rng, step)
            (spec if server.speculative else plain).extend(steps)
            if delta is not None:
                counters = delta if counters is None else counters + delta
    kind = "quick" if sweep == QUICK else "full"
    source = f"specgate calibrate ({kind} sweep) of {', '.join(s.url for s in servers)}"
    if time_scale != 1.0:
        source += f", replicas at time scale {time_scale:g}"
    return assemble(servers, plain, spec, counters, base, name, source)


def progress_bar(line: str) -> None:
    sys.stderr.write(f"\r{line[:110]:<110}")
    sys.stderr.flush()
