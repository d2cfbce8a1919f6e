"""How long an overload lasts, against each policy (`specgate bench overload`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specgate.bench.grid import Cell
from specgate.bench.overload import Job, points, run
from specgate.cli import main

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023"
needs_traces = pytest.mark.skipif(not TRACES.exists(), reason="the shared Azure traces are beside the checkout")


@needs_traces
def test_a_sustained_overload_collapses_a_fixed_rule_and_not_the_adaptive_policy() -> None:
    # A minute at twice the base cell's capacity: sent at once, every request queues behind the
    # ones before it and misses its TTFT; held and refused when out of reach, half meet theirs.
    fixed, adaptive = (run(Job(Cell(), 2.0, 60.0, policy, 0, str(TRACES))) for policy in ("round-robin", "adaptive"))
    assert 55.0 <= fixed["span_s"] <= 60.0
    assert fixed["requests"] == adaptive["requests"] > 200  # the middle third, both policies
    assert fixed["slo_attainment"] < 0.05
    assert adaptive["slo_attainment"] > 0.4


def test_the_margin_is_to_the_best_fixed_rule_of_each_point() -> None:
    figures = [(5.0, "adaptive", 0.5), (5.0, "round-robin", 0.7), (5.0, "least-loaded", 0.6),
               (40.0, "adaptive", 0.45), (40.0, "round-robin", 0.0), (40.0, "least-loaded", 0.1)]  # fmt: skip
    runs = [{"cell": "c", "load": 2.0, "duration_s": d, "policy": p, "slo_attainment": a} for d, p, a in figures]
    short, sustained = points(runs)
    assert (short["duration_s"], short["best_fixed"], round(short["margin"], 6)) == (5.0, "round-robin", -20.0)
    assert (sustained["best_fixed"], round(sustained["margin"], 6)) == ("least-loaded", 35.0)


@needs_traces
def test_the_command_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "overload"
    argv = ["bench", "overload", "--quick", "--loads", "2", "--durations", "1,2", "--policies",
            "adaptive,round-robin", "--traces", str(TRACES), "--out", str(out), "--jobs", "2"]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert [(p["duration_s"], sorted(p["attainment"])) for p in results["points"]] == [
        (1.0, ["adaptive", "round-robin"]),
        (2.0, ["adaptive", "round-robin"]),
    ]
    assert "| seconds | adaptive | round-robin | best fixed rule | margin |" in (out / "report.md").read_text()
    assert (out / "overload.png").stat().st_size > 0
