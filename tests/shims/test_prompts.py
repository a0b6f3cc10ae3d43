"""Prompt renderers against the text the models' published chat templates produce.

References: llama.cpp prints a model's template applied to a fixed conversation at load
("chat template, example_format"); the strings below are those prints for a Mistral v7 (tekken)
GGUF, a ChatML (Qwen) GGUF and a Gemma 4 GGUF, without the BOS the tokenizer adds. Qwen3's
enable_thinking=False suffix and its stripping of earlier reasoning are from Qwen3's
tokenizer_config chat template; TranslateGemma's prompt is the one its model card publishes.
"""
from __future__ import annotations

import pytest

from shims.prompts import PromptError, render

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "How are you?"},
]


def test_mistral_matches_the_v7_template() -> None:
    out = render(CONVERSATION, "mistral_template", multi_turn=True)
    assert out.prompt == ("[SYSTEM_PROMPT]You are a helpful assistant[/SYSTEM_PROMPT][INST]Hello[/INST]Hi there</s>"
                          "[INST]How are you?[/INST]")
    assert out.stop == ("</s>",)


def test_qwen3_matches_chatml() -> None:
    out = render(CONVERSATION, "qwen3_template", multi_turn=True)
    assert out.prompt == ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
                          "<|im_start|>user\nHello<|im_end|>\n"
                          "<|im_start|>assistant\nHi there<|im_end|>\n"
                          "<|im_start|>user\nHow are you?<|im_end|>\n"
                          "<|im_start|>assistant\n")
    assert out.stop == ("<|im_end|>",)


def test_qwen3_thinking_off_adds_the_empty_think_block_and_history_loses_reasoning() -> None:
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                {"role": "user", "content": "and 3+3?"}]
    out = render(messages, "qwen3_template", multi_turn=True, thinking=False)
    assert out.prompt == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                          "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_gemma4_matches_its_turn_markers_with_thinking_on() -> None:
    out = render(CONVERSATION, "gemma4_template", multi_turn=True, thinking=True)
    assert out.prompt == ("<|turn>system\n<|think|>\nYou are a helpful assistant<turn|>\n"
                          "<|turn>user\nHello<turn|>\n<|turn>model\nHi there<turn|>\n"
                          "<|turn>user\nHow are you?<turn|>\n<|turn>model\n")
    assert out.stop == ("<turn|>",)


def test_gemma4_default_is_googles_documented_dialogue() -> None:
    # ai.google.dev "Gemma 4 Prompt Formatting":
    # <|turn>system\nYou are a helpful assistant.<turn|>\n<|turn>user\nHello.<turn|>
    out = render([{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello."}],
                 "gemma4_template", multi_turn=False)
    assert out.prompt == ("<|turn>system\nYou are a helpful assistant.<turn|>\n<|turn>user\nHello.<turn|>\n"
                          "<|turn>model\n")


def test_translategemma_matches_the_model_card_prompt() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "source_lang_code": "nl", "target_lang_code": "en",
                                              "text": "Ach, hij is gewoon een ouwe brombeer."}]}]
    out = render(messages, "translategemma_template", multi_turn=False)
    assert out.prompt == (
        "<start_of_turn>user\nYou are a professional Dutch (nl) to English (en) translator. Your goal is to accurately "
        "convey the meaning and nuances of the original Dutch text while adhering to English grammar, vocabulary, "
        "and cultural sensitivities.\nProduce only the English translation, without any additional explanations or "
        "commentary. Please translate the following Dutch text into English:\n\n\n"
        "Ach, hij is gewoon een ouwe brombeer.<end_of_turn>\n<start_of_turn>model\n")
    assert out.stop == ("<end_of_turn>",)


def test_generic_single_turn_is_the_text_after_the_instructions() -> None:
    assert render([{"role": "user", "content": "Hallo"}], "generic", multi_turn=False).prompt == "Hallo"
    out = render([{"role": "system", "content": "Translate to English."}, {"role": "user", "content": "Hallo"}],
                 "generic", multi_turn=False)
    assert (out.prompt, out.stop) == ("Translate to English.\n\nHallo", ())


def test_generic_conversation_is_labelled_and_stops_at_the_next_user_turn() -> None:
    out = render(CONVERSATION, "generic", multi_turn=True)
    assert out.prompt == ("You are a helpful assistant\n\nUser: Hello\nAssistant: Hi there\nUser: How are you?\n"
                          "Assistant:")
    assert out.stop == ("\nUser:",)


def test_a_text_content_array_is_one_prompt() -> None:
    out = render([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                 "qwen3_template", multi_turn=False)
    assert "<|im_start|>user\na\nb<|im_end|>" in out.prompt


@pytest.mark.parametrize(("messages", "fmt", "multi_turn", "code"), [
    (CONVERSATION, "qwen3_template", False, "multi_turn_unsupported"),
    (CONVERSATION, "translategemma_template", True, "invalid_messages"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}], "generic", True,
     "modality_unsupported"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "generic", True, "invalid_messages"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "generic", True, "invalid_messages"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "target_lang_code": "xx"}]}],
     "translategemma_template", False, "target_lang_required"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "source_lang_code": "nl", "target_lang_code": "xx"}]}],
     "translategemma_template", False, "unsupported_language"),
    ([{"role": "user", "content": "a"}], "llama2_template", True, "invalid_request"),
])
def test_what_a_format_cannot_take_is_refused_with_a_code(messages, fmt, multi_turn, code) -> None:
    with pytest.raises(PromptError) as err:
        render(messages, fmt, multi_turn=multi_turn)
    assert err.value.code == code
