"""Replica accounting and health: admission on scrape, ejection, re-admission."""

import pytest

from specgate.calibration.modes import Pool
from specgate.workers.acceptance import SpecCounters
from specgate.workers.pools import Fleet, FleetSettings, Replica
from specgate.workers.scrape import VllmLoad

SETTINGS = FleetSettings(stale_after_s=2.0, eject_after=3)


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
    r.failed("5xx")
    r.failed("5xx")
    assert r.healthy
    r.succeeded()
    r.failed("5xx")
    r.failed("5xx")
    assert r.healthy  # the success in between reset the count
    r.failed("5xx")
    assert not r.healthy
    r.scraped(load(), 1.0, 0)
    assert r.healthy  # re-admitted
    r.failed("refused", eject=True)
    assert not r.healthy


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


def test_acceptance_is_a_window_over_recent_drafts_pooled_per_pool() -> None:
    settings = FleetSettings(acceptance_window_drafts=1000)
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
    assert not fleet.any_healthy()
    snapshot = fleet.snapshot(0.0)
    assert [r.pool for r in snapshot.replicas] == [Pool.SPECULATIVE, Pool.SPECULATIVE, Pool.PLAIN]
