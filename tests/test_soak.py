"""The soak benchmark (bench/soak.py): its traffic plan and figures, and a short soak of a real
gateway process that must end with nothing in flight, its descriptors back to idle, nothing lost."""

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from specgate.bench.soak import BAD_REQUESTS, Outcomes, Run, Sample, main, plan, slope_per_hour, summarize


def test_the_plan_is_the_mix_it_promises_and_the_same_for_the_same_seed() -> None:
    requests = plan(hours=1.0, rate=2.0, time_scale=40.0, seed=3)
    assert requests == plan(hours=1.0, rate=2.0, time_scale=40.0, seed=3)
    assert requests != plan(hours=1.0, rate=2.0, time_scale=40.0, seed=4)
    assert len(requests) == pytest.approx(7200, rel=0.05)  # Poisson at 2/s for an hour
    assert requests[-1].at_s < 3600 / 40  # compressed 40 times
    assert all(a.at_s <= b.at_s for a, b in itertools.pairwise(requests))
    kinds = Counter(r.kind for r in requests)
    bad = sum(kinds[name] for name, _, _ in BAD_REQUESTS)
    assert bad / len(requests) == pytest.approx(0.03, abs=0.01)
    good = [r for r in requests if r.kind in ("chat", "completion")]
    assert kinds["chat"] / len(good) == pytest.approx(0.7, abs=0.03)
    streams = [r for r in good if r.stream]
    assert len(streams) / len(good) == pytest.approx(0.7, abs=0.03)
    abandoned = sum(r.abandon_after_s is not None for r in streams)
    assert abandoned / len(streams) == pytest.approx(0.05, abs=0.015)
    assert any("x-slo-ttft-ms" in r.headers for r in good)
    assert any("x-priority" in r.headers for r in good)


def _sample(t: float, rss: float, fds: int = 20, in_flight: float = 0.0) -> Sample:
    return Sample(t, rss, fds, cpu_s=t / 10, in_flight=in_flight, queued=0.0, sent=int(t * 10))


def test_figures_call_a_growing_gateway_or_a_lost_request_what_they_are() -> None:
    assert slope_per_hour([0.0, 1.0, 2.0], [10.0, 12.0, 14.0]) == pytest.approx(2.0)
    flat = [_sample(t, 50.0 + (0.1 if t % 2 else 0.0)) for t in range(100)]
    growing = [_sample(t, 50.0 + t * 0.2) for t in range(100)]  # +40% over the run
    served = Outcomes()
    served.count("served", 200)
    lost = Outcomes()
    lost.count("lost", 502, "chat answered 502 upstream_unavailable")

    def figures(samples: list[Sample], outcomes: Outcomes, fds_after: int = 20) -> dict[str, object]:
        run = Run(1000, 100.0, outcomes, samples, _sample(0, 45.0), _sample(120, 50.0, fds_after))
        return summarize(run, time_scale=36.0)

    assert figures(flat, served)["flat"] is True
    assert figures(flat, served)["rss_mb_per_simulated_hour"] == pytest.approx(0.0, abs=0.1)
    assert figures(growing, served)["flat"] is False
    assert figures(growing, served)["rss_mb_per_simulated_hour"] == pytest.approx(20.0, rel=0.01)  # 1 s real = 36 s
    assert figures(flat, lost)["flat"] is False
    assert figures(flat, lost)["lost"] == ["chat answered 502 upstream_unavailable"]
    assert figures(flat, served, fds_after=25)["flat"] is False  # connections left open


@pytest.mark.slow
def test_a_short_soak_leaves_nothing_behind(tmp_path: Path) -> None:
    # Two simulated minutes at 2 requests/s, 40 times faster: about 240 requests in 3 s. Too short
    # for memory to settle after warm-up, so the figures checked are the ones that must hold at once.
    main(["--hours", "0.035", "--time-scale", "40", "--sample-s", "0.2", "--out", str(tmp_path)], prog="soak")
    figures = json.loads((tmp_path / "soak.json").read_text())["figures"]
    assert figures["lost"] == []
    assert figures["outcomes"]["served"] > 150
    assert figures["outcomes"].get("rejected", 0) > 0  # the bad requests, answered 4xx
    assert figures["in_flight_after"] == 0
    assert figures["queued_after"] == 0
    assert figures["fds_idle_after"] <= figures["fds_idle_before"]
    assert (tmp_path / "soak.png").stat().st_size > 0
    assert "Verdict" in (tmp_path / "soak.md").read_text()
