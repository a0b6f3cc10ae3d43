"""Running the batches (docs/batches.md): each line is sent to this proxy's own listener as its
owner would send it, so that it goes through everything a request goes through (the checks, the
tenant's key, limits and budget, the fair queue, a replica, failover, the ledger, the metrics),
at the `batch` priority class (proxy/fairness.py), and its answer is kept (proxy/batches/store.py).

How many lines run at once: as many as the model's free slots allow, less engine.batches.reserve_slots
kept free for the classes above (so that an interactive request finds a slot at once instead of
waiting for a line to end), counted again whenever a line ends and twice a second. A line is sent
only to a model that is loaded, or that loads on demand and fits beside the loaded ones without
evicting any: a batch never takes a model's room from its users.

A line the pool would not take now (a 429 of a full queue or a per-minute limit, a 503: the model is
loading, the queue timed out, the proxy is stopping) goes back to pending and its batch waits its
Retry-After; any other answer is the line's: a 2xx in the output file, the rest in the error file,
as OpenAI writes them.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from proxy.batches.store import BatchStore, new_id
from proxy.config.settings import BatchSettings
from proxy.edge.response_metrics import usage_numbers
from proxy.errors import NotFound
from proxy.fairness import FairnessPolicy
from proxy.lifecycle.pool import Pool
from proxy.lifecycle.state.replicas import ModelState
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.serving.body import PRIORITY_HEADER
from proxy.serving.tenancy import TENANCY
from proxy.supervisord.managed import pid_alive

log = logging.getLogger(__name__)

BATCH_CLASS = "batch"
TICK_S = 0.5
# Lines sent at most per round, and the pause between rounds while there is room for more: lines
# sent all at once end all at once, and each such wave (a request's work in this process for each
# line) held the event loop long enough to delay an interactive request's first token by 150 ms
# (tests/bench/bench_batches.py); paced, the waves spread out and stay spread.
BURST = 4
PACE_S = 0.02
# What the pool answers when it would not take a line now: the line waits, it does not fail.
RETRY_CODES = frozenset({"rate_limited", "fairness_key_queue_full", "executor_queue_full", "queue_full"})
RETRY_AFTER_S = (1.0, 60.0)   # the bounds of a batch's wait after such an answer
EXPIRED = {"code": "batch_expired",
           "message": "This request could not be executed before the completion window expired."}
# How many line ends the rate is measured over.
RATE_WINDOW = 64


@dataclass
class Running:
    """A batch with lines to run or an end to write, as this process holds it."""

    doc: dict[str, Any]
    owner: str
    model: str
    inflight: int = 0
    exhausted: bool = False          # no pending line was left at the last claim
    not_before: float = 0.0          # monotonic: its wait after a line the pool would not take
    ends: list[float] = field(default_factory=list)   # when its last lines ended (its rate)


class BatchRunner:
    def __init__(self, app: web.Application, store: BatchStore, settings: BatchSettings, pool: Pool,
                 policy: FairnessPolicy) -> None:
        self.app, self.store, self.settings, self.pool, self.policy = app, store, settings, pool, policy
        self.pid = os.getpid()
        self.running: dict[str, Running] = {}
        self.url: str | None = None
        self.claiming = False
        self.session: aiohttp.ClientSession | None = None
        self.keys: dict[str, str] = {}
        self.wake = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.loop_task: asyncio.Task[None] | None = None
        self.finalizing: set[str] = set()
        self.more = False   # the last round left room it did not fill (BURST): the next comes after PACE_S

    # -- from the routes -------------------------------------------------------------------------

    def add(self, doc: dict[str, Any], owner: str, model: str) -> None:
        self.running[doc["id"]] = Running(doc, owner, model)
        self.wake.set()

    def held(self, batch_id: str) -> Running | None:
        return self.running.get(batch_id)

    def cancel(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Its lines not yet sent are not sent; those in flight end; then its files are written."""
        held = self.running.get(doc["id"])
        doc = held.doc if held is not None else doc
        doc["status"], doc["cancelling_at"] = "cancelling", int(time.time())
        self.store.save(doc)
        self.wake.set()
        return self.store.batch(doc["id"], None) or doc

    def rate(self, batch_id: str) -> float | None:
        """Lines ended per second lately, or None before there is a measure."""
        held = self.running.get(batch_id)
        if held is None or len(held.ends) < 2 or held.ends[-1] <= held.ends[0]:
            return None
        return (len(held.ends) - 1) / (held.ends[-1] - held.ends[0])

    # -- its lifetime ----------------------------------------------------------------------------

    def start(self, url: str) -> None:
        """Run the batches through the listener at `url`, from now until `stop_claiming`."""
        self.url = url
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None))
        tenancy = self.app.get(TENANCY)
        if tenancy is not None:
            self.keys = {name: tenancy.keys.internal(name, "batch") for name in tenancy.settings.tenants}
        for doc, owner, model in self.store.active():
            self.running.setdefault(doc["id"], Running(doc, owner, model))
        self.claiming = True
        self.loop_task = asyncio.create_task(self._loop(), name="batch runner")

    def stop_claiming(self) -> None:
        """The proxy stops (or hands over): no line is sent from now on; those in flight end."""
        self.claiming = False
        self.wake.set()

    async def close(self) -> None:
        self.claiming = False
        if self.loop_task is not None:
            self.loop_task.cancel()
            await asyncio.gather(self.loop_task, return_exceptions=True)
        # What is still in flight outlived the drain: cancelled, its lines are pending for the next process.
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def _loop(self) -> None:
        recovered_at = 0.0
        while True:
            try:
                if time.monotonic() - recovered_at > 5:
                    recovered_at = time.monotonic()
                    self._recover()
                await self._fill()
            except Exception:
                log.exception("the batch runner failed a round; it goes on")
            if self.more:
                await asyncio.sleep(PACE_S)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), TICK_S)
            self.wake.clear()

    def _recover(self) -> None:
        """Lines a process that is gone left running (killed, or a reload's predecessor that died)."""
        for pid in self.store.running_owners(self.pid):
            if not pid_alive(pid):
                count = self.store.recover(pid)
                if count:
                    log.info("batches: %d line(s) of process %d, which is gone, are pending again", count, pid)
                for held in self.running.values():
                    held.exhausted = False

    async def _fill(self) -> None:
        if not self.claiming:
            # Stopping, or handed over: the lines in flight end on their own; what is left (a batch's
            # end, an expiry, a cancel's files) is the next process's, which reads the same file.
            return
        now, mono = time.time(), time.monotonic()
        self.more, budget = False, BURST
        ours: dict[str, int] = {}
        for held in self.running.values():
            ours[held.model] = ours.get(held.model, 0) + held.inflight
        for batch_id, held in list(self.running.items()):
            doc = held.doc
            if batch_id in self.finalizing:
                continue
            if doc["status"] == "in_progress" and now >= doc["expires_at"]:
                self._expire(held)
            if doc["status"] in ("cancelling", "finalizing"):
                # Once every line sent has ended (here, or in a reload's predecessor), its files.
                if held.inflight == 0 and self.store.counts(batch_id)["running"] == 0:
                    await self._finalize(held)
                continue
            if held.exhausted:
                # No line was left to claim: once its own have ended, it ends, unless lines came back
                # (a line the pool would not take, or those of a process that is gone).
                if held.inflight:
                    continue
                counts = self.store.counts(batch_id)
                if counts["pending"] == 0:
                    if counts["running"] == 0:
                        doc["status"], doc["finalizing_at"] = "finalizing", int(now)
                        self.store.save(doc)
                        await self._finalize(held)
                    continue
                held.exhausted = False
            if held.not_before > mono or self.url is None:
                continue
            runtime = self.pool.models.get(self.app_model(held.model))
            if runtime is None:
                continue
            room = self._room(runtime, ours.get(held.model, 0))
            if room <= 0:
                continue
            if room > budget:
                room, self.more = budget, True
            if room <= 0:
                continue
            lines = self.store.claim(batch_id, room, self.pid)
            budget -= len(lines)
            if len(lines) < room:
                held.exhausted = True
            for idx, custom_id, body in lines:
                held.inflight += 1
                ours[held.model] = ours.get(held.model, 0) + 1
                task = asyncio.create_task(self._send(held, idx, custom_id, body))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    def app_model(self, name: str) -> str:
        settings = self.pool.settings
        public = settings.aliases.get(name, name)
        adapted = settings.adapters.get(public)   # a LoRA adapter's lines run on its base model
        return adapted[0].name if adapted is not None else public

    def _room(self, runtime: ModelRuntime, ours: int) -> int:
        """How many more lines the model takes now (docs/batches.md: as the free slots allow)."""
        if runtime.state != ModelState.LOADED:
            if ours == 0 and runtime.state == ModelState.UNLOADED and runtime.config.load_on_demand and \
                    runtime.kind is not None and self.pool.placer.room_free(runtime):
                return 1   # it loads on demand, beside the others: one line brings it
            return 0
        admission = runtime.admission
        capacity = admission.capacity
        reserve = min(self.settings.reserve_slots, max(0, capacity - 1))
        others = max(0, admission.active + admission.waiting - ours)
        return max(0, capacity - reserve - others - ours)

    def _priority(self, owner: str) -> str:
        """`batch`, or the tenant's own class where that is lower (a line never raises it)."""
        names = [c.name for c in self.policy.classes]
        wanted = BATCH_CLASS if BATCH_CLASS in names else names[-1]
        tenant = self.pool.settings.tenants.get(owner)
        ceiling = tenant.priority if tenant is not None and tenant.priority else None
        if ceiling is not None and ceiling in names and names.index(ceiling) > names.index(wanted):
            return ceiling
        return wanted

    async def _send(self, held: Running, idx: int, custom_id: str, body: str) -> None:
        doc = held.doc
        request_id = new_id("batch_req_")
        headers = {"Content-Type": "application/json", PRIORITY_HEADER: self._priority(held.owner),
                   "X-Request-Id": request_id}
        assert self.session is not None and self.url is not None
        try:
            if held.owner and held.owner not in self.keys:
                # Its tenant was removed from the settings since: nobody may run its lines now.
                self.store.finish(doc["id"], idx, False, {
                    "id": request_id, "custom_id": custom_id, "response": None,
                    "error": {"code": "invalid_api_key", "message": f"tenant {held.owner!r} is not configured"}})
                return
            if held.owner:
                headers["Authorization"] = f"Bearer {self.keys[held.owner]}"
            try:
                async with self.session.post(self.url + doc["endpoint"], data=body.encode(), headers=headers) as resp:
                    status, raw = resp.status, await resp.read()
                    retry_after = resp.headers.get("Retry-After")
            except (aiohttp.ClientError, OSError) as exc:
                # This proxy's own listener refused it (it is stopping): the line waits for the next.
                log.info("batch %s: line %s not sent (%s); pending again", doc["id"], custom_id, exc)
                self.store.unclaim(doc["id"], idx)
                held.exhausted, held.not_before = False, time.monotonic() + RETRY_AFTER_S[0]
                return
            answer = _json(raw)
            code = answer.get("error", {}).get("code") if isinstance(answer.get("error"), dict) else None
            if status == 503 or (status == 429 and code in RETRY_CODES):
                self.store.unclaim(doc["id"], idx)
                held.exhausted = False
                held.not_before = time.monotonic() + _bounded(retry_after)
                return
            ok = 200 <= status < 300
            response = {"status_code": status, "request_id": request_id, "body": answer}
            error = None if ok else {"code": str(code or "request_failed"),
                                     "message": str(answer.get("error", {}).get("message", f"HTTP {status}"))
                                     if isinstance(answer.get("error"), dict) else f"HTTP {status}"}
            prompt, cached, output = usage_numbers(answer.get("usage")) if ok else (None, None, None)
            self.store.finish(doc["id"], idx, ok, {"id": request_id, "custom_id": custom_id, "response": response,
                                                   "error": error}, (prompt or 0, cached or 0, output or 0))
            held.ends.append(time.monotonic())
            del held.ends[:-RATE_WINDOW]
        except asyncio.CancelledError:
            self.store.unclaim(doc["id"], idx)
            raise
        except Exception:
            # A bug here must not leave the line running under this live process for good.
            log.exception("batch %s: line %s failed here; pending again", doc["id"], custom_id)
            self.store.unclaim(doc["id"], idx)
            held.exhausted, held.not_before = False, time.monotonic() + RETRY_AFTER_S[1]
        finally:
            held.inflight -= 1
            self.wake.set()

    def _expire(self, held: Running) -> None:
        """Past its completion window: its lines not yet sent are the error file's; those in flight
        end as they end."""
        doc = held.doc
        now = int(time.time())
        doc["status"], doc["expired_at"], doc["finalizing_at"] = "finalizing", now, now
        left = self.store.expire(doc, lambda cid: {"id": new_id("batch_req_"), "custom_id": cid, "response": None,
                                                   "error": EXPIRED})
        log.info("batch %s expired with %d line(s) not run", doc["id"], left)

    async def _finalize(self, held: Running) -> None:
        """Write its output and error files (where it has such lines); then it has ended: cancelled,
        expired or completed, as its timestamps say (a restart finishes what a stop left finalizing)."""
        doc = held.doc
        self.finalizing.add(doc["id"])
        try:
            status = "cancelled" if doc.get("cancelling_at") else "expired" if doc.get("expired_at") else "completed"
            for ok, key, suffix in ((True, "output_file_id", "output"), (False, "error_file_id", "errors")):
                row = await asyncio.to_thread(self.store.write_results, doc["id"], held.owner, ok,
                                              f"{doc['id']}_{suffix}.jsonl")
                doc[key] = row.id if row is not None else None
            doc["status"] = status
            doc[f"{status}_at"] = doc.get(f"{status}_at") or int(time.time())
            self.store.close_batch(doc)
            self.running.pop(doc["id"], None)
            counts = (self.store.batch(doc["id"], None) or doc)["request_counts"]
            log.info("batch %s %s: %d completed, %d failed", doc["id"], status, counts["completed"], counts["failed"])
        finally:
            self.finalizing.discard(doc["id"])

    def describe(self) -> dict[str, Any]:
        """GET /v1/admin/batches' figures of this process: per batch its rate and lines in flight, and
        per model the batch class's queue."""
        models = {held.model for held in self.running.values()}
        queues = {}
        for name in sorted(models):
            runtime = self.pool.models.get(self.app_model(name))
            if runtime is not None:
                classes = runtime.admission.describe_classes()
                queues[name] = classes.get(self._priority(""), {})
        return {"claiming": self.claiming, "queues": queues,
                "inflight": {bid: held.inflight for bid, held in self.running.items()}}


def runner_of(app: web.Application) -> BatchRunner:
    runner = app.get(BATCHES)
    if runner is None:
        raise NotFound("the Batch API is off here (engine.batches.enabled)", code="not_found")
    return runner


BATCHES: web.AppKey[BatchRunner] = web.AppKey("batches")


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {"error": {"message": raw[:500].decode("utf-8", "replace"), "code": "invalid_answer"}}
    return value if isinstance(value, dict) else {"value": value}


def _bounded(retry_after: str | None) -> float:
    try:
        seconds = float(retry_after) if retry_after is not None else 2.0
    except ValueError:
        seconds = 2.0
    return min(RETRY_AFTER_S[1], max(RETRY_AFTER_S[0], seconds))
