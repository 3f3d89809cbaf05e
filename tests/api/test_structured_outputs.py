"""Structured outputs and tool calling through the openai client (from PyPI) against a real
``shoal serve`` on a random-weight model: only the grammar can make these outputs valid."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "Describe a pet."}]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=8)


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(tiny_chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_chat_server.v1, api_key="unused", max_retries=0)


def test_parse_with_a_pydantic_model_returns_a_validated_object(client) -> None:
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(
            model="shoal-test", messages=MESSAGES, response_format=Pet, max_tokens=80,
            temperature=temperature, seed=3)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)


def test_json_object_mode_returns_a_json_object(client) -> None:
    completion = client.chat.completions.create(
        model="shoal-test", messages=MESSAGES, response_format={"type": "json_object"},
        max_tokens=64, temperature=0)
    assert isinstance(json.loads(completion.choices[0].message.content), dict)
    # sampled: whatever finished is an object; what ran out of tokens is an object's prefix
    sampled = client.chat.completions.create(
        model="shoal-test", messages=MESSAGES, response_format={"type": "json_object"},
        max_tokens=48, n=4, seed=0)
    for choice in sampled.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("constraint,check", [
    ({"regex": r"[a-c]{3}-\d{2}"}, lambda t: len(t) == 6 and t[3] == "-" and t[4:].isdigit()),
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"grammar": 'root ::= "x" [0-9] [0-9]? "y"'}, lambda t: t[0] == "x" and t[-1] == "y"),
    ({"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     lambda t: all(isinstance(v, bool) for v in json.loads(t))),
])
def test_vllm_structured_outputs_on_completions_streaming_and_not(client, constraint,
                                                                   check) -> None:
    body = {"structured_outputs": constraint}
    text = client.completions.create(model="shoal-test", prompt="Answer:", max_tokens=40,
                                     extra_body=body).choices[0].text
    assert check(text), text
    stream = client.completions.create(model="shoal-test", prompt="Answer:", max_tokens=40,
                                       extra_body=body, stream=True, seed=1)
    assert check("".join(c.choices[0].text for c in stream))


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                  "minimum": "zero"}}}},
     "response_format.json_schema"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_constraint_is_a_400_naming_the_field(client, body, param, stream) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        result = client.chat.completions.create(model="shoal-test", messages=MESSAGES,
                                                max_tokens=8, extra_body=body, stream=stream)
        list(result) if stream else None
    assert err.value.status_code == 400
    assert err.value.body["param"] == param


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_tool_choice_return_calls_whose_arguments_validate(
        client, tool_choice) -> None:
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.create(
            model="shoal-test", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
            parallel_tool_calls=False, max_tokens=60, temperature=temperature, seed=5)
        message = completion.choices[0].message
        assert message.tool_calls and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert completion.choices[0].finish_reason == (
            "tool_calls" if tool_choice == "required" else "stop")


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_assemble_like_the_openai_client_does(client, tool_choice) -> None:
    stream = client.chat.completions.create(
        model="shoal-test", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, max_tokens=60, temperature=0, stream=True)
    calls: dict[int, dict] = {}
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert len(calls) == 1 and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


# the random model writes this only because the regex makes it (tool_choice stays auto)
HERMES_CALL = {"regex": 'Checking\\.\n<tool_call>\n\\{"name": "get_weather", "arguments": '
                        '\\{"city": "(Paris|Oslo|Lima)", "days": [1-7]\\}\\}\n</tool_call>'}


def test_a_streamed_auto_tool_call_arrives_in_deltas_and_assembles_as_the_whole_one(
        client) -> None:
    kwargs = {"model": "shoal-test", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 80,
              "temperature": 0, "extra_body": {"structured_outputs": HERMES_CALL}}
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content == "Checking."
    with client.chat.completions.stream(**kwargs) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [tc.function.arguments for d in deltas for tc in d.tool_calls or []
              if tc.function and tc.function.arguments]
    assert len(pieces) > 1  # streamed as written, not sent whole
    streamed_content = "".join(d.content or "" for d in deltas)
    assert streamed_content.strip() == "Checking." and "<" not in streamed_content
    # content came before the call's first delta
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(d.content or "" for d in deltas[:first_call]).strip() == "Checking."
    calls = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    assert final.choices[0].finish_reason == "tool_calls"


def test_bad_tool_choices_are_400s(client) -> None:
    for kwargs, param in [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="shoal-test", messages=MESSAGES, max_tokens=4,
                                           **kwargs)
        assert err.value.body["param"] == param
