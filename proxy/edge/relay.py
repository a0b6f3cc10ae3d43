"""Reading a replica's answer under the model's timeouts and the proxy's size bound.

Timeouts (per model, service defaults): `first_byte_timeout_s` bounds the wait for the answer's
headers and then for a stream's first chunk, since a long prefill on a big model is legitimate;
`stream_idle_timeout_s` bounds the silence between two chunks. A stream has no total timeout; a
non-streamed answer's body must end within `first_byte_timeout_s` of its headers, however it trickles.
On expiry the upstream connection is closed, so the backend stops working for nobody.

What the proxy holds in memory (error bodies, non-streamed answers) is bounded by
`service.max_response_bytes`. A backend's error answer becomes an OpenAI error: its own envelope
and status when it sent one, else 502 `backend_error` with a short excerpt.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
from dataclasses import dataclass
from types import TracebackType
from typing import Any, AsyncIterator

from proxy.config.model import ModelConfig
from proxy.config.settings import ServiceSettings
from proxy.errors import BackendError, BackendTimeout, PoolError, RefusedByBackend
from proxy.upstream.client import Answer

EXCERPT_CHARS = 200
# Error codes a backend may send that the request metrics keep as they are: the shims' own and the
# common OpenAI ones. Any other becomes `backend_error` there (the client still gets it as sent),
# so an engine cannot grow the label without bound.
KNOWN_BACKEND_CODES = frozenset({
    "context_length_exceeded", "invalid_request", "invalid_request_error", "invalid_messages",
    "model_not_found", "model_loading", "model_load_failed", "shutting_down", "engine_fault", "engine_error",
    "modality_unsupported", "multi_turn_unsupported", "target_lang_required", "unsupported_language",
    "rate_limit_exceeded", "server_error", "invalid_type", "missing_required_parameter"})
# A backend's answer to a request it refuses as malformed: the client's mistake (see backend_error).
CLIENT_STATUSES = frozenset({400, 413, 422})
# The OpenAI error types a backend's 4xx may keep; an engine's own (llama-server's
# `exceed_context_size_error`) becomes `invalid_request_error`.
OPENAI_CLIENT_TYPES = frozenset({"invalid_request_error", "not_found_error", "permission_error"})
# How engines say that a prompt does not fit (llama-server's type, vLLM's and llama-server's
# messages), for OpenAI's `context_length_exceeded`.
CONTEXT_TYPES = frozenset({"exceed_context_size_error"})
CONTEXT_PHRASES = ("exceeds the available context size", "maximum context length", "context length exceeded",
                   "longer than the maximum model length")


# Whether the engine alone judges the input of the request in this task (proxy/serving/token_ids.py:
# /tokenize, /detokenize, token ids of a vocabulary the proxy could not read): its 500 is then the
# engine failing on what the client sent, the client's 400 (`input_refused`) and no failure of the
# replica. Set by the route, which knows the body; read where the answer is read (forward.read_answer).
# A context variable, as upstream.client's SENDING: the data path in between need not carry it.
ENGINE_JUDGES_INPUT: contextvars.ContextVar[bool] = contextvars.ContextVar("engine_judges_input", default=False)


@dataclass(frozen=True)
class Timeouts:
    first_byte_s: float
    idle_s: float

    @classmethod
    def of(cls, service: ServiceSettings, model: ModelConfig) -> "Timeouts":
        return cls(first_byte_s=float(model.get("first_byte_timeout_s", service.first_byte_timeout_s)),
                   idle_s=float(model.get("stream_idle_timeout_s", service.stream_idle_timeout_s)))


class Deadline:
    """`with Deadline(seconds): await ...`: TimeoutError when the awaits inside take longer.

    What asyncio.timeout does, as asyncio.timeout does it (the task is cancelled when the time is
    up, and that cancellation, told apart from any other by the task's cancel count, becomes
    TimeoutError), in a plain `with`: one timer and no coroutine of its own. It runs once per
    request, and every coroutine layer around an await is paid again each time the request's task
    resumes there (asyncio.timeout's was a measurable share of the hop's CPU). Not wait_for: no
    task per call, and a cancellation (the client left) that lands as the wait ends is never
    swallowed."""

    __slots__ = ("seconds", "task", "fired", "cancelling", "timer")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.fired = False

    def __enter__(self) -> "Deadline":
        task = asyncio.current_task()
        assert task is not None, "a Deadline bounds the awaits of a task"
        self.task = task
        self.cancelling = task.cancelling()   # cancellations requested before this wait began
        self.timer = task.get_loop().call_later(self.seconds, self._fire)
        return self

    def _fire(self) -> None:
        self.fired = True
        self.task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.timer.cancel()
        if not self.fired:
            return
        # Its own cancellation is taken back; only when no other was asked for meanwhile (the
        # client left too) is what it interrupted a timeout. Once fired, the cancellation lands at
        # the await inside the block even if what it awaited had just completed (the task was
        # suspended there): such a wait counts as timed out, as with asyncio.timeout.
        if self.task.uncancel() <= self.cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc


class _Stalled(Exception):
    """Raised by ReadWatch into a read that ran past its limit."""


class ReadWatch:
    """The time limits of one response's reads, with one timer for all of them instead of one
    asyncio.timeout per read (a timer scheduled and cancelled per stream chunk was a measurable
    share of the relay's CPU). Each read must end within its limit: the first within `first`, each
    next one within `idle`; the time between reads (the relay writing to its client) does not
    count, as before. A read past its limit raises BackendTimeout naming the setting, and the
    connection is closed so the backend stops."""

    def __init__(self, resp: Answer, label: str, first: tuple[float, str],
                 idle: tuple[float, str]) -> None:
        self.resp = resp
        self.label = label
        self.limit, self.setting = first
        self.idle = idle
        self.since: float | None = None   # when the read in progress began
        self.loop = asyncio.get_running_loop()
        self.timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> None:
        """`with watch: await <one read of resp.content>`. A plain `with`, not a coroutine around the
        read: a stream's task resumes at its read once per chunk, through every layer around it."""
        now = self.since = self.loop.time()
        due = now + self.limit
        if self.timer is None or self.timer.when() > due:
            # The first read, or the first after a longer first-byte limit: the timer must not be late.
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_at(due, self._check)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        limit, setting = self.limit, self.setting
        self.since = None
        self.limit, self.setting = self.idle
        if exc_type is _Stalled:
            raise timed_out(self.label, limit, setting) from None

    def _check(self) -> None:
        if self.resp.closed and self.since is None:
            self.timer = None   # the answer is over; nothing left to watch
            return
        now = self.loop.time()
        if self.since is None:
            self.timer = self.loop.call_at(now + self.limit, self._check)
        elif now >= self.since + self.limit:
            self.timer = None
            self.resp.content.set_exception(_Stalled())
            self.resp.close()
        else:
            self.timer = self.loop.call_at(self.since + self.limit, self._check)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def excerpt(raw: bytes) -> str:
    text = raw[:EXCERPT_CHARS * 4].decode(errors="replace").strip()
    text = " ".join(text.split())
    return text[:EXCERPT_CHARS] + ("..." if len(text) > EXCERPT_CHARS or len(raw) > EXCERPT_CHARS * 4 else "")


def timed_out(replica_label: str, seconds: float, setting: str) -> BackendTimeout:
    return BackendTimeout(f"{replica_label} sent nothing for {seconds:g}s ({setting})")


async def read_capped(resp: Answer, timeouts: Timeouts, limit: int, label: str) -> bytes:
    """The whole body of a non-streamed answer, at most `limit` bytes, within first_byte_timeout_s
    (a non-streamed answer's bytes come when it is done: one that trickles is held to it too) and
    with no silence longer than stream_idle_timeout_s; the connection is closed on a timeout or past
    the limit."""
    if resp.content_length is not None and resp.content_length > limit:
        resp.close()
        raise too_large(label, limit)
    buf = bytearray()
    idle = (timeouts.idle_s, "stream_idle_timeout_s")
    watch = ReadWatch(resp, label, idle, idle)
    total = Deadline(timeouts.first_byte_s)
    try:
        with total:
            while True:
                with watch:
                    chunk = await resp.content.readany()
                if not chunk:
                    return bytes(buf)
                buf += chunk
                if len(buf) > limit:
                    resp.close()
                    raise too_large(label, limit)
    except TimeoutError as exc:   # this deadline's, or the client's own (a provider's remote_timeout_s)
        resp.close()
        why = f"within {timeouts.first_byte_s:g}s (first_byte_timeout_s)" if total.fired else f"in time: {exc}"
        raise BackendTimeout(f"{label} did not end its answer {why}") from None
    finally:
        watch.close()


def too_large(label: str, limit: int) -> BackendError:
    return BackendError(f"{label} answered more than service.max_response_bytes ({limit} bytes)",
                        code="backend_response_too_large")


def stream_watch(resp: Answer, timeouts: Timeouts, label: str) -> ReadWatch:
    """A stream's reads: the first within first_byte_timeout_s, each next one within
    stream_idle_timeout_s; on expiry the upstream connection is closed so the backend stops."""
    return ReadWatch(resp, label, (timeouts.first_byte_s, "first_byte_timeout_s"),
                     (timeouts.idle_s, "stream_idle_timeout_s"))


async def sse_data(resp: Answer, timeouts: Timeouts, label: str) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an upstream OpenAI SSE stream, one per `data:` line, as they arrive.

    The stream's contract is checked: a chunk that is not a JSON object, an `error` event, or an
    end without `data: [DONE]` raises BackendError, so a broken stream is never taken for a
    finished one."""
    error_event = False
    watch = stream_watch(resp, timeouts, label)
    try:
        while True:
            try:
                with watch:
                    line = await resp.content.readline()
            except ValueError:  # a line over aiohttp's limit
                raise BackendError(f"{label} sent a stream line too long to be an SSE event") from None
            if not line:
                raise BackendError(f"{label} ended its stream without [DONE]")
            if line.startswith(b"event:"):
                error_event = line[6:].strip() == b"error"
                continue
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                chunk = json.loads(data)
            except (ValueError, RecursionError):
                raise BackendError(f"{label} sent a malformed stream chunk: {excerpt(data)!r}") from None
            if not isinstance(chunk, dict):
                raise BackendError(f"{label} sent a stream chunk that is not a JSON object: {excerpt(data)!r}")
            if error_event or "error" in chunk:  # llama-server sends `data: {"error": ...}` and ends the stream
                raise backend_error(500, data, label, mid_stream=True)
            yield chunk
    finally:
        watch.close()


def backend_error(status: int, raw: bytes, label: str, retry_after: str | None = None,
                  mid_stream: bool = False) -> PoolError:
    """A backend's error answer as an OpenAI error. Its own envelope passes on with its status;
    anything else (an HTML page, a bare string) becomes 502 `backend_error` with an excerpt."""
    err, message = _error_of(raw)
    if status in CLIENT_STATUSES and not mid_stream:
        return _refused(status, err if isinstance(err, dict) else {}, message if isinstance(message, str) else None,
                        raw, label)
    if isinstance(message, str) and message:
        out = BackendError(message, status=502 if mid_stream else status)
        assert isinstance(err, dict) or isinstance(err, str)
        if isinstance(err, dict):
            if isinstance(err.get("code"), str) and err["code"]:
                out.code = err["code"]
                out.metric_code = out.code if out.code in KNOWN_BACKEND_CODES else BackendError.code
            if isinstance(err.get("type"), str) and err["type"]:
                out.type = err["type"]
            if isinstance(err.get("param"), str):
                out.param = err["param"]
    else:
        what = "an error event" if mid_stream else f"HTTP {status}"
        out = BackendError(f"{label} answered {what} that is not an OpenAI error: {excerpt(raw)!r}")
    if retry_after is not None:
        try:
            out.retry_after = float(retry_after)
        except ValueError:
            pass  # an HTTP date; the default Retry-After applies
    return out


def _error_of(raw: bytes) -> tuple[Any, Any]:
    """An answer's `error` (an object, a string, or None where there is none) and its message."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        doc = None
    err = doc.get("error") if isinstance(doc, dict) else None
    return err, err.get("message") if isinstance(err, dict) else err


def input_refused(status: int, raw: bytes, label: str) -> PoolError:
    """An engine's 500 to a request whose input only it could judge (ENGINE_JUDGES_INPUT), as the
    client's 400 `invalid_request_error`, with the engine's own words."""
    _err, message = _error_of(raw)
    said = excerpt(message.encode()) if isinstance(message, str) and message else repr(excerpt(raw))
    out = RefusedByBackend(f"{label} could not take this request's input (HTTP {status}): {said}")
    out.metric_code = RefusedByBackend.code
    return out


def _refused(status: int, err: dict[str, Any], message: str | None, raw: bytes, label: str) -> PoolError:
    """A request the backend refused as malformed, as OpenAI says it: the backend's message (or an
    excerpt of its answer), OpenAI's type, and `context_length_exceeded` for a prompt that does not
    fit. It is the client's mistake: counted as such, and never against the replica."""
    text = message or f"{label} refused the request (HTTP {status}): {excerpt(raw)!r}"
    out = RefusedByBackend(text, status=status)
    kind, code = err.get("type"), err.get("code")
    if kind in CONTEXT_TYPES or any(p in text.lower() for p in CONTEXT_PHRASES):
        out.code = "context_length_exceeded"
    elif isinstance(code, str) and code:
        out.code = code   # the client gets it as sent; the metrics only a well-known one
    if isinstance(kind, str) and kind in OPENAI_CLIENT_TYPES:
        out.type = kind
    if isinstance(err.get("param"), str):
        out.param = err["param"]
    out.metric_code = out.code if out.code in KNOWN_BACKEND_CODES else RefusedByBackend.code
    return out
