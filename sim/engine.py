"""A model of vLLM V1's continuous-batching engine loop in virtual time.

Pure: no I/O and no clock of its own. The caller adds requests with their arrival time and
calls `step()`, which schedules one iteration the way vLLM V1's scheduler does, prices it with
the profile's step-time model, advances the virtual clock by that much and reports what each
request got out of it.

Scheduling follows vLLM V1: running requests first (decodes and unfinished prefill chunks),
within a per-step token budget; each allocation takes paged KV blocks and, when the pool is
empty, preempts the newest running request (its KV freed, recomputed later from scratch);
waiting requests join only in a step that preempted nobody, while `max_num_seqs` and the
budget allow, their prompts split into chunks as needed.

In speculative mode every decoding sequence verifies k draft tokens per step: the step pays
for k draft passes and one verification of k+1 tokens per sequence, and the sequence emits
its accepted run plus one token, drawn from its own acceptance rate.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from specgate.calibration.costs import Batch
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import Profile
from specgate.sim.outcomes import (
    EngineCounters,
    FinishedRequest,
    FinishReason,
    SpecStats,
    StepResult,
    TokenOutput,
)


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler settings, with vLLM V1's online-serving defaults."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_capacity_tokens: int | None = None
    """None takes the profile's capacity for the mode."""
    num_speculative_tokens: int | None = None
    """None takes the profile's k."""
    acceptance_mean: float | None = None
    """None takes the profile's mean acceptance rate."""
    acceptance_concentration: float | None = None
    """None takes the profile's; 0 gives every request exactly the mean."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be positive")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ValueError("kv_capacity_tokens must hold at least one block")
        if self.acceptance_mean is not None and not 0.0 <= self.acceptance_mean < 1.0:
            raise ValueError("acceptance_mean must lie in [0, 1)")


@dataclass(eq=False)
class _Seq:
    request_id: str
    prompt_tokens: int
    output_target: int
    finish_reason: FinishReason
    alpha: float
    arrival: float
    max_tokens: int | None
    rng: random.Random
    """The request's own draws (its acceptance, step by step): what a request accepts is a property
    of its content, not of the order in which a replica happens to serve it."""
    num_computed: int = 0
    output_tokens: int = 0
    blocks: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_output: float | None = None
    gaps: list[float] = field(default_factory=list)
    """Time between its outputs after the first: one engine step each, or more when stalled."""

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def is_decoding(self) -> bool:
        return self.output_tokens > 0 and self.num_computed == self.num_tokens - 1


def speculative_tokens(profile: Profile, mode: Pool, config: EngineConfig) -> int:
    """k, the draft tokens verified per sequence per step (0 in plain mode)."""
    if mode is Pool.PLAIN:
        return 0
    return config.num_speculative_tokens or profile.spec.num_speculative_tokens


def kv_blocks(profile: Profile, mode: Pool, config: EngineConfig) -> int:
    """The replica's KV blocks; raises ValueError for settings under which the engine could stall.

    As vLLM refuses to start when one max-length sequence cannot fit in its KV cache, so does
    the model: a lone request can then always run, and the engine never stalls.
    """
    k = speculative_tokens(profile, mode, config)
    default = profile.spec.kv_capacity_tokens if mode is Pool.SPECULATIVE else profile.kv_capacity_tokens
    capacity = config.kv_capacity_tokens or default
    blocks = capacity // config.block_size
    if blocks * config.block_size < profile.max_model_len + 2 * k + 1:
        raise ValueError(
            f"KV capacity of {capacity} tokens cannot hold one sequence of max_model_len {profile.max_model_len}"
        )
    if config.max_num_batched_tokens < 1 + k:
        raise ValueError("max_num_batched_tokens must fit one decode step with its draft tokens")
    return blocks


class Engine:
    def __init__(self, profile: Profile, mode: Pool, config: EngineConfig | None = None, seed: int = 0) -> None:
        self.profile = profile
        self.mode = mode
        self.config = config = config or EngineConfig()
        spec = profile.spec
        self.k = speculative_tokens(profile, mode, config)
        self.acceptance_mean = spec.acceptance_mean if config.acceptance_mean is None else config.acceptance_mean
        self.acceptance_concentration = (
            spec.acceptance_concentration
            if config.acceptance_concentration is None
            else config.acceptance_concentration
        )
        self.total_blocks = kv_blocks(profile, mode, config)
        self.free_blocks = self.total_blocks
        self.now = 0.0
        self.counters = EngineCounters(accepted_per_pos=[0] * self.k)
        self._rng = random.Random(seed)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}

    @property
    def speculative(self) -> bool:
        return self.mode is Pool.SPECULATIVE

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def advance_to(self, t: float) -> None:
        """Let virtual time pass while idle (never moves the clock back)."""
        self.now = max(self.now, t)

    def add_request(
        self,
        request_id: str,
        prompt_tokens: int,
        output_tokens: int,
        *,
        finish_reason: FinishReason = FinishReason.LENGTH,
        arrival: float | None = None,
        max_tokens: int | None = None,
        alpha: float | None = None,
        seed: str | None = None,
    ) -> None:
        """Queue a request that will generate exactly `output_tokens` tokens, then finish. With a
        `seed`, its acceptance draws are the same on any replica whatever else it serves (the
        offline benchmark compares policies on the same requests so); else the replica draws it."""
        if request_id in self._by_id:
            raise ValueError(f"duplicate request id {request_id!r}")
        if prompt_tokens < 1 or output_tokens < 1:
            raise ValueError("a request needs at least one prompt token and one output token")
        if prompt_tokens + output_tokens > self.profile.max_model_len:
            raise ValueError("prompt plus output exceeds max_model_len")
        arrival = self.now if arrival is None else arrival
        if not self.has_work():
            self.advance_to(arrival)
        rng = random.Random(self._rng.random() if seed is None else seed)
        seq = _Seq(
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            output_target=output_tokens,
            finish_reason=finish_reason,
            alpha=self._draw_alpha(rng) if alpha is None else alpha,
            arrival=arrival,
            max_tokens=max_tokens,
            rng=rng,
        )
        self._waiting.append(seq)
        self._by_id[request_id] = seq

    def abort(self, request_id: str) -> FinishedRequest | None:
        """Drop a request wherever it is and free its KV blocks."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return None
        if seq in self._running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._free(seq)
        return self._finished(seq, FinishReason.ABORT, self.now)

    def step(self) -> StepResult:
        """Schedule and run one iteration; the clock advances by its duration."""
        start = self.now
        scheduled, preempted = self._schedule(start)
        decodes = [(s, n) for s, n in scheduled if s.is_decoding]
        prefills = [(s, n) for s, n in scheduled if not s.is_decoding]
        completing = [s for s, n in prefills if s.num_computed + n >= s.num_tokens]

        batch = Batch(
            decode_seqs=len(decodes),
            query_per_seq=1 + self.k,
            mean_context=(sum(s.num_tokens for s, _ in decodes) / len(decodes)) if decodes else 0.0,
            prefill_tokens=sum(n for _, n in prefills),
            prefill_seqs=len(prefills),
        )
        steps = self.profile.steps
        forward_ms = steps.forward_ms(batch)
        overhead_ms = steps.overhead_ms(batch.num_seqs) if batch.num_seqs else 0.0
        draft_ms = 0.0
        if self.speculative:
            drafting = [s for s, _ in decodes] + completing
            draft = self.profile.spec.draft
            draft_ms = draft.step_ms(self.k, len(drafting), sum(s.num_tokens for s in drafting))
            draft_ms += draft.prefill_ms(batch.prefill_tokens)
        end = start + (forward_ms + draft_ms + overhead_ms) / 1e3
        self.now = end
        self.counters.steps += 1
        self.counters.preemptions += len(preempted)
        return self._apply(start, end, batch, forward_ms, draft_ms, overhead_ms, decodes, prefills, preempted)

    # --- scheduling -------------------------------------------------------------------------

    def _schedule(self, now: float) -> tuple[list[tuple[_Seq, int]], list[_Seq]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        preempted: list[_Seq] = []
        lookahead = self.k
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            wanted = seq.num_tokens - seq.num_computed + (self.k if seq.is_decoding else 0)
            if seq.is_decoding and wanted > budget:
                break  # a decode (and its drafts) is never split across steps
            n = min(wanted, budget)
            while not self._allocate(seq, n + lookahead):
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing after it can run either

        if not preempted:
            while self._waiting and len(self._running) < self.config.max_num_seqs and budget > 0:
                seq = self._waiting[0]
                n = min(seq.num_tokens - seq.num_computed, budget)
                if not self._allocate(seq, n + lookahead):
                    break
                self._waiting.popleft()
                self._running.append(seq)
                if seq.first_scheduled is None:
                    seq.first_scheduled = now
                scheduled.append((seq, n))
                budget -= n
        return scheduled, preempted

    def _allocate(self, seq: _Seq, new_tokens: int) -> bool:
        needed = math.ceil((seq.num_computed + new_tokens) / self.config.block_size) - seq.blocks
        if needed <= 0:
            return True
        if needed > self.free_blocks:
            return False
        self.free_blocks -= needed
        seq.blocks += needed
        return True

    def _free(self, seq: _Seq) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def _preempt(self, seq: _Seq) -> None:
        self._free(seq)
        seq.num_computed = 0
        self._waiting.appendleft(seq)

    # --- results ----------------------------------------------------------------------------

    def _draw_alpha(self, rng: random.Random) -> float:
        mean, conc = self.acceptance_mean, self.acceptance_concentration
        if not self.speculative or conc <= 0 or mean <= 0:
            return mean
        return rng.betavariate(mean * conc, (1 - mean) * conc)

    def _accepted(self, seq: _Seq) -> int:
        accepted = 0
        while accepted < self.k and seq.rng.random() < seq.alpha:
            accepted += 1
        return accepted

    def _apply(
        self,
        start: float,
        end: float,
        batch: Batch,
        forward_ms: float,
        draft_ms: float,
        overhead_ms: float,
        decodes: list[tuple[_Seq, int]],
        prefills: list[tuple[_Seq, int]],
        preempted: list[_Seq],
    ) -> StepResult:
        outputs: list[TokenOutput] = []
        finished: list[FinishedRequest] = []
        ttfts: list[float] = []
        itls: list[float] = []
        prompt_tokens = 0
        drafts = draft_tokens = accepted_total = 0
        per_pos = [0] * self.k

        emitted: list[tuple[_Seq, int]] = []
        for seq, _ in decodes:
            if self.speculative:
                accepted = self._accepted(seq)
                drafts += 1
                draft_tokens += self.k
                accepted_total += accepted
                for pos in range(accepted):
                    per_pos[pos] += 1
                seq.num_computed += 1 + accepted
                emitted.append((seq, accepted + 1))
            else:
                seq.num_computed += 1
                emitted.append((seq, 1))
        for seq, n in prefills:
            seq.num_computed += n
            if seq.num_computed >= seq.num_tokens:
                emitted.append((seq, 1))

        for seq, n in emitted:
            n = min(n, seq.output_target - seq.output_tokens)
            first = seq.first_token is None
            seq.output_tokens += n
            # Tokens past the request's end were drafted but never emitted; keep the
            # KV bookkeeping consistent with what the request actually holds.
            seq.num_computed = min(seq.num_computed, seq.num_tokens - 1)
            if first:
                seq.first_token = end
                ttfts.append(end - seq.arrival)
                prompt_tokens += seq.prompt_tokens
            elif seq.last_output is not None:
                itls.append(end - seq.last_output)
                seq.gaps.append(end - seq.last_output)
            seq.last_output = end
            done = seq.output_tokens >= seq.output_target
            outputs.append(TokenOutput(seq.request_id, n, first, seq.finish_reason if done else None))
            if done:
                self._running.remove(seq)
                del self._by_id[seq.request_id]
                self._free(seq)
                finished.append(self._finished(seq, seq.finish_reason, end))

        generation_tokens = sum(o.new_tokens for o in outputs)
        c = self.counters
        c.prompt_tokens += prompt_tokens
        c.generation_tokens += generation_tokens
        c.first_tokens += sum(o.first for o in outputs)
        c.drafts += drafts
        c.draft_tokens += draft_tokens
        c.accepted_tokens += accepted_total
        for pos, count in enumerate(per_pos):
            c.accepted_per_pos[pos] += count
        return StepResult(
            start=start,
            end=end,
            batch=batch,
            forward_ms=forward_ms,
            draft_ms=draft_ms,
            overhead_ms=overhead_ms,
            outputs=tuple(outputs),
            finished=tuple(finished),
            preempted=tuple(s.request_id for s in preempted),
            prompt_tokens=prompt_tokens,
            generation_tokens=generation_tokens,
            ttfts=tuple(ttfts),
            inter_token_latencies=tuple(itls),
            spec=SpecStats(drafts, draft_tokens, accepted_total, tuple(per_pos)),
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_usage=self.kv_usage,
        )

    @staticmethod
    def _finished(seq: _Seq, reason: FinishReason, now: float) -> FinishedRequest:
        scheduled = seq.first_scheduled if seq.first_scheduled is not None else now
        first = seq.first_token
        decode = (now - first) if first is not None else 0.0
        return FinishedRequest(
            request_id=seq.request_id,
            finish_reason=reason,
            prompt_tokens=seq.prompt_tokens,
            output_tokens=seq.output_tokens,
            max_tokens=seq.max_tokens,
            e2e=now - seq.arrival,
            queued=scheduled - seq.arrival,
            prefill=((first if first is not None else now) - scheduled),
            decode=decode,
            inference=now - scheduled,
            ttft=(first - seq.arrival) if first is not None else None,
            tpot=decode / (seq.output_tokens - 1) if seq.output_tokens > 1 else None,
            step=statistics.median(seq.gaps) if seq.gaps else None,
        )
