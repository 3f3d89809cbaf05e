"""Request bodies of Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``),
validated by pydantic, and their translation into a chat request, so the template, the
grammar for forced tools and the tool parsers are the chat endpoint's own.

Unknown fields are a 400 naming them, as on the OpenAI routes. Fields that cannot change
what is generated (``metadata``, ``service_tier``, ``container``, ``cache_control``,
``speed``, ...) are accepted and ignored; ``output_config.format`` is a JSON-schema
constraint (structured outputs) through the chat path's grammar.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import bad_request
from .protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    ChatTool,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
    ToolCallFunction,
    ToolChoice,
    ToolChoiceFunction,
)


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cache_control: dict[str, Any] | None = None  # prefix caching is automatic: ignored
    citations: list[dict[str, Any]] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


class ImageBlock(_Block):
    type: Literal["image", "document"]
    source: dict[str, Any]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock |
                         RedactedThinkingBlock | ImageBlock, Field(discriminator="type")]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured outputs: ``format`` is a JSON schema the text must match (the grammar
    path); ``effort`` cannot change what this server generates: ignored."""

    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    format: JsonOutputFormat | None = None


class CountTokensRequest(BaseModel):
    """What a prompt is made of: count_tokens takes exactly these."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the beta spelling of output_config.format
    # accepted and ignored: cannot change the output (cache_control: prefix caching is
    # automatic here)
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    diagnostics: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # accepted and ignored: cannot change the output
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: str | None = None
    # vLLM-style extras a client may send in extra_body
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(block.text for block in system) or None


def chat_messages(body: CountTokensRequest) -> list[ChatMessageIn]:
    """Anthropic's turns as chat messages: a user turn's ``tool_result`` blocks become tool
    messages (before its text, as the results answer the previous turn); an assistant
    turn's ``tool_use`` blocks become its tool_calls, its ``thinking`` its
    reasoning_content."""
    out: list[ChatMessageIn] = []
    system = system_text(body.system)
    if system:
        out.append(ChatMessageIn(role="system", content=system))
    for index, message in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=message.content)] \
            if isinstance(message.content, str) else message.content
        for block in blocks:
            if isinstance(block, ImageBlock):
                raise bad_request(f"{block.type} blocks are not supported by this server "
                                  "(text-only models)", f"messages.{index}.content")
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if message.role == "user":
            out += [ChatMessageIn(role="tool", content=b.text(), tool_call_id=b.tool_use_id)
                    for b in blocks if isinstance(b, ToolResultBlock)]
            if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append(ChatMessageIn(role="user", content=text))
            continue
        calls = [ToolCall(id=b.id, function=ToolCallFunction(name=b.name,
                                                             arguments=json.dumps(b.input)))
                 for b in blocks if isinstance(b, ToolUseBlock)]
        thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        out.append(ChatMessageIn(role="assistant", content=text or None,
                                 tool_calls=calls or None, reasoning_content=thinking or None))
    return out


def chat_tools(body: CountTokensRequest) -> list[ChatTool] | None:
    return [ChatTool(function=FunctionDefinition(name=t.name, description=t.description,
                                                 parameters=t.input_schema))
            for t in body.tools or []] or None


def chat_tool_choice(choice: AnthropicToolChoice | None) -> ToolChoice | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type tool needs a name", "tool_choice.name")
        return NamedToolChoice(function=ToolChoiceFunction(name=choice.name))
    if choice.type == "any":
        return "required"
    return "none" if choice.type == "none" else "auto"


def template_kwargs(body: CountTokensRequest, extra: dict[str, Any] | None) -> dict | None:
    """``thinking`` says whether a reasoning model thinks: the ``enable_thinking`` switch
    of the Qwen3-style templates (a request's own chat_template_kwargs win)."""
    kwargs: dict[str, Any] = {}
    if body.thinking is not None:
        kwargs["enable_thinking"] = body.thinking.type != "disabled"
    kwargs.update(extra or {})
    return kwargs or None


def response_format(body: CountTokensRequest) -> ResponseFormat | None:
    fmt = body.output_config.format if body.output_config is not None else None
    fmt = fmt or body.output_format
    if fmt is None:
        return None
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name="output", schema=fmt.schema_, strict=True))


def as_chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The Messages request as the chat endpoint's request (n = 1, no logprobs)."""
    if body.max_tokens < 1:
        raise bad_request("max_tokens: must be at least 1", "max_tokens")
    parallel = not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)
    return ChatCompletionRequest(
        messages=chat_messages(body), max_tokens=body.max_tokens,
        stop=body.stop_sequences, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, seed=body.seed, tools=chat_tools(body),
        tool_choice=chat_tool_choice(body.tool_choice), parallel_tool_calls=parallel,
        chat_template_kwargs=template_kwargs(body, body.chat_template_kwargs),
        response_format=response_format(body), stream=body.stream)
