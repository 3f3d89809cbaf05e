"""The official ``anthropic`` client, unchanged, against ``shoal serve``'s /v1/messages:
create, system blocks, streaming, forced tool use and a tool_result round trip,
count_tokens, stop sequences, structured output and Anthropic-shaped errors. The model has
random weights: only what the grammar forces is meaningful text, so the checks compare the
server with itself (stream vs. not, Anthropic vs. OpenAI rendering of one conversation)."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")

KEY = "sk-anthropic-test"
GREEDY = {"temperature": 0.0}  # the current SDK takes sampling fields only in extra_body
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}}}
TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "input_schema": WEATHER}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def keyed_server(start_server, tiny_qwen2):
    return start_server(model_dir=tiny_qwen2, api_key=KEY)


@pytest.fixture(scope="module")
def client(keyed_server):
    return anthropic.Anthropic(base_url=keyed_server.base_url, api_key=KEY, max_retries=0)


def test_create_with_system_blocks(client, keyed_server) -> None:
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be kind."}]
    message = client.messages.create(model="shoal-test", max_tokens=12, system=system,
                                     messages=USER, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("max_tokens", "end_turn")
    counted = client.messages.count_tokens(model="shoal-test", system=system, messages=USER)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    assert usage.output_tokens <= 12
    # the system blocks reach the template as one system message, as a string system does
    joined = client.messages.count_tokens(model="shoal-test", messages=USER,
                                          system="You are terse.\nBe kind.")
    assert joined.input_tokens == counted.input_tokens
    # the same conversation through the OpenAI route renders the same tokens
    tokens = httpx.post(keyed_server.base_url + "/tokenize", headers=keyed_server.headers(),
                        json={"messages": [{"role": "system", "content": "You are terse.\n"
                                            "Be kind."}, *USER]}).json()
    assert tokens["count"] == counted.input_tokens


def test_stream_assembles_to_the_created_message(client) -> None:
    kwargs = {"model": "shoal-test", "max_tokens": 16, "messages": USER, "extra_body": GREEDY}
    created = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "content_block_start" in types and "content_block_stop" in types
    assert final.content[0].text == created.content[0].text
    assert final.stop_reason == created.stop_reason
    assert final.usage.output_tokens == created.usage.output_tokens


def test_raw_stream_events_are_named_as_anthropic_sends_them(keyed_server) -> None:
    body = {"model": "shoal-test", "max_tokens": 4, "stream": True, "messages": USER}
    with httpx.stream("POST", keyed_server.base_url + "/v1/messages", json=body,
                      headers={"x-api-key": KEY}, timeout=30) as response:
        lines = [line for line in response.iter_lines() if line]
    names = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert not any("[DONE]" in line for line in lines)


def test_sampling_fields_in_the_body_apply(client) -> None:
    """temperature, top_p and top_k as the Messages API spells them, sent in the body: at
    temperature 1, top_k 1 or a tiny top_p leave only the greedy token, so the text is the
    greedy one; and a repeated prompt reads its blocks from the prefix cache."""
    kwargs = {"model": "shoal-test", "max_tokens": 24, "messages": USER}
    greedy = client.messages.create(**kwargs, extra_body=GREEDY)
    for fields in ({"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-9}):
        message = client.messages.create(**kwargs, extra_body=fields)
        assert message.content[0].text == greedy.content[0].text, fields
    sampled = {client.messages.create(**kwargs, extra_body={"temperature": 1.0, "top_k": 0,
                                                            "seed": seed}).content[0].text
               for seed in (1, 2, 3)}
    assert sampled != {greedy.content[0].text}  # the fields above, not the defaults, chose
    usage = message.usage  # the same prompt again: its full blocks come from the cache
    assert usage.cache_read_input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens == greedy.usage.input_tokens + \
        greedy.usage.cache_read_input_tokens


def test_stop_sequence_ends_the_message_before_it(client) -> None:
    kwargs = {"model": "shoal-test", "max_tokens": 30, "messages": USER, "extra_body": GREEDY}
    text = client.messages.create(**kwargs).content[0].text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2)
                if text[i:i + 2].isprintable() and text[i:i + 2].strip())
    message = client.messages.create(**kwargs, stop_sequences=["\x00never", stop])
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]
    with client.messages.stream(**kwargs, stop_sequences=["\x00never", stop]) as stream:
        final = stream.get_final_message()  # message_delta carries the reason and sequence
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == message.content[0].text


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"},
                                         {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_use_is_a_valid_object_streamed_or_not(client, tool_choice) -> None:
    kwargs = {"model": "shoal-test", "max_tokens": 60, "messages": USER, "tools": [TOOL],
              "tool_choice": tool_choice, "extra_body": GREEDY}
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(calls[0].input, WEATHER)
    assert calls[0].id.startswith("toolu_")
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in streamed] == [(c.name, c.input) for c in calls]
    assert final.stop_reason == "tool_use"


def test_tool_result_round_trip_renders_as_the_openai_conversation(client, keyed_server) -> None:
    first = client.messages.create(model="shoal-test", max_tokens=60, messages=USER,
                                   tools=[TOOL], extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    call = next(b for b in first.content if b.type == "tool_use")
    conversation = [*USER, {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": call.id,
                         "content": [{"type": "text", "text": "Cold, -3 C."}]},
                        {"type": "text", "text": "Thanks. Anything else?"}]}]
    answer = client.messages.create(model="shoal-test", max_tokens=8, messages=conversation,
                                    tools=[TOOL], extra_body=GREEDY)
    assert answer.content and answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
    counted = client.messages.count_tokens(model="shoal-test", messages=conversation,
                                           tools=[TOOL]).input_tokens
    openai_messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": __import__("json").dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Cold, -3 C."},
        {"role": "user", "content": "Thanks. Anything else?"}]
    chat = httpx.post(keyed_server.v1 + "/chat/completions", headers=keyed_server.headers(),
                      json={"model": "shoal-test", "max_tokens": 1, "messages": openai_messages,
                            "tools": [{"type": "function", "function": {
                                "name": TOOL["name"], "description": TOOL["description"],
                                "parameters": WEATHER}}]}).json()
    assert chat["usage"]["prompt_tokens"] == counted


def test_output_config_format_constrains_the_text(client) -> None:
    message = client.messages.create(
        model="shoal-test", max_tokens=60, messages=USER, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    jsonschema.validate(__import__("json").loads(message.content[0].text), WEATHER)


def test_errors_are_anthropic_shaped(client, keyed_server) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="shoal-test", max_tokens=0, messages=USER)
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=4, messages=USER)
    assert missing.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=keyed_server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model="shoal-test", max_tokens=4, messages=USER)
    assert denied.value.body["error"]["type"] == "authentication_error"
    raw = httpx.post(keyed_server.base_url + "/v1/messages", headers={"x-api-key": KEY},
                     json={"model": "shoal-test", "messages": USER})  # no max_tokens
    assert raw.status_code == 400
    assert raw.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in raw.json()["error"]["message"]
    unknown = httpx.post(keyed_server.base_url + "/v1/messages", headers={"x-api-key": KEY},
                         json={"model": "shoal-test", "max_tokens": 4, "messages": USER,
                               "temprature": 0.5})
    assert unknown.status_code == 400 and "temprature" in unknown.json()["error"]["message"]


def test_bearer_auth_works_too(keyed_server) -> None:
    response = httpx.post(keyed_server.base_url + "/v1/messages/count_tokens",
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "shoal-test", "messages": USER})
    assert response.status_code == 200 and response.json()["input_tokens"] > 0


def test_body_limits_answer_in_anthropic_shape(keyed_server) -> None:
    """A body over --max-request-body-bytes (8 MiB by default) is a 413 request_too_large,
    one nested past --max-json-depth a 400, both as Anthropic shapes its errors."""
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    big = b'{"model": "shoal-test", "max_tokens": 4, "messages": [{"role": "user", ' \
          b'"content": "' + b"a" * (9 * 1024 * 1024) + b'"}]}'
    for body, status, kind in ((big, 413, "request_too_large"),
                               (b'{"model": "shoal-test", "max_tokens": 4, "metadata": '
                                + b"[" * 100 + b"]" * 100 + b"}", 400,
                                "invalid_request_error")):
        response = httpx.post(keyed_server.base_url + "/v1/messages", content=body,
                              headers=headers, timeout=60)
        assert response.status_code == status, response.text[:300]
        assert response.json()["type"] == "error", response.text[:300]
        assert response.json()["error"]["type"] == kind
