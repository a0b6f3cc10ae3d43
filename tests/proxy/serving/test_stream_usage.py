"""The pieces of proxy/serving/stream_usage.py: asking for a stream's usage in the client's own
bytes, keeping the usage chunk from a client that did not ask, reading Anthropic's counts from a
stream's first and last reads, and a prompt's estimate."""
from __future__ import annotations

import json

from proxy.edge.stream_count import Tally, without_usage_chunk
from proxy.serving.stream_usage import ask_usage, estimated_prompt


def sent(tally: Tally, chunk: bytes) -> None:
    """What the relay does with each chunk that went out (forward._relay)."""
    tally.events += chunk.count(tally.needle)
    tally.ended = tally.ended or chunk.find(tally.marker, -32) >= 0


def test_the_client_bytes_get_the_question_spliced_in_not_encoded_again() -> None:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "é"}]}
    raw = json.dumps(body, ensure_ascii=False).encode() + b"\n"
    asked = ask_usage(body, raw)
    assert asked is not None
    sent, sent_raw = asked
    assert sent_raw is not None and json.loads(sent_raw) == sent == {**body, "stream_options": {"include_usage": True}}
    # The client's own options are kept; a client that asked itself is left alone.
    kept = ask_usage({**body, "stream_options": {"continuous_usage_stats": False}}, raw)
    assert kept is not None and kept[0]["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert kept[1] is None
    assert ask_usage({**body, "stream_options": {"include_usage": True}}, raw) is None


def test_only_a_whole_usage_chunk_is_kept_from_the_client() -> None:
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3}}\n\n'
    done = b"data: [DONE]\n\n"
    word = b'data: {"choices":[{"delta":{"content":"\\"choices\\":[]"}}]}\n\n'
    assert without_usage_chunk(word + usage + done) == word + done
    assert without_usage_chunk(b'data: {"choices": [], "usage": {}}\n\n') == b""
    assert without_usage_chunk(word) == word
    # Split over two reads: passed on, never cut in the middle.
    assert without_usage_chunk(usage[:30]) == usage[:30]
    assert without_usage_chunk(usage[4:]) == usage[4:]


def test_anthropic_counts_come_from_message_start_and_message_delta() -> None:
    tally = Tally("/v1/messages")
    tally.head = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
                  b'{"cache_read_input_tokens":4,"input_tokens":6,"output_tokens":0}}}\n\n'
                  b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"a"}}\n\n')
    sent(tally, tally.head)
    tail = (b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":9}}\n\n'
            b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    sent(tally, tail)
    assert tally.usage(tail) == {"cache_read_input_tokens": 4, "input_tokens": 6, "output_tokens": 9}
    assert tally.ended and tally.relayed() == 1


def test_openai_events_are_counted_without_the_end() -> None:
    tally = Tally("/v1/chat/completions")
    sent(tally, b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[{"delta":{"content":"b"}}]}\n\n')
    assert (tally.relayed(), tally.ended) == (2, False)
    sent(tally, b"data: [DONE]\n\n")
    assert (tally.relayed(), tally.ended) == (2, True)


def test_a_prompts_estimate_reads_text_and_token_ids() -> None:
    assert estimated_prompt({"messages": [{"role": "user", "content": "x" * 40},
                                          {"role": "user", "content": [{"type": "text", "text": "y" * 8}]}]}) == 12
    assert estimated_prompt({"prompt": [[1, 2, 3], [4, 5]]}) == 5
    assert estimated_prompt({"prompt": "abcde"}) == 2
    assert estimated_prompt({}) == 0


def test_a_messages_stream_cut_short_or_without_message_start_keeps_what_is_known() -> None:
    start = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
             b'{"input_tokens":6,"output_tokens":0}}}\n\n')
    cut = Tally("/v1/messages")
    cut.head = start
    sent(cut, start + b'data: {"type":"content_block_delta"}\n\n')
    assert cut.usage(start) == {"input_tokens": 6} and cut.relayed() == 1   # 0 output is no count
    headless = Tally("/v1/messages")
    end = b'data: {"type":"message_delta","usage":{"output_tokens":9}}\n\ndata: {"type":"message_stop"}\n\n'
    headless.head = end
    sent(headless, end)
    assert headless.usage(end) == {"completion_tokens": 9}
