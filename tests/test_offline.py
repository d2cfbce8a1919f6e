"""The offline simulator and its command line, on small traces."""

import itertools
import json
from pathlib import Path

import pytest

from specgate.bench.offline import TOO_LONG, Fleetspec, Scenario, attainable, policy_document, simulate
from specgate.bench.traces import TraceError, TraceRequest, read_trace, scaled
from specgate.calibration.profiles import A100_CODELLAMA_34B
from specgate.cli import main
from specgate.policies.decision import Shedding
from specgate.policies.document import DocumentError
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
    # 1+1 replicas, a request every 75 ms: about four times what they serve within the SLOs
    trace = [TraceRequest(i * 0.075, 1000, 150) for i in range(300)]
    runs = {
        policy: simulate(trace, Scenario(A100_CODELLAMA_34B, Fleetspec(1, 1), policy, 2000.0, 50.0))
        for policy in ("adaptive", "least-loaded", "adaptive:admission.enabled=false")
    }
    held, fixed, unheld = (runs[p].summary() for p in runs)
    assert held["slo_attainment"] > fixed["slo_attainment"] + 0.1
    assert held["slo_attainment"] > unheld["slo_attainment"] + 0.1
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
