"""One gateway's processes counting each other's requests through the shared file."""

from __future__ import annotations

import math
import random
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from specgate.calibration.modes import Pool
from specgate.workers.latency_fit import LatencyFit, Priced
from specgate.workers.pools import Fleet, FleetSettings, Replica
from specgate.workers.scrape import VllmLoad
from specgate.workers.shared import FIELDS, FIT_FIELDS, SLOTS, SharedCounts, key_of, taken_at
from tests.test_pools import STEP, TTFT

SETTINGS = FleetSettings()
A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


@pytest.fixture
def counts_file(tmp_path: Path) -> Path:
    return SharedCounts.create(3, tmp_path)


def fleets(path: Path, processes: int = 2) -> list[Fleet]:
    """One fleet per process, each naming the replicas in its own order."""
    made = []
    for index in range(processes):
        urls = [A, B] if index % 2 == 0 else [B, A]
        made.append(Fleet({Pool.PLAIN: urls}, SETTINGS, SharedCounts(path, processes, index)))
    return made


def scrape(fleet: Fleet, now: float, first_tokens_on_a: float = 0.0) -> None:
    for replica in fleet.replicas.values():
        load = VllmLoad(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, None, first_tokens_on_a if replica.url == A else 0.0)
        replica.scraped(load, now, replica.dispatched_by_gateway(now))


def state(fleet: Fleet, url: str, now: float) -> dict[str, float]:
    (replica,) = (r for r in fleet.snapshot(now).replicas if r.url == url)
    return {
        "in_flight": replica.in_flight,
        "prefilling": replica.prefilling,
        "prefill_tokens": replica.prefill_tokens,
        "dispatched": replica.dispatched_since_scrape,
        "arrivals_per_s": replica.arrivals_per_s,
        "prefill_tokens_per_s": replica.prefill_tokens_per_s,
    }


def by_url(fleet: Fleet, url: str) -> Replica:
    return next(r for r in fleet.replicas.values() if r.url == url)


def test_each_process_sees_the_others_requests_as_its_own(counts_file: Path) -> None:
    first, second = fleets(counts_file)
    scrape(first, 100.0)
    scrape(second, 100.0)
    on_a = by_url(first, A)
    on_a.dispatched_one(500, now=100.0)
    on_a.dispatched_one(300, now=100.0)
    seen = state(second, A, 100.0)
    assert (seen["in_flight"], seen["prefilling"], seen["prefill_tokens"]) == (2, 2, 800)
    assert seen["dispatched"] == 2  # since the last scrape, though another process sent them
    assert seen["arrivals_per_s"] == pytest.approx(state(first, A, 100.0)["arrivals_per_s"])
    assert state(second, B, 100.0)["in_flight"] == 0  # the other replica: nothing
    on_a.first_byte(500, now=100.1)
    assert state(second, A, 100.1)["prefilling"] == 1
    on_a.finished(got_first_byte=True, prompt_tokens=500, now=100.2)
    on_a.finished(got_first_byte=False, prompt_tokens=300, now=100.2)
    assert state(second, A, 100.2) | {"arrivals_per_s": 0, "prefill_tokens_per_s": 0} == {
        "in_flight": 0, "prefilling": 0, "prefill_tokens": 0, "dispatched": 2, "arrivals_per_s": 0,
        "prefill_tokens_per_s": 0,
    }  # fmt: skip
    scrape(second, 100.3)
    assert state(second, A, 100.3)["dispatched"] == 0  # a scrape after them shows them


def test_a_gateway_of_several_processes_alone_keeps_a_share_of_one(counts_file: Path) -> None:
    """Its processes' first tokens together are the fleet's: counting the others' in the share keeps it
    at 1, where each process counting only its own would think itself one gateway of three."""
    made = fleets(counts_file, 3)
    now, first_tokens = 0.0, 0.0
    for step in range(60):
        now = float(step)
        for fleet in made:
            replica = by_url(fleet, A)
            replica.dispatched_one(100, now=now)
            replica.first_byte(100, now=now)
            replica.finished(got_first_byte=True, prompt_tokens=100, now=now)
        first_tokens += 3
        for fleet in made:
            scrape(fleet, now + 0.5, first_tokens)
    assert [fleet.share.value for fleet in made] == [1.0, 1.0, 1.0]


def test_a_freed_slot_taken_by_another_replica_is_not_mistaken_for_the_old_one(counts_file: Path) -> None:
    first, second = fleets(counts_file)
    scrape(second, 0.0)
    on_a = by_url(first, A)
    on_a.dispatched_one(10, now=0.0)
    assert state(second, A, 0.0)["in_flight"] == 1
    on_a.finished(got_first_byte=False, prompt_tokens=10, now=0.0)
    first.reconcile({Pool.PLAIN: [B]})  # A no longer found: idle, so removed at once
    assert A not in {r.url for r in first.replicas.values()}
    first.reconcile({Pool.PLAIN: [B, "http://10.0.0.3:8000"]})  # a newcomer takes a free slot
    newcomer = next(r for r in first.replicas.values() if r.url.endswith("10.0.0.3:8000"))
    newcomer.dispatched_one(10, now=0.0)
    assert state(second, A, 0.0)["in_flight"] == 0


def test_a_row_holds_its_slots_and_no_more(tmp_path: Path) -> None:
    counts = SharedCounts(SharedCounts.create(1, tmp_path), 1, 0)
    for i in range(SLOTS - 1):  # (the first slot keeps the row's generation)
        counts.slot(f"http://10.1.{i // 256}.{i % 256}:8000")
    assert counts.slot("http://10.1.0.0:8000").base == FIELDS  # one it has: found, not taken again
    with pytest.raises(RuntimeError, match="replicas to share"):
        counts.slot("http://10.9.9.9:8000")


def test_a_replica_another_process_takes_up_later_is_found_at_once(counts_file: Path) -> None:
    early = Fleet({Pool.PLAIN: [A]}, SETTINGS, SharedCounts(counts_file, 2, 0))
    scrape(early, 0.0)  # searched for A in the other row: nothing there yet
    late = Fleet({Pool.PLAIN: [A]}, SETTINGS, SharedCounts(counts_file, 2, 1))
    by_url(late, A).dispatched_one(10, now=0.0)
    assert state(early, A, 0.0)["in_flight"] == 1


def test_counts_cross_real_processes(counts_file: Path) -> None:
    """Another process maps the same file and publishes: this one reads it."""
    (reader,) = fleets(counts_file, 2)[1:]
    scrape(reader, 0.0)
    program = (
        "import sys, pathlib; from specgate.calibration.modes import Pool; "
        "from specgate.workers.pools import Fleet, FleetSettings; from specgate.workers.shared import SharedCounts; "
        f"counts = SharedCounts(pathlib.Path(sys.argv[1]), 2, 0); f = Fleet({{Pool.PLAIN: ['{A}']}}, FleetSettings(), "
        "counts); r = next(iter(f.replicas.values())); [r.dispatched_one(64, now=1.0) for _ in range(3)]"
    )
    subprocess.run([sys.executable, "-c", program, str(counts_file)], check=True, timeout=60)
    assert state(reader, A, 1.0)["in_flight"] == 3
    assert state(reader, A, 1.0)["prefill_tokens"] == 192


def answers(fit: LatencyFit, n: int, slower: float, profile: str = "profile") -> None:
    """`n` answers from replicas `slower` times the profile's decode cost (TPOT by the step gap)."""
    for i in range(n):
        batch = 1 + i % 8
        step = (10.0, 2.0 * batch, 0.0, 0.0, 0.0)
        priced = Priced(profile, TTFT, step, step)
        measured = 10.0 + slower * 2.0 * batch
        fit.observe(None, measured, priced, step_ms=measured)


def test_each_process_fits_the_step_costs_from_every_processs_answers(counts_file: Path) -> None:
    first, second = fleets(counts_file)
    alone = FleetSettings().latency_fit()
    answers(first.fits[Pool.PLAIN], 60, slower=2.0)
    answers(alone, 60, slower=2.0)
    mine = second.fits[Pool.PLAIN]
    assert mine.scales.decode == 1.0  # nothing of its own yet
    mine.follow("profile")  # (as each snapshot makes it: the profile the policy predicts with)
    mine.refresh()
    assert mine.scales.decode == pytest.approx(alone.scales.decode, rel=1e-9)
    assert mine.scales.decode > 1.3  # learned from the other process's answers (the prior holds it back)
    assert second.fits[Pool.SPECULATIVE].scales.decode == 1.0  # the other pool's fit: untouched


def test_a_restarted_process_counts_in_the_share_again(counts_file: Path) -> None:
    first, second = fleets(counts_file)
    scrape(second, 0.0)
    for _ in range(3):
        by_url(first, A).dispatched_one(10, now=0.0, stream=False)  # counted in the share when sent
    scrape(second, 0.0)
    assert second.share.own == 3
    again = Fleet({Pool.PLAIN: [A, B]}, SETTINGS, SharedCounts(counts_file, 2, 0))  # its row starts afresh
    for sent in (2, 2):
        for _ in range(sent):
            by_url(again, A).dispatched_one(10, now=0.0, stream=False)
        scrape(second, 0.0)
    assert second.share.own == 5  # the first two after the restart are missed, none after them


def test_each_process_sees_the_requests_the_others_hold_that_can_still_be_saved(counts_file: Path) -> None:
    first, second = fleets(counts_file)
    alone = Fleet({Pool.PLAIN: [A, B]}, SETTINGS)
    first.hold(3)
    alone.hold(9)  # no one to tell
    assert (first.held_elsewhere(), second.held_elsewhere(), alone.held_elsewhere()) == (0.0, 3.0, 0.0)
    # a policy sees them all in the snapshot: its own process's and the others'; a gateway told
    # nothing of the others' queues, its own as its share of the fleet's (here one of six)
    second.hold(1)
    alone.share.own, alone.share.fleet = 50.0, 300.0
    assert (first.snapshot(0.0).held, second.snapshot(0.0).held, alone.snapshot(0.0).held) == (4.0, 4.0, 54.0)
    first.hold(0)
    assert second.held_elsewhere() == 0.0
    first.hold(2)
    Fleet({Pool.PLAIN: [A, B]}, SETTINGS, SharedCounts(counts_file, 2, 0))  # restarted in its row: it holds none
    assert second.held_elsewhere() == 0.0


def test_the_correction_factors_follow_every_processs_answers_one_after_another(counts_file: Path) -> None:
    """Each process moves the factors as the others last left them: two processes answering in
    turn end where one process with all their answers ends."""
    first, second = (fleet.fits[Pool.PLAIN] for fleet in fleets(counts_file))
    alone = FleetSettings().latency_fit()
    priced = Priced("profile", TTFT, STEP, STEP)
    for i in range(40):  # TTFTs twice what the profile says, not fitted (a queue was ahead of them)
        queued = replace(priced, queued=True)
        (first if i % 2 == 0 else second).observe(100.0, None, queued)
        alone.observe(100.0, None, queued)
    assert alone.scales.ttft_factor > 1.5
    for mine in (first, second):
        mine.refresh()
        assert mine.scales.ttft_factor == pytest.approx(alone.scales.ttft_factor, rel=1e-9)


def test_the_batch_an_answer_decoded_beside_counts_the_other_processes_requests(counts_file: Path) -> None:
    first, second = fleets(counts_file)
    mine, theirs = by_url(first, A), by_url(second, A)
    for _ in range(3):
        theirs.dispatched_one(10, now=0.0)
    stay = mine.dispatched_one(10, now=0.0)
    assert mine.request_seconds(2.0) - stay.request_seconds == pytest.approx(8.0)  # 4 requests for 2 s
    theirs.finished(got_first_byte=True, now=1.0)
    assert mine.request_seconds(2.0) - stay.request_seconds == pytest.approx(7.0)


# --- between gateways (`gateway/exchange.py` carries the summaries through Redis) -----------------

WINDOWS = (SETTINGS.rate_window_s, SETTINGS.burst_window_s)


def gateway(tmp_path: Path, processes: int = 1) -> list[Fleet]:
    """One gateway of `processes` processes, with a row for the other gateways' counts."""
    path = SharedCounts.create(processes, tmp_path, others=True)
    return [
        Fleet({Pool.PLAIN: [A, B]}, SETTINGS, SharedCounts(path, processes, i, others=True)) for i in range(processes)
    ]


def counts(fleet: Fleet) -> SharedCounts:
    assert fleet.shared is not None
    return fleet.shared


def take(fleet: Fleet, summaries: dict[str, bytes], now: float, wall: float, most: int = 7) -> int:
    return counts(fleet).take_all("me", summaries, now, wall, WINDOWS, stale_s=2.0, most=most)


def test_a_gateway_counts_the_other_gateways_requests_as_last_exchanged(tmp_path: Path) -> None:
    """The other gateways' processes' requests, summed, as one gateway sending them all would
    count them, their rates and request-seconds moved to this gateway's clock (another monotonic
    origin) and to the moment each summary was taken. (Rates as each process reads its own,
    summed: each reads from its own first prompt, `rates.py`.)"""
    two = gateway(tmp_path, processes=2)
    (three,) = gateway(tmp_path)
    (mine,) = gateway(tmp_path)
    alone = Fleet({Pool.PLAIN: [A, B]}, SETTINGS)  # one gateway sending all their requests
    sent = [(two[0], 500, 100.0), (two[1], 300, 100.0), (three, 50, 100.0), (two[1], 200, 100.2), (three, 70, 100.3)]
    sent += [(fleet, 40 * i, 100.0 + 0.1 * i) for i in range(1, 8) for fleet in (two[0], two[1], three)]
    for fleet, prompt, at in sent:
        by_url(fleet, A).dispatched_one(prompt, now=at)
        by_url(alone, A).dispatched_one(prompt, now=at)
    for fleet in (two[0], two[1], three):
        for i in range(1, 8):
            by_url(fleet, A).first_byte(40 * i, now=100.9)
            by_url(alone, A).first_byte(40 * i, now=100.9)
    by_url(two[0], A).first_byte(500, now=100.5)
    by_url(alone, A).first_byte(500, now=100.5)
    summaries = {  # taken at 101.0 and 101.1 on their clocks, 1_000_000.0 and .1 on the wall
        "two": counts(two[0]).summary(101.0, WINDOWS, wall=1_000_000.0),
        "three": counts(three).summary(101.1, WINDOWS, wall=1_000_000.1),
    }
    # read 0.2 s after the first was taken, by a gateway whose clock reads 5000 then
    assert take(mine, summaries, 5000.0, wall=1_000_000.2) == 2
    assert counts(mine).gateways_counted() == 2
    seen = state(mine, A, 5001.0)
    assert (seen["in_flight"], seen["prefilling"], seen["prefill_tokens"]) == (26, 4, 620)
    each = [by_url(fleet, A).prompt_rates(101.2 + 1.0) for fleet in (two[0], two[1], three)]
    assert seen["arrivals_per_s"] == pytest.approx(sum(prompts for prompts, _, _ in each), rel=1e-9)
    assert seen["prefill_tokens_per_s"] == pytest.approx(sum(tokens for _, tokens, _ in each), rel=1e-9)
    assert seen["arrivals_per_s"] == pytest.approx(state(alone, A, 101.2 + 1.0)["arrivals_per_s"], rel=0.25)
    stay = by_url(mine, A).dispatched_one(100, now=5000.0)
    assert by_url(mine, A).request_seconds(5002.0) - stay.request_seconds == pytest.approx(54.0)  # 27 for 2 s
    assert state(mine, B, 5001.0)["in_flight"] == 0
    scrape(mine, 5001.0)
    assert mine.share.value == 1.0  # with every gateway counted, the fleet is seen whole: no share to divide by


def test_only_a_gateways_own_processes_go_into_its_summary(tmp_path: Path) -> None:
    """What a gateway took from others is not passed on: counted once, by the gateway that sent it."""
    (first,) = gateway(tmp_path)
    (second,) = gateway(tmp_path)
    (third,) = gateway(tmp_path)
    by_url(first, A).dispatched_one(100, now=0.0)
    by_url(second, A).dispatched_one(100, now=0.0)
    board = {"1": counts(first).summary(0.0, WINDOWS, 0.0)}
    counts(second).take_all("2", board, 0.0, 0.0, WINDOWS, 2.0, 7)
    board["2"] = counts(second).summary(0.0, WINDOWS, 0.0)  # after taking the first's
    assert counts(third).take_all("3", board, 0.0, 0.0, WINDOWS, 2.0, 7) == 2
    assert state(third, A, 0.0)["in_flight"] == 2


def test_a_gateway_sees_the_requests_the_other_gateways_hold_that_can_still_be_saved(tmp_path: Path) -> None:
    two = gateway(tmp_path, processes=2)
    (three,) = gateway(tmp_path)
    (mine,) = gateway(tmp_path)
    two[0].hold(1)
    two[1].hold(2)
    three.hold(4)
    mine.hold(8)  # its own: not among the others'
    assert two[0].held_elsewhere() == 2.0  # its sibling's, not yet the other gateways'
    board = {name: counts(fleet).summary(0.0, WINDOWS, 0.0) for name, fleet in (("two", two[0]), ("three", three))}
    board["me"] = counts(mine).summary(0.0, WINDOWS, 0.0)
    take(mine, board, 0.0, 0.0)
    assert mine.held_elsewhere() == 7.0
    take(mine, {"three": board["three"]}, 0.0, 0.0)  # the first gateway gone
    assert mine.held_elsewhere() == 4.0
    counts(mine).forget()  # Redis away: nothing known of the others
    assert mine.held_elsewhere() == 0.0


def test_stale_malformed_and_surplus_summaries_are_not_counted(tmp_path: Path) -> None:
    (theirs,) = gateway(tmp_path)
    (mine,) = gateway(tmp_path)
    by_url(theirs, A).dispatched_one(100, now=0.0)
    good = counts(theirs).summary(0.0, WINDOWS, wall=50.0)
    assert take(mine, {"old": good}, 0.0, wall=53.0) == 0  # its gateway stopped writing 3 s ago
    assert take(mine, {"ahead": good}, 0.0, wall=47.0) == 0  # a clock 3 s ahead: not to be trusted
    nan = bytearray(good)
    nan[-8:] = struct.pack("d", math.nan)
    negative, last_slot = bytearray(good), len(good) - 8 * FIELDS
    negative[last_slot + 8 : last_slot + 16] = struct.pack("d", -4.0)  # in flight: -4
    factor_at = 4 + FIT_FIELDS - 3  # the first fit's TTFT factor (`workers/shared.py`'s layout)
    priced = Priced("profile", TTFT, STEP, STEP, queued=True)
    for fit in theirs.fits.values():
        fit.observe(100.0, None, priced)
    zero_factor = bytearray(counts(theirs).summary(0.0, WINDOWS, wall=50.0))
    zero_factor[8 * factor_at : 8 * factor_at + 8] = struct.pack("d", 0.0)
    rng = random.Random(7)
    for bad in (b"", good[:-8], good + b"\0" * 8, bytes(nan), bytes(negative), bytes(zero_factor), b"\xff" * len(good),
                bytes(rng.getrandbits(8) for _ in range(len(good)))):  # fmt: skip
        assert take(mine, {"bad": bad}, 0.0, wall=50.0) == 0, bad[:16]
    assert state(mine, A, 0.0)["in_flight"] == 0
    assert take(mine, {"one": good, "two": good, "three": good}, 0.0, wall=50.0, most=2) == 2  # at most 2
    assert state(mine, A, 0.0)["in_flight"] == 2
    assert take(mine, {"me": good}, 0.0, wall=50.0) == 0  # its own: not counted twice
    assert state(mine, A, 0.0)["in_flight"] == 0
    assert take(mine, {"one": good}, 0.0, wall=50.0) == 1
    counts(mine).forget()  # Redis away: the others' counts go stale
    assert (state(mine, A, 0.0)["in_flight"], counts(mine).gateways_counted()) == (0, 0)
    # When a summary was taken, for whoever deletes old ones: from its header, the rest unread.
    assert taken_at(good) == taken_at(bytes(negative)) == 50.0
    for bad in (b"", good[:16], good[:-4], b"\xff" * len(good), struct.pack("qdq", 1, 50.0, 0)):
        assert taken_at(bad) is None, bad[:16]


def test_a_replica_the_other_gateways_no_longer_count_is_dropped_from_their_row(tmp_path: Path) -> None:
    (theirs,) = gateway(tmp_path)
    (mine,) = gateway(tmp_path)
    by_url(theirs, A).dispatched_one(100, now=0.0)
    take(mine, {"theirs": counts(theirs).summary(0.0, WINDOWS, 0.0)}, 0.0, 0.0)
    row = counts(mine).processes
    assert counts(mine).find(row, key_of(B)) is not None
    generation = counts(mine).generation(row)
    theirs.reconcile({Pool.PLAIN: [A]})  # B left their fleet
    take(mine, {"theirs": counts(theirs).summary(0.1, WINDOWS, 0.1)}, 0.1, 0.1)
    assert counts(mine).find(row, key_of(B)) is None
    assert counts(mine).generation(row) > generation  # readers search the row again
    assert state(mine, A, 0.1)["in_flight"] == 1


def test_gateways_fit_from_each_others_answers_and_move_one_set_of_factors(tmp_path: Path) -> None:
    (theirs,) = gateway(tmp_path)
    (mine,) = gateway(tmp_path)
    alone = FleetSettings().latency_fit()
    answers(theirs.fits[Pool.PLAIN], 60, slower=2.0)
    answers(alone, 60, slower=2.0)
    priced = Priced("profile", TTFT, STEP, STEP)
    for _ in range(20):
        theirs.fits[Pool.PLAIN].observe(100.0, None, replace(priced, queued=True))
        alone.observe(100.0, None, replace(priced, queued=True))
    take(mine, {"theirs": counts(theirs).summary(0.0, WINDOWS, 0.0)}, 0.0, 0.0)
    fit = mine.fits[Pool.PLAIN]
    fit.follow("profile")
    fit.refresh()
    assert fit.scales.decode == pytest.approx(alone.scales.decode, rel=1e-9)
    assert fit.scales.ttft_factor == pytest.approx(alone.scales.ttft_factor, rel=1e-9)
    assert fit.scales.ttft_factor > 1.2  # moved by the other gateway's answers alone


def test_the_other_gateways_fits_are_summed_against_the_profile_most_of_their_answers_were(tmp_path: Path) -> None:
    """Mid-rollout of a policy document that changes the profile, gateways fit against different
    ones; fits against different profiles do not add, and the one most answers were fitted against
    is kept, whichever gateway's name sorts first (as between one gateway's processes)."""
    (rolled,) = gateway(tmp_path)
    (b,) = gateway(tmp_path)
    (c,) = gateway(tmp_path)
    (mine,) = gateway(tmp_path)
    alone = FleetSettings().latency_fit()
    answers(rolled.fits[Pool.PLAIN], 30, slower=0.5, profile="new-profile")
    for fleet in (b, c):
        answers(fleet.fits[Pool.PLAIN], 60, slower=2.0)
    answers(alone, 120, slower=2.0)
    summaries = {name: counts(f).summary(0.0, WINDOWS, 0.0) for name, f in (("a", rolled), ("b", b), ("c", c))}
    assert take(mine, summaries, 0.0, 0.0) == 3
    fit = mine.fits[Pool.PLAIN]
    fit.follow("profile")
    fit.refresh()
    # (two fits of 60 answers each forget their oldest as one of 120 does not: near, not equal)
    assert fit.scales.decode == pytest.approx(alone.scales.decode, rel=0.02)
    assert fit.scales.decode > 1.3


def test_a_burst_over_two_processes_is_expected_to_fall_back_to_both_processes_rate_before_it(
    counts_file: Path,
) -> None:
    """A minute at 2 prompts a second, then a storm of 20 a second, the kernel handing the
    requests to the two processes in turn: each process sees the storm, how long it has lasted
    and the rate before it as one process sending them all would."""
    both = fleets(counts_file, processes=3)[:2]
    alone = Fleet({Pool.PLAIN: [A, B]}, SETTINGS)
    arrivals = [i * 0.5 for i in range(120)] + [60.0 + i * 0.05 for i in range(80)]
    for i, at in enumerate(arrivals):
        by_url(both[i % 2], A).dispatched_one(1000, now=at)
        by_url(alone, A).dispatched_one(1000, now=at)
    truth = next(r for r in alone.snapshot(64.0).replicas if r.url == A).burst
    assert truth is not None
    assert truth.arrivals_before_per_s == pytest.approx(2.0, rel=0.1)
    for fleet in both:
        burst = next(r for r in fleet.snapshot(64.0).replicas if r.url == A).burst
        assert burst is not None
        assert burst.lasted_s == pytest.approx(truth.lasted_s, abs=0.1)
        assert burst.arrivals_per_s == pytest.approx(truth.arrivals_per_s, rel=1e-6)
        assert burst.arrivals_before_per_s == pytest.approx(truth.arrivals_before_per_s, rel=0.05)
