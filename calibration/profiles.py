"""Calibrated replica profiles: the data behind the simulated vLLM replica and the latency model.

Every number names where it comes from. "measured" figures come from the sources listed in
`SOURCES`; "derived" ones are computed from them (the computation is in the comment beside
it); "assumed" ones were chosen where no source gives a figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from specgate.calibration.costs import (
    Curve,
    DraftCost,
    Linear,
    LinearStepModel,
    ScaledStepModel,
    StepModel,
    StepTable,
    TableStepModel,
)

SOURCES: Mapping[str, str] = MappingProxyType(
    {
        "vidur": "Vidur (Agrawal et al., MLSys 2024), microsoft/vidur measured operator profiles, "
        "summed per layer; GPU time only. H100 rows derived by Vidur's A100->H100 ratios.",
        "specdecode-bench": "SpecDecode-Bench linear fit, vLLM 0.10.1, H100, Llama-3.1-8B, k=3, EAGLE.",
        "vllm-0.11-kv": "CodeLlama-34B on one 80 GB card in vLLM 0.11: weights 62.9 GiB, "
        "KV 7.43 GiB = 40,592 tokens (192 KiB/token).",
        "whitepaper": "The specgate whitepaper's own profile: CodeLlama-34B, A100-80G, vLLM 0.6.0, "
        "input 512, output 256, TinyLlama-1.1B draft, k=6.",
        "leviathan": "Leviathan et al. 2023, 'Fast Inference from Transformers via Speculative "
        "Decoding': E[tokens per step] = (1 - a^(k+1)) / (1 - a).",
    }
)


@dataclass(frozen=True)
class SpecProfile:
    """How the speculative variant of a replica drafts, accepts and spends memory."""

    method: str
    """vLLM `--speculative-config` method: draft_model, eagle, eagle3, ngram, mtp."""
    draft_model: str | None
    num_speculative_tokens: int
    """k: draft tokens proposed per sequence per step."""
    acceptance_mean: float
    """Mean per-token acceptance probability a (Leviathan et al.)."""
    acceptance_concentration: float
    """Requests draw their own a from Beta(mean * c, (1 - mean) * c); 0 gives every request the mean."""
    draft: DraftCost
    kv_capacity_tokens: int
    """KV token slots left once the draft's weights and its own KV take their share."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 0.0 <= self.acceptance_mean < 1.0:
            raise ValueError("acceptance_mean must lie in [0, 1)")
        if self.acceptance_concentration < 0:
            raise ValueError("acceptance_concentration must be >= 0")

    def expected_tokens_per_step(self, alpha: float | None = None) -> float:
        a = self.acceptance_mean if alpha is None else alpha
        k = self.num_speculative_tokens
        return (1 - a ** (k + 1)) / (1 - a)


@dataclass(frozen=True)
class Profile:
    name: str
    title: str
    model: str
    """Served model name a replica with this profile reports by default."""
    hardware: str
    steps: StepModel
    kv_capacity_tokens: int
    """KV token slots of the plain replica."""
    spec: SpecProfile
    max_model_len: int
    sources: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    def elsewhere(self, name: str, decode: float, prefill: float, fixed: float) -> Profile:
        """The same engine and model on other hardware: decoding (drafts included), prefill and
        the CPU time per step each that many times dearer."""
        spec = replace(self.spec, draft=self.spec.draft.scaled(decode, prefill))
        steps = ScaledStepModel(self.steps, decode, prefill, fixed)
        return replace(self, name=name, title=f"{self.title}, on other hardware", steps=steps, spec=spec)

    def describe(self) -> str:
        s = self.spec
        lines = [
            f"{self.name}: {self.title}",
            f"  model {self.model} on {self.hardware}; max_model_len {self.max_model_len}",
            f"  KV slots: plain {self.kv_capacity_tokens:,}, speculative {s.kv_capacity_tokens:,}",
            f"  speculation: {s.method}"
            + (f" ({s.draft_model})" if s.draft_model else "")
            + f", k={s.num_speculative_tokens}, acceptance a={s.acceptance_mean:.2f}"
            f" -> {s.expected_tokens_per_step():.2f} tokens/step",
            "  sources: " + "; ".join(self.sources),
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# --- A100, CodeLlama-34B, TP2: Vidur's measured tables -------------------------------------

_A100_34B_DECODE = StepTable(
    batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
    short_context=512,
    short_ms=(30.8, 31.2, 31.3, 31.3, 31.1, 32.3, 35.1, 41.2),
    long_context=2048,
    long_ms=(30.8, 31.2, 31.4, 32.2, 32.8, 36.2, 42.8, 53.5),
)
# Verification of 6 tokens per sequence: Vidur's lower bound (KV read once per sequence, as
# vLLM V1 does) at 512 tokens of context, its batch-expansion upper bound at 2048.
_A100_34B_VERIFY = StepTable(
    batch_sizes=(1, 2, 4, 8, 16, 32, 64),
    short_context=512,
    short_ms=(30.8, 30.3, 30.6, 32.6, 37.6, 49.1, 75.1),
    long_context=2048,
    long_ms=(31.8, 32.4, 33.3, 38.1, 48.7, 76.4, 132.7),
)
# Prefill of one request; the 1-token point is derived: one token costs a batch-1 decode step.
_A100_34B_PREFILL = Curve((1, 128, 512, 2048, 4096), (30.8, 35.9, 98.7, 369.0, 769.0))
# Vidur's CPU overhead for TP2 34B: 8.0 ms at B=8, 13.4 ms at B=128 -> 7.64 + 0.045 B.
_A100_34B_OVERHEAD = Linear(7.64, 0.045)
# Derived: a batch-1 decode step is the weight read plus a negligible KV read.
_A100_34B_WEIGHT_READ_MS = 30.5
# A ~1.1B draft (TinyLlama class). Assumed: ~3 ms per draft pass at batch 1 (the whitepaper's
# batch-1 figures imply it); 11 us per sequence per pass (2.2 GFLOP/token at ~200 TFLOP/s);
# 15 ns per cached token per pass (22 KiB/token at ~1.5 TB/s); prefill at the same rates.
_TINYLLAMA_DRAFT = DraftCost(
    pass_ms=3.0, pass_per_seq_us=11.0, per_pass_kv_ns=15.0, prefill_fixed_ms=3.0, prefill_per_token_us=11.0
)

A100_CODELLAMA_34B = Profile(
    name="a100-codellama34b-tp2",
    title="measured: CodeLlama-34B, 2xA100 TP2, Vidur operator tables, ~1B draft, k=5",
    model="codellama/CodeLlama-34b-Instruct-hf",
    hardware="2x A100-80GB (TP2)",
    steps=TableStepModel(
        decode=_A100_34B_DECODE,
        verify=_A100_34B_VERIFY,
        verify_query=6,
        prefill=_A100_34B_PREFILL,
        weight_read_ms=_A100_34B_WEIGHT_READ_MS,
        overhead=_A100_34B_OVERHEAD,
    ),
    # Derived for TP2 from the one-card vLLM 0.11 figures: 72 GiB usable per card (0.9 of 80),
    # 1.67 GiB non-KV overhead (72 - 62.9 - 7.43), half the weights (31.45 GiB) and half of
    # 192 KiB/token per card: (72 - 31.45 - 1.67) GiB / 96 KiB = 424,673 tokens.
    kv_capacity_tokens=424_673,
    spec=SpecProfile(
        method="draft_model",
        draft_model="TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        num_speculative_tokens=5,
        # Draft models on chat accept a ~ 0.6-0.75, on code ~ 0.8; 0.72 is what the
        # whitepaper's batch-1 TPOT implies.
        acceptance_mean=0.72,
        acceptance_concentration=30.0,  # assumed: per-request a has a standard deviation ~0.08
        draft=_TINYLLAMA_DRAFT,
        # Derived: the draft's weights (2.05 GiB) and KV (22 KiB/token), split over TP2:
        # (38.88 - 1.03) GiB / (96 + 11) KiB = 370,914 tokens (-12.7%).
        kv_capacity_tokens=370_914,
    ),
    max_model_len=16_384,
    sources=("vidur", "vllm-0.11-kv", "leviathan"),
)


# --- The whitepaper's own profile -----------------------------------------------------------

# Plain TTFT 420 ms for 512 prompt tokens: the measured prefill curve scaled so that
# prefill(512) + overhead(1) = 420 ms -> factor (420 - 7.685) / 98.7 = 4.1775 (derived).
_WHITEPAPER_PREFILL_SCALE = 4.1775
# Speculative TPOT 18 ms at k=6 with a = 0.72 (3.21 tokens/step) needs a 57.5 ms step:
# 30.9 verification + 7.7 overhead leaves 18.9 ms for six draft passes -> 3.13 ms each.
# TTFT 480 ms: 420 + 18.9 (first draft passes) + draft prefill(512) -> 41.1 ms (derived).
_WHITEPAPER_DRAFT = DraftCost(
    pass_ms=3.13, pass_per_seq_us=11.0, per_pass_kv_ns=15.0, prefill_fixed_ms=35.5, prefill_per_token_us=11.0
)

WHITEPAPER = Profile(
    name="whitepaper",
    title="the whitepaper's profile: CodeLlama-34B, A100-80G, vLLM 0.6.0, TinyLlama-1.1B draft, k=6",
    model="codellama/CodeLlama-34b-Instruct-hf",
    hardware="1x A100-80GB",
    steps=TableStepModel(
        decode=_A100_34B_DECODE,
        verify=_A100_34B_VERIFY,
        verify_query=6,
        prefill=_A100_34B_PREFILL.scaled(_WHITEPAPER_PREFILL_SCALE),
        weight_read_ms=_A100_34B_WEIGHT_READ_MS,
        overhead=_A100_34B_OVERHEAD,
    ),
    kv_capacity_tokens=40_592,  # measured (vLLM 0.11, one 80 GB card)
    spec=SpecProfile(
        method="draft_model",
        draft_model="TinyLlama/TinyLlama-1.1B-Chat-v1.0",
        num_speculative_tokens=6,
        acceptance_mean=0.72,
        acceptance_concentration=30.0,
        draft=_WHITEPAPER_DRAFT,
        # The whitepaper says the draft adds 4.2 GB: (7.43 GiB - 3.91 GiB) / 192 KiB (derived).
        kv_capacity_tokens=19_215,
    ),
    max_model_len=16_384,
    sources=("whitepaper", "vidur", "vllm-0.11-kv", "leviathan"),
    notes=(
        "reproduces the whitepaper's batch-1 figures (TTFT 420/480 ms, TPOT 38/18 ms);",
        "its +60 ms speculative TTFT is pessimistic (about +26 ms derived from the measured tables)",
        "its 1.4x speedup at batch 8 is not reproduced: step times do not support it (CALIBRATION.md)",
    ),
)


# --- H100, Llama-2-7B, TP1: Vidur's tables (H100 rows derived from A100 by Vidur's ratios) ---

_EAGLE_DRAFT = DraftCost(
    # The SpecDecode-Bench EAGLE fit, per step: 2.135 ms + 0.84 us x k + 2.38 ns x KV tokens.
    step_fixed_ms=2.135,
    pass_ms=0.00084,
    per_step_kv_ns=2.38,
    # Assumed: the one-layer head over the prompt costs ~1/32 of the target's 21 us/token.
    prefill_per_token_us=0.66,
)

H100_LLAMA2_7B = Profile(
    name="h100-llama2-7b",
    title="Llama-2-7B, 1xH100, Vidur operator tables, EAGLE head, k=3",
    model="meta-llama/Llama-2-7b-chat-hf",
    hardware="1x H100-80GB",
    steps=TableStepModel(
        decode=StepTable(
            batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
            short_context=512,
            short_ms=(5.9, 6.0, 6.2, 6.8, 7.8, 9.2, 11.8, 17.0),
            long_context=2048,
            long_ms=(6.1, 6.8, 7.4, 9.2, 11.9, 17.1, 26.8, 43.8),
        ),
        verify=StepTable(
            batch_sizes=(1, 2, 4, 8, 16, 32, 64),
            short_context=512,
            short_ms=(5.9, 6.3, 6.5, 7.2, 9.3, 10.8, 17.0),
            long_context=2048,
            long_ms=(8.4, 10.5, 14.4, 22.3, 37.1, 60.2, 109.9),
        ),
        verify_query=6,
        prefill=Curve((1, 128, 512, 2048, 4096), (5.9, 6.9, 13.4, 49.3, 114.0)),
        weight_read_ms=5.8,
        # Vidur's CPU overhead for TP1 7B: 1.4 ms at B=8, 7.2 ms at B=128.
        overhead=Linear(1.013, 0.04833),
    ),
    # Derived: (72 - 12.55 weights - 1.67) GiB / 512 KiB per token.
    kv_capacity_tokens=118_333,
    spec=SpecProfile(
        method="eagle",
        draft_model="yuhuili/EAGLE-llama2-chat-7B",
        num_speculative_tokens=3,
        acceptance_mean=0.6,  # derived from the SpecDecode-Bench batch-128 speedup, see below
        acceptance_concentration=30.0,
        draft=_EAGLE_DRAFT,
        # Derived: a ~0.24B head (0.45 GiB) with one layer of KV (16 KiB/token).
        kv_capacity_tokens=113_857,
    ),
    max_model_len=4_096,
    sources=("vidur", "specdecode-bench", "leviathan"),
)


# --- H100, Llama-3.1-8B: the SpecDecode-Bench linear fit ------------------------------------

H100_LLAMA31_8B = Profile(
    name="h100-llama31-8b",
    title="Llama-3.1-8B, 1xH100, SpecDecode-Bench linear fit (vLLM 0.10.1), EAGLE, k=3",
    model="meta-llama/Llama-3.1-8B-Instruct",
    hardware="1x H100-80GB",
    steps=LinearStepModel(base_ms=5.886, per_token_us=21.01, per_kv_token_ns=39.26, step_overhead_ms=1.207),
    # Derived: (72 - 14.96 weights - 1.67) GiB / 128 KiB per token (GQA, 8 KV heads).
    kv_capacity_tokens=453_591,
    spec=SpecProfile(
        method="eagle",
        draft_model="yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
        num_speculative_tokens=3,
        # Derived: with this fit, a = 0.6 reproduces the measured 1.21x speedup at batch 128
        # (GSM8K-sized contexts) and gives ~1.66x at batch 1.
        acceptance_mean=0.6,
        acceptance_concentration=30.0,
        draft=_EAGLE_DRAFT,
        # Derived: a ~0.4B head (0.75 GiB) with one layer of KV (4 KiB/token).
        kv_capacity_tokens=433_888,
    ),
    max_model_len=32_768,
    sources=("specdecode-bench", "leviathan"),
)


DEFAULT_PROFILE = A100_CODELLAMA_34B.name

PROFILES: Mapping[str, Profile] = MappingProxyType(
    {p.name: p for p in (A100_CODELLAMA_34B, WHITEPAPER, H100_LLAMA2_7B, H100_LLAMA31_8B)}
)


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(PROFILES)
        raise KeyError(f"unknown profile {name!r}; known profiles: {known}") from None
