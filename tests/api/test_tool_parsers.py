"""Tool calls read out of free text (tool_choice auto): hermes <tool_call> blocks and Llama
3 JSON, batch and streamed, with text that is not a call left as content; and the streamed
``required`` array. Streams are assembled the way the openai client does (by index).
BUILT_IN_CASES are also given to vLLM's hermes and llama3_json parsers by
bench/tool_parsers_vs_vllm.py; BUILT_IN_DEPARTS_FROM_VLLM says where Shoal differs on purpose."""

from __future__ import annotations

import json

import pytest
from shoal.runtime.api.tool_calls import ToolPolicy, calls_from_constrained
from shoal.runtime.api.tool_parsers import parse_tool_calls
from shoal.runtime.api.tool_stream import ToolDeltaStream

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
          '"note": "a \\"quoted\\" } brace"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
          '"arguments": {}}\n</tool_call>')
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Lima"}}'
HERMES_CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
HERMES_NO_ARGUMENTS = '<tool_call>\n{"name": "ping"}\n</tool_call>'
HERMES_ONE_BAD_BLOCK = '<tool_call>{"name": "ping", "arguments": {}}</tool_call><tool_call>oops</tool_call>'
LLAMA3_AFTER_TEXT = 'Sure: {"name": "get_weather", "parameters": {"city": "Lima"}}'
# (parser, model text, content, [(name, arguments object)]): the default reading's cases that
# bench/tool_parsers_vs_vllm.py also gives to vLLM's hermes and llama3_json parsers
BUILT_IN_CASES = [
    ("hermes", HERMES, "Let me check.", [
        ("get_weather", {"city": "Oslo", "note": 'a "quoted" } brace'}), ("get_time", {})]),
    ("hermes", 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}', "Hi",
     [("get_weather", {"city": "Oslo"})]),  # the closing tag never written
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ',
     '<tool_call>\n{"name": "get_weather", "arguments": ', []),
    ("hermes", HERMES_CUT, None, [("get_weather", {"<not JSON>": '{"ci'})]),
    ("hermes", HERMES_NO_ARGUMENTS, None, [("ping", {})]),
    ("hermes", HERMES_ONE_BAD_BLOCK, None, [("ping", {})]),
    ("hermes", "just words", "just words", []),
    ("llama3_json", LLAMA3, None, [("get_weather", {"city": "Lima"})]),
    ("llama3_json", LLAMA3 + '; {"name": "ping", "parameters": {}}', None,
     [("get_weather", {"city": "Lima"}), ("ping", {})]),
    ("llama3_json", '{"name": "get_weather", "arguments": {"city": "Lima"}}', None,
     [("get_weather", {"city": "Lima"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": ',
     '{"name": "get_weather", "parameters": ', []),
    ("llama3_json", LLAMA3_AFTER_TEXT, LLAMA3_AFTER_TEXT, []),
]
# where the default reading departs from vLLM's parsers on purpose (the bench reports them)
BUILT_IN_DEPARTS_FROM_VLLM = {
    HERMES_CUT: "vLLM's whole-text reading makes a block cut short content, while its stream "
                "has sent the call; Shoal counts it, so stream and whole agree",
    HERMES_NO_ARGUMENTS: "vLLM needs an arguments key (KeyError: all content); Shoal reads a "
                         "call without arguments as {}",
    HERMES_ONE_BAD_BLOCK: "one block that is not JSON makes vLLM return the whole message as "
                          "content; Shoal keeps the blocks that are calls",
    LLAMA3_AFTER_TEXT: "vLLM reads a JSON call after any text (and drops the text); Shoal "
                       "reads Llama 3 JSON only as the whole message, so prose quoting a "
                       "call stays prose",
}


def stream(text: str, mode: str = "auto", step: int = 3) -> tuple[str, dict[int, dict], int]:
    """(content, calls by index, number of arguments deltas) as the openai client sees them."""
    tools = ToolDeltaStream(ToolPolicy(mode))
    deltas = [tools.feed(text[i:i + step]) for i in range(0, len(text), step)]
    deltas.append(tools.finish())
    content, calls, pieces = "", {}, 0
    for delta in deltas:
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "",
                                                   "arguments": ""})
            entry["name"] += tc.get("function", {}).get("name") or ""
            if tc["function"].get("arguments"):
                entry["arguments"] += tc["function"]["arguments"]
                pieces += 1
    return content, calls, pieces


def test_hermes_blocks_become_calls_and_the_text_before_them_content() -> None:
    content, calls = parse_tool_calls(HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "note": 'a "quoted" } brace'}), ("get_time", {})]
    assert calls[0].arguments == '{"city": "Oslo", "note": "a \\"quoted\\" } brace"}'  # as written
    assert len({c.id for c in calls}) == 2


def test_llama3_json_is_a_call_and_plain_text_or_broken_json_is_content() -> None:
    content, calls = parse_tool_calls(LLAMA3)
    assert content is None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Lima"}
    for text in ("just words", '{"name": "x", "arguments": {', "<tool_call>{oops</tool_call>"):
        assert parse_tool_calls(text) == (text, [])


def test_streamed_hermes_calls_arrive_as_argument_deltas_that_assemble_to_the_batch_calls(
) -> None:
    _, whole = parse_tool_calls(HERMES)
    for step in (1, 3, 7, len(HERMES)):
        content, calls, pieces = stream(HERMES, step=step)
        assert content == "Let me check.\n" and "<" not in content
        assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
            (c.name, c.arguments) for c in whole]
        assert all(c["id"] for c in calls.values())
        if step == 3:
            assert pieces > 5  # the arguments streamed, not sent whole


def test_content_streams_and_only_a_possible_tag_is_held_back() -> None:
    tools = ToolDeltaStream(ToolPolicy("auto"))
    assert tools.feed("Hello <tool") == {"content": "Hello "}
    assert tools.feed(" kit") == {"content": "<tool kit"}  # not a tag after all
    assert tools.finish() == {}
    content, calls, _ = stream("plain <tool")
    assert content == "plain <tool" and not calls


def test_llama3_json_and_unstreamable_shapes_are_sent_whole_at_the_end() -> None:
    content, calls, _ = stream(LLAMA3)
    assert content == "" and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == parse_tool_calls(LLAMA3)[1][0].arguments
    late_name = '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>'
    content, calls, pieces = stream(late_name)
    assert content == "" and pieces == 1
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == ("get_time", {"zone": "UTC"})
    content, calls, _ = stream("<tool_call>{oops</tool_call>")
    assert content == "<tool_call>{oops</tool_call>" and not calls  # as the batch parse


def test_a_streamed_required_array_assembles_to_the_batch_calls() -> None:
    text = ('[{"name":"get_weather","parameters":{"city":"Paris","days":3}},'
            '{"name":"get_time","parameters":{"zone":"CET"}}]')
    whole = calls_from_constrained(text, ToolPolicy("required"))
    for step in (1, 4):
        content, calls, pieces = stream(text, "required", step)
        assert content == "" and pieces > 2
        assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
            (c.name, c.arguments) for c in whole] == [
            ("get_weather", '{"city":"Paris","days":3}'), ("get_time", '{"zone":"CET"}')]


def test_a_forced_call_cut_off_before_it_began_is_no_call_streamed_or_not() -> None:
    """max_tokens spent while a reasoning model was still thinking: no call (as vLLM), not one
    with arguments "" (which clients cannot json.loads); the named call's first delta waits
    for its first argument text."""
    from shoal.runtime.api.serving_chat import assistant_message

    named = ToolPolicy("named", "get_weather")
    for text in ("", "  "):
        message, finish = assistant_message(text, named, "length")
        assert "tool_calls" not in message and finish == "length"
        tools = ToolDeltaStream(named)
        assert tools.feed(text) == {} and tools.finish() == {} and tools.num_calls == 0
    tools = ToolDeltaStream(named)
    assert tools.feed("") == {}
    first = tools.feed(' {"ci')["tool_calls"][0]
    assert (first["function"]["name"], first["function"]["arguments"]) == ("get_weather",
                                                                          ' {"ci')
    message, _ = assistant_message("", ToolPolicy("required"), "length")
    assert message == {"role": "assistant", "content": None}


@pytest.mark.parametrize("text,arguments", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', '{"ci'),
    ('Hi <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "get_weather"'
     ', "arguments": {"city": ', '{"city": '),
    ('<tool_call>{"name": "get_weather", "arguments": ', None),  # arguments not begun
])
def test_a_hermes_call_cut_short_reads_the_same_streamed_or_not(text, arguments) -> None:
    """max_tokens inside a block's arguments: the stream has sent the call (as vLLM's does),
    so the whole message has it too, with the arguments written; before they began there is
    no call in either."""
    content, calls = parse_tool_calls(text)
    if arguments is None:
        assert (content, calls) == (text, [])
    else:
        assert (calls[-1].name, calls[-1].arguments) == ("get_weather", arguments)
    for step in (1, 3, len(text)):
        streamed_content, streamed, _ = stream(text, step=step)
        assert [(streamed[i]["name"], streamed[i]["arguments"]) for i in sorted(streamed)] == [
            (c.name, c.arguments) for c in calls]
        assert streamed_content.strip() == (content or "").strip()


def args_value(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {"<not JSON>": arguments}


@pytest.mark.parametrize("parser,text,content,expected", BUILT_IN_CASES)
def test_built_in_cases_whole_and_streamed(parser, text, content, expected) -> None:
    """The cases the peer check gives to vLLM too (both readings are tried on every text,
    as without --tool-call-parser; the parser name is vLLM's for it)."""
    got_content, calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, args_value(c.arguments)) for c in calls] == expected
    for step in (1, 4, len(text)):
        streamed_content, streamed, _ = stream(text, step=step)
        assert [(streamed[i]["name"], streamed[i]["arguments"]) for i in sorted(streamed)] == [
            (c.name, c.arguments) for c in calls]
        assert (streamed_content.strip() or None) == (content.strip() if content else None)
