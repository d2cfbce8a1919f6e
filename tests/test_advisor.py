"""The live advisor's window of recent traffic, and what it hands the plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specgate.bench.traces import read_trace
from specgate.calibration import profile_file
from specgate.calibration.profiles import A100_CODELLAMA_34B, PROFILES
from specgate.gateway.advisor import Advisor, AdvisorSettings, Seen, TrafficWindow, commonest_slo, trace_csv


def seen(at: float, ttft: float | None = 2000.0, tpot: float | None = 50.0) -> Seen:
    return Seen(at, 100 + int(at), 20, ttft, tpot)


def test_the_window_keeps_the_last_requests_of_its_span_and_no_more() -> None:
    window = TrafficWindow(window_s=60.0, max_requests=3)
    for at in (0.0, 10.0, 20.0, 30.0):
        window.record(seen(at))
    assert [s.at for s in window.requests(now=35.0)] == [10.0, 20.0, 30.0]  # the most recent three
    assert [s.at for s in window.requests(now=75.0)] == [20.0, 30.0]  # 10 s is out of the last minute
    assert window.requests(now=1000.0) == []


def test_the_plan_reads_the_window_as_a_trace(tmp_path: Path) -> None:
    requests = [seen(100.0), seen(100.5), seen(103.0)]
    path = tmp_path / "t.csv"
    path.write_bytes(trace_csv(requests))
    trace = read_trace(path)
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in trace] == [
        (0.0, 200, 20), (0.5, 200, 20), (3.0, 203, 20)
    ]  # fmt: skip


def test_the_plan_takes_the_commonest_slo_pair() -> None:
    assert commonest_slo([]) is None
    assert commonest_slo([seen(0, None, None), seen(1, 2000.0, None)]) is None  # no request with both
    mixed = [seen(0, 800.0, 40.0), seen(1), seen(2), seen(3, None, None), seen(4, None, None), seen(5, None, None)]
    assert commonest_slo(mixed) == (2000.0, 50.0)


def test_a_profile_that_is_not_built_in_is_a_file_for_the_plans_while_the_gateway_runs() -> None:
    mine = dataclasses.replace(A100_CODELLAMA_34B, name="mine")
    advisor = Advisor(AdvisorSettings(), lambda: (1, 1), lambda: "mine", {**PROFILES, "mine": mine})
    assert set(advisor.profile_files) == {"mine"}  # the built-in ones the plan knows by name
    path = advisor.profile_files["mine"]
    assert profile_file.load(path).profile == mine
    advisor.close()
    assert not path.parent.exists()
    assert Advisor(AdvisorSettings(enabled=False), lambda: (1, 1), lambda: "mine", {"mine": mine}).profile_files == {}
