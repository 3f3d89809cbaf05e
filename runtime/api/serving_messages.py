"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The request becomes a chat request (``anthropic_protocol.as_chat_request``), so the template,
the grammar that forces ``tool_choice`` any/tool and the tool parsers are the chat
endpoint's own; the answer is a Message (content blocks: thinking, text, tool_use) or its
event stream as Anthropic sends it: message_start, ping, per block content_block_start /
content_block_delta (thinking_delta, text_delta, input_json_delta) / content_block_stop,
then message_delta (stop_reason, usage) and message_stop.

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens not read from
the prefix cache, ``cache_read_input_tokens`` the ones that were (their sum is the prompt).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from .anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    as_chat_request,
    chat_messages,
    chat_tools,
    template_kwargs,
)
from .errors import bad_request
from .generation import Choice, ChoiceDelta, Generation
from .protocol import ChatTool
from .reasoning import ReasoningFormat
from .serving_chat import (
    assistant_message,
    chat_prompt,
    output_grammar,
    render_chat,
    stream_fields,
    with_reasoning,
    with_tool_format,
)
from .serving_common import (
    ANTHROPIC_SSE,
    first_delta,
    parse_body,
    run_to_completion,
    sampling_params,
    start_generation,
    stream_response,
)
from .state import ServerState
from .tool_calls import ToolPolicy, tool_policy
from .tool_stream import ToolDeltaStream


def _template_tools(tools: list[ChatTool] | None) -> list[dict] | None:
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


async def count_tokens(request: Request, state: ServerState) -> dict[str, int]:
    """The prompt a /v1/messages request with this body would run, counted."""
    body = await parse_body(request, state, CountTokensRequest)
    prompt = await render_chat(state, chat_prompt(
        chat_messages(body), tools=_template_tools(chat_tools(body)),
        template_kwargs=template_kwargs(body, None)))
    return {"input_tokens": len(prompt.token_ids)}


def stop_reason(choice: Choice, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished choice."""
    if choice.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):  # one of stop_sequences matched
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (``assistant_message``) as Anthropic content blocks. A call whose
    arguments are not a JSON object (cut short by max_tokens) stays text."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    text = message.get("content") or ""
    calls: list[dict[str, Any]] = []
    for call in message.get("tool_calls") or []:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            arguments = None
        if isinstance(arguments, dict):
            calls.append({"type": "tool_use", "id": tool_use_id(call["id"]),
                          "name": call["function"]["name"], "input": arguments})
        else:
            text += call["function"]["arguments"]
    if text:
        blocks.append({"type": "text", "text": text})
    return blocks + calls


def usage(choice: Choice) -> dict[str, int]:
    cached = choice.num_cached_tokens
    return {"input_tokens": len(choice.prompt.token_ids) - cached,
            "output_tokens": len(choice.token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def create_message(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, state, MessagesRequest)
    chat = as_chat_request(body)
    policy = tool_policy(chat.tools, chat.tool_choice, state.settings.tool_call_parser)
    grammar = output_grammar(chat, policy)
    params = sampling_params(chat, state, chat.max_tokens, None, grammar)
    if params.n != 1:
        raise bad_request("the Messages API makes one message", "n")
    prompt = await render_chat(state, chat_prompt(
        chat.messages, tools=_template_tools(chat.tools),
        template_kwargs=chat.chat_template_kwargs))
    fmt, params = with_reasoning(state, params, prompt, policy)
    params = with_tool_format(params, policy)
    generation = start_generation(request, state, "msg", [prompt], params, chat)
    message_id = f"msg_{uuid.uuid4().hex}"
    model = state.settings.model_name

    def message(gen: Generation) -> dict[str, Any]:
        choice = gen.choices[0]
        chat_message, _ = assistant_message(choice.text, policy, choice.finish_reason, fmt)
        blocks = content_blocks(chat_message)
        reason, sequence = stop_reason(choice, any(b["type"] == "tool_use" for b in blocks))
        return {"id": message_id, "type": "message", "role": "assistant", "model": model,
                "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage(choice)}

    if not body.stream:
        return await run_to_completion(request, state, generation, message)

    first = await first_delta(state, generation) if grammar is not None else None
    events = MessageEvents(message_id, model, policy, fmt)

    def chunks(delta: ChoiceDelta) -> list[dict]:
        return events.feed(generation.choices[0], delta)

    return stream_response(state, generation, chunks, None, first, ANTHROPIC_SSE)


class MessageEvents:
    """One message's stream events, from the chat path's delta fields: a new content block
    each time the kind of output changes (text, a tool call), closed before the next."""

    def __init__(self, message_id: str, model: str, policy: ToolPolicy,
                 fmt: ReasoningFormat | None = None) -> None:
        self.message_id = message_id
        self.model = model
        self.tools = ToolDeltaStream(policy)
        self.reasoning = fmt.stream() if fmt is not None else None
        self.started = False
        self.index = -1  # the open block's index (-1: none yet)
        self.open_kind: str | None = None  # "text" | "thinking" | "tool_use"
        self.blocks_of_calls: dict[int, int] = {}  # tool call index -> block index
        self.num_calls = 0

    def feed(self, choice: Choice, delta: ChoiceDelta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            start: dict[str, Any] = {"id": self.message_id, "type": "message", "role": "assistant",
                     "model": self.model, "content": [], "stop_reason": None,
                     "stop_sequence": None, "usage": {**usage(choice), "output_tokens": 0}}
            out += [{"type": "message_start", "message": start}, {"type": "ping"}]
        out += self.fields(stream_fields(self.tools, self.reasoning, delta))
        if delta.finish_reason is not None:
            out += self.close()
            reason, sequence = stop_reason(choice, self.num_calls > 0)
            out.append({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage(choice)})
            out.append({"type": "message_stop"})
        return out

    def fields(self, fields: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if fields.get("reasoning_content"):
            out += self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.delta({"type": "thinking_delta",
                                   "thinking": fields["reasoning_content"]}))
        if fields.get("content"):
            out += self.open("text", {"type": "text", "text": ""})
            out.append(self.delta({"type": "text_delta", "text": fields["content"]}))
        for call in fields.get("tool_calls") or []:
            arguments = call.get("function", {}).get("arguments", "")
            if "id" in call:  # a new call: its own block
                self.num_calls += 1
                out += self.open("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                              "name": call["function"]["name"], "input": {}},
                                 force=True)
                self.blocks_of_calls[call["index"]] = self.index
            if arguments:
                out.append({"type": "content_block_delta",
                            "index": self.blocks_of_calls[call["index"]],
                            "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return out

    def open(self, kind: str, block: dict[str, Any], force: bool = False) -> list[dict]:
        if self.open_kind == kind and not force:
            return []
        out = self.close()
        self.index += 1
        self.open_kind = kind
        return out + [{"type": "content_block_start", "index": self.index,
                       "content_block": block}]

    def close(self) -> list[dict[str, Any]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": self.index}]

    def delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}
