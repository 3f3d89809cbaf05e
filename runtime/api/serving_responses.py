"""POST /v1/responses: OpenAI's Responses API over the chat path.

The request becomes a chat request (instructions -> system message, the previous response's
conversation, input items -> messages, function tools -> chat tools, ``text.format`` ->
``response_format``), so templates, grammars and tool parsing are the chat endpoint's own.
The answer is a Response object, or its event stream: created, in_progress, per output item
added -> (content_part.added, output_text.delta*, output_text.done, content_part.done | the
function_call_arguments deltas and done) -> done, then completed. ``previous_response_id``
reads the in-memory ``ResponseStore``: a copy of the conversation, only the requesting
tenant's (anything else is a 404, as for an id that never existed), bounded in bytes; the
follow-up's own conversation is stored under the new response's id, the old one untouched.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from .errors import APIError, bad_request
from .generation import ChoiceDelta, Generation
from .protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    ChatTool,
    FunctionDefinition,
    NamedToolChoice,
    ResponseFormat,
    SamplingFields,
    ToolCall,
    ToolCallFunction,
    ToolChoiceFunction,
)
from .reasoning import ReasoningFormat
from .responses_events import ResponseEvents, message_item, reasoning_item, response_object
from .responses_protocol import FunctionCallItem, FunctionCallOutputItem, ResponsesRequest
from .responses_store import ConversationTooLarge, ResponseStore, encode_conversation
from .serving_chat import (
    assistant_message,
    chat_prompt,
    output_grammar,
    reasoning_tokens,
    render_chat,
    stream_fields,
    with_reasoning,
    with_tool_format,
)
from .serving_common import (
    first_delta,
    now_s,
    parse_body,
    run_to_completion,
    sampling_params,
    start_generation,
    stream_response,
)
from .state import ServerState
from .tool_calls import tool_policy
from .tool_stream import ToolDeltaStream


def not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r} (it may have expired, "
                    "or belong to another API key)", "previous_response_id",
                    "previous_response_not_found")


def conversation(body: ResponsesRequest, store: ResponseStore,
                 tenant: str | None) -> list[ChatMessageIn]:
    """What came before (a copy of the previous response's conversation, if this tenant
    stored it) and this request's input; instructions are not part of it (OpenAI does not
    carry them over)."""
    messages: list[ChatMessageIn] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id, tenant)
        if previous is None:
            raise not_found(body.previous_response_id)
        messages.extend(previous)
    if isinstance(body.input, str):
        messages.append(ChatMessageIn(role="user", content=body.input))
        return messages
    for item in body.input:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=ToolCallFunction(
                name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)  # parallel calls: one assistant turn
            else:
                messages.append(ChatMessageIn(role="assistant", content=None,
                                              tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessageIn(role="tool", content=item.output,
                                          tool_call_id=item.call_id))
        else:
            messages.append(ChatMessageIn(role=item.role, content=item.text()))
    return messages


def as_chat_request(body: ResponsesRequest, messages: list[ChatMessageIn]) -> ChatCompletionRequest:
    system = [ChatMessageIn(role="system", content=body.instructions)] if body.instructions else []
    tools = [ChatTool(function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in body.tools or []] or None
    choice = body.tool_choice
    chat_choice = NamedToolChoice(function=ToolChoiceFunction(name=choice.name)) \
        if choice is not None and not isinstance(choice, str) else choice
    fmt = body.text.format if body.text is not None else None
    response_format = body.response_format
    if fmt is not None and fmt.type != "text":
        response_format = ResponseFormat(type=fmt.type, json_schema=fmt if fmt.type ==
                                         "json_schema" else None)
    shared = {name: getattr(body, name) for name in SamplingFields.model_fields}
    shared["response_format"] = response_format
    if not messages and not system:
        raise bad_request("input is empty", "input")
    return ChatCompletionRequest.model_construct(
        **shared, messages=system + messages, max_tokens=body.max_output_tokens,
        max_completion_tokens=None, logprobs=False, top_logprobs=None,
        add_generation_prompt=True, tools=tools, tool_choice=chat_choice,
        parallel_tool_calls=body.parallel_tool_calls)


async def create_response(request: Request, state: ServerState,
                          store: ResponseStore) -> Response:
    body = await parse_body(request, state, ResponsesRequest)
    tenant: str | None = getattr(request.state, "tenant", None)
    messages = conversation(body, store, tenant)
    try:  # a conversation that could never be stored is refused before any work
        store.check_size(len(encode_conversation(messages)))
    except ConversationTooLarge as exc:
        raise bad_request(str(exc), "previous_response_id" if body.previous_response_id
                          else "input") from exc
    chat = as_chat_request(body, messages)
    policy = tool_policy(chat.tools, chat.tool_choice, state.settings.tool_call_parser)
    grammar = output_grammar(chat, policy)
    params = sampling_params(chat, state, chat.max_tokens, None, grammar)
    if params.n != 1:
        raise bad_request("the Responses API makes one output; n must be 1", "n")
    template_tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools \
        else None
    prompt = await render_chat(state, chat_prompt(chat.messages, tools=template_tools))
    fmt, params = with_reasoning(state, params, prompt, policy)
    params = with_tool_format(params, policy)
    generation = start_generation(request, state, "resp", [prompt], params, chat)
    response_id = store.new_id()
    created, model = now_s(), state.settings.model_name
    echo = {"instructions": body.instructions, "previous_response_id": body.previous_response_id,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) or
            body.tool_choice is None else body.tool_choice.model_dump(),
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens}

    def finished(gen: Generation, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        choice = gen.choices[0]
        if output is None:  # (a stream's items include its reasoning item already)
            message, _ = assistant_message(choice.text, policy, choice.finish_reason, fmt)
            output = reasoning_items(choice.text, fmt) + output_items(message)
        store.put(response_id, tenant, messages + [assistant_turn(output)])
        return response_object(response_id, created, model, echo, output,
                               choice.finish_reason,
                               usage(gen, reasoning_tokens(state, choice, fmt)))

    if not body.stream:
        return await run_to_completion(request, state, generation, finished)

    first = await first_delta(state, generation) if grammar is not None else None
    tools = ToolDeltaStream(policy)
    reasoning = fmt.stream() if fmt is not None else None
    events = ResponseEvents(response_object(response_id, created, model, echo, [], None, None))

    def chunks(delta: ChoiceDelta) -> list[dict]:
        out = events.start() if not events.started else []
        out += events.fields(stream_fields(tools, reasoning, delta))
        if delta.finish_reason is not None:
            out += events.finish(lambda items: finished(generation, items))
        return out

    return stream_response(state, generation, chunks, None, first)


def assistant_turn(output: list[dict[str, Any]]) -> ChatMessageIn:
    """The response as the next turn's template sees it: its text and its calls."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [ToolCall(id=item["call_id"], function=ToolCallFunction(
        name=item["name"], arguments=item["arguments"]))
        for item in output if item["type"] == "function_call"]
    return ChatMessageIn(role="assistant", content=text or None, tool_calls=calls or None)


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def reasoning_items(text: str, fmt: ReasoningFormat | None) -> list[dict[str, Any]]:
    """The ``<think>`` span as a reasoning output item (``--reasoning-parser``); a stream
    sends it as response.reasoning_text.delta events (``responses_events.py``)."""
    reasoning = fmt.split(text)[0] if fmt is not None else None
    if not reasoning:
        return []
    return [reasoning_item(f"rs_{uuid.uuid4().hex}", reasoning, "completed")]


def usage(gen: Generation, reasoning_tokens: int = 0) -> dict[str, Any]:
    choice = gen.choices[0]
    prompt, completion = len(choice.prompt.token_ids), len(choice.token_ids)
    return {"input_tokens": prompt, "output_tokens": completion,
            "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": choice.num_cached_tokens},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}
