"""What a generated token costs: the whitepaper's arithmetic, the throughput that prices a pool,
and the [pricing] section."""

from __future__ import annotations

import math

import pytest

from specgate.calibration.modes import Pool
from specgate.calibration.pricing import usd_per_million_tokens
from specgate.gateway.config import ConfigError, parse_settings
from specgate.gateway.throughput import TokenRate


def test_the_whitepaper_s_cost_per_million_tokens_from_its_inputs() -> None:
    # An A100 at $3.49 an hour: 105 tokens/s plain, 198 tokens/s with speculation.
    assert usd_per_million_tokens(3.49, 105) == pytest.approx(9.23, abs=0.01)
    assert usd_per_million_tokens(3.49, 198) == pytest.approx(4.89, abs=0.01)
    assert usd_per_million_tokens(2 * 3.49, 2 * 105) == pytest.approx(usd_per_million_tokens(3.49, 105))
    assert math.isinf(usd_per_million_tokens(3.49, 0))  # a pool that generates nothing
    assert usd_per_million_tokens(0.0, 100) == 0.0
    with pytest.raises(ValueError, match="negative"):
        usd_per_million_tokens(-1.0, 100)


def test_a_pool_s_throughput_is_over_the_last_minute_or_since_the_start() -> None:
    rate = TokenRate(started=1000.0)
    rate.add(Pool.PLAIN, 300, now=1000.5)
    rate.add(Pool.PLAIN, 300, now=1009.9)
    rate.add(Pool.PLAIN, 0, now=1009.9)  # nothing generated: nothing counted
    assert rate.per_second(Pool.PLAIN, now=1010.0) == pytest.approx(60.0)  # 600 over the 10 s since the start
    assert rate.per_second(Pool.SPECULATIVE, now=1010.0) == 0.0
    assert rate.per_second(Pool.PLAIN, now=1030.0) == pytest.approx(20.0)  # over 30 s
    assert rate.per_second(Pool.PLAIN, now=1065.0) == pytest.approx(5.0)  # the first 300 left the minute
    assert rate.per_second(Pool.PLAIN, now=1100.0) == 0.0
    young = TokenRate(started=0.0)
    young.add(Pool.PLAIN, 30, now=0.2)
    assert young.per_second(Pool.PLAIN, now=0.2) == pytest.approx(30.0)  # never over less than a second


def test_pricing_section() -> None:
    base = {"models": {"served": ["m"]}, "pools": {"plain": {"urls": ["http://127.0.0.1:1"]}}}
    assert parse_settings(base).usd_per_replica_hour == {}
    both = parse_settings({**base, "pricing": {"usd_per_replica_hour": 3.49}})
    assert both.usd_per_replica_hour == {Pool.SPECULATIVE: 3.49, Pool.PLAIN: 3.49}
    own = parse_settings({**base, "pricing": {"usd_per_replica_hour": 3.49, "plain_usd_per_replica_hour": 0.0}})
    assert own.usd_per_replica_hour == {Pool.SPECULATIVE: 3.49, Pool.PLAIN: 0.0}
    one = parse_settings({**base, "pricing": {"speculative_usd_per_replica_hour": 4.1}})
    assert one.usd_per_replica_hour == {Pool.SPECULATIVE: 4.1}
    for bad in ({"usd_per_replica_hour": -1}, {"usd_per_replica_hour": "cheap"}, {"per_token": 1}):
        with pytest.raises(ConfigError, match=r"^pricing"):
            parse_settings({**base, "pricing": bad})
