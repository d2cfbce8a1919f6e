"""What a generated token costs: the price of the replicas that generate it over the tokens they
generate in that time.

The speculative-decoding whitepaper prices it so: an A100 at $3.49 an hour generating 105 tokens/s
without speculation costs $9.23 per million tokens, and at 198 tokens/s with it $4.89 (its inputs
and its figures; tests/test_pricing.py reproduces them). The gateway prices each pool live from the
tokens it sees the pool generate (`gateway/throughput.py`) and a configured price per replica-hour;
a plan of the fleet's split prices each split from the throughput its simulation shows.
"""

from __future__ import annotations

SECONDS_PER_HOUR = 3600.0
TOKENS_PER_MILLION = 1e6


def usd_per_million_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    """The cost of a million tokens from replicas that cost `usd_per_hour` together and generate
    `tokens_per_s` together; infinite while they generate nothing."""
    if usd_per_hour < 0:
        raise ValueError(f"a price per hour cannot be negative, got {usd_per_hour}")
    if tokens_per_s <= 0:
        return float("inf")
    return usd_per_hour / (tokens_per_s * SECONDS_PER_HOUR) * TOKENS_PER_MILLION
