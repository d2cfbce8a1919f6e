"""Fidelity: the engine model reproduces the figures its profiles were calibrated on."""

import itertools
import statistics

import pytest

from specgate.calibration.costs import Batch, TableStepModel
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import (
    A100_CODELLAMA_34B,
    DEFAULT_PROFILE,
    H100_LLAMA31_8B,
    PROFILES,
    WHITEPAPER,
    Profile,
    get_profile,
)
from specgate.sim.probes import decode_step, load_point, run_alone


# The whitepaper's batch-1 figures: 512 prompt tokens, 256 output tokens.
@pytest.mark.parametrize(
    ("mode", "ttft_ms", "tpot_ms"),
    [(Pool.PLAIN, 420.0, 38.0), (Pool.SPECULATIVE, 480.0, 18.0)],
)
def test_whitepaper_profile_reproduces_its_batch1_figures(mode: Pool, ttft_ms: float, tpot_ms: float) -> None:
    at_mean = run_alone(WHITEPAPER, mode, 512, 256, spread=False)
    assert at_mean.ttft is not None
    assert at_mean.tpot is not None
    assert at_mean.ttft * 1e3 == pytest.approx(ttft_ms, rel=0.10)
    assert at_mean.tpot * 1e3 == pytest.approx(tpot_ms, rel=0.10)
    # With acceptance drawn per request, the mean over many single requests still holds.
    tpots = [run_alone(WHITEPAPER, mode, 512, 256, seed=s).tpot for s in range(40)]
    assert statistics.mean(t for t in tpots if t is not None) * 1e3 == pytest.approx(tpot_ms, rel=0.10)


@pytest.mark.parametrize("batch", [1, 8, 32, 64])
@pytest.mark.parametrize("row", [0, 1])
def test_measured_profile_decode_steps_match_the_tables(batch: int, row: int) -> None:
    steps = A100_CODELLAMA_34B.steps
    assert isinstance(steps, TableStepModel)
    table = steps.decode
    context = (table.short_context, table.long_context)[row]
    measured_ms = (table.short_ms, table.long_ms)[row][table.batch_sizes.index(batch)]
    forward_ms, step_ms = decode_step(A100_CODELLAMA_34B, batch, context)
    assert forward_ms == pytest.approx(measured_ms, rel=0.10)
    # The whole step adds Vidur's CPU overhead for TP2 (8.0 ms at B=8, 13.4 ms at B=128).
    assert step_ms == pytest.approx(measured_ms + steps.overhead(batch), rel=0.01)


def test_measured_profile_overhead_matches_vidur_points() -> None:
    steps = A100_CODELLAMA_34B.steps
    assert isinstance(steps, TableStepModel)
    assert steps.overhead(8) == pytest.approx(8.0, abs=0.05)
    assert steps.overhead(128) == pytest.approx(13.4, abs=0.05)


def test_speculative_advantage_shrinks_as_batch_grows() -> None:
    speedups = [load_point(A100_CODELLAMA_34B, n).speedup for n in (1, 16, 32, 64, 128, 256)]
    assert speedups[0] > 2.0  # ~2.4x alone
    assert all(later < earlier for earlier, later in itertools.pairwise(speedups)), speedups
    assert speedups[-1] < 1.0  # at full batch, speculation loses


def test_preemptions_appear_when_kv_runs_out() -> None:
    def preemptions(concurrency: int) -> int:
        point = load_point(A100_CODELLAMA_34B, concurrency, prompt=1024, output=512, kv_capacity=20_000)
        return point.plain_preemptions + point.spec_preemptions

    assert preemptions(8) == 0  # 8 x 1,536 tokens fit in 20k slots
    assert preemptions(32) > 0  # 32 x 1,536 do not


@pytest.mark.parametrize("profile", list(PROFILES.values()), ids=list(PROFILES))
def test_every_profile_is_coherent(profile: Profile) -> None:
    assert profile.spec.kv_capacity_tokens < profile.kv_capacity_tokens  # the draft takes memory
    assert profile.sources
    alone = {mode: run_alone(profile, mode, 512, 256, spread=False) for mode in Pool}
    plain, spec = alone[Pool.PLAIN], alone[Pool.SPECULATIVE]
    assert plain.ttft is not None
    assert spec.ttft is not None
    assert plain.tpot is not None
    assert spec.tpot is not None
    assert spec.ttft > plain.ttft  # speculation costs time to first token
    assert spec.tpot < plain.tpot  # and saves time per token at batch 1
    assert profile.name in profile.describe()


def test_default_profile_is_the_measured_one() -> None:
    assert get_profile(DEFAULT_PROFILE) is A100_CODELLAMA_34B


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="whitepaper"):
        get_profile("nope")


def test_a_profile_on_other_hardware_scales_each_part_of_a_step() -> None:
    """`Profile.elsewhere` (the refit benchmark's replicas): decoding and drafting, prefill and the
    CPU time per step each scaled by its own factor, and nothing else changed."""
    base = H100_LLAMA31_8B
    other = base.elsewhere("other", decode=2.0, prefill=0.5, fixed=3.0)
    decoding, prompt = Batch(8, 1, 1024), Batch(0, 1, 0, 512, 1)
    both = Batch(8, 1, 1024, 512, 1)
    assert other.steps.forward_ms(decoding) == pytest.approx(2.0 * base.steps.forward_ms(decoding))
    assert other.steps.forward_ms(prompt) == pytest.approx(0.5 * base.steps.forward_ms(prompt))
    prefill_part = base.steps.forward_ms(both) - base.steps.forward_ms(decoding)
    assert other.steps.forward_ms(both) == pytest.approx(2.0 * base.steps.forward_ms(decoding) + 0.5 * prefill_part)
    assert other.steps.overhead_ms(8) == pytest.approx(3.0 * base.steps.overhead_ms(8))
    k = base.spec.num_speculative_tokens
    assert other.spec.draft.step_ms(k, 8, 8192) == pytest.approx(2.0 * base.spec.draft.step_ms(k, 8, 8192))
    assert other.spec.draft.prefill_ms(512) == pytest.approx(0.5 * base.spec.draft.prefill_ms(512))
    assert (other.kv_capacity_tokens, other.spec.acceptance_mean) == (
        base.kv_capacity_tokens,
        base.spec.acceptance_mean,
    )
