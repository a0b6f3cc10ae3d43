"""What the public routes answer on their own, before anything reaches a backend."""
from __future__ import annotations

from proxy.config.model import ModelConfig
from proxy.lifecycle.kinds.kind import traits_for
from proxy.lifecycle.state.runtime import ModelRuntime
from proxy.serving.routes_public import embeddings_unsupported


def runtime(backend: str) -> ModelRuntime:
    config = ModelConfig(name="m", backend=backend, enabled=True, replicas=1, replica_max=1, target_inflight=1,
                         modalities=("text",), gpus=(), options={"backend": backend})
    return ModelRuntime(config=config, traits=traits_for(backend))


def test_the_embeddings_refusal_says_what_applies_to_the_backend() -> None:
    assert "set llama_server_embeddings: true" in embeddings_unsupported(runtime("llama_server")).message
    for backend in ("ct2", "sim", "openai_remote", "vllm_serve"):
        err = embeddings_unsupported(runtime(backend))
        assert (err.status, err.code) == (400, "embeddings_unsupported")
        assert "llama_server_embeddings" not in err.message and f"backend {backend!r} serves none" in err.message
