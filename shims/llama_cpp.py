"""llama-cpp-python behind the shared shim core: `python -m shims.llama_cpp --model-path FILE.gguf ...`.

One `Llama` object is not safe across threads, so a replica generates for one request at a time:
the others wait their turn here (reported as waiting on /metrics), and more throughput comes from
more replicas (the schema holds `target_inflight` to 1 for this backend). Generation runs token by
token in a worker thread through `Llama.generate`; the loop ends as soon as the client has gone.

Chat: with a `prompt_format` set, messages are rendered by shims.prompts; without one, by the GGUF's
own chat template when it has one, else the generic format. Text only.
"""
from __future__ import annotations

import asyncio
import contextlib
import codecs
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator


from shims.core import (GenerationRequest, RequestRejected, base_parser, create_app, engine_counters, engine_tallies,
                        flag, prometheus, run)
from shims.prompts import PromptError, render, split_messages
from shims.threaded import TokenPipe

# KV cache types by the names llama.cpp's own tools use (`--cache-type-k q8_0`), as ggml type ids.
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}


@dataclass(frozen=True)
class LlamaCppOptions:
    model_path: str
    prompt_format: str | None = None
    enable_thinking: bool | None = None
    n_gpu_layers: int = 0
    n_ctx: int = 4096
    flash_attn: str = "auto"          # on | off | auto (on when layers are offloaded to a GPU)
    type_k: str | None = None
    type_v: str | None = None


def flash_attn_enabled(value: str, n_gpu_layers: int) -> bool:
    # llama-cpp-python takes a bool; "auto" follows where the model runs, as llama.cpp's auto would.
    value = value.lower()
    if value in ("on", "true", "1", "enabled"):
        return True
    if value in ("off", "false", "0", "disabled"):
        return False
    if value == "auto":
        return n_gpu_layers != 0
    raise ValueError(f"gguf_flash_attn must be on, off or auto, not {value!r}")


def kv_type(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return KV_TYPES[name.lower()]
    except KeyError:
        raise ValueError(f"KV cache type {name!r} is not one of {', '.join(KV_TYPES)}") from None


class LlamaCppEngine:
    def __init__(self, model_name: str, options: LlamaCppOptions) -> None:
        self.model_name = model_name
        self.options = options
        self.llm: Any = None
        self._template: Any = None            # the GGUF's chat template, when used
        self._is_eog: Any = None
        # One worker: the Llama object is only ever touched from this thread.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama")
        self.turn = asyncio.Lock()
        self.running = 0
        self.waiting = 0
        self.counters = engine_tallies()

    async def load(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.executor, self._load)

    def _load(self) -> None:
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        o = self.options
        self.llm = llama_cpp.Llama(
            model_path=o.model_path, n_gpu_layers=o.n_gpu_layers, n_ctx=o.n_ctx,
            flash_attn=flash_attn_enabled(o.flash_attn, o.n_gpu_layers), type_k=kv_type(o.type_k),
            type_v=kv_type(o.type_v), verbose=False)
        vocab = self.llm._model.vocab
        self._is_eog = lambda token: llama_cpp.llama_vocab_is_eog(vocab, token)
        template = self.llm.metadata.get("tokenizer.chat_template")
        if o.prompt_format is None and template:
            def text(token: int) -> str:
                return self.llm._model.token_get_text(token) if token != -1 else ""
            self._template = Jinja2ChatFormatter(template=template, eos_token=text(self.llm.token_eos()),
                                                 bos_token=text(self.llm.token_bos()))

    # -- requests --------------------------------------------------------------------------------

    def render_chat(self, messages: Any, body: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        try:
            if self._template is None:
                rendered = render(messages, self.options.prompt_format or "generic", multi_turn=True,
                                  thinking=self.options.enable_thinking)
                return rendered.prompt, rendered.stop
            system, turns = split_messages(messages)  # the same roles and text-only rules
        except PromptError as exc:
            raise RequestRejected(str(exc), exc.code) from None
        plain = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": role, "content": text} for role, text in turns]
        try:
            out = self._template(messages=plain)
        except Exception as exc:  # the model's own template refused (raise_exception in jinja)
            raise RequestRejected(f"the model's chat template refused these messages: {exc}",
                                  "invalid_messages") from None
        stop = out.stop if isinstance(out.stop, list) else [out.stop] if out.stop else []
        return out.prompt, tuple(stop)

    def count_tokens(self, text: str) -> int:
        return len(self._tokenize(text))

    def _tokenize(self, text: str) -> list[int]:
        # special=True: a rendered prompt's turn markers are the model's control tokens, not text.
        tokens = self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        bos = self.llm.token_bos()
        if len(tokens) > 1 and tokens[0] == bos and tokens[1] == bos:  # a template that writes its own BOS
            tokens = tokens[1:]
        return tokens

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[str]]:
        self.waiting += 1
        try:
            await self.turn.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        finished = False
        pipe: TokenPipe[str] | None = None
        try:
            tokens = await asyncio.get_running_loop().run_in_executor(self.executor, self._tokenize, request.prompt)
            room = self.options.n_ctx - len(tokens)
            if room < 1:
                raise RequestRejected(f"the prompt is {len(tokens)} tokens; this model's context is "
                                      f"{self.options.n_ctx} (gguf_n_ctx)", "context_length_exceeded")
            request.prompt_tokens = len(tokens)
            self.counters["prompt_tokens"] += len(tokens)
            limit = min(request.max_tokens, room)
            pipe = TokenPipe(asyncio.get_running_loop())
            # aclosing: a reader that leaves waits here until llama.cpp has let go of the request,
            # so the gauge and the counters below change together, after the engine is idle.
            async with contextlib.aclosing(pipe.run(self.executor,
                                                    lambda p: self._decode(p, tokens, request, limit))) as batches:
                async for batch in batches:
                    yield batch
            finished = True
        finally:
            self.running -= 1
            self.turn.release()
            if finished:
                self.counters["request_success"] += 1
            elif pipe is not None and pipe.abandoned:
                self.counters["requests_cancelled"] += 1

    def _decode(self, pipe: TokenPipe[str], tokens: list[int], request: GenerationRequest, limit: int) -> None:
        """In the worker thread: one token per step, each out through `pipe`, until done or abandoned."""
        temperature = 0.8 if request.temperature is None else float(request.temperature)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        produced = 0
        steps = self.llm.generate(tokens, temp=temperature, top_k=request.top_k if request.top_k is not None else 40,
                                  top_p=1.0 if request.top_p is None else float(request.top_p), min_p=0.0,
                                  repeat_penalty=request.repetition_penalty or 1.0)
        try:
            for token in steps:
                if self._is_eog(token) and not request.ignore_eos:
                    break
                produced += 1
                self.counters["generation_tokens"] += 1
                piece = decoder.decode(self.llm.detokenize([token], special=False))
                if not pipe.emit(piece):
                    break  # the client has gone: no further token is computed
                if produced >= limit:
                    break
        finally:
            steps.close()

    def metrics_text(self) -> str:
        # The context holds the last request's tokens (kept for prefix reuse): its share of n_ctx.
        kv = (self.llm.n_tokens / self.options.n_ctx) if self.llm is not None else 0.0
        return prometheus(self.model_name,
                          {"vllm:num_requests_running": self.running, "vllm:num_requests_waiting": self.waiting,
                           "vllm:kv_cache_usage_perc": min(1.0, kv)},
                          engine_counters(self.counters))


def main(argv: list[str] | None = None) -> None:
    parser = base_parser("llama-cpp-python (GGUF) behind an OpenAI-compatible server.")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--prompt-format", default=None)
    parser.add_argument("--enable-thinking", type=flag, default=None)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--flash-attn", default="auto")
    parser.add_argument("--type-k", default=None)
    parser.add_argument("--type-v", default=None)
    args = parser.parse_args(argv)
    options = LlamaCppOptions(model_path=args.model_path, prompt_format=args.prompt_format,
                              enable_thinking=args.enable_thinking, n_gpu_layers=args.n_gpu_layers,
                              n_ctx=args.n_ctx, flash_attn=args.flash_attn, type_k=args.type_k, type_v=args.type_v)
    run(create_app(LlamaCppEngine(args.model, options)), args.host, args.port, args.shutdown_timeout)


if __name__ == "__main__":
    main()
