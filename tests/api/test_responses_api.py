"""POST /v1/responses through the openai client (PyPI): create and stream, instructions,
input items, function tools and their outputs, previous_response_id."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

CITY = {"type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": CITY}]


@pytest.fixture(scope="module")
def client(tiny_chat_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_chat_server.v1, api_key="unused", max_retries=0)


def test_create_with_instructions_returns_text_and_usage(client) -> None:
    response = client.responses.create(model="shoal-test", input="Say hi",
                                       instructions="Be brief.", max_output_tokens=8)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete"  # a random model does not stop within 8 tokens
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text and response.output[0].type == "message"
    assert response.usage.output_tokens == 8
    plain = client.responses.create(model="shoal-test", input="Say hi", max_output_tokens=8)
    assert plain.usage.input_tokens < response.usage.input_tokens  # the system turn counted


def test_stream_events_arrive_in_order_and_assemble_the_final_response(client) -> None:
    with client.responses.stream(model="shoal-test", input="Stream it",
                                 max_output_tokens=6) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.usage.output_tokens == 6
    raw = list(client.responses.create(model="shoal-test", input="x", max_output_tokens=3,
                                       stream=True))
    assert raw[-1].type == "response.completed"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_return_calls_and_their_outputs_continue_the_conversation(
        client, tool_choice, stream) -> None:
    kwargs = {"model": "shoal-test", "input": "Weather?", "tools": TOOLS,
              "tool_choice": tool_choice, "max_output_tokens": 120, "temperature": 0,
              "parallel_tool_calls": False}
    if stream:
        events = list(client.responses.create(**kwargs, stream=True))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs)
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), CITY)
    follow = client.responses.create(
        model="shoal-test", previous_response_id=response.id, max_output_tokens=4,
        tools=TOOLS, tool_choice="none",  # same tools: the prompt grows by the turns only
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > response.usage.input_tokens
    assert follow.previous_response_id == response.id


def test_input_items_and_bad_requests(client) -> None:
    items = [{"role": "system", "content": "You answer."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"}]
    response = client.responses.create(model="shoal-test", input=items, max_output_tokens=2,
                                       text={"format": {"type": "json_object"}})
    assert response.output_text.startswith("{")
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="shoal-test", input="x", max_output_tokens=2,
                                previous_response_id="resp_missing")
    assert missing.value.body["param"] == "previous_response_id"
    for kwargs, param in [({"tool_choice": "required"}, "tool_choice"),
                          ({"temprature": 0.5}, "temprature")]:
        extra = {"extra_body": kwargs} if "temprature" in kwargs else kwargs
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="shoal-test", input="x", max_output_tokens=2, **extra)
        assert err.value.body["param"] == param
