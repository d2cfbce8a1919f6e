import pytest

from specgate.workers.scrape import MetricsFormatError, parse_vllm_metrics

V1 = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 30.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 12.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 500.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 210.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="4"} 10.0
"""


def test_v1_exposition() -> None:
    load = parse_vllm_metrics(V1)
    assert (load.running, load.waiting) == (5.0, 4.0)
    assert load.kv_usage == pytest.approx(0.375)  # engines average
    assert load.preemptions == 7.0
    assert load.spec is not None
    assert (load.spec.drafts, load.spec.draft_tokens, load.spec.accepted_tokens) == (100.0, 500.0, 210.0)
    assert load.spec.accepted_per_pos == (80.0, 60.0, 40.0, 20.0, 10.0)
    assert load.first_tokens == 42.0  # the TTFT histogram's counts, not its buckets


def test_plain_replica_has_no_spec_counters() -> None:
    text = "\n".join(line for line in V1.splitlines() if "spec_decode" not in line)
    assert parse_vllm_metrics(text).spec is None


def test_v0_cache_gauge_is_a_fallback_only() -> None:
    text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.9\n"
    assert parse_vllm_metrics(text).kv_usage == 0.9
    assert parse_vllm_metrics(V1 + "vllm:gpu_cache_usage_perc 0.9\n").kv_usage == pytest.approx(0.375)


@pytest.mark.parametrize(
    "text",
    ["", "<html>not metrics</html>", "vllm:num_requests_running 1\n", "vllm:num_requests_running{x} nope\n"],
)
def test_not_a_vllm_exposition(text: str) -> None:
    with pytest.raises(MetricsFormatError):
        parse_vllm_metrics(text)


def test_garbage_lines_are_skipped() -> None:
    text = V1 + 'vllm:num_requests_running{engine="2"} NaNx\nvllm:broken\nvllm:num_requests_waiting\n'
    assert parse_vllm_metrics(text).running == 5.0
