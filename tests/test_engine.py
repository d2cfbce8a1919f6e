"""The engine model's scheduling, preemption, speculation and bookkeeping, in virtual time."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgate.calibration.modes import Pool
from specgate.calibration.profiles import A100_CODELLAMA_34B, H100_LLAMA31_8B, Profile
from specgate.sim.engine import Engine, EngineConfig
from specgate.sim.outcomes import FinishReason, StepResult
from specgate.sim.probes import speculative_run
from specgate.workers.acceptance import SpecCounters, acceptance

PROFILE = A100_CODELLAMA_34B


def drain(engine: Engine, max_steps: int = 200_000) -> list[StepResult]:
    steps = []
    while engine.has_work():
        steps.append(engine.step())
        assert len(steps) < max_steps, "engine did not drain"
    return steps


def tokens_by_request(steps: list[StepResult]) -> Counter[str]:
    got: Counter[str] = Counter()
    for step in steps:
        for out in step.outputs:
            got[out.request_id] += out.new_tokens
    return got


def test_requests_that_fit_the_budget_prefill_together_then_decode_together() -> None:
    engine = Engine(PROFILE, Pool.PLAIN)
    for i in range(4):
        engine.add_request(f"r{i}", 1000, 10, arrival=0.0)
    first = engine.step()
    assert (first.batch.prefill_seqs, first.batch.prefill_tokens, first.batch.decode_seqs) == (4, 4000, 0)
    assert [o.first for o in first.outputs] == [True] * 4
    assert first.prompt_tokens == 4000
    second = engine.step()
    assert (second.batch.prefill_seqs, second.batch.decode_seqs) == (0, 4)


def test_token_budget_chunks_a_long_prompt() -> None:
    engine = Engine(PROFILE, Pool.PLAIN, EngineConfig(max_num_batched_tokens=8192))
    engine.add_request("long", 10_000, 5, arrival=0.0)
    first = engine.step()
    assert first.batch.prefill_tokens == 8192
    assert first.outputs == ()  # no token before the whole prompt is in
    second = engine.step()
    assert second.batch.prefill_tokens == 10_000 - 8192
    assert [o.request_id for o in second.outputs] == ["long"]


def test_chunked_prefill_rides_along_decodes() -> None:
    engine = Engine(PROFILE, Pool.PLAIN)
    engine.add_request("early", 100, 50, arrival=0.0)
    engine.step()
    engine.add_request("late", 3000, 5)
    step = engine.step()
    assert (step.batch.decode_seqs, step.batch.prefill_tokens) == (1, 3000)


def test_max_num_seqs_caps_the_running_batch() -> None:
    engine = Engine(PROFILE, Pool.PLAIN, EngineConfig(max_num_seqs=4))
    for i in range(10):
        engine.add_request(f"r{i}", 100, 20, arrival=0.0)
    step = engine.step()
    assert (step.num_running, step.num_waiting) == (4, 6)
    assert max(s.num_running for s in drain(engine)) <= 4


def test_preemption_takes_the_newest_and_recomputes_without_losing_tokens() -> None:
    # Room for ~3 sequences of 2,000 tokens: the fourth admitted is preempted as they grow.
    config = EngineConfig(kv_capacity_tokens=16_400, block_size=16)
    engine = Engine(PROFILE, Pool.PLAIN, config)
    for i in range(4):
        engine.add_request(f"r{i}", 3000, 1500, arrival=0.0)
    steps = drain(engine)
    preempted = [rid for s in steps for rid in s.preempted]
    assert preempted == ["r3"]  # the most recently admitted goes first, and once is enough
    assert tokens_by_request(steps) == {f"r{i}": 1500 for i in range(4)}
    assert engine.free_blocks == engine.total_blocks
    assert engine.counters.preemptions == len(preempted)


def test_abort_frees_kv_and_forgets_the_request() -> None:
    engine = Engine(PROFILE, Pool.PLAIN)
    engine.add_request("a", 2000, 100, arrival=0.0)
    engine.add_request("b", 2000, 100, arrival=0.0)
    engine.step()
    assert engine.kv_usage > 0
    gone = engine.abort("a")
    assert gone is not None
    assert gone.finish_reason is FinishReason.ABORT
    assert gone.output_tokens == 1
    assert "a" not in engine
    assert engine.abort("a") is None
    assert engine.abort("b") is not None
    assert engine.kv_usage == 0.0
    assert not engine.has_work()


def test_abort_of_a_waiting_request() -> None:
    engine = Engine(PROFILE, Pool.PLAIN, EngineConfig(max_num_seqs=1))
    engine.add_request("running", 100, 100, arrival=0.0)
    engine.add_request("queued", 100, 100, arrival=0.0)
    engine.step()
    assert engine.num_waiting == 1
    gone = engine.abort("queued")
    assert gone is not None
    assert gone.ttft is None
    assert engine.num_waiting == 0


def test_idle_time_passes_and_arrivals_are_timed_from_arrival() -> None:
    engine = Engine(PROFILE, Pool.PLAIN)
    engine.add_request("r", 512, 2, arrival=5.0)
    assert engine.now == 5.0
    steps = drain(engine)
    (finished,) = steps[-1].finished
    assert finished.e2e == pytest.approx(steps[-1].end - 5.0)
    assert finished.ttft == pytest.approx(steps[0].end - 5.0)


@pytest.mark.parametrize("mode", list(Pool))
def test_same_seed_same_run(mode: Pool) -> None:
    def run(seed: int) -> list[tuple[float, tuple[tuple[str, int], ...]]]:
        engine = Engine(PROFILE, mode, seed=seed)
        for i in range(20):
            engine.add_request(f"r{i}", 200 + 50 * i, 40 + i, arrival=0.01 * i)
        return [(s.end, tuple((o.request_id, o.new_tokens) for o in s.outputs)) for s in drain(engine)]

    assert run(7) == run(7)
    if mode is Pool.SPECULATIVE:
        assert run(7) != run(8)


@pytest.mark.parametrize(
    ("prompt", "output", "message"),
    [(0, 1, "at least one"), (1, 0, "at least one"), (16_000, 1000, "max_model_len")],
)
def test_add_request_rejects_impossible_requests(prompt: int, output: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Engine(PROFILE, Pool.PLAIN).add_request("r", prompt, output)


def test_duplicate_request_ids_are_rejected() -> None:
    engine = Engine(PROFILE, Pool.PLAIN)
    engine.add_request("r", 10, 10)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("r", 10, 10)


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(kv_capacity_tokens=1024),  # cannot hold one max-length sequence
        EngineConfig(max_num_batched_tokens=3),  # cannot fit one decode with 5 drafts
    ],
)
def test_engine_refuses_configurations_that_could_stall(config: EngineConfig) -> None:
    with pytest.raises(ValueError, match=r"max_model_len|draft"):
        Engine(PROFILE, Pool.SPECULATIVE, config)


@pytest.mark.parametrize("kwargs", [{"max_num_seqs": 0}, {"block_size": 0}, {"acceptance_mean": 1.0}])
def test_engine_config_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must"):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_speculative_steps_emit_bursts_and_pay_for_drafting() -> None:
    engine = Engine(PROFILE, Pool.SPECULATIVE)
    engine.add_request("r", 512, 300, arrival=0.0)
    prefill = engine.step()
    assert prefill.draft_ms > 0  # draft prefill and the first k draft passes delay the first token
    steps = drain(engine)
    bursts = [o.new_tokens for s in steps for o in s.outputs]
    assert max(bursts) <= engine.k + 1
    assert max(bursts) > 1
    assert sum(bursts) == 299


def test_plain_steps_never_draft() -> None:
    engine = Engine(PROFILE, Pool.PLAIN)
    engine.add_request("r", 512, 50, arrival=0.0)
    steps = drain(engine)
    assert all(s.draft_ms == 0 and s.spec.drafts == 0 for s in steps)
    assert all(o.new_tokens == 1 for s in steps for o in s.outputs)


@pytest.mark.parametrize(("profile", "alpha"), [(PROFILE, 0.72), (PROFILE, 0.3), (H100_LLAMA31_8B, 0.6)])
def test_spec_counters_recover_the_acceptance_rate(profile: Profile, alpha: float) -> None:
    engine = speculative_run(profile, alpha)
    c = engine.counters
    est = acceptance(SpecCounters(c.drafts, c.draft_tokens, c.accepted_tokens, tuple(c.accepted_per_pos)))
    assert est is not None
    assert est.per_token_alpha == pytest.approx(alpha, abs=0.02)
    k = engine.k
    assert est.mean_tokens_per_step == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha), rel=0.03)
    assert c.draft_tokens == k * c.drafts
    assert list(c.accepted_per_pos) == sorted(c.accepted_per_pos, reverse=True)


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(list(Pool)),
    requests=st.lists(
        st.tuples(
            st.floats(0.0, 5.0),  # arrival
            st.integers(1, 4000),  # prompt
            st.integers(1, 600),  # output
            st.booleans(),  # aborted after its first step?
        ),
        min_size=1,
        max_size=40,
    ),
    seed=st.integers(0, 2**16),
)
def test_engine_invariants_under_random_load(
    mode: Pool, requests: list[tuple[float, int, int, bool]], seed: int
) -> None:
    config = EngineConfig(kv_capacity_tokens=17_000, max_num_seqs=16, max_num_batched_tokens=2048)
    engine = Engine(PROFILE, mode, config, seed=seed)
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    emitted: Counter[str] = Counter()
    finished: dict[str, FinishReason] = {}
    to_abort: set[str] = set()
    last_end = 0.0
    steps = 0
    while pending or engine.has_work():
        while pending and (not engine.has_work() or pending[0][1][0] <= engine.now):
            i, (arrival, prompt, output, abort) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, output, arrival=arrival)
            if abort:
                to_abort.add(f"r{i}")
        step = engine.step()
        steps += 1
        assert steps < 100_000
        assert step.end >= step.start >= last_end - 1e-12
        last_end = step.end
        assert 0 <= engine.free_blocks <= engine.total_blocks
        assert step.num_running <= config.max_num_seqs
        assert step.batch.decode_seqs * (1 + engine.k) + step.batch.prefill_tokens <= config.max_num_batched_tokens
        for out in step.outputs:
            emitted[out.request_id] += out.new_tokens
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
        for rid in list(to_abort):
            if rid in engine and emitted[rid]:
                gone = engine.abort(rid)
                assert gone is not None
                finished[rid] = FinishReason.ABORT
                to_abort.discard(rid)
    assert engine.free_blocks == engine.total_blocks
    assert set(finished) == {f"r{i}" for i in range(len(requests))}
    for i, (_, _, output, _) in enumerate(requests):
        rid = f"r{i}"
        if finished[rid] is FinishReason.ABORT:
            assert emitted[rid] < output
        else:
            assert emitted[rid] == output


def test_a_seeded_request_accepts_the_same_wherever_it_runs_and_beside_whatever() -> None:
    """What a request accepts is its content's: the offline benchmark seeds it per request, so that
    two policies that route it differently compare on the same draws."""

    def steps_of(engine: Engine, request_id: str) -> list[int]:
        tokens = []
        for step in drain(engine):
            tokens += [o.new_tokens for o in step.outputs if o.request_id == request_id and not o.first]
        return tokens

    alone = Engine(H100_LLAMA31_8B, Pool.SPECULATIVE, seed=1)
    alone.add_request("mine", 300, 60, arrival=0.0, seed="0:17")
    crowded = Engine(H100_LLAMA31_8B, Pool.SPECULATIVE, seed=2)
    for i in range(8):
        crowded.add_request(f"other-{i}", 200 + i, 80, arrival=0.0)
    crowded.add_request("mine", 300, 60, arrival=0.0, seed="0:17")
    assert steps_of(alone, "mine") == steps_of(crowded, "mine")
    other = Engine(H100_LLAMA31_8B, Pool.SPECULATIVE, seed=1)
    other.add_request("mine", 300, 60, arrival=0.0, seed="0:18")
    assert steps_of(other, "mine") != steps_of(alone, "mine")
