"""vLLM V1's Prometheus metrics, by name, label and bucket, fed from the engine model.

Each replica owns its own `CollectorRegistry`. Labels are vLLM's: `model_name` and `engine`
("0": one engine core), plus `finished_reason` on request successes and `position` on the
per-position acceptance counter. Times observed are virtual (the profile's units), so a
replica running with a time scale still reports real-hardware latencies.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specgate.sim.engine import Engine
from specgate.sim.outcomes import FinishedRequest, FinishReason, StepResult

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`, as vLLM buckets token counts."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class VllmMetrics:
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        labels = ("model_name", "engine")
        values = (model_name, "0")
        tokens = one_two_five_buckets(engine.profile.max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=registry,
        )
        self.success = {reason: success.labels(*values, reason.value) for reason in FinishReason}
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", _ITERATION_TOKEN_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _TOKEN_LATENCY_BUCKETS
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            _REQUEST_LATENCY_BUCKETS,
        )
        cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "num_gpu_blocks", "engine"),
            registry=registry,
        )
        cache_info.labels(str(engine.config.block_size), str(engine.total_blocks), "0").set(1)

        self.spec: tuple[Counter, Counter, Counter, list[Counter]] | None = None
        if engine.speculative:
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                (*labels, "position"),
                registry=registry,
            )
            self.spec = (
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                [per_pos.labels(*values, str(pos)) for pos in range(engine.k)],
            )

    def set_queues(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

    def observe_step(self, step: StepResult) -> None:
        self.preemptions.inc(len(step.preempted))
        self.prompt_tokens.inc(step.prompt_tokens)
        self.generation_tokens.inc(step.generation_tokens)
        self.iteration_tokens.observe(step.prompt_tokens + step.generation_tokens)
        for ttft in step.ttfts:
            self.ttft.observe(ttft)
        for itl in step.inter_token_latencies:
            self.itl.observe(itl)
        for finished in step.finished:
            self.observe_finished(finished)
        if self.spec is not None and step.spec.drafts:
            drafts, draft_tokens, accepted, per_pos = self.spec
            drafts.inc(step.spec.drafts)
            draft_tokens.inc(step.spec.draft_tokens)
            accepted.inc(step.spec.accepted_tokens)
            for counter, count in zip(per_pos, step.spec.accepted_per_pos, strict=True):
                counter.inc(count)

    def observe_finished(self, f: FinishedRequest) -> None:
        self.success[f.finish_reason].inc()
        self.e2e.observe(f.e2e)
        self.queue.observe(f.queued)
        self.prefill.observe(f.prefill)
        self.decode.observe(f.decode)
        self.inference.observe(f.inference)
        self.request_prompt_tokens.observe(f.prompt_tokens)
        self.request_generation_tokens.observe(f.output_tokens)
        if f.tpot is not None:
            self.request_tpot.observe(f.tpot)
        if f.max_tokens is not None:
            self.request_max_tokens.observe(f.max_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
