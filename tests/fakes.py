"""Fakes, all of them here. Each stands in for something these unit tests keep out on purpose;
the integration tests use the real thing."""
from __future__ import annotations

from proxy.supervisor import ProcessInfo, ProcessState


class FakeSupervisor:
    """FAKE supervisord driver: records the calls the pool makes and answers from a process table."""

    def __init__(self) -> None:
        self.processes: dict[str, ProcessInfo] = {}
        self.calls: list[tuple[str, str]] = []
        self.log = "llama-server: error: model file is corrupt"

    def set(self, fullname: str, state: ProcessState, pid: int) -> ProcessInfo:
        group, name = fullname.split(":")
        info = ProcessInfo(group=group, name=name, state=state, pid=pid, exitstatus=0, description="")
        self.processes[fullname] = info
        return info

    async def all_process_info(self) -> list[ProcessInfo]:
        return list(self.processes.values())

    async def tail_log(self, fullname: str, length: int = 4000) -> str:
        return self.log

    async def stop_process(self, fullname: str) -> None:
        self.calls.append(("stop", fullname))

    async def start_process(self, fullname: str) -> None:
        self.calls.append(("start", fullname))


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
