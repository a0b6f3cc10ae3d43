"""Typed keys for what the aiohttp app holds."""
from __future__ import annotations

from aiohttp import web

from proxy.config.model import Adapter
from proxy.config.settings import Settings
from proxy.serving.metrics import ProxyMetrics
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import Replica
from proxy.gpu.vram_estimate import Estimator
from proxy.serving.vocabulary import Vocabularies
from proxy.upstream.client import UpstreamHttp

SETTINGS = web.AppKey("settings", Settings)
POOL = web.AppKey("pool", Pool)
HTTP = web.AppKey("http", UpstreamHttp)
METRICS = web.AppKey("metrics", ProxyMetrics)
VRAM = web.AppKey("vram_estimator", Estimator)
# Each model file's vocabulary size, what a request's token ids are checked against.
VOCABULARIES = web.AppKey("vocabularies", Vocabularies)
# The models whose replicas were running when the pool started, which its startup adopts.
ADOPTING: web.AppKey[frozenset[str]] = web.AppKey("adopting")
# The model a request was admitted for, set once it is known to be a served model (so metric
# labels only ever hold configured model ids, never whatever a client typed).
MODEL = web.RequestKey("model", str)
# The model's LoRA adapter the request asked for by its id (docs/adapters.md), set with MODEL.
ADAPTER = web.RequestKey("adapter", Adapter)
# A fallback's body (proxy/serving/fallbacks.py): the request's, naming the model that answers in
# its model's place, and no raw bytes (they name the first).
FALLBACK_BODY = web.RequestKey("fallback_body", tuple)
# Set once the request's answer began (its headers went out): no fallback answers after that.
ANSWERED = web.RequestKey("answered", bool)
# For the request metrics: the request's fairness key, when it arrived (perf_counter), and the
# error code of a stream that failed after its 200 went out.
FAIRNESS_KEY = web.RequestKey("fairness_key", str)
STARTED = web.RequestKey("started", float)
STREAM_ERROR = web.RequestKey("stream_error", str)
# A stream whose end went out whole ([DONE], message_stop): a success with its counts, even if the
# client then closes before the handler returns (which cancels it) or before its last write.
STREAM_ENDED = web.RequestKey("stream_ended", web.StreamResponse)
# The replica that took the request, once one did: its index is every answer's X-Replica header.
REPLICA = web.RequestKey("replica", Replica)
REPLICA_HEADER = "X-Replica"
# The llama-server slot the request ran in on REPLICA, where the proxy chose one (Replica.slots).
ENGINE_SLOT = web.RequestKey("engine_slot", int)
# For the usage ledger: the tokens the answer's usage gave (prompt, cached, output), and how long
# the request waited for its slot.
USAGE = web.RequestKey("usage", tuple)
# True when USAGE's prompt count is the proxy's estimate, not the engine's or provider's figure (a
# stream that ended before its usage chunk): the ledger row says so.
USAGE_ESTIMATED = web.RequestKey("usage_estimated", bool)
QUEUE_WAIT = web.RequestKey("queue_wait_s", float)
# With tenants, the request's tenant: the scope of its affinity key and of its llama-server slot
# (proxy/lifecycle/state/slots.py). Absent without tenants: one scope, and slots only for affinity keys.
CACHE_SCOPE = web.RequestKey("cache_scope", str)
# With service.admin_port: whether the request came in on the admin listener (only it shows failure
# reasons on /health and /ready).
ON_ADMIN_LISTENER = web.RequestKey("on_admin_listener", bool)
