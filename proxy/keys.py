"""Typed keys for what the aiohttp app holds."""
from __future__ import annotations

import aiohttp
from aiohttp import web

from proxy.config import Settings
from proxy.metrics import ProxyMetrics
from proxy.pool import Pool

SETTINGS = web.AppKey("settings", Settings)
POOL = web.AppKey("pool", Pool)
HTTP = web.AppKey("http", aiohttp.ClientSession)
METRICS = web.AppKey("metrics", ProxyMetrics)
