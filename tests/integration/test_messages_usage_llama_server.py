"""A /v1/messages stream to a llama-server model is charged what the stream itself says (issue 39,
item 9): llama-server speaks Messages and its answer passes through; its prompt's count comes in
message_start, its output's in message_delta (was: 0 and 0 in the ledger for every stream). And one
the client cuts short is charged for the events that went out. The pinned llama-server with the
tiny GGUF, the proxy's routes in-process with the tenants' real ledger."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from direct_llama_server import configured, served
from launchers import llama_server
from metered import Metered, metered_app
from proxy.upstream.reach import ProgramReach

pytestmark = pytest.mark.integration

BODY = {"model": "m", "max_tokens": 24, "stream": True,
        "messages": [{"role": "user", "content": "Tell me about the sea and the ships on it."}]}


async def events(metered: Metered, body: dict[str, Any], stop_after: int | None = None) -> list[dict[str, Any]]:
    """The stream's events as the client read them; it hangs up after `stop_after` text deltas."""
    seen: list[dict[str, Any]] = []
    async with metered.client.post(metered.url + "/v1/messages", json=body, headers=metered.headers()) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data:"):
                seen.append(json.loads(line[5:]))
                if stop_after is not None and sum(e["type"] == "content_block_delta" for e in seen) == stop_after:
                    resp.close()
                    break
    return seen


async def test_a_messages_stream_to_llama_server_is_charged_its_own_counts(
        tiny_gguf: Path, llama_server_bin: Path, tmp_path: Path) -> None:
    model = configured(tmp_path, model_path=str(tiny_gguf), llama_server_binary=str(llama_server_bin))
    with served(model, tmp_path / "llama-server.log") as url:
        port = int(url.rsplit(":", 1)[1])
        config = {"backend": "llama_server", "model_path": str(tiny_gguf), "llama_server_binary": str(llama_server_bin)}
        async with metered_app(tmp_path, "m", config,
                               lambda c: ProgramReach(llama_server.launch(c, 0, port, 5, {}))) as metered:
            streams = [await events(metered, {**BODY, "messages": [{"role": "user", "content": f"{i} " * (5 + i)}]})
                       for i in range(4)]
            prompt = output = 0
            for seen in streams:
                assert seen[-1]["type"] == "message_stop"
                starts = [e["message"]["usage"] for e in seen if e["type"] == "message_start"]
                output += next(e for e in seen if e["type"] == "message_delta")["usage"]["output_tokens"]
                # llama-server now and then starts a stream without message_start (DESIGN.md): then
                # the prompt is the proxy's estimate, and says so.
                prompt += starts[0]["input_tokens"] + starts[0].get("cache_read_input_tokens", 0) if starts else 0
            await metered.until_finished(4)
            row = metered.ledger()
            assert (row["requests"], row["errors"]) == (4, 0)
            assert row["output_tokens"] == output > 0
            exact = [usage for _path, usage, estimated in metered.seen if not estimated]
            assert exact and sum(u[0] for u in exact) == prompt > 0

            # Cut short after 3 text events: at least what the client read is charged.
            await events(metered, {**BODY, "max_tokens": 400}, stop_after=3)
            await metered.until_finished(5)
            _path, usage, _estimated = metered.seen[-1]
            assert usage is not None and usage[2] >= 3 and usage[0] > 0
