"""A streamed pass-through is charged (issue 39, item 1): the proxy asks a backend that sends a
stream's usage only when asked (`stream_options.include_usage`: providers, llama-server, vLLM) for
it on every stream, and a client that did not ask does not get the usage chunk. Against the FAKE
provider (tests/fakes.py), which sends usage only when asked, with the tenants' real ledger."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

from metered import Metered, content_of, metered_pool
from proxy.capabilities import Traits
from proxy.lifecycle.kinds import remote_options

PROMPT = "say hello " * 40
WORDS = 5   # the fake provider's answer


async def stream(metered: Metered, **fields: object) -> list[bytes]:
    """The `data:` payloads of one streamed chat, as the client got them."""
    async with metered.client.post(metered.url + "/v1/chat/completions", json=metered.chat(PROMPT, **fields),
                                   headers=metered.headers()) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    return [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]


async def test_a_stream_the_client_did_not_ask_usage_for_is_charged_and_gets_no_usage_chunk(tmp_path: Path) -> None:
    async with metered_pool(tmp_path) as metered:
        events = await stream(metered)
        await metered.until_finished(1)
        sent = metered.provider.received("/v1/chat/completions")[-1]["body"]
        assert isinstance(sent, dict) and sent["stream_options"] == {"include_usage": True}
        # What the client gets is what it would without the proxy's question: words, then [DONE].
        assert events[-1] == b"[DONE]" and len(events) == WORDS + 1
        assert all(b'"usage"' not in e for e in events)
        assert "".join(content_of(e) for e in events[:-1]) == "Hello from the fake provider"
        row = metered.ledger()
        assert (row["requests"], row["output_tokens"], row["errors"]) == (1, WORDS, 0)
        assert row["prompt_tokens"] == len(PROMPT) // 4 + 1   # the provider's own figure
        assert metered.seen[-1][2] is False   # counted by the provider, not estimated


async def test_a_client_that_asked_for_usage_gets_the_usage_chunk(tmp_path: Path) -> None:
    async with metered_pool(tmp_path) as metered:
        events = await stream(metered, stream_options={"include_usage": True})
        await metered.until_finished(1)
        usage = json.loads(events[-2])["usage"]
        assert (usage["completion_tokens"], events[-1]) == (WORDS, b"[DONE]")
        assert metered.ledger()["output_tokens"] == WORDS


def test_backends_that_send_usage_only_when_asked_say_so_in_their_traits() -> None:
    traits = {name: importlib.import_module(f"launchers.{name}").TRAITS
              for name in ("llama_server", "vllm_serve", "sim", "ct2", "llama_cpp", "exllamav3")}
    asked = {name for name, t in traits.items() if t.usage_on_request}
    # The shims (shims/core.py) put usage in every stream's last chunk; the others follow OpenAI.
    assert asked == {"llama_server", "vllm_serve"}
    assert remote_options.TRAITS.usage_on_request and not Traits().usage_on_request
