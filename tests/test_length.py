import pytest

from specgate.policies.length import (
    MAX_GROUPS,
    MAX_PENDING,
    MAX_WAIT_S,
    PRIORS,
    SPREAD,
    LengthStats,
    Pending,
    band,
    shrunk,
)


def with_prior(*lengths: int) -> int:
    """What a group of the first band expects after its first few `lengths`: their mean, drawn
    toward the band's prior."""
    return round(shrunk(sum(lengths) / len(lengths), len(lengths), PRIORS[0]))


@pytest.mark.parametrize(
    ("prompt", "expected"), [(1, 0), (255, 0), (256, 1), (1023, 1), (1024, 2), (4096, 3), (10**6, 3)]
)
def test_bands(prompt: int, expected: int) -> None:
    assert band(prompt) == expected


@pytest.mark.parametrize(
    ("observed", "prompt", "hint", "max_tokens", "expected"),
    [
        ([], 100, None, None, PRIORS[0]),  # cold start: the band's prior
        ([], 5000, None, None, PRIORS[3]),
        ([], 100, None, 50, 50),  # never above max_tokens
        ([], 100, 700, None, 700),  # the client's hint wins
        ([], 100, 700, 300, 300),  # ... within max_tokens
        # the first lengths known, their mean (20) drawn toward the band's prior (200)
        ([(100, 10), (120, 30)], 150, None, None, 89),
        ([(100, 10), (120, 30)], 2000, None, None, PRIORS[2]),  # another band has not learned
    ],
)
def test_expected_length(
    observed: list[tuple[int, int]], prompt: int, hint: int | None, max_tokens: int | None, expected: int
) -> None:
    stats = LengthStats()
    for p, out in observed:
        stats.observe("m", p, out)
    assert stats.expected("m", prompt, hint=hint, max_tokens=max_tokens) == expected


def test_learned_lengths_follow_drift_and_stay_per_model_and_class() -> None:
    stats = LengthStats()
    for _ in range(200):
        stats.observe("m", 100, 50)
    for _ in range(200):
        stats.observe("m", 100, 500)
    assert stats.expected("m", 100) == pytest.approx(500, rel=0.02)  # smoothed mean moved on
    assert stats.expected("other", 100) == PRIORS[0]
    assert stats.expected("m", 100, request_class="batch") == PRIORS[0]


def test_a_client_inventing_classes_cannot_grow_the_learned_groups_without_end() -> None:
    stats = LengthStats()
    stats.observe("m", 100, 40, "chat")
    for i in range(MAX_GROUPS + 500):
        stats.observe("m", 100, 900, f"class-{i}")
    assert len(stats.groups.means) == len(stats.groups.counts) == MAX_GROUPS
    # The groups known before still learn; a new one gets its band's prior.
    stats.observe("m", 100, 60, "chat")
    assert stats.expected("m", 100, request_class="chat") == with_prior(40, 60)
    assert stats.expected("m", 100, request_class="class-new") == PRIORS[band(100)]


def began(stats: LengthStats, now: float) -> Pending:
    """A request of the first band whose answer began `now`."""
    pending = stats.begin("m", 100)
    assert pending is not None
    stats.start(pending, now)
    return pending


def test_lengths_finishing_shortest_first_are_learned_in_the_order_their_answers_began() -> None:
    stats = LengthStats()
    lengths = [400, 10, 20, 30, 300, 5]  # a burst: the short answers finish first
    pending = [began(stats, i * 0.01) for i in range(len(lengths))]
    by_end = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for i in by_end[:-1]:  # all but the longest, the first to begin, have ended
        stats.end(pending[i], lengths[i], now=1.0)
    # A mean of what finished would be 73 tokens; nothing is learned while the first still runs.
    assert stats.expected("m", 100) == PRIORS[0]
    stats.end(pending[by_end[-1]], lengths[by_end[-1]], now=2.0)
    assert stats.expected("m", 100) == with_prior(*lengths)


def test_a_request_still_waiting_for_its_answer_holds_back_no_lengths() -> None:
    stats = LengthStats()
    queued = stats.begin("m", 100)  # arrived first, still waiting in a queue
    running = [began(stats, 1.0 + i) for i in range(3)]
    for pending, length in zip(running, (30, 40, 50), strict=True):
        stats.end(pending, length, now=10.0)
    assert stats.expected("m", 100) == with_prior(30, 40, 50)
    stats.start(queued, 11.0)
    later = began(stats, 12.0)
    stats.end(later, 20, now=13.0)  # began after the one once queued, which now runs
    assert stats.expected("m", 100) == with_prior(30, 40, 50)
    stats.end(queued, 60, now=14.0)
    stats.start(queued, 15.0)  # (an answer going on from another replica: no second start)
    assert stats.expected("m", 100) == with_prior(30, 40, 50, 60, 20)
    assert not stats._queues


def test_a_request_ending_without_a_length_or_twice_is_learned_once_or_not_at_all() -> None:
    stats = LengthStats()
    refused = stats.begin("m", 100)  # never began: refused, or failed before its first token
    answered, later = began(stats, 0.1), began(stats, 0.2)
    failed = began(stats, 0.0)  # its answer broke off: its length is not known
    stats.end(answered, 40, now=0.5)
    stats.end(answered, None, now=0.6)  # the handler's own end, after the answer's
    stats.end(refused, None, now=0.6)
    assert stats.expected("m", 100) == with_prior(40)
    stats.end(later, 60, now=0.8)
    stats.end(later, 60, now=0.9)
    stats.end(failed, None, now=1.0)
    assert stats.expected("m", 100) == with_prior(40, 60)
    assert stats.groups.counts[("m", 0, "")] == 2


def test_an_answer_running_past_the_wait_no_longer_holds_its_group_back() -> None:
    stats = LengthStats()
    stuck = began(stats, 0.0)
    quick = began(stats, 1.0)
    stats.end(quick, 30, now=2.0)
    assert stats.expected("m", 100) == PRIORS[0]
    began(stats, MAX_WAIT_S + 1.0)  # a newcomer finds the head running too long
    assert stats.expected("m", 100) == with_prior(30)
    stats.end(stuck, 3000, now=MAX_WAIT_S + 2.0)  # learned when it ends, all the same
    assert stats.expected("m", 100) == with_prior(30, 3000)


def test_answers_waiting_to_be_learned_are_bounded_per_group() -> None:
    stats = LengthStats()
    first = began(stats, 0.0)
    waiting = [began(stats, 0.0) for _ in range(MAX_PENDING + 10)]
    assert sum(len(queue) for queue in stats._queues.values()) == MAX_PENDING
    for pending in waiting[-11:]:  # past the bound: learned when they end
        stats.end(pending, 50, now=1.0)
    assert stats.groups.counts[("m", 0, "")] == 11
    for pending in waiting:
        stats.end(pending, 50, now=1.0)
    stats.end(first, 70, now=1.0)
    assert stats.groups.counts[("m", 0, "")] == MAX_PENDING + 11
    assert not stats._queues  # nothing left behind once all have ended


def test_a_group_far_from_its_prior_is_learned_within_dozens_of_requests() -> None:
    stats = LengthStats()
    for _ in range(60):
        stats.observe("m", 100, 20)
        stats.observe("m", 100, 2000, "essays")
    assert stats.expected("m", 100) < 30
    assert stats.expected("m", 100, request_class="essays") > 1800


def test_a_few_lengths_far_from_the_prior_outweigh_it_and_a_few_near_it_do_not() -> None:
    short, near = LengthStats(), LengthStats()
    for _ in range(10):  # code completions: a tenth of the band's prior
        short.observe("m", 100, 20)
    assert 20 < short.expected("m", 100) < 50
    for length in (60, 150, 240):  # as spread as lengths are, and about the prior
        near.observe("m", 100, length)
    assert abs(near.expected("m", 100) - PRIORS[0]) < 10


@pytest.mark.parametrize("mean", [1.0, 20.0, 150.0, 199.0, 201.0, 400.0, 5000.0])
@pytest.mark.parametrize("worth", [1.0, 3.0, 39.0])
def test_the_prior_moves_a_mean_toward_it_by_at_most_half_its_standard_error(mean: float, worth: float) -> None:
    prior = 200.0
    estimate = shrunk(mean, worth, prior)
    assert min(mean, prior) <= estimate <= max(mean, prior)
    assert abs(estimate - mean) <= SPREAD * prior / worth**0.5 / 2 + 1e-9
