"""CTranslate2 behind the shared shim core: `python -m shims.ct2 --model-path DIR ...`.

The model folder decides the engine: a decoder-only model (`vocabulary.*`) runs on
`ctranslate2.Generator`, an encoder-decoder one (`shared_vocabulary.*` or `source_vocabulary.*`)
on `ctranslate2.Translator`. Text is tokenized with the folder's `tokenizer.json` (`tokenizers`).

Requests run in parallel: the model gets `--max-concurrency` CT2 workers (`inter_threads`), and each
request blocks one executor thread in `generate_batch`/`translate_batch`, whose per-token callback
streams the token out and stops the decoding once the client has gone. Beam search (`beam_size` > 1)
needs the whole decoding, so its tokens stream after it ends and it cannot be stopped early.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator


from shims.core import (GenerationRequest, RequestRejected, base_parser, create_app, engine_counters, engine_tallies,
                        flag, prometheus, run)
from shims.prompts import PromptError, render
from shims.threaded import TokenPipe

DECODER_VOCABULARIES = ("vocabulary.json", "vocabulary.txt")
SEQ2SEQ_VOCABULARIES = ("shared_vocabulary.json", "shared_vocabulary.txt", "source_vocabulary.json",
                        "source_vocabulary.txt")
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class CT2Options:
    model_path: str
    device: str = "cpu"
    compute_type: str = "int8"
    prompt_format: str = "generic"
    enable_thinking: bool | None = None
    max_concurrency: int = 1          # CT2 workers: requests decoded at once
    intra_threads: int = 0            # threads per worker; 0 splits the CPU cores between workers


def model_kind(path: Path) -> str:
    """"generator" or "translator", from the vocabulary files a converted CT2 folder holds; ValueError
    naming what is missing from a folder this shim cannot serve (the launcher's check asks it too)."""
    if not (path / "model.bin").is_file():
        raise ValueError(f"{path} is not a CTranslate2 model folder (no model.bin)")
    if any((path / name).is_file() for name in SEQ2SEQ_VOCABULARIES):
        kind = "translator"
    elif any((path / name).is_file() for name in DECODER_VOCABULARIES):
        kind = "generator"
    else:
        raise ValueError(f"{path}: no vocabulary file, so neither a decoder-only nor an encoder-decoder CT2 model")
    if not (path / TOKENIZER_FILE).is_file():
        raise ValueError(f"{path}: no {TOKENIZER_FILE} (the CT2 shim tokenizes with the `tokenizers` library)")
    return kind


class Detokenizer:
    """One generation's token ids to text pieces, one piece per token, as the tokens are made.

    `DecodeStream` holds back a token that ends inside a UTF-8 character until a later one completes
    it; at the last token nothing will, so what it holds is decoded there as the tokenizer decodes
    the whole sequence (the incomplete bytes become U+FFFD). Joined, the pieces are that decoding:
    streamed or not, an answer keeps its last bytes.
    """

    def __init__(self, tokenizer: Any, stream: Any) -> None:
        self._tokenizer = tokenizer
        self._stream = stream
        self._ids: list[int] = []
        self._sent = 0   # characters out so far

    def step(self, token_id: int, last: bool) -> str:
        self._ids.append(token_id)
        piece = self._stream.step(self._tokenizer, token_id)
        if piece is None and last:
            piece = self._tokenizer.decode(self._ids, skip_special_tokens=True)[self._sent:]
        self._sent += len(piece or "")
        return piece or ""


class CT2Engine:
    def __init__(self, model_name: str, options: CT2Options) -> None:
        self.model_name = model_name
        self.options = options
        self.kind = ""
        self.model: Any = None
        self.tokenizer: Any = None
        self._decode_stream: Any = None
        self.executor = ThreadPoolExecutor(max_workers=max(4, 2 * options.max_concurrency),
                                           thread_name_prefix="ct2")
        self.active = 0
        self.counters = engine_tallies()

    def close(self) -> None:
        """Before the interpreter's exit: the executor's threads end and the model is released here,
        while Python still runs. Left to the interpreter's teardown, CTranslate2's objects went with
        it in no set order, and the process could abort after a clean drain (`terminate called
        without an active exception`, exit -6: 1 run in 6 of test_shim_process' SIGTERM test on a
        busy machine)."""
        self.executor.shutdown(wait=True)
        self.model = None   # the last reference: its threads are joined now

    # -- loading ---------------------------------------------------------------------------------

    async def load(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.executor, self._load)

    def _load(self) -> None:
        import ctranslate2
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream

        path = Path(self.options.model_path)
        self.kind = model_kind(path)
        self.tokenizer = Tokenizer.from_file(str(path / TOKENIZER_FILE))
        self._decode_stream = DecodeStream
        workers = self.options.max_concurrency
        intra = self.options.intra_threads or max(1, (os.cpu_count() or 1) // workers)
        cls = ctranslate2.Translator if self.kind == "translator" else ctranslate2.Generator
        self.model = cls(str(path), device=self.options.device, compute_type=self.options.compute_type,
                         inter_threads=workers, intra_threads=intra)

    # -- requests --------------------------------------------------------------------------------

    def render_chat(self, messages: Any, body: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        try:
            rendered = render(messages, self.options.prompt_format, multi_turn=False,
                              thinking=self.options.enable_thinking)
        except PromptError as exc:
            raise RequestRejected(str(exc), exc.code) from None
        return rendered.prompt, rendered.stop

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def _sampling(self, request: GenerationRequest) -> dict[str, Any]:
        temperature = request.temperature
        if temperature is None or temperature == 0:
            # Greedy, CT2's default (and what temperature 0 means to an OpenAI client).
            options: dict[str, Any] = {"sampling_topk": 1, "sampling_temperature": 1.0}
        else:
            options = {"sampling_topk": request.top_k or 0, "sampling_temperature": float(temperature)}
            if request.top_p is not None:
                options["sampling_topp"] = float(request.top_p)
        if request.repetition_penalty is not None:
            options["repetition_penalty"] = float(request.repetition_penalty)
        if request.ignore_eos:
            options["end_token"] = []
        return options

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[str]]:
        tokens = self.tokenizer.encode(request.prompt).tokens
        request.prompt_tokens = len(tokens)
        self.counters["prompt_tokens"] += len(tokens)
        pipe: TokenPipe[str] = TokenPipe(asyncio.get_running_loop())
        options = self._sampling(request)
        self.active += 1
        finished = False
        try:
            # aclosing: a reader that leaves waits here until CT2 has let go of the request, so the
            # gauge and the counters below change together, after the engine is idle.
            async with contextlib.aclosing(pipe.run(self.executor,
                                                    lambda p: self._decode(p, tokens, request, options))) as batches:
                async for batch in batches:
                    yield batch
            finished = True
        finally:
            self.active -= 1
            if finished:
                self.counters["request_success"] += 1
            elif pipe.abandoned:
                self.counters["requests_cancelled"] += 1

    def _decode(self, pipe: TokenPipe[str], tokens: list[str], request: GenerationRequest,
                options: dict[str, Any]) -> None:
        """In a worker thread: the blocking CT2 call, each token out through `pipe` as it is made."""
        text = Detokenizer(self.tokenizer, self._decode_stream(skip_special_tokens=True))
        counters = self.counters

        def on_token(step: Any) -> bool:
            counters["generation_tokens"] += 1
            # True stops this decoding: its client has gone.
            return not pipe.emit(text.step(step.token_id, step.is_last))

        beam = request.beam_size
        common = dict(beam_size=beam, **options)
        if beam == 1:
            common["callback"] = on_token
        if self.kind == "translator":
            results = self.model.translate_batch([tokens], max_decoding_length=request.max_tokens, **common)
            produced = [self.tokenizer.token_to_id(t) for t in results[0].hypotheses[0]]
        else:
            results = self.model.generate_batch([tokens], max_length=request.max_tokens,
                                                include_prompt_in_result=False, **common)
            produced = results[0].sequences_ids[0]
        if beam > 1:
            # Beam search has no per-token callback: stream the best hypothesis once it is known.
            for i, token_id in enumerate(produced):
                counters["generation_tokens"] += 1
                if not pipe.emit(text.step(token_id, last=i == len(produced) - 1)):
                    break

    def metrics_text(self) -> str:
        workers = self.options.max_concurrency
        return prometheus(self.model_name,
                          {"vllm:num_requests_running": min(self.active, workers),
                           "vllm:num_requests_waiting": max(0, self.active - workers)},
                          engine_counters(self.counters))


def main(argv: list[str] | None = None) -> None:
    parser = base_parser("CTranslate2 model behind an OpenAI-compatible server.")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compute-type", default="int8")
    parser.add_argument("--prompt-format", default="generic")
    parser.add_argument("--enable-thinking", type=flag, default=None)
    parser.add_argument("--max-concurrency", type=int, default=1)
    parser.add_argument("--intra-threads", type=int, default=0)
    args = parser.parse_args(argv)
    options = CT2Options(model_path=args.model_path, device=args.device, compute_type=args.compute_type,
                         prompt_format=args.prompt_format, enable_thinking=args.enable_thinking,
                         max_concurrency=args.max_concurrency, intra_threads=args.intra_threads)
    engine = CT2Engine(args.model, options)
    try:
        run(create_app(engine), args.host, args.port, args.shutdown_timeout)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
