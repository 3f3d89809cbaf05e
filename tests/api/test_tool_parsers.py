"""Tool calls read out of free text (tool_choice auto): hermes <tool_call> blocks and Llama
3 JSON, batch and streamed, with text that is not a call left as content."""

from __future__ import annotations

import json

from shoal.runtime.api.tool_parsers import StreamingToolParser, parse_tool_calls

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Lima"}}'


def test_hermes_blocks_become_calls_and_the_text_before_them_content() -> None:
    content, calls = parse_tool_calls(HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2


def test_llama3_json_is_a_call_and_plain_text_or_broken_json_is_content() -> None:
    content, calls = parse_tool_calls(LLAMA3)
    assert content is None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Lima"}
    for text in ("just words", '{"name": "x", "arguments": {', "<tool_call>{oops</tool_call>"):
        assert parse_tool_calls(text) == (text, [])


def test_streaming_sends_content_until_a_call_may_start_then_the_calls_at_the_end() -> None:
    for text, streamed in ((HERMES, "Let me check.\n"), (LLAMA3, ""), ("plain <tool", None)):
        parser = StreamingToolParser()
        sent = "".join(parser.feed(text[i:i + 3]) for i in range(0, len(text), 3))
        rest, calls = parser.finish()
        if streamed is None:  # no call: everything arrives as content, in order
            assert sent + rest == text and not calls
        else:
            assert sent == streamed and calls and not rest.strip()
