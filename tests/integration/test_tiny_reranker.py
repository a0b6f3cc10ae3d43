"""The pinned llama-server on the tiny test models, started with the argv the launcher builds: the
tiny reranker answers /v1/rerank with `llama_server_reranking: true`, and the demo model answers
/infill (with its FIM tokens), /tokenize and /detokenize."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from direct_llama_server import configured, served
from helpers import http
from launchers import llama_server
from proxy.setup import tiny_reranker
from proxy.setup.demo_model import FIM_TOKENS, write_tiny_gguf

pytestmark = pytest.mark.integration

DOCUMENTS = ["Paris is the capital of France.", "It rains in the park today.", "hello world"]


def test_the_tiny_reranker_scores_every_document(tiny_reranker_gguf: Path, llama_server_bin: Path,
                                                 tmp_path: Path) -> None:
    model = configured(tmp_path, model_path=str(tiny_reranker_gguf), llama_server_binary=str(llama_server_bin),
                       llama_server_reranking=True)
    argv = llama_server.argv(model, "127.0.0.1", 1)
    assert "--reranking" in argv and "--pooling" not in argv   # --reranking pools by rank itself
    with served(model, tmp_path / "llama-server.log") as url:
        status, _, body = http("POST", url + "/v1/rerank", {"query": "what is the capital of france?",
                                                            "documents": DOCUMENTS})
        assert status == 200, body
        results = body["results"]
        assert len(results) == len(DOCUMENTS)
        assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
        for r in results:
            assert isinstance(r["relevance_score"], float) and math.isfinite(r["relevance_score"])
        # Best first, as llama-server sorts them.
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)
        # Each document was read as [CLS] query [SEP] document: the BOS and SEP the GGUF declares.
        def n_tokens(text: str) -> int:
            return len(http("POST", url + "/tokenize", {"content": text})[2]["tokens"])

        query = n_tokens("what is the capital of france?")
        assert body["usage"]["prompt_tokens"] == sum(2 + query + n_tokens(d) for d in DOCUMENTS)

        # The same server also answers /v1/embeddings 200 (--reranking is --embeddings too), but the
        # vector is not an embedding: the pinned build reads n_embd floats from the rank pooling's
        # one-score output (server-context.cpp send_embedding), so past it; seen as zeros and a null.
        status, _, body = http("POST", url + "/v1/embeddings", {"input": "hello world"})
        assert status == 200, body
        assert [len(d["embedding"]) for d in body["data"]] == [tiny_reranker.N_EMBD]


def test_without_reranking_the_tiny_reranker_refuses_rerank(tiny_reranker_gguf: Path, llama_server_bin: Path,
                                                            tmp_path: Path) -> None:
    # The GGUF declares rank pooling, but llama-server serves /v1/rerank only when told to.
    model = configured(tmp_path, model_path=str(tiny_reranker_gguf), llama_server_binary=str(llama_server_bin),
                       llama_server_embeddings=True)
    with served(model, tmp_path / "llama-server.log") as url:
        status, _, body = http("POST", url + "/v1/rerank", {"query": "q", "documents": DOCUMENTS})
    assert status == 501 and "Start it with `--reranking`" in body["error"]["message"], body


def test_the_demo_model_infills_with_its_fim_tokens_and_round_trips_tokens(tiny_gguf: Path, llama_server_bin: Path,
                                                                          tmp_path: Path) -> None:
    infill = {"input_prefix": "def f(", "input_suffix": ")\n", "n_predict": 8}
    without = write_tiny_gguf(tmp_path / "no-fim.gguf", fim=False)
    plain = configured(tmp_path, model_path=str(without), llama_server_binary=str(llama_server_bin))
    with served(plain, tmp_path / "plain.log") as url:
        # Without the FIM tokens llama-server cannot infill.
        status, _, body = http("POST", url + "/infill", infill)
        assert status == 501, body
        assert body["error"]["message"] == ("Infill is not supported by this model: prefix token is missing. "
                                            "suffix token is missing. middle token is missing. ")
        status, _, tokens = http("POST", url + "/tokenize", {"content": "hello world"})
        assert status == 200 and tokens["tokens"], tokens
        status, _, text = http("POST", url + "/detokenize", {"tokens": tokens["tokens"]})
        # SPM prefixes a space to the text it tokenizes (U+2581), and detokenizing keeps it.
        assert status == 200 and text["content"] == " hello world", text

    # The demo model as setup writes it (and the tests load it) has them.
    with served(configured(tmp_path, model_path=str(tiny_gguf), llama_server_binary=str(llama_server_bin)),
                tmp_path / "fim.log") as url:
        status, _, body = http("POST", url + "/infill", infill)
    assert status == 200, body
    assert isinstance(body["content"], str) and body["tokens_predicted"] <= 8
    # The prompt llama-server built: prefix, suffix, then the middle the model writes.
    prompt = body["prompt"]
    marks = [prompt.index(text) for text, _ in FIM_TOKENS]
    assert marks == sorted(marks) and prompt.index("def f(") < marks[1] < prompt.index(")\n") < marks[2], prompt
