"""`specgate bench grid`: cells, capacity, and the report of margins."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest

from specgate.bench.grid import ADAPTIVE, FIXED, HOMOGENEOUS, Cell, Job, capacity_rps, cells, points, report, run
from specgate.bench.traces import TraceRequest
from specgate.calibration.profiles import A100_CODELLAMA_34B, H100_LLAMA31_8B
from specgate.cli import main

TRACE = [TraceRequest(i * 0.2, 600 + 50 * (i % 9), 60 + 10 * (i % 5)) for i in range(300)]


def _trace_file(tmp_path: Path, requests: int) -> Path:
    """The first `requests` of TRACE as a trace file."""
    trace = tmp_path / "t.csv"
    rows = "".join(f"{r.arrival_s},{r.prompt_tokens},{r.output_tokens}\n" for r in TRACE[:requests])
    trace.write_text("timestamp_s,input_tokens,output_tokens\n" + rows)
    return trace


def test_the_cells_vary_every_factor_and_include_the_reported_hard_cases() -> None:
    grid = cells()
    assert Cell() in grid
    assert len(set(grid)) == len(grid)
    for factor in ("trace", "arrivals", "prompts", "classes", "slo", "fleet", "profile"):
        assert len({getattr(c, factor) for c in grid}) > 1, factor
    assert Cell(arrivals="storms", classes=True, slo=(800.0, 60.0)) in grid
    assert Cell(prompts="long", fleet=(4, 4), profile="h100-llama31-8b") in grid


@pytest.mark.parametrize("seed", [2, 3, 4, 5])
def test_held_out_cells_are_the_seeds_random_draws_and_none_of_the_fixed_ones(seed: int) -> None:
    """`--held-out`: what the seed draws at random, nothing every seed shares (the base cell, each
    factor varied from it, the reported hard cases), so a new seed is traffic not tuned to."""
    held_out = cells(seed=seed, held_out=True)
    shared = set(cells(seed=seed, extra=0))
    assert held_out
    assert not shared & set(held_out)
    assert set(held_out) == set(cells(seed=seed)) - shared
    assert set(held_out) != set(cells(seed=seed + 10, held_out=True))


def test_capacity_grows_with_the_fleet_the_hardware_and_a_looser_target() -> None:
    small = capacity_rps(A100_CODELLAMA_34B, (1, 1), TRACE, 50.0)
    assert capacity_rps(A100_CODELLAMA_34B, (2, 2), TRACE, 50.0) == pytest.approx(2 * small)
    assert capacity_rps(A100_CODELLAMA_34B, (1, 1), TRACE, 120.0) > small
    assert capacity_rps(H100_LLAMA31_8B, (1, 1), TRACE, 50.0) > 5 * small


@pytest.mark.slow
def test_the_grid_command_writes_margins_a_report_and_a_heat_map(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path, 80)
    out = tmp_path / "grid"
    args = ["bench", "grid", "--quick", "--conv", str(trace), "--code", str(trace), "--loads", "0.5,3"]
    assert main([*args, "--requests", "80", "--out", str(out), "--jobs", "2"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["points"]) == 3 * 2
    for point in results["points"]:
        best = max(point["attainment"][f] for f in FIXED)
        assert point["margin"] == pytest.approx(point["attainment"]["adaptive"] - best)
        assert {"all-speculative", "all-plain"} <= set(point["attainment"])
    report = (out / "report.md").read_text()
    assert "worst points" in report
    assert "grid mean: adaptive" in report
    assert (out / "margin.png").stat().st_size > 1000


def test_a_point_exactly_one_point_behind_is_not_counted_as_more() -> None:
    met = {ADAPTIVE: 395 / 400, **dict.fromkeys(FIXED, 399 / 400)}
    runs = [{"cell": "c", "load": 1.0, "policy": p, "slo_attainment": a, "ttft_p99_ms": 1.0, "shed": 0,
             "too_long": 0} for p, a in met.items()]  # fmt: skip
    assert points(runs)[0]["margin"] == -0.01
    runs[0]["slo_attainment"] = 394 / 400
    assert cast(float, points(runs)[0]["margin"]) < -0.01


def test_a_window_kept_up_counts_its_own_requests_on_a_fleet_already_loaded(tmp_path: Path) -> None:
    trace = _trace_file(tmp_path, 60)
    alone, kept = (run(Job(Cell(), 4.0, "round-robin", 60, 0, str(trace), steady)) for steady in (False, True))
    assert alone["requests"] == kept["requests"] == 60
    # Four times past capacity, a window alone starts on an idle fleet; kept up, the fleet it meets
    # is as loaded as this traffic keeps it.
    assert cast(float, kept["slo_attainment"]) < cast(float, alone["slo_attainment"]) - 0.1
    results = {"points": points([{**r, "policy": p} for r in (kept,) for p in (ADAPTIVE, *FIXED, *HOMOGENEOUS)]),
               "cells": [Cell()], "loads": [4.0], "requests_per_run": 60, "seed": 0, "steady": True}  # fmt: skip
    assert "60 requests per run kept up" in report(results, "specgate bench grid --steady")
