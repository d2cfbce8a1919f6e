"""The typed keys under which the application keeps its shared resources."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from specgate.gateway.advisor import Advisor
from specgate.gateway.config import GatewaySettings
from specgate.gateway.metrics import GatewayMetrics
from specgate.gateway.policy_sync import PolicyControl
from specgate.gateway.relay import Relay
from specgate.workers.pools import Fleet

SETTINGS = web.AppKey("settings", GatewaySettings)
SESSION = web.AppKey("session", aiohttp.ClientSession)
FLEET = web.AppKey("fleet", Fleet)
METRICS = web.AppKey("metrics", GatewayMetrics)
RELAY = web.AppKey("relay", Relay)
POLICY = web.AppKey("policy", PolicyControl)
ADVISOR = web.AppKey("advisor", Advisor)
