"""/v1/responses requests: every validation rule (status and code) and the translation to the
backend's chat request."""
from __future__ import annotations

from typing import Any

import pytest

from proxy.capabilities import capabilities
from proxy.lifecycle.kinds.kind import traits_for
from proxy.config.model import ModelConfig
from proxy.errors import BadRequest
from proxy.edge.response_metrics import METRIC_KEYS, Timer, build
from proxy.serving.responses import MIXED_SOURCE_NOTE, backend_request, parse, validate_for_model

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQSkZJRg=="}}
FILE = {"type": "file", "file": {"filename": "paper.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}}


def model(backend: str = "llama_server", modalities: tuple[str, ...] = ("text",), **options: Any) -> ModelConfig:
    return ModelConfig(name="m", backend=backend, enabled=True, replicas=1, replica_max=1, target_inflight=1,
                       modalities=modalities, gpus=(), options={"backend": backend, **options})


def check(body: dict[str, Any], cfg: ModelConfig | None = None) -> dict[str, Any]:
    cfg = cfg or model()
    req = parse({"model": "m", **body})
    validate_for_model(req, cfg, capabilities(cfg, traits_for(cfg.backend)))
    return backend_request(req, cfg, traits_for(cfg.backend), {"temperature": 0.7, "max_tokens": 256})


def rejected(body: dict[str, Any], cfg: ModelConfig | None = None, raw: bool = False) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        if raw:
            parse(body)
        else:
            check(body, cfg)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("body, code, param", [
    ({"input": "x"}, "missing_model", "model"),
    ({"model": 3, "input": "x"}, "invalid_request", "model"),
    ({"model": "m", "input": 5}, "invalid_request", "input"),
    ({"model": "m", "input": "x", "decoding": {"top_p": 2}}, "invalid_request", "decoding.top_p"),
    ({"model": "m", "input": "x", "decoding": {"max_tokens": 0}}, "invalid_request", "decoding.max_tokens"),
    ({"model": "m", "input": "x", "decoding": {"stop": ["s"] * 17}}, "invalid_request", "decoding.stop"),
    ({"model": "m", "input": "x", "thinking": "maybe"}, "invalid_request", "thinking"),
    ({"model": "m", "input": "x", "stream": "yes"}, "invalid_request", "stream"),
    ({"model": "m", "input": [{"type": "audio", "data": "x"}]}, "invalid_request", "input"),
    ({"model": "m", "input": [{"type": "file", "file": {"file_data": "not a data url"}}]}, "invalid_request", "input"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}] * 513}, "invalid_request", "messages"),
])
def test_shape_rules(body: dict[str, Any], code: str, param: str) -> None:
    err = rejected(body, raw=True)
    assert err.code == code
    assert err.param.startswith(param)


def test_unknown_fields_are_ignored_and_named_at_both_levels() -> None:
    # One policy (docs/api.md: /v1/responses): a top-level and a decoding field alike are ignored, never a
    # 400 for one and silence for the other, and the response names them.
    body = {"model": "m", "input": "x", "min_tokens": 2, "decoding": {"min_p": 0.05, "temperature": 0.2}}
    req = parse(body)
    assert req.ignored == ("min_tokens", "decoding.min_p")
    out = backend_request(req, model(), traits_for("llama_server"), {})
    assert "min_p" not in out and "min_tokens" not in out and out["temperature"] == 0.2
    assert parse({"model": "m", "input": "x", "decoding": {"top_k": 1}}).ignored == ()


@pytest.mark.parametrize("body, cfg, code", [
    ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, None, "invalid_input"),
    ({}, None, "invalid_input"),
    ({"messages": [{"role": "system", "content": "y"}, {"role": "user", "content": "x"}]}, None, "invalid_messages"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, None,
     "invalid_messages"),
    ({"messages": [{"role": "user", "content": "x"}]}, model("ct2"), "multi_turn_unsupported"),
    ({"input": [{"type": "text", "text": "x"}, IMAGE]}, None, "modality_unsupported"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, None, "modality_unsupported"),
    ({"input": [FILE]}, model(modalities=("text", "image")), "modality_unsupported"),
    ({"input": "x", "thinking": "enabled"}, model("ct2"), "thinking_unsupported"),
    ({"input": "x", "thinking": "enabled"}, model(thinking_modes=["default", "disabled"]), "thinking_unsupported"),
    ({"input": "x"}, model(prompt_format="translategemma_template"), "target_lang_required"),
    ({"input": "x", "target_lang_code": "en", "instructions": "Translate"},
     model(prompt_format="translategemma_template"), "instructions_not_allowed"),
    ({"messages": [{"role": "user", "content": "x"}], "target_lang_code": "en"},
     model(prompt_format="translategemma_template"), "invalid_input"),
])
def test_model_rules(body: dict[str, Any], cfg: ModelConfig | None, code: str) -> None:
    assert rejected(body, cfg).code == code


def test_file_items_pass_where_a_remote_file_mode_is_configured() -> None:
    cfg = model("openai_remote", remote_file_mode="chat_completions_inline")
    out = check({"input": [{"type": "text", "text": "Summarise"}, FILE]}, cfg)
    assert out["messages"][-1]["content"][1] == FILE


def test_text_input_with_instructions_and_engine_defaults() -> None:
    out = check({"input": "The weather is pleasant.", "instructions": "Translate to Dutch.",
                 "decoding": {"temperature": 0.1}})
    assert out["messages"] == [{"role": "system", "content": "Translate to Dutch."},
                               {"role": "user", "content": "The weather is pleasant."}]
    assert out["temperature"] == 0.1 and out["max_tokens"] == 256  # omitted fields from engine.decoding
    assert "stream" not in out and "fairness_key" not in out


def test_decoding_fields_are_mapped_per_backend() -> None:
    decoding = {"beam_size": 2, "top_k": 1, "top_p": 0.9, "temperature": 0, "repetition_penalty": 1.1,
                "max_tokens": 8}
    llama = check({"input": "x", "decoding": decoding})
    assert (llama["repeat_penalty"], llama["top_k"], llama["top_p"], llama["temperature"], llama["max_tokens"]) \
        == (1.1, 1, 0.9, 0, 8)
    assert "beam_size" not in llama and "repetition_penalty" not in llama
    vllm = check({"input": "x", "decoding": decoding}, model("vllm_serve"))
    assert vllm["repetition_penalty"] == 1.1
    assert check({"input": "x", "decoding": decoding}, model("ct2"))["beam_size"] == 2


def test_image_content_arrays_pass_in_openai_form() -> None:
    cfg = model(modalities=("text", "image"))
    content = [{"type": "text", "text": "What does this menu say?"}, IMAGE]
    out = check({"input": content, "instructions": "Describe the image briefly."}, cfg)
    assert out["messages"][1] == {"role": "user", "content": content}


def test_text_only_arrays_become_one_prompt() -> None:
    out = check({"input": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    assert out["messages"] == [{"role": "user", "content": "a\nb"}]


def test_multi_turn_messages_follow_instructions() -> None:
    msgs = [{"role": "user", "content": "My favorite color is teal."}, {"role": "assistant", "content": "Got it."},
            {"role": "user", "content": "What is my favorite color?"}]
    out = check({"messages": msgs, "instructions": "You are concise."})
    assert out["messages"] == [{"role": "system", "content": "You are concise."}, *msgs]


@pytest.mark.parametrize("thinking, configured, expected", [
    ("enabled", None, {"enable_thinking": True}),
    ("disabled", True, {"enable_thinking": False}),
    ("default", False, {"enable_thinking": False}),
    ("default", None, None),
])
def test_thinking_maps_to_chat_template_kwargs(thinking: str, configured: bool | None, expected: Any) -> None:
    out = check({"input": "x", "thinking": thinking}, model(enable_thinking=configured))
    assert out.get("chat_template_kwargs") == expected


def test_stop_merges_format_stops_with_the_request_without_duplicates() -> None:
    out = check({"input": "x", "decoding": {"stop": ["\n\n", "<turn|>"]}},
                model(prompt_format="gemma4_template"))
    assert out["stop"] == ["<turn|>", "\n\n"]
    assert "stop" not in check({"input": "x"})


def test_translategemma_known_source_is_structured_content() -> None:
    cfg = model(prompt_format="translategemma_template")
    out = check({"input": "Ach, hij is gewoon een ouwe brombeer.", "source_lang_code": "nl", "target_lang_code": "en"},
                cfg)
    assert out["messages"] == [{"role": "user", "content": [{
        "type": "text", "source_lang_code": "nl", "target_lang_code": "en",
        "text": "Ach, hij is gewoon een ouwe brombeer."}]}]
    assert out["stop"] == ["<end_of_turn>"]


@pytest.mark.parametrize("source", [None, "auto", "mixed"])
def test_translategemma_mixed_source_keeps_the_format_with_a_fallback_and_a_note(source: str | None) -> None:
    body = {"input": "1. De vergadering is verplaatst.\n2. La réunion a été déplacée.", "target_lang_code": "en"}
    if source:
        body["source_lang_code"] = source
    (item,) = check(body, model(prompt_format="translategemma_template"))["messages"][0]["content"]
    assert item["source_lang_code"] not in (None, "auto", "mixed", "en")
    assert item["target_lang_code"] == "en"
    assert item["text"] == MIXED_SOURCE_NOTE + body["input"]


def test_stream_asks_the_backend_for_usage() -> None:
    out = check({"input": "x", "stream": True})
    assert out["stream"] is True and out["stream_options"] == {"include_usage": True}


def test_prompt_cache_key_is_forwarded_only_when_the_model_opts_in() -> None:
    assert "prompt_cache_key" not in check({"input": "x", "prompt_cache_key": "k"})
    cfg = model("openai_remote", remote_prompt_cache_key_enabled=True)
    assert check({"input": "x", "prompt_cache_key": "k"}, cfg)["prompt_cache_key"] == "k"


def test_metrics_have_every_key_and_null_for_what_nobody_measured() -> None:
    timer = Timer(handler=10.0, enqueued=10.001, admitted=10.002, sent=10.002, received=10.140, finished=10.1405)
    metrics = build(timer, {"prompt_tokens": 47, "completion_tokens": 23}, None, now=10.141)
    assert tuple(metrics) == METRIC_KEYS
    assert metrics["backend_inference_wall_ms"] == 138.0
    assert metrics["engine_total_wall_ms"] == 139.5 and metrics["engine_outside_backend_wall_ms"] == 1.5
    assert metrics["pool_total_wall_ms"] == 141.0 and metrics["engine_queue_wait_ms"] == 1.0
    assert metrics["gpu_time_to_first_token_ms"] is None and metrics["gpu_generate_total_ms"] is None
    assert metrics["engine_cached_prompt_tokens"] is None and metrics["engine_tokenize_ms"] is None
    assert metrics["engine_tokens_per_second"] == round(23 / 0.138, 1)


def test_metrics_use_the_engines_timings_and_cached_tokens_when_reported() -> None:
    timer = Timer(handler=0.0, enqueued=0.0, admitted=0.0, sent=0.0, received=0.2, finished=0.2)
    usage = {"prompt_tokens": 47, "completion_tokens": 23, "prompt_tokens_details": {"cached_tokens": 40}}
    metrics = build(timer, usage, {"prompt_ms": 10.0, "predicted_ms": 128.4}, now=0.2)
    assert metrics["gpu_time_to_first_token_ms"] == 10.0 and metrics["gpu_decode_after_first_token_ms"] == 128.4
    assert metrics["gpu_generate_total_ms"] == 138.4 and metrics["engine_tokens_per_second"] == 166.2
    assert metrics["engine_cached_prompt_tokens"] == 40
    moonshot = build(timer, {"prompt_tokens": 5, "completion_tokens": 1, "cached_tokens": 3}, None, now=0.2)
    assert moonshot["engine_cached_prompt_tokens"] == 3
