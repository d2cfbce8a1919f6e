"""Replica accounting and health: admission on scrape, ejection, re-admission."""

import math
import random
from collections.abc import Iterator

import pytest

from specgate.calibration.modes import Pool
from specgate.workers.acceptance import SpecCounters
from specgate.workers.health import State
from specgate.workers.latency_fit import Priced
from specgate.workers.pools import Fleet, FleetSettings, Replica, Share
from specgate.workers.scrape import VllmLoad

SETTINGS = FleetSettings(stale_after_s=2.0, eject_after=3)
TTFT = (20.0, 0.0, 30.0, 1.0, 0.0)
"""A TTFT as the profile prices it: a step, a prompt's prefill and the overhead."""
STEP = (10.0, 2.0, 0.0, 0.0, 0.0)


def load(running: float = 1.0, spec: SpecCounters | None = None) -> VllmLoad:
    return VllmLoad(running, 2.0, 0.1, 0.0, 0.0, 0.0, spec)


def test_replica_starts_down_and_comes_up_on_a_good_scrape() -> None:
    r = Replica("plain-0", "http://x/", Pool.PLAIN, SETTINGS)
    assert not r.healthy
    assert r.url == "http://x"
    r.scraped(load(), now=10.0, dispatched_at_send=0)
    assert r.healthy


def test_connect_failure_ejects_at_once_other_failures_after_three() -> None:
    r = Replica("plain-0", "http://x", Pool.PLAIN, SETTINGS)
    r.scraped(load(), 0.0, 0)
    r.failed("5xx", now=0.0)
    r.failed("5xx", now=0.0)
    assert r.healthy
    r.succeeded(now=0.0)
    r.failed("5xx", now=0.0)
    r.failed("5xx", now=0.0)
    assert r.healthy  # the success in between reset the count
    r.failed("5xx", now=0.0)
    assert not r.healthy
    r2 = Replica("plain-1", "http://y", Pool.PLAIN, SETTINGS)
    r2.scraped(load(), 0.0, 0)
    r2.failed("refused", eject=True, now=0.0)
    assert not r2.healthy


def test_an_ejection_holds_whatever_the_scrapes_say_then_the_replica_is_probed() -> None:
    r = Replica("plain-0", "http://x", Pool.PLAIN, FleetSettings(base_ejection_s=2.0, max_ejection_s=5.0))
    r.scraped(load(), 0.0, 0)
    r.failed("refused", eject=True, now=10.0)
    r.scraped(load(), 11.0, 0)
    assert not r.healthy  # a good scrape does not cut the ejection short (a hung replica's metrics answer)
    r.scraped(load(), 12.0, 0)
    assert r.healthy
    assert r.health.state is State.PROBING
    assert r.available()
    r.dispatched_one()
    assert not r.available()  # one probe at a time
    r.finished(got_first_byte=True)
    r.failed("5xx", now=12.5)  # the probe failed: out again, twice as long
    assert r.health.ejected_until == pytest.approx(12.5 + 4.0)
    r.scraped(load(), 16.5, 0)
    r.succeeded(now=16.6)
    assert r.health.state is State.UP
    r.failed("refused", eject=True, now=17.0)
    assert r.health.ejected_until == pytest.approx(17.0 + 5.0)  # capped
    r.scraped(load(), 22.0, 0)
    r.succeeded(now=22.0)
    r.scraped(load(), 30.0, 0)  # a clean stretch as long as the longest ejection
    assert r.health.ejections == 0


def test_scrapes_that_fail_eject_and_requests_waiting_there_are_told() -> None:
    r = Replica("plain-0", "http://x", Pool.PLAIN, SETTINGS)
    r.scraped(load(), 0.0, 0)
    told: list[str] = []
    r.waiting.add(lambda: told.append("go elsewhere"))
    r.scrape_failed("timeout", now=1.0)
    r.scrape_failed("timeout", now=1.2)
    assert r.healthy
    assert not told
    r.scrape_failed("timeout", now=1.4)
    assert not r.healthy
    assert told == ["go elsewhere"]


def test_a_replica_that_holds_requests_but_makes_no_progress_is_ejected() -> None:
    r = Replica("plain-0", "http://x", Pool.PLAIN, FleetSettings(hang_after_s=5.0))
    stuck = VllmLoad(1.0, 0.0, 0.1, 0.0, 100.0, 50.0, None)
    r.scraped(stuck, 0.0, 0)
    r.scraped(stuck, 30.0, 0)  # idle, nothing in flight: standing still is fine
    assert r.healthy
    r.dispatched_one()
    r.scraped(stuck, 31.0, 0)
    r.scraped(stuck, 34.0, 0)
    assert r.healthy
    moved = VllmLoad(1.0, 0.0, 0.1, 0.0, 100.0, 51.0, None)  # a token: progress
    r.scraped(moved, 34.5, 0)
    r.scraped(moved, 39.0, 0)
    assert r.healthy
    r.scraped(moved, 39.6, 0)
    assert not r.healthy
    assert r.health.last_reason == "no progress"


def test_accounting_and_state() -> None:
    r = Replica("spec-0", "http://x", Pool.SPECULATIVE, SETTINGS)
    r.scraped(load(running=3.0), now=100.0, dispatched_at_send=0)
    r.dispatched_one()
    r.dispatched_one()
    r.first_byte()
    s = r.state(now=101.0)
    assert (s.in_flight, s.prefilling, s.dispatched_since_scrape) == (2, 1, 2)
    assert (s.running, s.waiting) == (3.0, 2.0)
    assert s.load == 3.0 + 2.0 + 2
    r.finished(got_first_byte=True)
    r.finished(got_first_byte=False)
    s = r.state(now=101.0)
    assert (s.in_flight, s.prefilling) == (0, 0)
    # a scrape sent after both dispatches accounts for them
    r.scraped(load(running=0.0), now=102.0, dispatched_at_send=2)
    assert r.state(102.0).dispatched_since_scrape == 0


def test_stale_scrapes_are_ignored() -> None:
    r = Replica("plain-0", "http://x", Pool.PLAIN, SETTINGS)
    r.scraped(load(running=50.0), now=0.0, dispatched_at_send=0)
    r.dispatched_one()
    assert r.state(now=1.0).running == 50.0
    stale = r.state(now=5.0)
    assert stale.running is None
    assert stale.load == 1.0  # only the gateway's own count remains


def test_tokens_per_step_from_counter_deltas() -> None:
    r = Replica("spec-0", "http://x", Pool.SPECULATIVE, SETTINGS)
    r.scraped(load(spec=SpecCounters(100, 500, 200, ())), 0.0, 0)
    assert r.tokens_per_step is None  # one reading is no interval
    r.scraped(load(spec=SpecCounters(200, 1000, 350, ())), 1.0, 0)
    assert r.tokens_per_step == 1 + 150 / 100


def test_steps_without_drafts_count_in_the_tokens_per_step() -> None:
    """An n-gram proposer drafts only in the steps where it finds a match: the generated tokens
    less the accepted ones count every step, the drafts only those that drafted."""
    r = Replica("spec-0", "http://x", Pool.SPECULATIVE, SETTINGS)

    def at(drafts: int, accepted: int, generated: float, first_tokens: float = 0.0) -> VllmLoad:
        spec = SpecCounters(drafts, 5 * drafts, accepted, ())
        return VllmLoad(1.0, 0.0, 0.1, 0.0, 0.0, generated, spec, first_tokens)

    r.scraped(at(0, 0, 0.0), 0.0, 0)
    # 200 decode steps, 100 of them drafting and accepting 3 tokens each: 100 x 4 + 100 x 1 = 500
    # tokens, and 10 requests' first tokens from their prompts' steps.
    r.scraped(at(100, 300, 510.0, 10.0), 1.0, 0)
    assert r.tokens_per_step == pytest.approx(500 / 200)  # not 1 + 300 / 100 = 4
    # A counter that does not add up (fewer tokens than the drafting steps emitted): the 100
    # drafts count as the interval's steps (beside the 200 before, kept at 1 - 100 / 2000).
    r.scraped(at(200, 600, 510.0, 10.0), 2.0, 0)
    assert r.tokens_per_step == pytest.approx(1 + (300 * 0.95 + 300) / (200 * 0.95 + 100))


def test_acceptance_is_a_window_over_recent_drafts_pooled_per_pool() -> None:
    settings = FleetSettings(acceptance_window_steps=1000)
    fleet = Fleet({Pool.SPECULATIVE: ["http://a", "http://b"], Pool.PLAIN: ["http://c"]}, settings)
    a, b = fleet.replicas["spec-0"], fleet.replicas["spec-1"]
    a.scraped(load(spec=SpecCounters(0, 0, 0, ())), 0.0, 0)
    a.scraped(load(spec=SpecCounters(1000, 5000, 3000, ())), 1.0, 0)  # 3 accepted per draft
    # A short interval of poor acceptance moves the estimate by its share of the window, no more.
    a.scraped(load(spec=SpecCounters(1100, 5500, 3000, ())), 2.0, 0)
    assert a.tokens_per_step == pytest.approx(1 + 3000 * 0.9 / 1000)
    b.scraped(load(spec=SpecCounters(0, 0, 0, ())), 0.0, 0)
    b.scraped(load(spec=SpecCounters(1000, 5000, 1000, ())), 1.0, 0)  # 1 accepted per draft
    pooled = {r.name: r.tokens_per_step for r in fleet.snapshot(2.0).replicas}
    assert pooled["spec-0"] == pooled["spec-1"] == pytest.approx(1 + (2700 + 1000) / 2000)
    assert pooled["plain-0"] is None


def test_fleet_names_replicas_by_pool() -> None:
    fleet = Fleet({Pool.SPECULATIVE: ["http://a", "http://b"], Pool.PLAIN: ["http://c"]}, SETTINGS)
    assert list(fleet.replicas) == ["spec-0", "spec-1", "plain-0"]
    assert not fleet.any_serving()
    snapshot = fleet.snapshot(0.0)
    assert [r.pool for r in snapshot.replicas] == [Pool.SPECULATIVE, Pool.SPECULATIVE, Pool.PLAIN]


def test_a_fleet_drained_whole_does_not_serve_however_healthy_its_servers() -> None:
    fleet = Fleet({Pool.SPECULATIVE: ["http://a"], Pool.PLAIN: ["http://c"]}, SETTINGS)
    for replica in fleet.replicas.values():
        fleet.scraped(replica, load(), 10.0, 0)
    assert fleet.any_serving()
    fleet.arrange({}, {"http://a"})
    assert fleet.any_serving()  # the plain one still takes requests
    fleet.arrange({}, {"http://a", "http://c"})
    assert all(r.healthy for r in fleet.replicas.values())
    assert not fleet.any_serving()
    fleet.arrange({}, set())
    assert not fleet.any_serving()  # back from a drain, each is admitted at its next good scrape
    fleet.scraped(fleet.replicas["plain-0"], load(), 11.0, 0)
    assert fleet.any_serving()


def test_a_replica_failing_a_share_of_its_requests_is_ejected_though_never_three_in_a_row() -> None:
    r = Replica("plain-0", "http://x", Pool.PLAIN, SETTINGS)
    r.scraped(load(), 0.0, 0)
    for _ in range(4):  # one request in two fails: never three in a row
        r.succeeded(now=0.0)
        r.failed("5xx", now=0.0)
    assert r.healthy  # eight requests: too few to judge
    r.succeeded(now=0.0)
    r.failed("malformed body", now=0.0)
    assert not r.healthy  # five of its last ten failed
    assert r.health.last_reason == "5 of its last 10 requests failed (malformed body)"
    steady = Replica("plain-1", "http://y", Pool.PLAIN, SETTINGS)
    steady.scraped(load(), 0.0, 0)
    for _ in range(40):  # one in four: an unlucky replica, not a sick one
        for _ in range(3):
            steady.succeeded(now=0.0)
        steady.failed("5xx", now=0.0)
    assert steady.healthy


def test_a_burst_of_prompts_shows_in_the_rate_at_once_for_as_long_as_it_lasts() -> None:
    settings = FleetSettings(rate_window_s=10.0, burst_window_s=2.0)
    steady = Replica("plain-0", "http://x", Pool.PLAIN, settings)
    for i in range(600):  # 2 prompts of 1,000 tokens a second for five minutes
        steady.dispatched_one(1000, now=i * 0.5)
    for horizon_s in (0.1, 60.0):  # a steady stream is its rate, whatever the life to come
        prompts, tokens = steady.state(300.0).prompt_rates(horizon_s)
        assert prompts == pytest.approx(2.0, rel=0.1)
        assert tokens == pytest.approx(2000.0, rel=0.1)
    burst = Replica("plain-1", "http://y", Pool.PLAIN, settings)
    slow = Replica("plain-2", "http://z", Pool.PLAIN, FleetSettings(rate_window_s=10.0, burst_window_s=10.0))
    for replica in (burst, slow):  # one prompt, a minute's quiet, then 20 prompts in one second
        replica.dispatched_one(1000, now=40.0)
        for i in range(20):
            replica.dispatched_one(1000, now=100.0 + i * 0.05)
    assert slow.state(101.0).prompt_rates(0.5)[0] < 2.0  # the ten-second window alone would lag far behind
    state = burst.state(101.0)
    assert state.burst is not None
    prompts, tokens = state.prompt_rates(0.5)  # a short life: the burst's rate all through it
    assert prompts > 7.0
    assert tokens == pytest.approx(prompts * 1000)
    # a minute's life: a burst seen for a second or two stalls only its start, and then the rate
    # from before it (nothing), not the ten-second window's, which the burst itself has raised
    assert state.burst.lasted_s == settings.burst_window_s  # seen for a second: taken to last a window
    assert state.burst.arrivals_before_per_s < 0.2 < 1.0 < state.arrivals_per_s
    long_life, _ = state.prompt_rates(60.0)
    assert long_life == pytest.approx(prompts * settings.burst_window_s / 60.0, rel=0.1)
    quiet, _ = burst.state(131.0).prompt_rates(0.5)  # half a minute later, the burst has all but faded
    assert quiet < 0.2


def test_a_burst_that_goes_on_is_expected_to_go_on_about_as_long_again() -> None:
    settings = FleetSettings(rate_window_s=10.0, burst_window_s=2.0)
    storm = Replica("plain-0", "http://x", Pool.PLAIN, settings)
    storm.dispatched_one(1000, now=0.0)
    for i in range(400):  # after a quiet minute, 20 prompts a second for twenty seconds
        storm.dispatched_one(1000, now=60.0 + i * 0.05)
    state = storm.state(80.0)
    assert state.burst is not None
    assert state.burst.lasted_s == pytest.approx(20.0, abs=0.1)
    # half of a forty-second life at the storm's rate, then at the quiet minute's (not at the
    # ten-second window's, most of which is the storm's)
    assert state.burst.arrivals_before_per_s < 0.5 < 15.0 < state.arrivals_per_s
    rate, _ = state.prompt_rates(40.0)
    assert rate == pytest.approx((state.burst.arrivals_before_per_s + state.burst.arrivals_per_s) / 2)
    for i in range(20):  # it ends; a new one starts a minute later and is a new burst
        storm.dispatched_one(1000, now=140.0 + i * 0.05)
    later = storm.state(141.0).burst
    assert later is not None
    assert later.lasted_s == settings.burst_window_s


def _random_prompts(replica: Replica, rnd: random.Random, rate: float, since: float, until: float) -> Iterator[float]:
    """Prompts sent to `replica` at random at `rate` a second, long-tailed (the windows cross at
    every arrival); yields each arrival's time before its prompt is sent."""
    now = since
    while (now := now + rnd.expovariate(rate)) < until:
        yield now
        replica.dispatched_one(int(rnd.lognormvariate(7.0, 1.0)), now=now)


@pytest.mark.parametrize("rate", [0.5, 2.0, 8.0])
def test_prompts_at_random_at_a_steady_rate_are_seldom_a_burst(rate: float) -> None:
    rnd = random.Random(1)
    replica = Replica("plain-0", "http://x", Pool.PLAIN, FleetSettings(rate_window_s=10.0, burst_window_s=2.0))
    bursts = [replica.state(now).burst is not None for now in _random_prompts(replica, rnd, rate, 0.0, 600.0)]
    assert sum(bursts[int(60 * rate) :]) / len(bursts[int(60 * rate) :]) < 0.08  # (shorter window above: 33-45%)


@pytest.mark.parametrize("rate", [2.0, 8.0])
def test_a_storm_is_a_burst_within_seconds_priced_from_the_rate_before_it(rate: float) -> None:
    rnd = random.Random(1)
    replica = Replica("plain-0", "http://x", Pool.PLAIN, FleetSettings(rate_window_s=10.0, burst_window_s=2.0))
    for _ in _random_prompts(replica, rnd, rate, 0.0, 300.0):
        pass
    storm = [(now, replica.state(now).burst) for now in _random_prompts(replica, rnd, 5 * rate, 300.0, 310.0)]
    began = next(at for at, burst in storm if burst is not None)
    assert began - 300.0 < 2.0
    bursts = [burst for _, burst in storm if burst is not None]
    assert len(bursts) / len(storm) > 0.8  # and on through it (the windows have noise of their own)
    assert max(burst.lasted_s for burst in bursts) > 5.0
    assert all(burst.arrivals_before_per_s == pytest.approx(rate, rel=0.5) for burst in bursts)
    assert bursts[-1].arrivals_per_s == pytest.approx(5 * rate, rel=0.4)


def test_the_document_moves_a_replica_to_the_other_pool_and_drains_one() -> None:
    fleet = Fleet({Pool.SPECULATIVE: ["http://a"], Pool.PLAIN: ["http://b", "http://c"]}, SETTINGS)
    a, b, c = fleet.replicas["spec-0"], fleet.replicas["plain-0"], fleet.replicas["plain-1"]
    b.scraped(load(), 0.0, 0)
    for _ in range(3):
        b.failed("5xx", now=0.0)  # a record of failures, then a restart with speculation
    assert b.health.state is State.EJECTED
    fleet.arrange({"http://b": Pool.SPECULATIVE}, drained={"http://c"})
    assert (b.pool, b.fit) == (Pool.SPECULATIVE, fleet.fits[Pool.SPECULATIVE])
    fresh = b.health
    assert fresh.state is State.UNKNOWN  # the restarted server's record starts afresh
    for r in (a, b, c):
        r.scraped(load(spec=SpecCounters(0, 0, 0, ())), 1.0, 0)
    b.scraped(load(spec=SpecCounters(100, 300, 200, ())), 2.0, 0)
    a.scraped(load(spec=SpecCounters(100, 300, 200, ())), 2.0, 0)
    snapshot = {r.name: r for r in fleet.snapshot(2.0).replicas}
    assert snapshot["plain-0"].pool is Pool.SPECULATIVE
    assert snapshot["plain-0"].tokens_per_step == snapshot["spec-0"].tokens_per_step == pytest.approx(3.0)
    assert snapshot["plain-0"].healthy
    assert not snapshot["plain-1"].healthy
    assert c.in_flight == 0
    for _ in range(5):
        c.scrape_failed("refused", now=3.0)  # down for its restart: not held against it
    assert c.health.state is State.UP
    fleet.arrange({}, drained=())  # back as configured
    assert b.pool is Pool.PLAIN
    assert b.tokens_per_step is None
    assert not c.drained
    assert not c.healthy
    c.scraped(load(), 4.0, 0)
    assert c.healthy
    fleet.arrange({"http://elsewhere": Pool.PLAIN}, drained={"http://elsewhere"})  # another gateway's replica
    assert [r.pool for r in fleet.replicas.values()] == [Pool.SPECULATIVE, Pool.PLAIN, Pool.PLAIN]


def test_a_gateway_alone_has_the_whole_share_and_one_of_three_a_third() -> None:
    alone, one_of_three = Share(window_s=30.0), Share(window_s=30.0)
    assert alone.value == 1.0  # no evidence yet
    for i in range(300):
        now = i * 0.1
        alone.sent(now)
        alone.processed(1.0, now)
        if i % 3 == 0:
            one_of_three.sent(now)
        one_of_three.processed(1.0, now)
    assert alone.value == 1.0
    assert one_of_three.value == 1 / 3
    # the others leave: within a few time constants it has the whole fleet again
    for i in range(300, 1200):
        one_of_three.sent(i * 0.1)
        one_of_three.processed(1.0, i * 0.1)
    assert one_of_three.value == 1.0


def test_a_gateway_counts_its_requests_as_its_share_of_the_fleets() -> None:
    fleet = Fleet({Pool.SPECULATIVE: ["http://s0:80"], Pool.PLAIN: []}, FleetSettings())
    replica = fleet.replicas["spec-0"]
    for i in range(40):  # a third of the first tokens the replica's counters show are this gateway's
        fleet.share.processed(3.0, i * 0.1)
        fleet.share.sent(i * 0.1)
    for _ in range(2):
        replica.dispatched_one(100, now=4.0)
    share = fleet.share.value
    assert share == 1 / 3
    state = replica.state(4.0)
    assert (state.in_flight, state.prefilling, state.prefill_tokens) == (6, 6, round(200 / share))
    alone = Fleet({Pool.SPECULATIVE: ["http://s0:80"], Pool.PLAIN: []}, FleetSettings(count_share=False))
    alone.share.processed(300.0, 1.0)
    alone.replicas["spec-0"].dispatched_one(100, now=5.0)
    assert alone.replicas["spec-0"].state(5.0).in_flight == 1


def test_the_share_follows_the_replicas_first_token_counters() -> None:
    fleet = Fleet({Pool.SPECULATIVE: [], Pool.PLAIN: ["http://p0:80"]}, FleetSettings())
    replica = fleet.replicas["plain-0"]
    for i in range(1, 31):
        replica.scraped(VllmLoad(0.0, 0.0, 0.1, None, None, None, None, first_tokens=4.0 * i), float(i), 0)
        replica.dispatched_one(10, now=float(i))
        replica.first_byte(10, now=float(i))  # one of the four is this gateway's
    assert fleet.share.value == 0.25
    restarted = VllmLoad(0.0, 0.0, 0.1, None, None, None, None, first_tokens=0.0)  # its counters from 0
    replica.scraped(restarted, 31.0, 0)
    assert fleet.share.value == 0.25


def test_a_stream_counts_at_its_first_byte_and_a_whole_answer_when_sent() -> None:
    fleet = Fleet({Pool.SPECULATIVE: [], Pool.PLAIN: ["http://p0:80"]}, FleetSettings())
    replica = fleet.replicas["plain-0"]
    replica.dispatched_one(10, now=1.0)
    assert fleet.share.own == 0.0  # a stream: when its first token is (as vLLM counts it)
    replica.first_byte(10, now=1.5)
    assert fleet.share.own == pytest.approx(1.0)
    replica.dispatched_one(10, now=2.0, stream=False)  # its first token shows only at its end
    assert fleet.share.own == pytest.approx(1.0 + math.exp(-0.5 / 30.0))
    replica.first_byte(10, now=9.0, stream=False)
    assert fleet.share.own == pytest.approx(1.0 + math.exp(-0.5 / 30.0))


def test_counters_a_little_ahead_of_a_lone_gateway_leave_it_alone() -> None:
    share = Share(window_s=30.0)
    for i in range(200):  # the replicas' counters run a step ahead: 7% more than it has seen
        share.sent(i * 0.1)
        share.processed(1.07, i * 0.1)
    assert share.value == 1.0


def test_a_step_gap_timed_while_prompts_joined_the_replica_is_not_fitted_as_a_decode_step() -> None:
    """The median gap between a stream's events is one decode step only while few of those steps
    carry the prefill of prompts that joined the replica meanwhile."""
    priced = Priced("profile", TTFT, STEP, STEP, in_flight=0)
    for joined, fitted in ((0, 1), (3, 1), (30, 0)):
        r = Replica("plain-0", "http://x", Pool.PLAIN, SETTINGS)
        r.scraped(load(), 0.0, 0)
        stay = r.dispatched_one(100, now=1.0)
        r.first_byte(100, now=1.05)
        for _ in range(joined):  # others' prompts sent to it while it decoded its 50 steps
            r.dispatched_one(2000, now=1.2)
            r.finished(got_first_byte=False, prompt_tokens=2000, now=1.3)
        r.finished(got_first_byte=True, now=1.55)
        r.observe(None, 0.010, priced, stay, now=1.55, step_s=0.010)
        assert r.fit.fitted == fitted, joined


def test_a_replica_holds_newcomers_back_only_once_its_queue_outlasts_a_scrape() -> None:
    r = Replica("plain-0", "http://x", Pool.PLAIN, SETTINGS)
    r.scraped(load(), now=10.0, dispatched_at_send=0)  # two waiting: queued for the next steps
    assert not r.state(now=10.1).holding
    r.scraped(load(), now=10.5, dispatched_at_send=0)  # still waiting a scrape later: held back
    assert r.state(now=10.6).holding
    assert not r.state(now=13.0).holding  # a stale scrape tells nothing
    r.scraped(VllmLoad(1.0, 0.0, 0.1, 0.0, 0.0, 0.0, None), now=11.0, dispatched_at_send=0)
    assert not r.state(now=11.1).holding
