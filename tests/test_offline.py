"""The offline simulator and its command line, on small traces."""

import dataclasses
import itertools
import json
import statistics
from pathlib import Path

import pytest

from specgate.bench.offline import (
    TOO_LONG,
    Fleetspec,
    Scenario,
    Switchover,
    attainable,
    policy_document,
    simulate,
    steady,
    warmed,
)
from specgate.bench.traces import TraceError, TraceRequest, read_trace, scaled
from specgate.calibration.modes import Pool
from specgate.calibration.profiles import A100_CODELLAMA_34B
from specgate.cli import main
from specgate.policies.decision import Shedding
from specgate.policies.document import DocumentError, Switching
from specgate.policies.features import SloTargets

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


def synthetic(n: int = 120, every_s: float = 0.5) -> list[TraceRequest]:
    return [TraceRequest(i * every_s, 200 + 37 * (i % 13), 20 + 11 * (i % 7)) for i in range(n)]


def test_plain_csv_and_azure_csv(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("timestamp_s,input_tokens,output_tokens\n10.5,100,20\n10.0,50,0\n11.0,300,40\n")
    trace = read_trace(path)
    assert trace == [TraceRequest(0.0, 100, 20), TraceRequest(0.5, 300, 40)]  # empty outputs dropped
    if AZURE.exists():
        azure = read_trace(AZURE, limit=50)
        assert len(azure) == 50
        assert azure[0].arrival_s == 0.0
        assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(azure))


@pytest.mark.parametrize("text", ["a,b,c\n1,2,3\n", "timestamp_s,input_tokens,output_tokens\nx,1,1\n", ""])
def test_bad_traces(tmp_path: Path, text: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(TraceError):
        read_trace(path)


def test_scaling_compresses_arrivals() -> None:
    assert [r.arrival_s for r in scaled(synthetic(3), 2.0)] == [0.0, 0.25, 0.5]


@pytest.mark.parametrize("policy", ["adaptive", "least-loaded", "threshold", "plain-only"])
def test_every_request_is_served_or_shed_and_runs_repeat(policy: str) -> None:
    scenario = Scenario(A100_CODELLAMA_34B, Fleetspec(2, 2), policy, slo_ttft_ms=2000, slo_tpot_ms=50)
    first = simulate(synthetic(), scenario)
    assert first.requests == 120
    assert first.requests == len(first.served) + sum(first.refused.values()) == 120
    summary = first.summary()
    assert 0.0 <= summary["slo_attainment"] <= 1.0
    assert simulate(synthetic(), scenario).summary() == summary  # deterministic
    if policy == "plain-only":
        assert summary["spec_share"] == 0.0


def test_load_hurts_and_the_true_length_helps_no_worse() -> None:
    scenario = Scenario(A100_CODELLAMA_34B, Fleetspec(1, 1), "adaptive", slo_ttft_ms=1500, slo_tpot_ms=45)
    light = simulate(synthetic(every_s=2.0), scenario).summary()
    heavy = simulate(synthetic(every_s=0.05), scenario).summary()
    assert heavy["slo_attainment"] < light["slo_attainment"]
    assert heavy["ttft_p99_ms"] > light["ttft_p99_ms"]


def test_clairvoyant_bound() -> None:
    trace = synthetic()

    def bound(ttft_ms: float | None, tpot_ms: float | None) -> float:
        return attainable(trace, Scenario(A100_CODELLAMA_34B, Fleetspec(1, 1), "adaptive", ttft_ms, tpot_ms))

    assert bound(None, None) == 1.0
    assert bound(10.0, None) == 0.0  # no prefill is that fast
    assert 0.0 < bound(2000.0, 20.0) <= 1.0  # only speculation meets 20 ms


def test_bench_offline_command_writes_results_report_and_plots(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "timestamp_s,input_tokens,output_tokens\n" + "".join(f"{i * 0.3},{300 + i},{30 + i % 50}\n" for i in range(60))
    )
    out = tmp_path / "out"
    code = main(
        ["bench", "offline", "--trace", str(trace), "--policies", "adaptive,least-loaded,threshold:max_load=4",
         "--rate-scale", "1,4", "--spec-replicas", "1", "--plain-replicas", "1", "--jobs", "1", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    labels = {(r["policy"], r["rate_scale"]) for r in results["runs"]}
    expected = {"adaptive", "least-loaded", "threshold:max_load=4", "all-plain fleet", "all-speculative fleet"}
    assert labels == {(p, s) for p in expected for s in (1.0, 4.0)}
    for run in results["runs"]:
        assert set(run) >= {"policy", "fleet", "rate_scale", "requests", "slo_attainment", "goodput_rps",
                            "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms",
                            "e2e_p99_ms", "spec_share", "shed"}  # fmt: skip
    assert 0.0 <= results["bound"]["slo_attainment"] <= 1.0
    assert "| adaptive |" in (out / "report.md").read_text()
    assert (out / "t_attainment.png").stat().st_size > 10_000
    assert (out / "t_ttft_p99.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args",
    [
        ["--policies", "magic"],
        ["--policies", ""],
        ["--policies", "adaptive:shed=yes"],
        ["--policies", "adaptive:wings=2"],
        ["--policies", "threshold:max_load=-1"],
        ["--rate-scale", "0"],
        ["--spec-replicas", "0", "--plain-replicas", "0"],
        ["--profile", "nonesuch"],
    ],
)
def test_bench_offline_refuses_bad_arguments(tmp_path: Path, args: list[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("timestamp_s,input_tokens,output_tokens\n0,10,10\n")
    try:
        code = main(["bench", "offline", "--trace", str(trace), "--out", str(tmp_path / "o"), *args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == 2


@pytest.mark.parametrize(
    ("text", "policy", "params", "shedding"),
    [
        ("least-loaded", "least-loaded", {}, Shedding()),
        ("threshold:max_load=16", "threshold", {"max_load": 16}, Shedding()),
        (
            "adaptive:shedding.enabled=true;shedding.below_priority=-1;harm_weight=0.25",
            "adaptive",
            {"harm_weight": 0.25},
            Shedding(enabled=True, below_priority=-1),
        ),
    ],
)
def test_policy_settings_on_the_command_line(
    text: str, policy: str, params: dict[str, object], shedding: Shedding
) -> None:
    document = policy_document(text, "whitepaper")
    assert (document.policy, dict(document.params), document.shedding, document.profile) == (
        policy,
        params,
        shedding,
        "whitepaper",
    )


@pytest.mark.parametrize(
    ("text", "field"),
    [("magic", "policy"), ("threshold:max_load=-1", "params.max_load"), ("adaptive:shed=true", "params.shed"),
     ("least-loaded:shedding.enabled=true", "shedding.enabled"), ("adaptive:exploration=0.9", "exploration")],
)  # fmt: skip
def test_policy_settings_are_checked_like_a_document(text: str, field: str) -> None:
    with pytest.raises(DocumentError) as exc:
        policy_document(text, "whitepaper")
    assert exc.value.field == field


def test_prompts_past_the_context_window_are_refused_as_vllm_does_and_counted() -> None:
    window = A100_CODELLAMA_34B.max_model_len
    trace = [TraceRequest(i * 1.0, window + i if i % 4 == 0 else 500, 40) for i in range(20)]
    result = simulate(trace, Scenario(A100_CODELLAMA_34B, Fleetspec(1, 1), "least-loaded", 2000.0, 50.0))
    assert result.refused == {TOO_LONG: 5}
    assert len(result.served) == 15
    summary = result.summary()
    assert summary["too_long"] == 5
    assert summary["slo_attainment"] <= 15 / 20  # a refused request meets nothing
    # one that fits with room to spare still answers in full; one near the window is cut short
    near = [TraceRequest(0.0, window - 10, 400)]
    (served,) = simulate(near, Scenario(A100_CODELLAMA_34B, Fleetspec(0, 1), "plain-only")).served
    assert served.output_tokens == 10


def test_under_overload_the_adaptive_policy_holds_and_refuses_instead_of_queueing_everyone_late() -> None:
    # 1+1 replicas, a request every 60-100 ms: three to five times what they serve within the
    # SLOs. Holding the requests the replicas cannot serve in time meets SLOs where queueing every
    # one there meets almost none: on average over several such overloads (one run moves by
    # several points with what the fit happens to learn first).
    policies = ("adaptive", "least-loaded", "adaptive:admission.enabled=false")
    met: dict[str, list[float]] = {policy: [] for policy in policies}
    runs = {}
    for gap_s, output in ((0.06, 100), (0.09, 300), (0.1, 150), (0.075, 150)):  # the last checked whole, below
        trace = [TraceRequest(i * gap_s, 1000, output) for i in range(300)]
        runs = {policy: simulate(trace, Scenario(A100_CODELLAMA_34B, Fleetspec(1, 1), policy, 2000.0, 50.0))
                for policy in policies}  # fmt: skip
        for policy, run in runs.items():
            met[policy].append(run.summary()["slo_attainment"])
    held_met, fixed_met, unheld_met = (statistics.fmean(met[policy]) for policy in policies)
    assert held_met > fixed_met + 0.1
    assert held_met > unheld_met + 0.1
    held, fixed = runs["adaptive"].summary(), runs["least-loaded"].summary()
    # nobody waits much past three times the TTFT target (the last dispatches land on predictions)
    assert held["ttft_p99_ms"] < 1.1 * 3 * 2000.0 < fixed["ttft_p99_ms"]
    assert set(runs["adaptive"].refused) <= {"deadline", "queue-full"}
    assert sum(runs["adaptive"].refused.values()) > 0
    assert fixed["shed"] == 0


def test_per_class_targets_apply_to_the_requests_of_each_class() -> None:
    trace = [TraceRequest(i * 0.5, 500, 60, "batch" if i % 2 else "interactive") for i in range(20)]
    classes = {"interactive": SloTargets(1.0, None), "batch": SloTargets(60_000.0, None)}
    result = simulate(trace, Scenario(A100_CODELLAMA_34B, Fleetspec(1, 1), "least-loaded", slo_classes=classes))
    assert {s.slo for s in result.served} == set(classes.values())
    assert result.summary()["slo_attainment"] == 0.5  # no first token comes within 1 ms


def test_a_switching_fleet_moves_servers_and_loses_no_request() -> None:
    """A fleet of two plain servers whose traffic needs a pace only speculation keeps: the advisor's
    plans move both to the speculative pool, each drained, restarted (serving nothing) and
    re-admitted; every request is answered or refused, none dropped by the moves."""
    trace = [TraceRequest(i * 0.5, 400, 150) for i in range(600)]
    rules = Switching(enabled=True, min_per_pool=0, confirmations=1, min_gain=0.01, cooldown_ms=0)
    switchover = Switchover(rules, interval_s=20.0, window_s=40.0, restart_s=10.0, min_requests=20, max_requests=60)
    scenario = Scenario(A100_CODELLAMA_34B, Fleetspec(0, 2), "adaptive", 2000.0, 30.0, switching=switchover)
    result = simulate(trace, scenario)
    assert result.requests == len(trace)
    assert result.switches
    drained, serving, name, pool = result.switches[0]
    assert (name, pool) == ("plain-0", Pool.SPECULATIVE)
    assert serving - drained >= switchover.restart_s  # drained, idle, then restarted
    after = [s.pool for s in result.served if s.arrival_s > serving + 5]
    assert Pool.SPECULATIVE in after
    # Every plan is kept: the first move began at the first plan that asked for it, which saw the
    # fleet all plain and a gain in the recommended split.
    first = next(plan for plan in result.plans if plan.step)
    assert (first.at_s, first.plan.current, first.step) == (drained, 0, 1)
    assert first.plan.recommended > 0
    assert first.plan.gain >= rules.min_gain
    assert first.plan.good_tokens[first.plan.recommended] > first.plan.good_tokens[0]
    assert [p.at_s for p in result.plans] == sorted(p.at_s for p in result.plans)
    fixed = simulate(trace, dataclasses.replace(scenario, switching=None)).summary()["slo_attainment"]
    assert result.summary()["slo_attainment"] > fixed + 0.2


def test_a_short_trace_replayed_on_the_fleet_it_loaded_counts_once_and_fares_no_better() -> None:
    trace = scaled(read_trace(AZURE, 300), 4.0)  # past saturation of one server
    scenario = Scenario(A100_CODELLAMA_34B, Fleetspec(1, 0), "least-loaded", 2000.0, 50.0)
    once, loaded = simulate(trace, scenario), steady(trace, scenario)
    assert loaded.requests == len(trace)
    assert loaded.summary()["ttft_p50_ms"] > once.summary()["ttft_p50_ms"]
    assert loaded.summary()["slo_attainment"] <= once.summary()["slo_attainment"]


def test_a_short_window_is_counted_between_its_own_traffic_before_and_after_it() -> None:
    """A window about as long as its requests take, past saturation: counted alone, its last
    requests would finish on an emptying replica; counted between two more rounds of itself, they
    decode beside the next round's prompts, as they would while the traffic went on."""
    trace = scaled(read_trace(AZURE, 60), 8.0)
    scenario = Scenario(A100_CODELLAMA_34B, Fleetspec(1, 0), "least-loaded", 2000.0, 50.0)
    rounds, start, end = warmed(trace)
    assert len(rounds) >= 3 * len(trace)
    assert len(rounds) % len(trace) == 0
    assert [r.arrival_s for r in rounds] == sorted(r.arrival_s for r in rounds)
    middle = steady(trace, scenario)
    assert middle.requests == len(trace)
    assert all(start <= s.arrival_s < end for s in middle.served)
    nothing_after = simulate(rounds[: 2 * len(trace)], scenario).between(start, end)
    assert nothing_after.requests == len(trace)
    assert middle.summary()["tpot_p50_ms"] > nothing_after.summary()["tpot_p50_ms"]
    assert warmed(trace[:1])[1] > 0  # a single request: its rounds still apart


def test_a_window_whose_answers_outlive_the_next_round_is_kept_up_until_its_last_one_ends() -> None:
    """Its requests take longer than a round of their traffic: the rounds after it go on coming
    while they decode (one round after it, most of their answers would end on an emptying
    replica), and the run stops as the last of them ends."""
    trace = scaled(read_trace(AZURE, 60), 8.0)
    scenario = Scenario(A100_CODELLAMA_34B, Fleetspec(1, 0), "least-loaded", 2000.0, 50.0)
    rounds, start, end = warmed(trace)
    run = simulate(rounds, scenario, measured=(start, end))
    counted = run.between(start, end)
    assert counted.requests == len(trace)
    last_end = max(s.arrival_s + s.e2e_s for s in counted.served)
    assert last_end > end + (end - start)  # they outlive the round after theirs
    assert max(s.arrival_s + s.e2e_s for s in run.served) <= last_end + 1e-9  # nothing ran on after them
    one_round_after = simulate(rounds[: 3 * len(trace)], scenario, measured=(start, end)).between(start, end)
    assert one_round_after.requests == len(trace)
    assert counted.summary()["tpot_p50_ms"] > 1.1 * one_round_after.summary()["tpot_p50_ms"]


def test_bench_daily_writes_every_split_and_the_switching_fleet(tmp_path: Path) -> None:
    out = tmp_path / "daily"
    args = ["bench", "daily", "--requests", "300", "--trace", str(AZURE), "--jobs", "2", "--out", str(out)]
    assert main(args) == 0
    results = json.loads((out / "results.json").read_text())
    fleets = [r["fleet"] for r in results["runs"]]
    assert fleets[:5] == ["all-plain x4", "1 speculative + 3 plain", "2 speculative + 2 plain",
                          "3 speculative + 1 plain", "all-speculative x4"]  # fmt: skip
    assert fleets[5].startswith("switching")
    assert all(r["requests"] == 300 for r in results["runs"])
    assert len(results["arrivals_per_s_by_hour"]) == 24
    assert (out / "timeline.png").stat().st_size > 0
    assert "| switching" in (out / "report.md").read_text()
    switching = results["runs"][5]
    assert all(0 <= plan["hour"] < 24 and set(plan["good_tokens_per_s"]) == {"0", "1", "2", "3", "4"}
               for plan in switching["plans"])  # fmt: skip
