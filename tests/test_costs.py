import pytest

from specgate.calibration.costs import Batch, Curve, DraftCost, Linear, LinearStepModel, StepTable, TableStepModel

CURVE = Curve((1, 128, 512), (10.0, 20.0, 60.0))


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        (1, 10.0),
        (128, 20.0),
        (320, 40.0),  # halfway between 128 and 512
        (512, 60.0),
        (896, 100.0),  # extended with the last segment's slope
        (0, 10.0 - 10.0 / 127),  # extended with the first segment's slope
    ],
)
def test_curve_interpolates_and_extends(x: float, expected: float) -> None:
    assert CURVE(x) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("xs", "ys"),
    [((1,), (1.0,)), ((1, 1), (1.0, 2.0)), ((2, 1), (1.0, 2.0)), ((1, 2), (1.0,))],
)
def test_curve_rejects_bad_points(xs: tuple[float, ...], ys: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="curve"):
        Curve(xs, ys)


TABLE = StepTable(
    batch_sizes=(1, 2, 4), short_context=512, short_ms=(10.0, 12.0, 16.0), long_context=2048, long_ms=(20.0, 24.0, 32.0)
)


@pytest.mark.parametrize(
    ("batch", "context", "expected"),
    [
        (1, 512, 10.0),
        (4, 2048, 32.0),
        (3, 512, 14.0),
        (2, 1280, 18.0),  # halfway in context
        (8, 512, 24.0),  # past the last batch size
        (1, 0, 10.0 - 10.0 * 512 / 1536),  # shorter context: extended, not clamped yet
        (1, -5000, 5.0),  # never below half the short-context time
    ],
)
def test_step_table_interpolates(batch: float, context: float, expected: float) -> None:
    assert TABLE.at(batch, context) == pytest.approx(expected)


TABLE_MODEL = TableStepModel(
    decode=TABLE,
    verify=TABLE.scaled(2.0),
    verify_query=6,
    prefill=Curve((1, 1000), (10.0, 110.0)),
    weight_read_ms=9.0,
    overhead=Linear(1.0, 0.5),
)


@pytest.mark.parametrize(
    ("batch", "expected_ms"),
    [
        (Batch(), 0.0),
        (Batch(decode_seqs=2, mean_context=512), 12.0),
        # verification of 6 tokens costs what the verify table says
        (Batch(decode_seqs=2, query_per_seq=6, mean_context=512), 24.0),
        # 3 tokens: the extra compute scales with the extra tokens, (3 - 1) / (6 - 1)
        (Batch(decode_seqs=2, query_per_seq=3, mean_context=512), 12.0 + 12.0 * 2 / 5),
        (Batch(prefill_tokens=1000, prefill_seqs=1), 110.0),
        # decode and prefill in one step read the weights once
        (Batch(decode_seqs=2, mean_context=512, prefill_tokens=1000, prefill_seqs=1), 12.0 + 110.0 - 9.0),
    ],
)
def test_table_model_prices_batches(batch: Batch, expected_ms: float) -> None:
    assert TABLE_MODEL.forward_ms(batch) == pytest.approx(expected_ms)
    assert TABLE_MODEL.overhead_ms(4) == pytest.approx(3.0)


LINEAR_MODEL = LinearStepModel(base_ms=5.0, per_token_us=20.0, per_kv_token_ns=40.0, step_overhead_ms=1.0)


@pytest.mark.parametrize(
    ("batch", "expected_ms"),
    [
        (Batch(), 0.0),
        (Batch(decode_seqs=10, mean_context=1000), 5.0 + 0.2 + 0.4),
        (Batch(decode_seqs=10, query_per_seq=4, mean_context=1000), 5.0 + 0.8 + 0.4),
        (Batch(prefill_tokens=1000, prefill_seqs=1), 5.0 + 20.0 + 0.04),
    ],
)
def test_linear_model_prices_batches(batch: Batch, expected_ms: float) -> None:
    assert LINEAR_MODEL.forward_ms(batch) == pytest.approx(expected_ms)


def test_linear_model_overhead_only_for_nonempty_steps() -> None:
    assert LINEAR_MODEL.overhead_ms(0) == 0.0
    assert LINEAR_MODEL.overhead_ms(3) == 1.0


DRAFT = DraftCost(
    step_fixed_ms=1.0,
    pass_ms=2.0,
    pass_per_seq_us=100.0,
    per_step_kv_ns=10.0,
    per_pass_kv_ns=20.0,
    prefill_fixed_ms=3.0,
    prefill_per_token_us=10.0,
)


@pytest.mark.parametrize(
    ("k", "seqs", "kv", "expected_ms"),
    [
        (5, 0, 0, 0.0),
        (5, 1, 0, 1.0 + 5 * (2.0 + 0.1)),
        (3, 10, 100_000, 1.0 + 3 * (2.0 + 1.0) + 100_000 * (10 + 3 * 20) / 1e6),
    ],
)
def test_draft_step_cost(k: int, seqs: int, kv: float, expected_ms: float) -> None:
    assert DRAFT.step_ms(k, seqs, kv) == pytest.approx(expected_ms)


def test_draft_prefill_cost() -> None:
    assert DRAFT.prefill_ms(0) == 0.0
    assert DRAFT.prefill_ms(500) == pytest.approx(3.0 + 5.0)
