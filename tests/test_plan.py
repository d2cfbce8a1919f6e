"""`specgate plan`: every split of a fleet simulated on a traffic, the best one recommended, its
tokens priced."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from specgate.bench.plan import PlanSettings, plan, table
from specgate.calibration.pricing import usd_per_million_tokens
from specgate.calibration.profiles import A100_CODELLAMA_34B
from specgate.cli import main
from specgate.gateway.advisor import recommend


def light_trace(tmp_path: Path, requests: int = 60) -> Path:
    """Long answers, a request every two seconds: far below any split's capacity."""
    path = tmp_path / "light.csv"
    rows = "".join(f"{2.0 * i},200,200\n" for i in range(requests))
    path.write_text("timestamp_s,input_tokens,output_tokens\n" + rows)
    return path


def test_a_tpot_only_speculation_meets_needs_a_speculative_replica(tmp_path: Path) -> None:
    # The A100 profile decodes at 38 ms a token plain and 18 with speculation: a 30 ms target is
    # out of a plain replica's reach at any load.
    settings = PlanSettings(light_trace(tmp_path), 2, A100_CODELLAMA_34B, 2000.0, 30.0, price_per_hour=3.49)
    results = plan(settings)
    rows = {r["speculative"]: r for r in results["splits"]}
    assert sorted(rows) == [0, 1, 2]
    assert rows[0]["slo_attainment"] < 0.1
    assert rows[1]["slo_attainment"] > 0.9  # the adaptive policy sends them to the speculative one
    assert results["recommended"] in (1, 2)
    for row in rows.values():
        expected = usd_per_million_tokens(2 * 3.49, row["tokens_per_s"])
        assert row["usd_per_million_tokens"] == pytest.approx(expected)
        assert row["usd_per_million_good_tokens"] >= row["usd_per_million_tokens"]
    assert math.isinf(rows[0]["usd_per_million_good_tokens"])  # no request met its SLOs
    # The good tokens by stretch of the traffic, which the advisor weighs a gain's noise by, add up
    # to the split's figure; a request every two seconds gives each stretch some.
    for row in rows.values():
        stretches = row["good_tokens_per_s_by_stretch"]
        assert len(stretches) == 10
        assert sum(stretches) / 10 == pytest.approx(row["good_tokens_per_s"])
    assert rows[0]["good_tokens_per_s_by_stretch"] == [0.0] * 10
    assert all(v > 0 for v in rows[1]["good_tokens_per_s_by_stretch"])
    text = table(results)
    assert "(recommended)" in text
    assert "$/M good tokens" in text


def test_the_recommendation_is_the_most_good_tokens_then_the_most_slos_met() -> None:
    rows: list[dict[str, Any]] = [
        {"speculative": 0, "slo_attainment": 0.95, "good_tokens_per_s": 1000.0, "tpot_p99_ms": 40.0},
        {"speculative": 1, "slo_attainment": 0.96, "good_tokens_per_s": 996.0, "tpot_p99_ms": float("nan")},
        {"speculative": 2, "slo_attainment": 0.96, "good_tokens_per_s": 997.0, "tpot_p99_ms": 45.0},
        {"speculative": 3, "slo_attainment": 0.99, "good_tokens_per_s": 900.0, "tpot_p99_ms": 20.0},
    ]
    # 3 meets more requests but serves a tenth fewer good tokens; 0, 1 and 2 are within half a
    # percent of the most, 1 and 2 meet one point more, and 2's TPOT p99 is known.
    assert recommend(rows)["speculative"] == 2
    assert recommend(rows[:1] + rows[3:])["speculative"] == 0


def test_the_command_prints_writes_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = light_trace(tmp_path, 30)
    args = ["plan", "--trace", str(trace), "--replicas", "2", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "30"]
    out = ["--json", str(tmp_path / "plan.json"), "--plot", str(tmp_path / "plan.png"), "--jobs", "2"]
    assert main([*args, "--price-per-hour", "3.49", *out]) == 0
    printed = capsys.readouterr().out
    assert "recommended:" in printed
    results = json.loads((tmp_path / "plan.json").read_text())
    assert [r["speculative"] for r in results["splits"]] == [0, 1, 2]
    assert (tmp_path / "plan.png").stat().st_size > 1000
    assert main([*args, "--profile", "tpu-v9"]) == 2
    assert main([*args, "--policy", "fastest-ever"]) == 2
    assert main([*args[:-4], "--trace", str(tmp_path / "missing.csv"), *args[-4:]]) == 2
