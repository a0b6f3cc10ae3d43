"""A simulated engine: an OpenAI-compatible server that behaves like a GPU engine, without one.

Continuous batching: up to `max_seqs` sequences run at once and the rest wait. A sequence first
prefills (time to first token plus its uncached prompt tokens at the prefill rate; a prompt prefix
seen before is cached), then joins the decode batch, where one shared step produces a token for
every decoding sequence. A step lasts 1/decode_tokens_per_s, longer by `batch_slowdown` for each
sequence beyond the first. `/metrics` speaks vLLM's names, and `fault_rate` fails that share of
requests (before or during their output). Its text is filler; its timing is the point.

Fault modes, for reliability tests and the chaos benchmark (all off by default): `hang_before_headers`
never answers, `stall_after_tokens` goes silent mid-answer with the connection open, `garbage`
breaks the SSE stream (a non-JSON chunk, no `[DONE]`, or a JSON chunk cut off), `error_rate` answers
`error_status` with a JSON or HTML body, `drop_rate` closes the connection after reading the
request, and `response_bytes` pads non-streamed answers.

    python -m shims.sim --port 8000 --model sim --max-seqs 32 --decode-tokens-per-s 50
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler

from shims.core import EngineFault, GenerationRequest, base_parser, create_app, run

WORDS = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor incididunt ut labore "
         "et dolore magna aliqua").split()
CHARS_PER_TOKEN = 4
CACHE_BLOCK_TOKENS = 16
CACHE_BLOCKS = 4096


@dataclass(frozen=True)
class SimParams:
    max_seqs: int = 8
    decode_tokens_per_s: float = 50.0
    prefill_tokens_per_s: float = 5000.0
    ttft_ms: float = 10.0
    batch_slowdown: float = 0.0
    prefix_cache: bool = True
    kv_cache_tokens: int = 65536
    fault_rate: float = 0.0
    seed: int | None = None
    hang_before_headers: bool = False
    stall_after_tokens: int = -1
    garbage: str = ""                 # "", "malformed", "no_done" or "truncated"
    error_rate: float = 0.0
    error_status: int = 500
    error_body: str = "json"          # or "html"
    drop_rate: float = 0.0
    response_bytes: int = 0


@dataclass(eq=False)
class _Seq:
    tokens: int                                   # prompt plus generated so far, for KV-cache use
    out: asyncio.Queue[str] = field(default_factory=asyncio.Queue)


class SimEngine:
    def __init__(self, model_name: str, params: SimParams) -> None:
        self.model_name = model_name
        self.params = params
        self.running: set[_Seq] = set()           # admitted: prefilling or decoding
        self.decoding: set[_Seq] = set()
        self.waiting: deque[tuple[_Seq, asyncio.Future[None]]] = deque()
        self.started: deque[dict[str, object]] = deque(maxlen=100_000)
        self.counters = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generation_tokens": 0,
                         "requests_finished": 0, "requests_failed": 0, "requests_received": 0,
                         "requests_dropped": 0}
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._rng = random.Random(params.seed)
        self._wake = asyncio.Event()
        self._stepper: asyncio.Task[None] | None = None

    def count_tokens(self, text: str) -> int:
        return max(1, len(text) // CHARS_PER_TOKEN)

    # -- continuous batching ---------------------------------------------------------------------

    async def _admit(self, seq: _Seq) -> None:
        """Take a place in the running batch, waiting in arrival order when it is full."""
        if len(self.running) < self.params.max_seqs and not self.waiting:
            self.running.add(seq)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (seq, fut)
        self.waiting.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if entry in self.waiting:
                self.waiting.remove(entry)
            elif seq in self.running:  # admitted just before the cancel: give the place on
                self.running.discard(seq)
                self._admit_next()
            raise

    def _admit_next(self) -> None:
        while self.waiting and len(self.running) < self.params.max_seqs:
            seq, fut = self.waiting.popleft()
            if not fut.done():
                self.running.add(seq)
                fut.set_result(None)

    def _step_seconds(self) -> float:
        extra = max(0, len(self.decoding) - 1)
        return (1.0 + self.params.batch_slowdown * extra) / self.params.decode_tokens_per_s

    async def _step_loop(self) -> None:
        word = 0
        while True:
            if not self.decoding:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self._step_seconds())
            for seq in list(self.decoding):
                seq.out.put_nowait(" " + WORDS[word % len(WORDS)])
                seq.tokens += 1
                word += 1

    def _cached_tokens(self, prompt: str) -> int:
        """Tokens of the prompt's longest cached block prefix; caches the prompt's blocks."""
        if not self.params.prefix_cache:
            return 0
        step = CACHE_BLOCK_TOKENS * CHARS_PER_TOKEN
        digest = hashlib.sha256()
        cached, hit = 0, True
        for end in range(step, len(prompt) + 1, step):
            digest.update(prompt[end - step:end].encode())
            key = digest.copy().digest()
            if hit and key in self._cache:
                self._cache.move_to_end(key)
                cached += CACHE_BLOCK_TOKENS
            else:
                hit = False
                self._cache[key] = None
                if len(self._cache) > CACHE_BLOCKS:
                    self._cache.popitem(last=False)
        return cached

    # -- the engine interface --------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[str]:
        if self._stepper is None:
            self._stepper = asyncio.create_task(self._step_loop())
        prompt_tokens = self.count_tokens(request.prompt)
        seq = _Seq(tokens=prompt_tokens)
        await self._admit(seq)
        try:
            self.started.append({"id": request.request_id, "fields": list(request.fields)})
            cached = self._cached_tokens(request.prompt)
            self.counters["prompt_tokens"] += prompt_tokens
            self.counters["cached_prompt_tokens"] += cached
            fail_at = self._rng.randrange(request.max_tokens + 1) \
                if self._rng.random() < self.params.fault_rate else None
            prefill = self.params.ttft_ms / 1000 + (prompt_tokens - cached) / self.params.prefill_tokens_per_s
            await asyncio.sleep(prefill)
            self.decoding.add(seq)
            self._wake.set()
            for produced in range(request.max_tokens):
                if produced == fail_at:
                    self.counters["requests_failed"] += 1
                    raise EngineFault(f"simulated fault after {produced} tokens")
                if produced == self.params.stall_after_tokens:
                    await asyncio.Event().wait()  # silent with the connection open, until the client leaves
                piece = await seq.out.get()
                self.counters["generation_tokens"] += 1
                yield piece
            self.counters["requests_finished"] += 1
        finally:
            self.decoding.discard(seq)
            self.running.discard(seq)
            self._admit_next()

    def metrics_text(self) -> str:
        kv = sum(s.tokens for s in self.running) / self.params.kv_cache_tokens
        label = f'{{model_name="{self.model_name}"}}'
        lines = [
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{label} {len(self.running)}",
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{label} {len(self.waiting)}",
            "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{label} {min(1.0, kv):.6f}",
            "# TYPE vllm:prompt_tokens counter", f"vllm:prompt_tokens_total{label} {self.counters['prompt_tokens']}",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{label} {self.counters['cached_prompt_tokens']}",
            "# TYPE vllm:generation_tokens counter",
            f"vllm:generation_tokens_total{label} {self.counters['generation_tokens']}",
            "# TYPE vllm:request_success counter",
            f"vllm:request_success_total{label} {self.counters['requests_finished']}",
            "# TYPE llm_pool_sim_faults counter",
            f"llm_pool_sim_faults_total{label} {self.counters['requests_failed']}",
            "# TYPE llm_pool_sim_requests_received counter",
            f"llm_pool_sim_requests_received_total{label} {self.counters['requests_received']}",
            "# TYPE llm_pool_sim_drops counter",
            f"llm_pool_sim_drops_total{label} {self.counters['requests_dropped']}",
        ]
        return "\n".join(lines) + "\n"


_HTML_ERROR = "<html><head><title>{status}</title></head><body><h1>{status} Internal Server Error</h1></body></html>"


def _fault_middleware(engine: SimEngine) -> Any:
    """The HTTP-level fault modes of SimParams, in front of the shared server core."""
    params = engine.params
    rng = random.Random(None if params.seed is None else params.seed + 1)

    @web.middleware
    async def faults(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST" or not request.path.endswith("completions"):
            return await handler(request)
        engine.counters["requests_received"] += 1
        if params.hang_before_headers:
            await asyncio.Event().wait()  # until the client leaves (handler cancellation)
        if params.drop_rate and rng.random() < params.drop_rate:
            await request.read()
            engine.counters["requests_dropped"] += 1
            assert request.transport is not None
            request.transport.close()
            await asyncio.Event().wait()
        if params.error_rate and rng.random() < params.error_rate:
            status = params.error_status
            if params.error_body == "html":
                return web.Response(status=status, text=_HTML_ERROR.format(status=status), content_type="text/html")
            return web.json_response({"error": {"message": "simulated error", "type": "server_error",
                                                "code": "sim_error", "param": None}}, status=status)
        body = await request.json()
        if params.garbage and isinstance(body, dict) and body.get("stream"):
            return await _garbage_stream(request, params.garbage)
        response = await handler(request)
        if params.response_bytes and isinstance(response, web.Response) and response.status == 200 \
                and response.body is not None:
            answer = json.loads(bytes(response.body))  # type: ignore[arg-type]
            pad = max(0, params.response_bytes - len(bytes(response.body)))  # type: ignore[arg-type]
            choice = answer["choices"][0]
            if "message" in choice:
                choice["message"]["content"] += "x" * pad
            else:
                choice["text"] += "x" * pad
            return web.json_response(answer)
        return response

    return faults


async def _garbage_stream(request: web.Request, mode: str) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    good = b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ok"}}]}\n\n'
    await out.write(good)
    if mode == "malformed":
        await out.write(b"data: {this is not json\n\n" + good + b"data: [DONE]\n\n")
    elif mode == "truncated":
        await out.write(b'data: {"object": "chat.completion.chunk", "choices": [{"ind')
    elif mode == "no_done":
        await out.write(good)
    await out.write_eof()
    return out


def build_app(engine: SimEngine) -> web.Application:
    app = create_app(engine)
    app.middlewares.append(_fault_middleware(engine))

    async def started(_: web.Request) -> web.Response:
        # Requests in the order they began (X-Request-Id and body field names): how tests see
        # scheduling decisions and what reached the engine.
        return web.json_response({"started": list(engine.started)})

    app.router.add_get("/v1/sim/started", started)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = base_parser("Simulated OpenAI-compatible LLM engine (no GPU, no weights).")
    defaults = SimParams()
    for name in SimParams.__dataclass_fields__:
        flag = "--" + name.replace("_", "-")
        value = getattr(defaults, name)
        if isinstance(value, bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes", "on"), default=value)
        else:
            parser.add_argument(flag, type=type(value) if value is not None else int, default=value)
    args = parser.parse_args(argv)
    params = SimParams(**{name: getattr(args, name) for name in SimParams.__dataclass_fields__})
    run(build_app(SimEngine(args.model, params)), args.host, args.port)


if __name__ == "__main__":
    main()
