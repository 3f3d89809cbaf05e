"""Forced tool calls and structured outputs on a reasoning model's real output: the grammar
applies only after the reasoning ends. The tiny qwen2 trained in test_trained_tool_calls.py
thinks (``<think>Check the weather.</think>``) then writes a DeepSeek-V3 call, which no JSON
grammar allows. Served with ``--reasoning-parser qwen3``: with ``tool_choice`` required or a
named function (openai client's chat and Responses), ``{"type": "any"}`` or
``{"type": "tool"}`` (anthropic client) and a ``response_format`` json_schema, the answer must keep the whole trained
reasoning (a grammar from the first token would forbid ``<think>``) and give a call or
content that is a valid object (the model's own call text after it would not be).
Streamed and not; the stream's reasoning all comes before the call. And Anthropic's
``auto`` (the model's call read by ``--tool-call-parser deepseek_v3``) and ``none`` (the same
output left as text)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.test_trained_tool_calls import (  # noqa: F401 (trained_model: a fixture)
    ARGUMENTS,
    CALLS,
    REASONING,
    TOOLS,
    question,
    trained_model,
)

MESSAGES = question("deepseek_v3")  # its trained call is not JSON
# what the grammar guarantees (strict: no properties beyond the schema's)
SCHEMA = {**TOOLS[0]["function"]["parameters"], "additionalProperties": False}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(start_server, trained_model):  # noqa: F811 (the imported fixture)
    return start_server("--reasoning-parser", "qwen3", "--tool-call-parser", "deepseek_v3",
                        model_dir=trained_model)


def streamed(client, **kwargs) -> tuple[str, str, list[tuple[str, str]], str | None, list[str]]:
    """(reasoning, content, [(name, arguments)], finish_reason, kinds in order) as the
    openai client's chunks assemble."""
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    finish, kinds = None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning_content"):
                reasoning += extra["reasoning_content"]
                kinds.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                kinds.append("content")
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
                kinds.append("tool_call")
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish, kinds


@pytest.mark.parametrize("tool_choice,finish", [("required", "tool_calls"), (NAMED, "stop")])
def test_forced_call_follows_unconstrained_reasoning_openai(server, tool_choice, finish):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    kwargs = {"model": "shoal-test", "messages": MESSAGES, "tools": TOOLS, "temperature": 0,
              "max_tokens": 120, "tool_choice": tool_choice, "parallel_tool_calls": False}
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.finish_reason == finish, choice
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert answer.usage.completion_tokens_details.reasoning_tokens > 0

    reasoning, content, calls, stream_finish, kinds = streamed(client, **kwargs)
    assert (reasoning, content, stream_finish) == (REASONING, "", finish)
    assert calls == [(call.function.name, call.function.arguments)]
    last_reasoning = max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert kinds.index("tool_call") > last_reasoning  # the call only after the thinking


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "name": "get_weather"}])
def test_forced_call_follows_its_reasoning_item_responses(server, tool_choice) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    kwargs = {"model": "shoal-test", "input": MESSAGES, "temperature": 0,
              "max_output_tokens": 120, "tool_choice": tool_choice,
              "parallel_tool_calls": False,
              "tools": [{"type": "function", **TOOLS[0]["function"]}]}
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == REASONING
    assert response.output[1].name == "get_weather"
    jsonschema.validate(json.loads(response.output[1].arguments), SCHEMA)
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [(i.type, getattr(i, "arguments", None)) for i in final.output] == [
        (i.type, getattr(i, "arguments", None)) for i in response.output]


def test_json_schema_output_follows_unconstrained_reasoning(server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    # the tools shown (tool_choice none) as in training; the schema constrains the content
    kwargs = {"model": "shoal-test", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none",
              "temperature": 0, "max_tokens": 120, "response_format": {
                  "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.message.model_extra["reasoning_content"] == REASONING
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    reasoning, content, calls, _, kinds = streamed(client, **kwargs)
    assert (reasoning, content, calls) == (REASONING, choice.message.content, [])
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")


def anthropic_messages(server, tool_choice: dict) -> tuple[object, dict]:
    """(the anthropic client's messages resource, a request body with the tool)."""
    anthropic = pytest.importorskip("anthropic")
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="unused",
                                   max_retries=0).messages
    function = TOOLS[0]["function"]
    return messages, {"model": "shoal-test", "max_tokens": 120, "messages": MESSAGES,
                      "tools": [{"name": function["name"], "description": function["description"],
                                 "input_schema": function["parameters"]}],
                      "tool_choice": tool_choice, "extra_body": {"temperature": 0}}


@pytest.mark.parametrize("tool_choice", [{"type": "any", "disable_parallel_tool_use": True},
                                         {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_follows_thinking_anthropic(server, tool_choice) -> None:
    messages, body = anthropic_messages(server, tool_choice)
    message = messages.create(**body)
    assert message.stop_reason == "tool_use", message
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == REASONING
    assert message.content[1].name == "get_weather"
    jsonschema.validate(message.content[1].input, SCHEMA)
    with messages.stream(**body) as stream:
        events = [(event.type, getattr(event, "index", None)) for event in stream]
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"id", "signature"}) for b in final.content] == [
        b.model_dump(exclude={"id", "signature"}) for b in message.content]
    assert final.stop_reason == "tool_use"
    # the thinking block (0) is whole before the tool_use block (1) opens
    assert events.index(("content_block_stop", 0)) < events.index(("content_block_start", 1))


def test_anthropic_tool_choice_auto_reads_the_call_and_none_leaves_it_text(server) -> None:
    """auto: the model's own call (read by --tool-call-parser) is a tool_use block; none:
    the same output stays text, after the thinking."""
    messages, auto = anthropic_messages(server, {"type": "auto"})
    message = messages.create(**auto)
    assert message.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in message.content] == [
        ("thinking", None), ("tool_use", ARGUMENTS)]
    # the turn sent back with its thinking block, then the tool's result: accepted, and the
    # same prompt as the openai conversation with the call and a tool message
    call = message.content[1]
    history = [*MESSAGES, {"role": "assistant", "content": message.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "Sunny, 21 C."}]}]
    answer = messages.create(**{**auto, "messages": history, "max_tokens": 4})
    assert answer.content
    counted = messages.count_tokens(model="shoal-test", messages=history, tools=auto["tools"])
    openai = pytest.importorskip("openai")
    chat = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    as_chat = chat.chat.completions.create(
        model="shoal-test", max_tokens=1, tools=TOOLS, messages=[
            *MESSAGES, {"role": "assistant", "content": None, "reasoning_content": REASONING,
                        "tool_calls": [{"id": call.id, "type": "function", "function": {
                            "name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}])
    assert as_chat.usage.prompt_tokens == counted.input_tokens
    _, none = anthropic_messages(server, {"type": "none"})
    message = messages.create(**none)
    assert message.stop_reason == "end_turn"
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (
        REASONING, CALLS["deepseek_v3"])
