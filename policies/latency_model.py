"""Per-replica latency predictions from the calibrated profile.

For the replica a request would join:

- TTFT: the requests still before their first token there are prefilled first (each assumed the
  size of this one), then this prompt, with the CPU overhead of a step; a speculative replica adds
  the draft's prefill and its first k draft passes.
- TPOT: the step time at the batch the request would join (its load plus one), at a context of
  the prompt plus half the expected output; a speculative replica divides its draft-and-verify step
  by the tokens per step it was last seen to emit (the profile's mean until scraped).

These are the profile's figures, not yet corrected by what the gateway observes.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.features import RequestFeatures
from workers.sim.costs import Batch
from workers.sim.profiles import Profile
from workers.snapshot import Pool, ReplicaState

DEFAULT_OUTPUT_TOKENS = 256
"""Assumed output length when neither the client nor max_tokens says more."""


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class LatencyModel:
    profile: Profile

    def expected_output(self, features: RequestFeatures) -> int:
        if features.expected_output_tokens is not None:
            return features.expected_output_tokens
        if features.max_tokens is not None:
            return min(features.max_tokens, DEFAULT_OUTPUT_TOKENS)
        return DEFAULT_OUTPUT_TOKENS

    def predict(self, replica: ReplicaState, features: RequestFeatures) -> Prediction:
        steps = self.profile.steps
        spec = self.profile.spec
        speculative = replica.pool is Pool.SPECULATIVE
        k = spec.num_speculative_tokens if speculative else 0
        prompt = max(features.prompt_tokens, 1)
        batch = max(round(replica.load), 0)
        ahead = replica.prefilling + int(replica.waiting or 0)

        prefill = Batch(prefill_tokens=prompt * (ahead + 1), prefill_seqs=ahead + 1)
        ttft = steps.forward_ms(prefill) + steps.overhead_ms(prefill.num_seqs)
        if speculative:
            ttft += spec.draft.prefill_ms(prompt) + spec.draft.step_ms(k, 1, prompt)

        context = prompt + self.expected_output(features) / 2
        decode = Batch(decode_seqs=batch + 1, query_per_seq=1 + k, mean_context=context)
        step = steps.forward_ms(decode) + steps.overhead_ms(decode.num_seqs)
        if speculative:
            step += spec.draft.step_ms(k, decode.decode_seqs, decode.decode_seqs * context)
            tokens_per_step = replica.tokens_per_step or spec.expected_tokens_per_step()
            tpot = step / max(tokens_per_step, 1.0)
        else:
            tpot = step
        return Prediction(ttft_ms=ttft, tpot_ms=tpot)
