"""ExLlamaV3 behind the shared shim core: `python -m shims.exllamav3 --model-path DIR ...`. Needs CUDA.

ExLlamaV3's `Generator` batches continuously: jobs are enqueued, and each `iterate()` call prefills
or advances every active job by a step. The generator is not thread-safe and its calls block, so
one worker thread owns it: it takes new jobs from an inbox, drops jobs whose client has gone
(`Generator.cancel`, which frees their cache pages at once), iterates, and hands each job's text to
its request. `target_inflight` requests run together in one batch.

Written against exllamav3 1.6.5 (pinned in setup.cfg): Config, Model, Cache, Tokenizer, Generator,
Job, ComboSampler, CacheLayer_fp16/CacheLayer_quant.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator


from shims.core import (GenerationRequest, RequestRejected, base_parser, create_app, engine_counters, engine_tallies,
                        flag, prometheus, run)
from shims.prompts import PromptError, render
from shims.threaded import TokenPipe

log = logging.getLogger("shim.exllamav3")
PAGE_SIZE = 256   # exllamav3's cache page: the cache size must be a multiple of it


@dataclass(frozen=True)
class ExLlamaV3Options:
    model_path: str
    prompt_format: str = "generic"
    enable_thinking: bool | None = None
    cache_size: int = 8192                   # exllama_cache_size: tokens the cache holds, over all jobs
    cache_quant: str | None = None           # exllama_cache_quant: None (fp16), "8" or "4,6" (K,V bits)
    gpu_split: tuple[float, ...] = ()        # exllama_gpu_split: GB per GPU
    tensor_parallel: bool = False            # exllama_tensor_parallel
    tp_backend: str | None = None            # exllama_tp_backend
    max_batch_size: int | None = None        # exllama_max_batch_size (default: target_inflight)
    max_chunk_size: int | None = None        # exllama_max_chunk_size: prefill tokens per step
    max_q_size: int | None = None            # exllama_max_q_size
    max_rq_tokens: int | None = None         # exllama_max_rq_tokens: pages per job per round, then requeue
    max_concurrency: int = 1                 # target_inflight


def cache_bits(quant: str | None) -> tuple[int, int] | None:
    """(K bits, V bits) for a quantized cache, None for fp16; "8", "q8", "4,6" and "k4v6" are understood."""
    if quant is None or str(quant).lower() in ("", "none", "fp16", "f16"):
        return None
    text = str(quant).lower().replace("q", "").replace("k", "").replace("v", ",")
    parts = [p for p in text.replace(" ", "").split(",") if p]
    try:
        bits = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"exllama_cache_quant {quant!r}: use bits (2-8) for K and V, e.g. 8 or \"4,6\"") from None
    if len(bits) == 1:
        bits *= 2
    if len(bits) != 2 or not all(2 <= b <= 8 for b in bits):
        raise ValueError(f"exllama_cache_quant {quant!r}: K and V bits must each be 2 to 8")
    return bits[0], bits[1]


@dataclass(eq=False)
class _Request:
    job: Any
    pipe: TokenPipe[str]


class ExLlamaV3Engine:
    def __init__(self, model_name: str, options: ExLlamaV3Options) -> None:
        self.model_name = model_name
        self.options = options
        self.tokenizer: Any = None
        self.generator: Any = None
        self._job_cls: Any = None
        self._sampler_cls: Any = None
        self._inbox: list[_Request] = []
        self._live: dict[int, _Request] = {}      # id(job) -> request, for jobs in the generator
        self._wake = threading.Condition()
        self._worker: threading.Thread | None = None
        self.counters = engine_tallies()

    # -- loading ---------------------------------------------------------------------------------

    async def load(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._load)
        self._worker = threading.Thread(target=self._loop, name="exllamav3-generator", daemon=True)
        self._worker.start()

    def _load(self) -> None:
        from exllamav3 import Cache, Config, Model, Tokenizer
        from exllamav3.cache import CacheLayer_fp16, CacheLayer_quant
        from exllamav3.generator import Generator, Job
        from exllamav3.generator.sampler import ComboSampler

        o = self.options
        config = Config.from_directory(o.model_path)
        model = Model.from_config(config)
        size = -(-o.cache_size // PAGE_SIZE) * PAGE_SIZE
        bits = cache_bits(o.cache_quant)
        if bits is None:
            cache = Cache(model, max_num_tokens=size, layer_type=CacheLayer_fp16)
        else:
            cache = Cache(model, max_num_tokens=size, layer_type=CacheLayer_quant, k_bits=bits[0], v_bits=bits[1])
        load_args: dict[str, Any] = {"progressbar": False}
        if o.gpu_split:
            load_args["use_per_device"] = list(o.gpu_split)
        if o.tensor_parallel:
            load_args["tensor_p"] = True
            if o.tp_backend:
                load_args["tp_backend"] = o.tp_backend
        model.load(**load_args)
        self.tokenizer = Tokenizer.from_config(config)
        gen_args: dict[str, Any] = {"max_batch_size": o.max_batch_size or o.max_concurrency}
        if o.max_chunk_size:
            gen_args["max_chunk_size"] = o.max_chunk_size
        if o.max_q_size:
            gen_args["max_q_size"] = o.max_q_size
        self.generator = Generator(model=model, cache=cache, tokenizer=self.tokenizer, **gen_args)
        self._job_cls, self._sampler_cls = Job, ComboSampler
        self.cache_tokens = size

    # -- the generator's thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and not self._live:
                    self._wake.wait()
                new, self._inbox = self._inbox, []
            for req in new:
                if req.pipe.stopped.is_set():
                    req.pipe.finish()
                    continue
                try:
                    self.generator.enqueue(req.job)
                except Exception as exc:  # e.g. a job larger than the cache
                    req.pipe.fail(RequestRejected(f"exllamav3 refused the request: {exc}", "invalid_request"))
                    continue
                self._live[id(req.job)] = req
            for key, req in list(self._live.items()):
                if req.pipe.stopped.is_set():
                    # The client has gone: the job leaves the batch and its cache pages are freed now.
                    self.generator.cancel(req.job)
                    del self._live[key]
                    self.counters["requests_cancelled"] += 1
                    req.pipe.finish()
            if not self._live:
                continue
            try:
                results = self.generator.iterate()
            except Exception as exc:
                log.exception("exllamav3 iterate failed")
                for req in self._live.values():
                    self.generator.cancel(req.job)
                    req.pipe.fail(exc)
                self._live.clear()
                continue
            for result in results:
                req = self._live.get(id(result.get("job")))
                if req is None or result.get("stage") != "streaming":
                    continue
                ids = result.get("token_ids")
                count = int(ids.shape[-1]) if ids is not None else (1 if result.get("text") else 0)
                self.counters["generation_tokens"] += count
                # One piece per token: the text of the step, then an empty piece per further token.
                for i in range(count):
                    req.pipe.emit(result.get("text", "") if i == 0 else "")
                if result.get("eos"):
                    del self._live[id(req.job)]
                    self.counters["request_success"] += 1
                    req.pipe.finish()

    # -- requests --------------------------------------------------------------------------------

    def render_chat(self, messages: Any, body: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        try:
            rendered = render(messages, self.options.prompt_format, multi_turn=False,
                              thinking=self.options.enable_thinking)
        except PromptError as exc:
            raise RequestRejected(str(exc), exc.code) from None
        return rendered.prompt, rendered.stop

    def count_tokens(self, text: str) -> int:
        return int(self.tokenizer.encode(text, add_bos=True, encode_special_tokens=True).shape[-1])

    def _sampler(self, request: GenerationRequest) -> Any:
        temperature = 0.8 if request.temperature is None else float(request.temperature)
        return self._sampler_cls(rep_p=request.repetition_penalty or 1.0, temperature=temperature,
                                 top_k=request.top_k or 0, top_p=1.0 if request.top_p is None else request.top_p)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[str]]:
        input_ids = self.tokenizer.encode(request.prompt, add_bos=True, encode_special_tokens=True)
        request.prompt_tokens = int(input_ids.shape[-1])
        if request.prompt_tokens + request.max_tokens > self.cache_tokens:
            raise RequestRejected(f"prompt ({request.prompt_tokens} tokens) plus max_tokens ({request.max_tokens}) "
                                  f"exceed the cache ({self.cache_tokens} tokens, exllama_cache_size)",
                                  "context_length_exceeded")
        self.counters["prompt_tokens"] += request.prompt_tokens
        stop: list[Any] = [] if request.ignore_eos else [self.tokenizer.eos_token_id]
        stop += request.stop
        job_args: dict[str, Any] = {}
        if self.options.max_rq_tokens:
            job_args["max_rq_tokens"] = self.options.max_rq_tokens
        job = self._job_cls(input_ids=input_ids, max_new_tokens=request.max_tokens, sampler=self._sampler(request),
                            stop_conditions=stop, identifier=request.request_id or None, **job_args)
        pipe: TokenPipe[str] = TokenPipe(asyncio.get_running_loop())
        with self._wake:
            self._inbox.append(_Request(job, pipe))
            self._wake.notify()
        try:
            async for batch in pipe.stream():
                yield batch
        finally:
            # Leaving early set pipe.stopped; wake the worker so it cancels the job now, not next round.
            with self._wake:
                self._wake.notify()

    def metrics_text(self) -> str:
        running = self.generator.num_active_jobs() if self.generator is not None else 0
        pending = self.generator.num_pending_jobs() if self.generator is not None else 0
        return prometheus(self.model_name,
                          {"vllm:num_requests_running": running,
                           "vllm:num_requests_waiting": pending + len(self._inbox)},
                          engine_counters(self.counters))


def main(argv: list[str] | None = None) -> None:
    parser = base_parser("ExLlamaV3 (EXL3) model behind an OpenAI-compatible server; needs CUDA.")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--prompt-format", default="generic")
    parser.add_argument("--enable-thinking", type=flag, default=None)
    parser.add_argument("--cache-size", type=int, default=8192)
    parser.add_argument("--cache-quant", default=None)
    parser.add_argument("--gpu-split", default="", help="GB per GPU, comma-separated")
    parser.add_argument("--tensor-parallel", type=flag, default=False)
    parser.add_argument("--tp-backend", default=None)
    parser.add_argument("--max-batch-size", type=int, default=None)
    parser.add_argument("--max-chunk-size", type=int, default=None)
    parser.add_argument("--max-q-size", type=int, default=None)
    parser.add_argument("--max-rq-tokens", type=int, default=None)
    parser.add_argument("--max-concurrency", type=int, default=1)
    args = parser.parse_args(argv)
    options = ExLlamaV3Options(
        model_path=args.model_path, prompt_format=args.prompt_format, enable_thinking=args.enable_thinking,
        cache_size=args.cache_size, cache_quant=args.cache_quant,
        gpu_split=tuple(float(x) for x in args.gpu_split.split(",") if x), tensor_parallel=args.tensor_parallel,
        tp_backend=args.tp_backend, max_batch_size=args.max_batch_size, max_chunk_size=args.max_chunk_size,
        max_q_size=args.max_q_size, max_rq_tokens=args.max_rq_tokens, max_concurrency=args.max_concurrency)
    run(create_app(ExLlamaV3Engine(args.model, options)), args.host, args.port, args.shutdown_timeout)


if __name__ == "__main__":
    main()
