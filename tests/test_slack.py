"""The TPOT slack ledger: what each request on a replica can still take, spent by every prompt
placed after it, and the SLOs a placement would break."""

from hypothesis import given
from hypothesis import strategies as st

from specgate.calibration.modes import Pool
from specgate.workers.pools import FleetSettings, Replica
from specgate.workers.slack import SlackLedger, missed_by


def test_a_delay_spends_the_slack_of_every_request_there_and_only_theirs() -> None:
    ledger = SlackLedger()
    ledger.enter("a", 300.0)
    ledger.enter("b", 1000.0)
    ledger.delay(200.0)
    ledger.enter("c", 150.0)  # came after that delay: its slack is whole
    marks, spent = ledger.marks(), ledger.spent_ms
    assert missed_by(marks, spent, 50.0) == 0
    assert missed_by(marks, spent, 120.0) == 1  # a: 100 left
    assert missed_by(marks, spent, 160.0) == 2  # and c: 150 left
    assert missed_by(marks, spent, 900.0) == 3
    ledger.delay(500.0)  # a is late now: it cannot be broken again
    assert missed_by(ledger.marks(), ledger.spent_ms, 10_000.0) == 1  # b only (c 150 - 500 < 0 too)


def test_leaving_removes_the_request_and_an_empty_ledger_starts_over() -> None:
    ledger = SlackLedger()
    ledger.enter("a", 100.0)
    ledger.enter("b", 100.0)  # the same mark twice
    ledger.delay(40.0)
    ledger.leave("a")
    ledger.leave("a")  # twice: no harm
    assert len(ledger) == 1
    assert missed_by(ledger.marks(), ledger.spent_ms, 70.0) == 1
    ledger.leave("b")
    assert (len(ledger), ledger.spent_ms) == (0, 0.0)
    ledger.delay(1e9)  # nobody there to delay
    assert ledger.spent_ms == 0.0


@given(st.lists(st.tuples(st.sampled_from(["enter", "delay", "leave"]), st.integers(0, 5), st.integers(0, 10_000))))
def test_the_ledger_counts_as_a_pass_over_every_request_would(ops: list[tuple[str, int, int]]) -> None:
    ledger, left = SlackLedger(), {}  # whole milliseconds: the sums are exact
    for op, key, ms in ops:
        if op == "enter":
            ledger.enter(key, ms)
            left[key] = ms
        elif op == "delay":
            ledger.delay(ms)
            left = {k: v - ms for k, v in left.items()}
        else:
            ledger.leave(key)
            left.pop(key, None)
        for probe in (1, 500, 5000):
            expected = sum(1 for v in left.values() if 0 <= v < probe)
            assert missed_by(ledger.marks(), ledger.spent_ms, probe) == expected


def test_a_replica_keeps_the_ledger_of_what_the_gateway_sent_it() -> None:
    r = Replica("plain-0", "http://x", Pool.PLAIN, FleetSettings())
    r.dispatched_one(100, 0.0, key="short", slack_ms=400.0)
    r.dispatched_one(8000, 0.1, key="long", slack_ms=None, delays_ms=300.0)  # no TPOT target: not tracked
    assert r.state(0.2).missed_by(50.0) == 0
    assert r.state(0.2).missed_by(150.0) == 1  # the short answer has 100 ms left
    r.finished(got_first_byte=True, key="short")
    assert r.state(0.3).missed_by(1e6) == 0
    assert r.state(0.3).idle().missed_by(1e6) == 0
