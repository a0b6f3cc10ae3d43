"""Fakes, all of them here. Each stands in for something these unit tests keep out on purpose;
the integration tests use the real thing."""
from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from aiohttp import web
from supervisor.xmlrpc import Faults

from proxy.supervisord.supervisor import BadName, NotRunning, ProcessInfo, ProcessState, SpawnError, StillRunning


class FakeSupervisor:
    """FAKE supervisord driver: records the calls the pool makes and answers from a process table;
    a start spawns the program as supervisord does, under the next PID from `next_pid`."""

    def __init__(self) -> None:
        self.processes: dict[str, ProcessInfo] = {}
        self.next_pid = 300
        self.calls: list[tuple[str, str]] = []
        self.log = "llama-server: error: model file is corrupt"
        self.refuse_starts = False   # each start is supervisord's SPAWN_ERROR (a program that exits at once)
        self.main_log = ""           # supervisord's own log, as a test writes it

    def set(self, fullname: str, state: ProcessState, pid: int) -> ProcessInfo:
        group, name = fullname.split(":")
        info = ProcessInfo(group=group, name=name, state=state, pid=pid, exitstatus=0, description="")
        self.processes[fullname] = info
        return info

    async def all_process_info(self) -> list[ProcessInfo]:
        return list(self.processes.values())

    async def tail_log(self, fullname: str, length: int = 4000) -> str:
        return self.log

    async def main_log_tail(self, length: int) -> str:
        """supervisord's own log: this fake writes none, a test may (`main_log`)."""
        return self.main_log[-length:]

    async def stop_process(self, fullname: str) -> None:
        self.calls.append(("stop", fullname))

    async def start_process(self, fullname: str) -> None:
        self.calls.append(("start", fullname))
        if self.refuse_starts:
            raise SpawnError(50, f"SPAWN_ERROR: {fullname}")
        self.set(fullname, ProcessState.STARTING, self.next_pid)
        self.next_pid += 1

    async def process_info(self, fullname: str) -> ProcessInfo:
        if fullname not in self.processes:
            raise BadName(fullname)
        return self.processes[fullname]

    async def add_process_group(self, name: str) -> None:
        self.calls.append(("add", name))


class FakeManagedSupervisord:
    """FAKE of proxy.supervisord.managed.ManagedSupervisord: says whether supervisord died, and
    counts the times it was asked to start it again (the real one stops orphans and spawns one)."""

    def __init__(self, dead: bool = True) -> None:
        self.is_dead = dead
        self.started = 0

    def dead(self) -> bool:
        return self.is_dead

    async def start_again(self) -> None:
        self.started += 1
        self.is_dead = False


class ScriptedSupervisor(FakeSupervisor):
    """FAKE supervisord driver for unload under faults: stopProcess and removeProcessGroup follow
    supervisord's rules (a stopped, exited or fatal process is NOT_RUNNING; a group with a live
    process is STILL_RUNNING), `faults[method]` raises its queued exceptions first, and each
    `script` step changes the process table before one getAllProcessInfo answers (a crash, a
    restart by autorestart, a process that ignores its stop)."""

    STOPPED_STATES = (ProcessState.STOPPED, ProcessState.EXITED, ProcessState.FATAL)

    def __init__(self) -> None:
        super().__init__()
        self.faults: dict[str, list[Exception]] = {}
        self.script: list[Callable[["ScriptedSupervisor"], None]] = []
        self.stuck: set[str] = set()     # programs that stay STOPPING when asked to stop
        self.removed: list[str] = []

    def _fault(self, method: str) -> None:
        queued = self.faults.get(method)
        if queued:
            raise queued.pop(0)

    async def all_process_info(self) -> list[ProcessInfo]:
        self._fault("all_process_info")
        if self.script:
            self.script.pop(0)(self)
        return list(self.processes.values())

    async def stop_process(self, fullname: str) -> None:
        self.calls.append(("stop", fullname))
        self._fault("stop_process")
        info = self.processes.get(fullname)
        if info is None:
            raise BadName(Faults.BAD_NAME, f"BAD_NAME: {fullname}")
        if info.state in self.STOPPED_STATES:
            raise NotRunning(Faults.NOT_RUNNING, f"NOT_RUNNING: {fullname}")
        stuck = fullname in self.stuck and info.state != ProcessState.BACKOFF
        self.set(fullname, ProcessState.STOPPING if stuck else ProcessState.STOPPED, info.pid if stuck else 0)

    async def remove_process_group(self, name: str) -> None:
        self.calls.append(("remove", name))
        self._fault("remove_process_group")
        members = [i for i in self.processes.values() if i.group == name]
        if not members:
            raise BadName(Faults.BAD_NAME, f"BAD_NAME: {name}")
        if any(i.state not in self.STOPPED_STATES for i in members):
            raise StillRunning(Faults.STILL_RUNNING, f"STILL_RUNNING: {name}")
        for info in members:
            del self.processes[info.fullname]
        self.removed.append(name)

    async def reload_config(self) -> tuple[list[str], list[str], list[str]]:
        self.calls.append(("reload", ""))
        self._fault("reload_config")
        return [], [], []


class FakeProvider:
    """FAKE remote OpenAI-compatible provider (Moonshot- or OpenAI-like), for the `openai_remote`
    tests and benchmark: an aiohttp app on a loopback port 0, in a thread of its own so that a test
    or a proxy subprocess can call it synchronously.

    It checks the bearer key, records every request it receives (`requests`), answers Chat
    Completions (JSON and SSE) with Moonshot's usage shape (`usage.cached_tokens`) for a model whose
    name starts with "moonshot" and OpenAI's (`usage.prompt_tokens_details.cached_tokens`) otherwise,
    and speaks the Files API (upload, content, delete; `files` holds what is not deleted yet).
    Faults are scripted per remote model name, or per "files" for the Files API, one per request:
    "429:<retry-after>", "500", "401", "400" (its message echoes the key), "400:parts" (it echoes the
    key's first 10 characters and 9 from its middle, as providers that show a key's prefix do), "drop"
    (the connection breaks before an answer), "slow" (no answer for `slow_s`), "slow_stream" (one chunk,
    then silence), "broken" (one chunk, then the connection drops), "hold:<n>" (a stream's first n
    words, then silence until its caller hangs up or `slow_s` passes), "linger" (the whole stream and
    its `data: [DONE]`, then the connection held open until `release()` or `slow_s`); an empty
    script answers normally. A stream's words are `words`; it sends usage only when the request asks
    (`stream_options.include_usage`), as OpenAI does.
    Two knobs make it a hostile or a slow provider: `usage`, when set, is the usage object every chat
    answer carries, sent as given (`{"prompt_tokens": 10**30}`, NaN as JSON's NaN); `hold()` keeps
    every chat answer back (`held` counts those waiting) until `release()`.
    `tool_call`, when set to (name, arguments), makes every chat answer to a request that carries
    `tools` call that tool after its words, as OpenAI does: a message's `tool_calls`, or in a stream
    the call's name first and its arguments in three pieces, then `finish_reason: tool_calls`.
    """

    CACHED_TOKENS = 3

    def __init__(self, key: str, models: tuple[str, ...] = (), port: int = 0) -> None:
        # `port`: a given one, for a test that sees its callers refused before the provider starts.
        self.key = key
        self.models = list(models)
        self.requests: list[dict[str, object]] = []
        self.files: dict[str, dict[str, object]] = {}
        self.scripts: dict[str, list[str]] = {}
        self.slow_s = 30.0
        self.words = ["Hello", " from", " the", " fake", " provider"]
        self.usage: object = None
        self.tool_call: tuple[str, dict[str, object]] | None = None
        self.holding = False
        self.held = 0
        self._ids = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake provider", daemon=True)
        self.port = port

    # -- control, from the test's thread -----------------------------------------------------------

    def start(self) -> "FakeProvider":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("fake provider did not start")
        return self

    def stop(self) -> None:

        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
        self._thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, name: str, *steps: str) -> None:
        self.scripts[name] = list(steps)

    def received(self, path: str | None = None) -> list[dict[str, object]]:
        return [r for r in list(self.requests) if path is None or r["path"] == path]

    def clear(self) -> None:
        self.requests.clear()
        self.scripts.clear()
        self.tool_call = None

    def hold(self) -> None:
        self._loop.call_soon_threadsafe(self._released.clear)
        self.holding = True

    def release(self) -> None:
        """Let the held answers go (hold()) and end the streams that linger (script step "linger")."""
        self.holding = False
        self._loop.call_soon_threadsafe(self._released.set)

    # -- the server, in its own thread -------------------------------------------------------------

    def _run(self) -> None:

        self._loop = asyncio.new_event_loop()
        self._released = asyncio.Event()
        self._loop.run_until_complete(self._serve())
        self._loop.run_forever()
        self._loop.close()

    async def _serve(self) -> None:

        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/files", self._upload)
        app.router.add_get("/v1/files/{id}/content", self._content)
        app.router.add_delete("/v1/files/{id}", self._delete)
        # handler_cancellation: a caller that hangs up ends a slow answer at once, as at a real provider.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        self._loop.call_soon(self._loop.stop)

    def _next(self, name: str) -> str:
        steps = self.scripts.get(name)
        return steps.pop(0) if steps else "ok"

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body: object = None
        if request.content_type == "application/json":
            body = await request.json()
        self.requests.append({"method": request.method, "path": request.path, "body": body,
                              "authorization": request.headers.get("Authorization"), "at": time.monotonic()})
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "Invalid Authentication",
                                                "type": "invalid_authentication_error"}}, status=401)
        return await handler(request)

    async def _fault(self, request: web.Request, step: str) -> web.Response | None:

        if step.startswith("429"):
            retry_after = step.split(":", 1)[1] if ":" in step else "1"
            return web.json_response({"error": {"message": "rate limit reached", "type": "rate_limit_reached_error"}},
                                     status=429, headers={"Retry-After": retry_after})
        if step == "500":
            return web.json_response({"error": {"message": "the fake provider is overloaded", "type": "server_error"}},
                                     status=500)
        if step == "400":   # a careless provider that echoes the caller's key in its message
            return web.json_response({"error": {"message": f"max_tokens too large for key {self.key}"}}, status=400)
        if step == "400:parts":
            middle = len(self.key) // 2
            message = f"key {self.key[:10]}... (...{self.key[middle:middle + 9]}...) may not ask for this many tokens"
            return web.json_response({"error": {"message": message}}, status=400)
        if step == "401":
            return web.json_response({"error": {"message": "Invalid Authentication"}}, status=401)
        if step == "slow":
            await asyncio.sleep(self.slow_s)
        if step == "drop":   # the connection breaks before any answer
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=500)
        return None

    async def _list_models(self, request: web.Request) -> web.StreamResponse:

        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    def _usage(self, model: str, prompt: int, output: int) -> object:
        if self.usage is not None:
            return self.usage
        usage: dict[str, object] = {"prompt_tokens": prompt, "completion_tokens": output,
                                    "total_tokens": prompt + output}
        if model.startswith("moonshot"):
            usage["cached_tokens"] = self.CACHED_TOKENS
        else:
            usage["prompt_tokens_details"] = {"cached_tokens": self.CACHED_TOKENS}
        return usage

    async def _chat(self, request: web.Request) -> web.StreamResponse:


        body = await request.json()
        model = str(body.get("model"))
        step = self._next(model)
        fault = await self._fault(request, step)
        if fault is not None:
            return fault
        if self.holding:
            self.held += 1
            await self._released.wait()
            self.held -= 1
        words = list(self.words)
        prompt = sum(len(str(m.get("content"))) for m in body.get("messages", [])) // 4 + 1
        call = self.tool_call if body.get("tools") else None
        arguments = json.dumps(call[1]) if call is not None else ""
        if not body.get("stream"):
            message: dict[str, object] = {"role": "assistant", "content": "".join(words) or None}
            if call is not None:
                message["tool_calls"] = [{"id": "call_fake", "type": "function",
                                          "function": {"name": call[0], "arguments": arguments}}]
            return web.json_response({
                "id": "chatcmpl-fake", "object": "chat.completion", "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if call else "stop"}],
                "usage": self._usage(model, prompt, len(words))})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)

        def chunk(data: dict[str, object]) -> bytes:
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        for i, word in enumerate(words):
            await out.write(chunk({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model,
                                   "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}))
            if i == 0 and step == "slow_stream":
                await asyncio.sleep(self.slow_s)
            if i == 0 and step == "broken":
                assert request.transport is not None
                request.transport.abort()   # the provider's connection drops mid-answer
                return out
            if step.startswith("hold:") and i + 1 == int(step[5:]):
                await asyncio.sleep(self.slow_s)   # cancelled when the caller hangs up
                return out
        if call is not None:
            third = len(arguments) // 3 + 1
            deltas = [{"index": 0, "id": "call_fake", "type": "function", "function": {"name": call[0], "arguments": ""}}]
            deltas += [{"index": 0, "function": {"arguments": arguments[i:i + third]}}
                       for i in range(0, len(arguments), third)]
            for delta in deltas:
                await out.write(chunk({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model,
                                       "choices": [{"index": 0, "delta": {"tool_calls": [delta]},
                                                    "finish_reason": None}]}))
            await out.write(chunk({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model,
                                   "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            await out.write(chunk({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model,
                                   "choices": [], "usage": self._usage(model, prompt, len(words))}))
        await out.write(b"data: [DONE]\n\n")
        if step == "linger":
            until = time.monotonic() + self.slow_s
            while not self._released.is_set() and time.monotonic() < until:
                await asyncio.sleep(0.01)
        await out.write_eof()
        return out

    async def _upload(self, request: web.Request) -> web.StreamResponse:

        fault = await self._fault(request, self._next("files"))
        if fault is not None:
            return fault
        form = await request.post()
        upload = form["file"]
        assert isinstance(upload, web.FileField)
        self._ids += 1
        file_id = f"file-{self._ids}"
        self.files[file_id] = {"purpose": form.get("purpose"), "filename": upload.filename,
                               "data": upload.file.read()}
        self.requests[-1]["body"] = {"purpose": form.get("purpose"), "filename": upload.filename}
        return web.json_response({"id": file_id, "object": "file", "purpose": form.get("purpose"),
                                  "filename": upload.filename, "status": "ok"})

    async def _content(self, request: web.Request) -> web.StreamResponse:


        fault = await self._fault(request, self._next("files"))
        if fault is not None:
            return fault
        file = self.files.get(request.match_info["id"])
        if file is None:
            return web.json_response({"error": {"message": "no such file"}}, status=404)
        data = file["data"]
        assert isinstance(data, bytes)
        # Moonshot answers with a JSON document describing the extracted text.
        return web.Response(text=json.dumps({"content": "EXTRACTED " + data.decode(errors="replace"),
                                             "filename": file["filename"], "type": "file"}),
                            content_type="application/json")

    async def _delete(self, request: web.Request) -> web.StreamResponse:

        file_id = request.match_info["id"]
        found = self.files.pop(file_id, None) is not None
        return web.json_response({"id": file_id, "object": "file", "deleted": found}, status=200 if found else 404)
class GatedEngine:
    """FAKE shim engine: loads when the test says so and generates a scripted list of pieces.

    It stands in for a real engine where the shim core's own behaviour is under test (health while
    loading, stop strings, errors before and after the stream began); the real engines are tested
    in their own files. `fail_after` raises EngineFault once that many pieces were generated.
    """

    def __init__(self, pieces: list[str], fail_after: int | None = None, load_error: str | None = None) -> None:
        import asyncio

        self.model_name = "gated"
        self.pieces = pieces
        self.fail_after = fail_after
        self.load_error = load_error
        self.release = asyncio.Event()
        self.generated = 0
        self.closed = 0          # generations that were closed before their script ran out

    async def load(self) -> None:
        await self.release.wait()
        if self.load_error:
            raise RuntimeError(self.load_error)

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    async def generate(self, request):  # type: ignore[no-untyped-def]
        from shims.core import EngineFault

        finished = False
        try:
            for i, piece in enumerate(self.pieces[:request.max_tokens]):
                if i == self.fail_after:
                    raise EngineFault(f"scripted fault after {i} pieces")
                self.generated += 1
                yield piece
            finished = True
        finally:
            if not finished:
                self.closed += 1

    def metrics_text(self) -> str:
        return ""


class FakeCT2Generator:
    """FAKE ctranslate2.Generator that answers every prompt with the same token ids, so a test
    chooses where the answer ends (a random-weight model cannot be steered). It calls back per
    token as CT2's greedy search does (`is_last` on the final one) and returns the same ids for
    beam search; the ids are assumed to fit `max_length`."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def generate_batch(self, prompts: list[list[str]], *, max_length: int, include_prompt_in_result: bool,
                       beam_size: int = 1, callback: Callable[[Any], bool] | None = None,
                       **options: Any) -> list[Any]:
        for step, token_id in enumerate(self.ids):
            last = step == len(self.ids) - 1
            if callback is not None and callback(SimpleNamespace(step=step, batch_id=0, token_id=token_id,
                                                                 is_last=last)):
                break
        return [SimpleNamespace(sequences_ids=[list(self.ids)])]


class _FakeTensor:
    """FAKE of the one torch.Tensor trait the ExLlamaV3 shim uses: `.shape`."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.shape = (1, len(ids))


class FakeExllamaV3:
    """FAKE exllamav3 package (it needs CUDA, which these machines lack), installed in sys.modules.

    It mirrors the names and call shapes the ExLlamaV3 shim uses from exllamav3 1.6.5 (Config,
    Model, Cache, Tokenizer, Generator, Job, ComboSampler, CacheLayer_*), records how they were
    called, and generates one word per job per `iterate()`, so the shim's batching, cancellation
    and field mapping can be checked. tests/gpu/exllamav3_e2e.py runs the real library.
    """

    def __init__(self) -> None:
        import threading
        import types

        fake = self
        self.calls: list[tuple[str, object]] = []
        self.max_active = 0          # the most jobs one iterate() advanced together
        self.cancelled: list[object] = []
        self.iterations = 0
        self.lock = threading.Lock()

        class Config:
            @staticmethod
            def from_directory(path: str) -> "Config":
                fake.calls.append(("Config.from_directory", path))
                return Config()

        class Model:
            @staticmethod
            def from_config(config: Config) -> "Model":
                return Model()

            def load(self, **kwargs: object) -> None:
                fake.calls.append(("Model.load", kwargs))

        class CacheLayer_fp16:  # noqa: N801 (the library's name)
            pass

        class CacheLayer_quant:  # noqa: N801
            pass

        class Cache:
            def __init__(self, model: Model, **kwargs: object) -> None:
                fake.calls.append(("Cache", kwargs))

        class Tokenizer:
            eos_token_id = 2

            @staticmethod
            def from_config(config: Config) -> "Tokenizer":
                return Tokenizer()

            def encode(self, text: str, add_bos: bool = False, encode_special_tokens: bool = False) -> _FakeTensor:
                return _FakeTensor(([1] if add_bos else []) + [3] * len(text.split()))

        class ComboSampler:
            def __init__(self, **kwargs: object) -> None:
                self.kwargs = kwargs

        class Job:
            def __init__(self, input_ids: _FakeTensor, max_new_tokens: int, **kwargs: object) -> None:
                self.input_ids = input_ids
                self.max_new_tokens = max_new_tokens
                self.kwargs = kwargs
                self.new_tokens = 0

        class Generator:
            def __init__(self, model: Model, cache: Cache, tokenizer: Tokenizer, **kwargs: object) -> None:
                fake.calls.append(("Generator", kwargs))
                self.pending: list[Job] = []
                self.active: list[Job] = []
                self.max_batch_size = int(kwargs.get("max_batch_size", 256))  # type: ignore[call-overload]

            def enqueue(self, job: Job) -> int:
                self.pending.append(job)
                return len(self.pending)

            def cancel(self, job: Job) -> None:
                fake.cancelled.append(job)
                for queue in (self.pending, self.active):
                    if job in queue:
                        queue.remove(job)

            def num_active_jobs(self) -> int:
                return len(self.active)

            def num_pending_jobs(self) -> int:
                return len(self.pending)

            def iterate(self) -> list[dict[str, object]]:
                import time

                while self.pending and len(self.active) < self.max_batch_size:
                    self.active.append(self.pending.pop(0))
                with fake.lock:
                    fake.iterations += 1
                    fake.max_active = max(fake.max_active, len(self.active))
                time.sleep(0.002)  # a decode step takes time, as on a GPU
                results: list[dict[str, object]] = []
                for job in list(self.active):
                    job.new_tokens += 1
                    eos = job.new_tokens >= job.max_new_tokens
                    results.append({"job": job, "stage": "streaming", "eos": eos, "text": f" w{job.new_tokens}",
                                    "token_ids": _FakeTensor([5])})
                    if eos:
                        self.active.remove(job)
                return results

        root = types.ModuleType("exllamav3")
        root.Config, root.Model = Config, Model  # type: ignore[attr-defined]
        root.Cache, root.Tokenizer = Cache, Tokenizer  # type: ignore[attr-defined]
        cache = types.ModuleType("exllamav3.cache")
        cache.CacheLayer_fp16, cache.CacheLayer_quant = CacheLayer_fp16, CacheLayer_quant  # type: ignore[attr-defined]
        generator = types.ModuleType("exllamav3.generator")
        generator.Generator, generator.Job = Generator, Job  # type: ignore[attr-defined]
        sampler = types.ModuleType("exllamav3.generator.sampler")
        sampler.ComboSampler = ComboSampler  # type: ignore[attr-defined]
        self.modules = {"exllamav3": root, "exllamav3.cache": cache, "exllamav3.generator": generator,
                        "exllamav3.generator.sampler": sampler}
        self.CacheLayer_quant = CacheLayer_quant
class FakeSSEResponse:
    """FAKE upstream aiohttp response: `content.readline()` hands out the given lines, then EOF.
    For parsing a stream exactly as a misbehaving backend sent it, without a server."""

    def __init__(self, lines: list[bytes]) -> None:
        self.content = self
        self._lines = list(lines)
        self.closed = False

    async def readline(self) -> bytes:
        return self._lines.pop(0) if self._lines else b""

    def close(self) -> None:
        self.closed = True


class FakeNvmlError(Exception):
    """FAKE pynvml.NVMLError."""


class FakeNvml:
    """FAKE pynvml (nvidia-ml-py) module: NVML needs an NVIDIA driver and GPU, which these tests do
    not have. It answers the calls proxy/gpu/report.py makes from a table of GPUs, each with its memory and
    the processes NVML would list (pid, used bytes; None when NVML cannot tell)."""

    NVMLError = FakeNvmlError

    def __init__(self, gpus: list[dict[str, Any]]) -> None:
        self.gpus = gpus
        self.initialised = False
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        assert self.initialised
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> bytes:
        return handle.get("name", "FAKE GPU").encode()  # older nvidia-ml-py returns bytes

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(used=handle["used"], total=handle["total"], free=handle["total"] - handle["used"])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict[str, Any]) -> list[SimpleNamespace]:
        if handle.get("processes_error"):
            raise FakeNvmlError(handle["processes_error"])
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.get("processes", [])]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: dict[str, Any]) -> list[SimpleNamespace]:
        return []


class FakeLlamaServerHTTP:
    """FAKE llama-server, for its connection handling only (no engine): raw HTTP/1.1 on a loopback
    port 0, in the test's event loop, so that what happens to each TCP connection is scripted
    exactly. It answers POST /v1/chat/completions and /v1/completions, JSON or SSE (`stream`).

    Like the pinned llama-server (measured, DESIGN.md "Process model"): every answer says
    `Keep-Alive: timeout=5, max=100`; a connection stays open after a JSON answer and is closed
    after a streamed one; a request with `Connection: close` is answered with `Connection: close`
    and its connection closed. The close after a stream is made to land at its worst moment, and
    always there, so that no test depends on a race: the fake keeps the connection until the
    client writes its next request on it, reads that request and closes without answering. `dies`
    is how that close shows: "fin" (the client reads the end, ServerDisconnectedError) or "reset"
    (an RST, ClientOSError). `idle_close` does the same to kept-alive JSON connections (a
    keep-alive timeout that expires as the client reuses the connection); `drop_fresh` drops that
    many requests that arrive first on a new connection, after reading them (a server that dies
    with the request).

    `requests` records (connection number, path, body, request headers) for every request read,
    answered or not; `connections` counts the connections accepted.

    `cached`: what its answers say they read from the slot's cache (usage.prompt_tokens_details.
    cached_tokens and timings.cache_n, and a stream's usage chunk when asked for); None: they say
    nothing of it. It also answers llama-server's slot endpoints (the KV store's): GET /slots (its
    three slots, each holding `slot_tokens`) and POST /slots/{id}?action=save or restore, each done
    at once with `slot_tokens` tokens; it keeps no file and no cache, so a restore that reports
    success and then shows `cached: 0` is the llama.cpp bug of a restore that reuses nothing.
    """

    def __init__(self, dies: str = "fin", idle_close: bool = False, drop_fresh: int = 0,
                 cached: int | None = None, slot_tokens: int = 40) -> None:
        assert dies in ("fin", "reset")
        self.dies = dies
        self.idle_close = idle_close
        self.drop_fresh = drop_fresh
        self.cached = cached
        self.slot_tokens = slot_tokens
        self.requests: list[tuple[int, str, dict[str, Any], dict[str, str]]] = []
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> "FakeLlamaServerHTTP":
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop_listening(self) -> None:
        """Refuse new connections from now on, as a server that died would; the open ones stay
        open until their next request (as if their close were still on its way)."""
        assert self._server is not None
        self._server.close()

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self._open.add(writer)
        doomed = False     # answered in a way after which llama-server closes this connection
        first = True
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return   # the client closed it
                request_line, *lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, v in
                           (line.split(":", 1) for line in lines if ":" in line)}
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                body = json.loads(raw) if raw else {}
                self.requests.append((number, request_line.split()[1], body, headers))
                fresh, first = first, False
                if doomed or (fresh and self.drop_fresh > 0):
                    if not doomed:
                        self.drop_fresh -= 1
                    if self.dies == "reset":
                        writer.transport.abort()
                    return
                close = headers.get("connection", "").lower() == "close"
                if request_line.split()[1].startswith("/slots"):
                    await self._slots(writer, request_line.split()[1], body, close)
                elif body.get("stream"):
                    await self._stream(writer, body, close)
                else:
                    await self._json(writer, body, close)
                if close:
                    return
                doomed = bool(body.get("stream")) or self.idle_close
        finally:
            self._open.discard(writer)
            writer.close()

    @staticmethod
    def _head(content_type: str, close: bool, length: int | None = None) -> bytes:
        lines = ["HTTP/1.1 200 OK", "Server: llama.cpp", f"Content-Type: {content_type}",
                 f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked",
                 "Connection: close" if close else "Keep-Alive: timeout=5, max=100"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def _usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        if self.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return usage

    async def _json(self, writer: asyncio.StreamWriter, body: dict[str, Any], close: bool) -> None:
        answer = {"id": "chatcmpl-fake", "object": "chat.completion", "model": body.get("model"),
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "fake answer"},
                               "finish_reason": "stop"}], "usage": self._usage()}
        if self.cached is not None:
            answer["timings"] = {"cache_n": self.cached, "prompt_n": 3 - self.cached}
        await self._write_json(writer, answer, close)

    async def _write_json(self, writer: asyncio.StreamWriter, answer: Any, close: bool) -> None:
        data = json.dumps(answer).encode()
        writer.write(self._head("application/json; charset=utf-8", close, len(data)) + data)
        await writer.drain()

    async def _slots(self, writer: asyncio.StreamWriter, target: str, body: dict[str, Any], close: bool) -> None:
        if target == "/slots":
            await self._write_json(writer, [{"id": i, "n_prompt_tokens": self.slot_tokens, "is_processing": False,
                                             "id_task": i} for i in range(3)], close)
            return
        slot, _, action = target.removeprefix("/slots/").partition("?action=")
        counts = {"save": ("n_saved", "n_written", "save_ms"), "restore": ("n_restored", "n_read", "restore_ms")}
        tokens, size, ms = counts[action]
        await self._write_json(writer, {"id_slot": int(slot), "filename": body.get("filename"),
                                        tokens: self.slot_tokens, size: 4096, "timings": {ms: 1.0}}, close)

    async def _stream(self, writer: asyncio.StreamWriter, body: dict[str, Any], close: bool) -> None:
        writer.write(self._head("text/event-stream", close))
        events = [{"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": body.get("model"),
                   "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                  for word in ("fake", " stream")]
        options = body.get("stream_options")
        if self.cached is not None and isinstance(options, dict) and options.get("include_usage"):
            events.append({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": body.get("model"),
                           "choices": [], "usage": self._usage(), "timings": {"cache_n": self.cached}})
        for data in [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]:
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()


class FastUpstream(asyncio.Protocol):
    """FAKE OpenAI-compatible engine that costs next to nothing, for tests/bench/bench_proxy_overhead.py.

    The benchmark measures the proxy hop's own CPU on the same cores as its upstream; a real engine
    (or the sim, an aiohttp app) spends far more per request than the hop and blurs the figure. So
    this speaks just enough HTTP/1.1 over a bare asyncio protocol: keep-alive, Content-Length
    bodies, `Connection: close`; canned answers to GET /health, /v1/models, /metrics and POST
    /v1/chat/completions, /v1/completions (JSON with usage, or `events` SSE chunks one `gap_s`
    apart, then the usage chunk and [DONE]). It is what a replica looks like to the proxy (a sim
    replica's /metrics names), nothing more.
    """

    def __init__(self, model: str, events: int, gap_s: float) -> None:
        self.model = model
        self.events = events
        self.gap_s = gap_s
        self.buffer = bytearray()   # appended to in place: a 32 MiB body arrives in thousands of reads
        self.transport: Any = None   # an asyncio or a uvloop transport (not an asyncio.Transport subclass)
        self.busy = False
        usage = {"prompt_tokens": 9, "completion_tokens": events, "total_tokens": 9 + events}
        self.json_answer = json.dumps({
            "id": "chatcmpl-fast", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there"},
                         "finish_reason": "stop"}], "usage": usage}).encode()
        delta = {"id": "chatcmpl-fast", "object": "chat.completion.chunk", "created": 0, "model": model,
                 "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}
        self.event = b"data: " + json.dumps(delta).encode() + b"\n\n"
        self.last = b"data: " + json.dumps({**delta, "choices": [], "usage": usage}).encode() + \
            b"\n\ndata: [DONE]\n\n"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next_request()

    def _next_request(self) -> None:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.transport is None:
            return
        head = self.buffer[:end].decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        length = int(headers.get("content-length", "0"))
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4:end + 4 + length])
        del self.buffer[:end + 4 + length]
        method, path = head[0].split(" ")[:2]
        close = headers.get("connection", "").lower() == "close"
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            if b'"stream": true' in body or b'"stream":true' in body:
                self.busy = True
                asyncio.get_running_loop().create_task(self._stream(close))
                return
            self._answer(b"application/json", self.json_answer, close)
        elif path == "/v1/models":
            self._answer(b"application/json", json.dumps(
                {"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode(), close)
        elif path == "/metrics":
            self._answer(b"text/plain", b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
                         b"vllm:kv_cache_usage_perc 0\n", close)
        else:
            self._answer(b"application/json", b'{"status": "ok"}', close)

    def _answer(self, content_type: bytes, body: bytes, close: bool) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type + b"\r\nContent-Length: " +
                             str(len(body)).encode() + (b"\r\nConnection: close" if close else b"") +
                             b"\r\n\r\n" + body)
        if close:
            self.transport.close()
        elif self.buffer:
            self._next_request()

    async def _stream(self, close: bool) -> None:
        transport = self.transport
        assert transport is not None
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked" +
                        (b"\r\nConnection: close" if close else b"") + b"\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (len(self.event), self.event)
        for _ in range(self.events):
            if transport.is_closing():
                return
            transport.write(chunk)
            await asyncio.sleep(self.gap_s)
        transport.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(self.last), self.last))
        self.busy = False
        if close:
            transport.close()
        elif self.buffer:
            self._next_request()


def serve_fast_upstream(argv: list[str]) -> None:
    """Run FastUpstream until killed: `--host H --port P --model M [--events N] [--gap-ms G]`, other
    arguments ignored (a sim replica's launcher passes its own). On uvloop where it is installed."""
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--events", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=1.0)
    args, _ = parser.parse_known_args(argv)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: FastUpstream(args.model, args.events, args.gap_ms / 1000),
                                          args.host, args.port)
        print(f"fast upstream on {args.host}:{server.sockets[0].getsockname()[1]}", flush=True)
        await server.serve_forever()

    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


class FakeApt:
    """FAKE apt-get (a unit test must not install packages): records the commands
    proxy.setup.browser.ensure_browser runs; `installs_on` is the
    attempt (1-based) after which the browser is on PATH."""

    def __init__(self, installs_on: int | None) -> None:
        self.calls: list[list[str]] = []
        self.installs_on = installs_on

    def run(self, argv: Sequence[str]) -> "subprocess.CompletedProcess[str]":
        self.calls.append(list(argv))
        installs = [c for c in self.calls if c[1] == "install"]
        ok = argv[1] != "install" or len(installs) == self.installs_on
        return subprocess.CompletedProcess(list(argv), 0 if ok else 100, "", "" if ok else "E: Unable to locate package")

    def which(self, name: str) -> str | None:
        if name == "apt-get":
            return "/usr/bin/apt-get"
        installs = [c for c in self.calls if c[1] == "install"]
        done = self.installs_on is not None and len(installs) >= self.installs_on
        return "/usr/bin/chromium" if done and name == "chromium" else None


class FakeReplicaKind:
    """A fake `Kind` (proxy/lifecycle/state/kind.py) whose replicas are READY the moment they are added
    and gone the moment they are removed, no process behind them; `fail_adds` makes that many
    adds come up FAILED. For the pool's decisions about replicas (a roll's order), not for how
    replicas start (the integration tests start real ones). Each add and remove is in `calls`,
    with the READY count of the model just before."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.fail_adds = 0

    def check(self, config: Any) -> list[str]:
        return []

    async def start(self, runtime: Any, config: Any) -> None:
        raise NotImplementedError

    async def stop(self, runtime: Any) -> None:
        return None

    async def add(self, runtime: Any, config: Any, indices: Sequence[int]) -> list[Any]:
        from proxy.upstream.reach import ProgramReach
        from proxy.lifecycle.state.replicas import Replica, ReplicaState
        from launchers import sim

        added = []
        for i in indices:
            self.calls.append(("add", i, len(runtime.ready())))
            spec = sim.launch(config, i, 18000 + i, 1, {})
            replica = Replica(model=runtime.name, index=i, spec=spec, reach=ProgramReach(spec), fullname=f"g:r{i}")
            runtime.replicas = sorted(runtime.replicas + [replica], key=lambda r: r.index)
            runtime.set_replica_state(replica, ReplicaState.STARTING)
            if self.fail_adds:
                self.fail_adds -= 1
                runtime.set_replica_state(replica, ReplicaState.FAILED, "exited at once")
            else:
                runtime.set_replica_state(replica, ReplicaState.READY)
            added.append(replica)
        return added

    async def remove(self, runtime: Any, replicas: list[Any]) -> None:
        for replica in replicas:
            self.calls.append(("remove", replica.index, len(runtime.ready())))

    def gate(self, config: Any, headers: Any, body: Any) -> None:
        return None

    def describe(self, config: Any) -> dict[str, object]:
        return {}


class BrokenCallXmlRpc:
    """FAKE supervisord XML-RPC endpoint (aiohttp on port 0) for the driver's transport handling:
    `supervisor.getPID` drops its connection without an answer (a call that fails on the wire);
    `supervisor.getState` answers once `release` is set, so it can be held in flight meanwhile."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = asyncio.Event()     # a getState is in flight
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "BrokenCallXmlRpc":
        import xmlrpc.client

        async def rpc(request: web.Request) -> web.StreamResponse:
            (_params, method) = xmlrpc.client.loads(await request.read())
            if method == "supervisor.getPID":
                assert request.transport is not None
                request.transport.close()
                return web.Response()
            self.held.set()
            await self.release.wait()
            return web.Response(text=xmlrpc.client.dumps(({"statename": "RUNNING"},), methodresponse=True),
                                content_type="text/xml")
        app = web.Application()
        app.router.add_post("/RPC2", rpc)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class FakeClock:
    """FAKE clock (proxy/lifecycle/placement/actions.py Clock) for the placer's unit tests: its wall
    and monotonic readings move only when the test calls `advance`, both by the same amount."""

    def __init__(self, wall: float = 1_700_000_000.0, mono: float = 10_000.0) -> None:
        self.wall = wall
        self.mono = mono

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


class RecordingPlacerActions:
    """FAKE of the pool as the placer's actions (proxy/lifecycle/placement/actions.py PlacerActions),
    in the style of llama-swap's scheduler tests: each action the placer asks for is recorded in
    `calls`, in order, and carried out only as far as the placer's decisions can see it. No process
    starts and no memory is held: a load ends LOADED (or raises `load_fails[name]`, the model FAILED),
    an unload ends UNLOADED (or raises `unload_fails[name]`). A load that must evict first makes room
    through the placer's make_room before it starts, as the pool does (set `placer`). A spawned
    coroutine is kept, its name in `spawned`, until the test runs it (`run_spawned`): what runs when
    is the test's to say."""

    def __init__(self, runtimes: Any = None, predecessor_gone: bool = True) -> None:
        self.runtimes = dict(runtimes or {})
        self.predecessor_gone = asyncio.Event()
        if predecessor_gone:
            self.predecessor_gone.set()
        self.placer: Any = None
        self.calls: list[tuple[object, ...]] = []
        self.spawned: list[str] = []
        self.load_fails: dict[str, Exception] = {}
        self.unload_fails: dict[str, Exception] = {}
        self._queued: list[Any] = []

    def spawn(self, coro: Any) -> None:
        self.spawned.append(coro.__qualname__)
        self._queued.append(coro)

    async def run_spawned(self) -> None:
        """Run every coroutine spawned so far to its end, in order (and those they spawn)."""
        while self._queued:
            await self._queued.pop(0)

    def drop_spawned(self) -> None:
        """Forget what was spawned and not run (closed, so that none is reported as never awaited)."""
        for coro in self._queued:
            coro.close()
        self._queued.clear()

    async def load_placed(self, name: str, evict: tuple[str, ...]) -> Any:
        from proxy.lifecycle.state.replicas import ModelState

        runtime = self.runtimes[name]
        if evict:
            assert self.placer is not None, "set RecordingPlacerActions.placer: a load evicts through it"
            await self.placer.make_room(runtime, evict)
        self.calls.append(("load", name, evict))
        runtime.move(ModelState.LOADING)
        if name in self.load_fails:
            runtime.move(ModelState.FAILED, str(self.load_fails[name]))
            raise self.load_fails[name]
        runtime.move(ModelState.LOADED)
        return runtime

    async def unload_by_pool(self, name: str, reason: str, cause: str | None = None) -> Any:
        from proxy.lifecycle.state.replicas import ModelState

        self.calls.append(("unload", name, reason, cause))
        if name in self.unload_fails:
            raise self.unload_fails[name]
        runtime = self.runtimes[name]
        runtime.move(ModelState.UNLOADING)
        runtime.move(ModelState.UNLOADED)
        return runtime


class FakeSleepyVllm:
    """FAKE `vllm serve --enable-sleep-mode` at the HTTP boundary (aiohttp on port 0): vLLM's sleep
    mode needs CUDA, which these tests do not have (tests/gpu/vllm_sleep.sh runs the real one). It
    serves /health and /v1/models (as `model`), POST /sleep?level=N, POST /wake_up and GET
    /is_sleeping as vLLM's dev mode does; `sleep_status` and `wake_status` are what those answer
    (a 500 is a sleep or wake that fails), `says_asleep` what is_sleeping says after a sleep.
    Every call is in `calls` as (method, path with query)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.asleep = False
        self.sleep_status = 200
        self.wake_status = 200
        self.says_asleep = True
        self.calls: list[tuple[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> "FakeSleepyVllm":
        async def health(request: web.Request) -> web.Response:
            return web.Response()

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        async def sleep(request: web.Request) -> web.Response:
            self.calls.append(("POST", request.path_qs))
            if self.sleep_status == 200:
                self.asleep = self.says_asleep
            return web.json_response({}, status=self.sleep_status)

        async def wake_up(request: web.Request) -> web.Response:
            self.calls.append(("POST", request.path_qs))
            if self.wake_status == 200:
                self.asleep = False
            return web.json_response({}, status=self.wake_status)

        async def is_sleeping(request: web.Request) -> web.Response:
            self.calls.append(("GET", request.path_qs))
            return web.json_response({"is_sleeping": self.asleep})

        app = web.Application()
        app.add_routes([web.get("/health", health), web.get("/v1/models", models), web.post("/sleep", sleep),
                        web.post("/wake_up", wake_up), web.get("/is_sleeping", is_sleeping)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
