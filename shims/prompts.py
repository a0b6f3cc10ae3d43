"""Chat messages rendered as one prompt string, per the model's `prompt_format`.

For engines without a chat template of their own (CT2, ExLlamaV3, a GGUF without one). Each renderer
reproduces the text the model family's published chat template produces for the same messages,
minus the BOS token: the engine's tokenizer adds that itself, and a second one would change the
prompt. Each format also names the stop strings that end a model turn.

Messages are OpenAI chat messages as the proxy sends them: an optional leading `system` message
(the request's `instructions`), then `user` and `assistant` turns ending with a `user` turn.
TranslateGemma's single user turn carries `source_lang_code` and `target_lang_code` in its content
item, as the model's own template expects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

FORMATS = ("generic", "mistral_template", "qwen3_template", "gemma4_template", "translategemma_template")
# Formats whose template can take a conversation; the others render one user turn.
MULTI_TURN_FORMATS = frozenset({"generic", "mistral_template", "qwen3_template", "gemma4_template"})
# The string each chat template ends a model turn with. The proxy sends these as stop strings on
# /v1/responses too, so the shims and engines with their own templates stop at the same place.
TURN_STOPS = {"mistral_template": ("</s>",), "qwen3_template": ("<|im_end|>",), "gemma4_template": ("<turn|>",),
              "translategemma_template": ("<end_of_turn>",)}

# The languages TranslateGemma's template names (WMT24++ and its technical report), by code.
LANGUAGES = {
    "ar": "Arabic", "bg": "Bulgarian", "bn": "Bengali", "ca": "Catalan", "cs": "Czech", "da": "Danish",
    "de": "German", "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian", "fa": "Persian",
    "fi": "Finnish", "fil": "Filipino", "fr": "French", "gu": "Gujarati", "he": "Hebrew", "hi": "Hindi",
    "hr": "Croatian", "hu": "Hungarian", "id": "Indonesian", "is": "Icelandic", "it": "Italian",
    "ja": "Japanese", "kn": "Kannada", "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian",
    "ml": "Malayalam", "mr": "Marathi", "nl": "Dutch", "no": "Norwegian", "pa": "Punjabi", "pl": "Polish",
    "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sk": "Slovak", "sl": "Slovenian",
    "sr": "Serbian", "sv": "Swedish", "sw": "Swahili", "ta": "Tamil", "te": "Telugu", "th": "Thai",
    "tr": "Turkish", "uk": "Ukrainian", "ur": "Urdu", "vi": "Vietnamese", "zh": "Chinese", "zu": "Zulu",
}


class PromptError(ValueError):
    """The messages cannot be rendered in this format; `code` is the OpenAI error code."""

    def __init__(self, message: str, code: str = "invalid_messages") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Rendered:
    prompt: str
    stop: tuple[str, ...]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for item in content:
            if not isinstance(item, dict) or item.get("type") != "text":
                kind = item.get("type") if isinstance(item, dict) else type(item).__name__
                raise PromptError(f"this model takes text only, not {kind!r} content", "modality_unsupported")
            parts.append(str(item.get("text", "")))
        return "\n".join(parts)
    if content is None:
        return ""
    raise PromptError("message content must be a string or a list of content items")


def split_messages(messages: Any) -> tuple[str | None, list[tuple[str, str]]]:
    """(system text or None, [(role, text), ...]) after checking roles and order."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("`messages` must be a non-empty list")
    system = None
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"messages.{i}: must be an object")
        role = message.get("role")
        if role in ("system", "developer") and i == 0:
            system = _text(message.get("content"))
        elif role in ("user", "assistant"):
            turns.append((role, _text(message.get("content"))))
        else:
            raise PromptError(f"messages.{i}.role: {role!r} is not allowed here (a system message may only come "
                              "first; then user and assistant)")
    if not turns or turns[-1][0] != "user":
        raise PromptError("the last message must have role user")
    return system, turns


def _generic(system: str | None, turns: list[tuple[str, str]], thinking: bool | None) -> Rendered:
    # One turn is the text itself (what a translation or completion model expects), after the
    # instructions when there are any; a conversation is labelled plainly.
    if len(turns) == 1:
        text = turns[0][1]
        return Rendered(f"{system}\n\n{text}" if system else text, ())
    lines = [system, ""] if system else []
    lines += [f"{'User' if role == 'user' else 'Assistant'}: {text}" for role, text in turns]
    return Rendered("\n".join(lines) + "\nAssistant:", ("\nUser:",))


def _mistral(system: str | None, turns: list[tuple[str, str]], thinking: bool | None) -> Rendered:
    # Mistral's v7 (tekken) template, as llama.cpp prints it for a Mistral GGUF:
    # [SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]Hello[/INST]Hi there</s>[INST]How are you?[/INST]
    out = [f"[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT]"] if system else []
    for role, text in turns:
        out.append(f"[INST]{text}[/INST]" if role == "user" else f"{text}</s>")
    return Rendered("".join(out), TURN_STOPS["mistral_template"])


def _qwen3(system: str | None, turns: list[tuple[str, str]], thinking: bool | None) -> Rendered:
    # Qwen3's ChatML template: earlier assistant turns lose their <think> part; with thinking off
    # the generation prompt carries an empty think block, as enable_thinking=False renders it.
    out = [f"<|im_start|>system\n{system}<|im_end|>\n"] if system else []
    for role, text in turns:
        if role == "assistant":
            text = text.split("</think>")[-1].lstrip("\n")
        out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    if thinking is False:
        out.append("<think>\n\n</think>\n\n")
    return Rendered("".join(out), TURN_STOPS["qwen3_template"])


def _gemma4(system: str | None, turns: list[tuple[str, str]], thinking: bool | None) -> Rendered:
    # Gemma 4's turn markers (<|turn>role ... <turn|>), the assistant as `model`, content trimmed;
    # thinking on puts <|think|> at the top of the system turn.
    out = []
    if system or thinking:
        think = "<|think|>\n" if thinking else ""
        out.append(f"<|turn>system\n{think}{(system or '').strip()}<turn|>\n")
    for role, text in turns:
        out.append(f"<|turn>{'model' if role == 'assistant' else 'user'}\n{text.strip()}<turn|>\n")
    out.append("<|turn>model\n")
    return Rendered("".join(out), TURN_STOPS["gemma4_template"])


def _language(code: Any, field: str) -> str:
    if not isinstance(code, str) or not code:
        raise PromptError(f"translategemma_template needs `{field}`", "target_lang_required")
    name = LANGUAGES.get(code) or LANGUAGES.get(code.replace("_", "-").split("-")[0].lower())
    if name is None:
        raise PromptError(f"{field} {code!r} is not a language TranslateGemma knows; one of: "
                          f"{', '.join(sorted(LANGUAGES))}", "unsupported_language")
    return name


def translategemma(messages: Any) -> Rendered:
    """TranslateGemma's one structured user turn (Gemma 3 turn markers) with its fixed instruction."""
    if not isinstance(messages, list) or len(messages) != 1 or not isinstance(messages[0], dict) \
            or messages[0].get("role") != "user":
        raise PromptError("translategemma_template takes exactly one user message (no instructions)")
    content = messages[0].get("content")
    items = content if isinstance(content, list) else [{"type": "text", "text": _text(content)}]
    if len(items) != 1 or not isinstance(items[0], dict) or items[0].get("type") != "text":
        raise PromptError("translategemma_template takes one text item", "modality_unsupported")
    item = items[0]
    source_code, target_code = item.get("source_lang_code"), item.get("target_lang_code")
    source, target = _language(source_code, "source_lang_code"), _language(target_code, "target_lang_code")
    prompt = (f"<start_of_turn>user\nYou are a professional {source} ({source_code}) to {target} ({target_code}) "
              f"translator. Your goal is to accurately convey the meaning and nuances of the original {source} "
              f"text while adhering to {target} grammar, vocabulary, and cultural sensitivities.\n"
              f"Produce only the {target} translation, without any additional explanations or commentary. "
              f"Please translate the following {source} text into {target}:\n\n\n"
              f"{str(item.get('text', '')).strip()}<end_of_turn>\n<start_of_turn>model\n")
    return Rendered(prompt, TURN_STOPS["translategemma_template"])


_RENDERERS: dict[str, Callable[[str | None, list[tuple[str, str]], bool | None], Rendered]] = {
    "generic": _generic,
    "mistral_template": _mistral,
    "qwen3_template": _qwen3,
    "gemma4_template": _gemma4,
}


def render(messages: Any, prompt_format: str, multi_turn: bool, thinking: bool | None = None) -> Rendered:
    """Render chat `messages` in `prompt_format`; refuse a conversation where `multi_turn` is False.

    `thinking` is the model's `enable_thinking` (None: the template's default).
    """
    if prompt_format == "translategemma_template":
        return translategemma(messages)
    renderer = _RENDERERS.get(prompt_format)
    if renderer is None:
        raise PromptError(f"unknown prompt_format {prompt_format!r}; one of {', '.join(FORMATS)}", "invalid_request")
    system, turns = split_messages(messages)
    if len(turns) > 1 and not (multi_turn and prompt_format in MULTI_TURN_FORMATS):
        raise PromptError("this model takes a single user turn (capabilities.multi_turn is false)",
                          "multi_turn_unsupported")
    return renderer(system, turns, thinking)
