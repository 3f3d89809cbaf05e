"""LangChain (langchain-openai, langchain-anthropic) and LiteLLM, from PyPI, unchanged
against ``shoal serve``: chat, streaming, tools and structured output, on a random-weight
model whose outputs are only valid because the grammar makes them so."""

from __future__ import annotations

import json
import os
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

MESSAGES = [{"role": "user", "content": "Describe a pet."}]


class Pet(BaseModel):
    """A pet."""

    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class PetKind(BaseModel):
    """A pet's kind."""

    kind: Literal["cat", "dog", "fish"]
    name: str


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}}


@pytest.fixture(scope="module")
def chat_model(tiny_chat_server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=tiny_chat_server.v1, api_key="unused", model="shoal-test",
                      max_tokens=60, temperature=0, max_retries=0)


def test_langchain_invoke_and_stream(chat_model) -> None:
    message = chat_model.invoke("Hello")
    assert isinstance(message.content, str) and message.content
    assert message.usage_metadata["output_tokens"] == 60
    chunks = list(chat_model.stream("Hello"))
    assert len(chunks) > 2
    assert "".join(c.content for c in chunks) == message.content  # greedy: same text


def test_langchain_bind_tools_returns_calls_with_valid_arguments(chat_model) -> None:
    for tool_choice in ("any", "get_weather"):  # langchain's words for required / named
        bound = chat_model.bind_tools([WEATHER_TOOL], tool_choice=tool_choice,
                                      parallel_tool_calls=False)
        message = bound.invoke("What is the weather?")
        assert [c["name"] for c in message.tool_calls] == ["get_weather"]
        jsonschema.validate(message.tool_calls[0]["args"], WEATHER)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_returns_the_model(chat_model, method) -> None:
    pet = chat_model.with_structured_output(Pet, method=method).invoke("A pet, please.")
    assert isinstance(pet, Pet)


def test_langchain_json_mode_returns_a_json_object(chat_model) -> None:
    schema = {"title": "anything", "type": "object"}
    value = chat_model.with_structured_output(schema, method="json_mode").invoke("JSON please")
    assert isinstance(value, dict)


@pytest.fixture(scope="module")
def litellm_kwargs(tiny_chat_server) -> dict:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the net
    return {"model": "openai/shoal-test", "api_base": tiny_chat_server.v1,
            "api_key": "unused", "max_tokens": 80, "temperature": 0, "num_retries": 0}


def test_litellm_completion_and_streaming(litellm_kwargs) -> None:
    import litellm

    response = litellm.completion(messages=MESSAGES, **litellm_kwargs)
    text = response.choices[0].message.content
    assert text and response.usage.completion_tokens == 80
    stream = litellm.completion(messages=MESSAGES, stream=True, **litellm_kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == text


def test_litellm_tools_and_response_format(litellm_kwargs) -> None:
    import litellm

    response = litellm.completion(messages=MESSAGES, tools=[WEATHER_TOOL],
                                  tool_choice="required", parallel_tool_calls=False,
                                  **litellm_kwargs)
    assert response.choices[0].message.tool_calls, response.choices[0]
    call = response.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    response = litellm.completion(messages=MESSAGES, response_format=Pet, **litellm_kwargs)
    assert Pet.model_validate_json(response.choices[0].message.content)


@pytest.fixture(scope="module")
def anthropic_chat_model(tiny_chat_server):
    """LangChain's Anthropic chat model (langchain-anthropic) on /v1/messages."""
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(base_url=tiny_chat_server.base_url, api_key="unused",
                         model="shoal-test", max_tokens=60, temperature=0, max_retries=0)


def test_langchain_anthropic_invoke_stream_tools_and_structured_output(
        anthropic_chat_model) -> None:
    message = anthropic_chat_model.invoke("Hello")
    assert isinstance(message.content, str) and message.content
    assert message.usage_metadata["output_tokens"] == 60
    assert message.response_metadata["stop_reason"] == "max_tokens"
    chunks = list(anthropic_chat_model.stream("Hello"))
    assert len(chunks) > 2
    assert "".join(c.text for c in chunks) == message.content  # greedy: same text
    for tool_choice in ("any", "get_weather"):  # Anthropic's any, and a named tool
        bound = anthropic_chat_model.bind_tools([WEATHER_TOOL], tool_choice=tool_choice)
        called = bound.invoke("What is the weather?")
        assert [c["name"] for c in called.tool_calls] == ["get_weather"]
        jsonschema.validate(called.tool_calls[0]["args"], WEATHER)
    pet = anthropic_chat_model.with_structured_output(Pet).invoke("A pet, please.")
    assert isinstance(pet, Pet)  # a forced tool call, its input_schema the model's
    # output_config: the anthropic client moves minimum/maximum (which Anthropic does not
    # constrain) into the description before sending, so the model here has no bounds
    kind = anthropic_chat_model.with_structured_output(PetKind, method="json_schema").invoke(
        "A pet, please.")
    assert isinstance(kind, PetKind)
