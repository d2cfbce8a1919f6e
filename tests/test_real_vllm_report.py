"""The real-vLLM benchmark's workload and report, on made-up runs (the benchmark itself needs the
real servers: `specgate bench real-vllm`)."""

from __future__ import annotations

from typing import Any

import pytest

from specgate.bench.real_vllm import CASES, case_report, main, predictions, schedule, speculative_config, workload


def sample(
    pool: str, kind: str, ttft: float, tpot: float, predicted: tuple[float, float], ok: bool = True
) -> dict[str, Any]:
    return {"pool": pool, "kind": kind, "ttft_ms": ttft, "tpot_ms": tpot, "predicted_ttft_ms": predicted[0],
            "predicted_tpot_ms": predicted[1], "ok": ok}  # fmt: skip


def run(policy: str, clients: int, attained: float, samples: list[dict[str, Any]]) -> dict[str, Any]:
    nan = float("nan")
    latency = {"ttft_p50_ms": nan, "ttft_p99_ms": nan, "tpot_p50_ms": nan, "tpot_p99_ms": nan}
    return {"policy": policy, "concurrency": clients, "slo_attainment": attained, **latency, "spec_share": 0.5,
            "samples": samples}  # fmt: skip


def test_the_workload_alternates_kinds_with_answers_of_their_own_length() -> None:
    requests = workload(40, 64)
    assert [r.kind for r in requests[:4]] == ["copy", "free", "copy", "free"]
    lengths = [r.max_tokens for r in requests]
    assert min(lengths) >= 32
    assert max(lengths) <= 96
    assert len(set(lengths)) > 10  # not one length: a closed loop of equal answers runs in waves
    assert workload(40, 64) == requests  # the same requests for every policy and every run


def test_each_case_names_its_speculative_server() -> None:
    assert speculative_config("ngram", "/m")["method"] == "ngram"
    draft = speculative_config("draft", "/m")
    assert (draft["method"], draft["model"]) == ("draft_model", "/m-4layers")
    assert set(CASES) == {"ngram", "draft"}
    with pytest.raises(SystemExit):
        main(["--speculation", "eagle"])


def test_the_report_sets_adaptive_against_the_best_fixed_policy_and_checks_predictions() -> None:
    copy_spec = [sample("speculative", "copy", 80, 8, (84, 9)), sample("speculative", "copy", 90, 10, (86, 11))]
    free_plain = [sample("plain", "free", 60, 20, (45, 21))]  # TTFT predicted 25% short
    runs = [
        run("adaptive", 1, 1.0, copy_spec), run("adaptive", 8, 0.75, free_plain),
        run("round-robin", 1, 0.5, []), run("round-robin", 8, 0.875, []),
        run("plain-only", 1, 0.75, []), run("plain-only", 8, 0.5, []),
    ]  # fmt: skip
    cells = predictions(runs)
    assert [(c["pool"], c["kind"], c["requests"]) for c in cells] == [("speculative", "copy", 2), ("plain", "free", 1)]
    assert (cells[0]["ttft_ms"], cells[0]["predicted_tpot_ms"]) == (85, 10)
    text = case_report({"case": "ngram", "speculative_config": {"method": "ngram"}, "profile": "p", "runs": runs})
    assert "x1 +0.25 (best fixed: plain-only), x8 -0.12 (best fixed: round-robin)" in text
    assert "| plain | free | 1 | 60 ms | 45 ms | -25% | 20 ms | 21 ms | +5% |" in text
    assert "3 of 4 predictions within ±20%" in text
    assert "What the gateway learned" not in text  # no fit recorded


def test_the_report_shows_what_each_gateway_fitted() -> None:
    fit = {"wait_steps": 0.84, "overhead_s": 0.012, "ttft_factor": 1.07, "tpot_factor": 0.98}
    unread = dict.fromkeys(fit)
    last = run("adaptive", 8, 0.75, []) | {"fit": {"speculative": unread, "plain": fit}}
    text = case_report({"case": "draft", "speculative_config": {}, "runs": [run("adaptive", 1, 1.0, []), last]})
    assert "| 8 | plain | 0.84 | 12 | 1.07 | 0.98 |" in text
    assert "| 8 | speculative | - | - | - | - |" in text


def test_a_level_at_a_time_each_starting_one_policy_further_on() -> None:
    runs = schedule([1, 2, 4], ["a", "b", "c"])
    assert runs == [(1, ["a", "b", "c"]), (2, ["b", "c", "a"]), (4, ["c", "a", "b"])]
