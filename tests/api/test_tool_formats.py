"""``--tool-call-parser`` formats (mistral, qwen3_coder, pythonic, deepseek_v3, openai): each
read whole and as it streams, cut at every point; the streamed calls assemble to the whole
ones, their arguments arriving piece by piece as the model writes them (pythonic's at the end).
The expected calls are what vLLM's parsers return for the same text
(bench/tool_parsers_vs_vllm.py runs vLLM's own parsers on these cases), except the few in
DEPARTS_FROM_VLLM. Served, on what a model trained to write each format samples:
tests/api/test_trained_tool_calls.py."""

from __future__ import annotations

import json

import pytest
from shoal.runtime.api.tool_formats import (
    FORMATS,
    FormatCallStream,
    parse_whole,
    tool_format,
)
from shoal.runtime.api.tool_formats.mistral import mistral_call_id
from shoal.runtime.api.tool_formats.qwen3_coder import typed_value

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"},
                                     "hours": {"type": "array"}, "zip": {"type": "string"}}}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {}}}}]
OA_START = "<|start|>assistant to=functions."  # the harmony reading's call fragment
DS_BEGIN, DS_CALL, DS_SEP, DS_END, DS_ALL_END = (
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>")

MISTRAL_CUT_ARRAY = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}, '
                     '{"name": "ping", "arguments": {"a')
# cut off by max_tokens right after the call's name: arguments "{}" (vLLM's reading of
# "name[ARGS]" at the end), never "" (clients json.loads the arguments)
MISTRAL_CUT_ITEM = '[TOOL_CALLS] [{"name": "get_weather", "arguments": '
DS_CUT_FENCE = f"{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
MISTRAL_STRING_ARGUMENTS = ('[TOOL_CALLS] [{"name": "get_weather", '
                            '"arguments": "{\\"city\\": \\"Rome\\"}"}]')
# where Shoal reads a text differently from vLLM, on purpose (the bench reports them apart)
DEPARTS_FROM_VLLM = {
    MISTRAL_CUT_ARRAY:
        "a pre-v11 array cut short: vLLM's whole-text reading finds no JSON array (its stream "
        "has sent the items by then); Shoal counts the items begun, so stream and whole agree",
    '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}':
        "vLLM keeps '[CALL_ID]a1b2c3d4e' in the function name",
    f"{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n" '{"city": "Tok':
        "vLLM's whole-text reading needs the closing fence (its stream has sent the call "
        "by then); Shoal counts a call begun, so its stream and whole reading agree",
    MISTRAL_CUT_ITEM: "as the cut array above, its item cut before the arguments: {}",
    DS_CUT_FENCE: "as the cut call above, cut before the arguments: {}",
}


def args_value(arguments: str):
    """A call's arguments as an object; text that is not JSON (a call cut short) marked so
    (bench/tool_parsers_vs_vllm.py reads vLLM's calls the same way)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {"<not JSON>": arguments}

# (format, model text, expected content, expected [(name, arguments object)])
CASES = [
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}', "Sure.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]ping[ARGS]{}', None,
     [("get_weather", {"city": "Oslo"}), ("ping", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}', None,
     [("get_weather", {"city": "Rome"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}, '
                '{"name": "ping", "arguments": {}}]', None,
     [("get_weather", {"city": "Lima"}), ("ping", {})]),
    ("mistral", MISTRAL_CUT_ARRAY, None,
     [("get_weather", {"city": "Lima"}), ("ping", {"<not JSON>": '{"a'})]),
    ("mistral", "[TOOL_CALLS] [1, 2]", "[TOOL_CALLS] [1, 2]", []),
    ("mistral", '[TOOL_CALLS] [5, {"name": "ping", "arguments": null}, {"x": 1}, '
                '{"arguments": {"a": 1}}]', None, [("ping", {}), ("", {"a": 1})]),  # skipped
    ("mistral", MISTRAL_STRING_ARGUMENTS, None, [("get_weather", {"city": "Rome"})]),
    ("mistral", 'Ok [TOOL_CALLS] {"name": "get_weather", "arguments": {"city": "Oslo"}} {}', "Ok",
     [("get_weather", {"city": "Oslo"})]),  # one call object written bare
    ("mistral", '[TOOL_CALLS]{"city": "Oslo"}', '[TOOL_CALLS]{"city": "Oslo"}', []),
    ("mistral", "No tools needed [TOOL", "No tools needed [TOOL", []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]{\"city\": ", None,  # cut short: a call begun
     [("get_weather", {"<not JSON>": '{"city":'})]),  # (trailing space dropped, as vLLM)
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]", None, [("get_weather", {})]),
    ("mistral", MISTRAL_CUT_ITEM, None, [("get_weather", {})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n", None, [("get_weather", {})]),
    ("deepseek_v3", DS_CUT_FENCE, None, [("get_weather", {})]),
    ("openai", f"{OA_START}get_weather<|message|>", None, [("get_weather", {})]),
    ("qwen3_coder", "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    "New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                    "<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
                    "</parameter>\n<parameter=zip>\n10001\n</parameter>\n</function>\n"
                    "</tool_call>", "Let me check.",
     [("get_weather", {"city": "New York", "days": 3, "metric": True, "hours": [1, 2],
                       "zip": "10001"})]),
    ("qwen3_coder", "<tool_call>\n<function=ping>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>", None,
     [("ping", {}), ("get_weather", {"city": "Oslo", "extra": "7"})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>"
                    "\n<parameter=city>\nBern", None,
     [("get_weather", {"days": 2})]),  # cut short: the closed parameters count
    ("qwen3_coder", "a <tool_call> b", "a <tool_call> b", []),
    ("pythonic", '[get_weather(city="San Francisco", days=2, metric=True), ping()]', None,
     [("get_weather", {"city": "San Francisco", "days": 2, "metric": True}), ("ping", {})]),
    ("pythonic", '[get_weather(city="Paris", hours=[1, 2], zip=None)]', None,
     [("get_weather", {"city": "Paris", "hours": [1, 2], "zip": None})]),
    ("pythonic", ' [ping()]', ' [ping()]', []),  # vLLM: the message must be the list
    ("pythonic", "[1, 2] are numbers", "[1, 2] are numbers", []),
    ("pythonic", "It is [get_weather(city='x')]", "It is [get_weather(city='x')]", []),
    ("pythonic", "[get_weather(city=foo)]", "[get_weather(city=foo)]", []),
    ("deepseek_v3", f"Checking.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
                    f'{{"city": "Tokyo"}}\n```{DS_END}{DS_CALL}function{DS_SEP}ping\n```json\n'
                    f"{{}}\n```{DS_END}{DS_ALL_END}", "Checking.",
     [("get_weather", {"city": "Tokyo"}), ("ping", {})]),
    ("deepseek_v3", f"{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
                    '{"city": "Tok', None, [("get_weather", {"<not JSON>": '{"city": "Tok'})]),
    ("deepseek_v3", f"{DS_BEGIN}{DS_CALL}function{DS_SEP}get_wea", f"{DS_BEGIN}{DS_CALL}"
                    f"function{DS_SEP}get_wea", []),
    ("openai", f'Checking.{OA_START}get_weather<|message|>{{"city": "Paris", "days": 2}}'
               f'<|call|>', "Checking.", [("get_weather", {"city": "Paris", "days": 2})]),
    ("openai", f'{OA_START}ping<|message|>{{}}<|call|>{OA_START}get_weather<|message|>'
               f'{{"city": "Oslo"}}<|call|>', None,
     [("ping", {}), ("get_weather", {"city": "Oslo"})]),
]


def assembled(name: str, text: str, step: int) -> tuple[str, list[tuple[str, str]], set, int]:
    """(content, [(name, arguments text)], ids, argument deltas) as a client assembles the
    stream: a call's first delta has its id and name, later ones only add arguments."""
    stream = FormatCallStream(tool_format(name, TOOLS))  # type: ignore[arg-type]
    content, calls, ids, pieces_of_args = "", {}, set(), 0
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for out in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += out[0]
        for delta in out[1]:
            function = delta["function"]
            if "id" in delta:
                assert delta["index"] not in calls and delta["index"] == len(calls)
                calls[delta["index"]] = (function["name"], "")
                ids.add(delta["id"])
            else:
                assert set(function) == {"arguments"} and function["arguments"]
            call_name, arguments = calls[delta["index"]]
            calls[delta["index"]] = (call_name, arguments + function["arguments"])
            pieces_of_args += bool(function["arguments"])
    return content, [calls[i] for i in sorted(calls)], ids, pieces_of_args


@pytest.mark.parametrize("name,text,content,expected", CASES)
def test_whole_and_streamed_at_every_cut(name, text, content, expected) -> None:
    got_content, calls = parse_whole(tool_format(name, TOOLS), text)  # type: ignore[arg-type]
    assert got_content == content
    assert [(c.name, args_value(c.arguments)) for c in calls] == expected
    for step in (1, 2, 5, len(text)):
        streamed_content, streamed, ids, pieces = assembled(name, text, step)
        assert streamed == [(c.name, c.arguments) for c in calls]
        assert len(ids) == len(calls)
        # content streams as written; the whole message trims it
        assert (streamed_content.strip() or None) == (content.strip() if content else None)
        if not calls:
            assert streamed_content == text
        # (pythonic's calls are sent when the message ends, arguments written as a JSON
        # string when their item ends)
        sent_whole = name == "pythonic" or text == MISTRAL_STRING_ARGUMENTS
        if step == 1 and not sent_whole and any(len(c.arguments) > 8 for c in calls):
            assert pieces > len(calls)  # arguments arrive as written, not in one piece


def test_mistral_ids_are_nine_alphanumerics_and_markers_kept() -> None:
    assert len(mistral_call_id()) == 9 and mistral_call_id().isalnum()
    _, calls = parse_whole(FORMATS["mistral"](TOOLS), '[TOOL_CALLS]ping[ARGS]{}')
    assert len(calls[0].id) == 9
    assert FORMATS["mistral"].keeps_special_tokens


def test_mistral_pre_v11_name_is_sent_before_its_arguments() -> None:
    stream = FormatCallStream(tool_format("mistral", TOOLS))  # type: ignore[arg-type]
    assert stream.feed('[TOOL_CALLS] [{"name": "get_wea') == ("", [])
    _, [delta] = stream.feed('ther", ')
    assert (delta["function"]["name"], delta["function"]["arguments"]) == ("get_weather", "")
    _, [more] = stream.feed('"arguments": {"city"')
    assert more["function"] == {"arguments": '{"city"'}


@pytest.mark.parametrize("text,schema_type,value", [
    ("5", "integer", 5), ("5.0", "number", 5), ("2.5", "number", 2.5), ("x", "integer", "x"),
    ("TRUE", "boolean", True), ("0", "boolean", False), ("null", ["string", "null"], None),
    ('{"a": 1}', "object", {"a": 1}), ("inf", "number", "inf"), ("7", "string", "7"),
    ("[1e999]", "array", "[1e999]"), ("12", None, 12),
])
def test_qwen3_coder_values_take_the_schema_type_in_vllm_order(text, schema_type, value):
    assert typed_value(text, schema_type) == value


def test_mistral_requests_keep_special_tokens_in_the_text_on_every_endpoint() -> None:
    from shoal.runtime.api.serving_chat import with_tool_format
    from shoal.runtime.api.tool_calls import ToolPolicy
    from shoal.runtime.sampling_params import SamplingParams

    mistral = ToolPolicy("auto", format=tool_format("mistral", TOOLS))
    assert with_tool_format(SamplingParams(), mistral).skip_special_tokens is False
    for other in (ToolPolicy("auto"), ToolPolicy("auto", format=tool_format("pythonic", TOOLS)),
                  ToolPolicy("none")):
        assert with_tool_format(SamplingParams(), other).skip_special_tokens is True
