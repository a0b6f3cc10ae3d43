"""What the public routes answer on their own, before anything reaches a backend."""
from __future__ import annotations

from proxy.config.model import ModelConfig
from proxy.lifecycle.kinds.kind import traits_for
from proxy.lifecycle.state.runtime import ModelRuntime
import pytest

from proxy.errors import BadRequest
from proxy.serving.body import check_endpoint, embeddings_unsupported


def runtime(backend: str, **options: object) -> ModelRuntime:
    config = ModelConfig(name="m", backend=backend, enabled=True, replicas=1, replica_max=1, target_inflight=1,
                         modalities=("text",), gpus=(), options={"backend": backend, **options})
    return ModelRuntime(config=config, traits=traits_for(backend))


def test_the_embeddings_refusal_says_what_applies_to_the_backend() -> None:
    assert "set llama_server_embeddings: true" in embeddings_unsupported(runtime("llama_server")).message
    for backend in ("ct2", "sim", "openai_remote", "vllm_serve"):
        err = embeddings_unsupported(runtime(backend))
        assert (err.status, err.code) == (400, "embeddings_unsupported")
        assert "llama_server_embeddings" not in err.message and f"backend {backend!r} serves none" in err.message


def test_a_route_the_model_is_not_served_on_is_refused_naming_what_it_serves() -> None:
    with pytest.raises(BadRequest) as refused:
        check_endpoint(runtime("sim"), "/infill")
    assert (refused.value.status, refused.value.code, refused.value.param) == (400, "endpoint_unsupported", "model")
    assert "does not serve /infill" in refused.value.message
    assert refused.value.message.endswith("it serves /v1/chat/completions, /v1/responses, /v1/completions, /v1/messages")


def test_a_route_the_backend_speaks_but_the_model_has_off_says_which_field_turns_it_on() -> None:
    with pytest.raises(BadRequest, match="set llama_server_reranking: true to serve it"):
        check_endpoint(runtime("llama_server"), "/v1/rerank")
    check_endpoint(runtime("llama_server", llama_server_reranking=True), "/v1/rerank")
    with pytest.raises(BadRequest) as refused:
        check_endpoint(runtime("ct2"), "/v1/rerank")
    assert "llama_server_reranking" not in refused.value.message
    with pytest.raises(BadRequest) as refused:
        check_endpoint(runtime("sim"), "/v1/embeddings")
    assert refused.value.code == "embeddings_unsupported"
