import pytest

from specgate.policies.length import MAX_GROUPS, PRIORS, LengthStats, band


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
        ([(100, 10), (120, 30)], 150, None, None, 20),  # a plain mean while few are known
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
    assert stats.expected("m", 100, request_class="chat") == 50
    assert stats.expected("m", 100, request_class="class-new") == PRIORS[band(100)]
