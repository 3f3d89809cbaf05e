"""POST /v1/chat/completions: the chat template renders the conversation, then as completions.

With ``tools``, the choice's text becomes a message with ``tool_calls`` (``tool_calls.py``:
grammar-constrained for ``required`` and named choices, parsed for ``auto``)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response
from shoal.runtime.frontend.chat_template import ChatMessage, ChatTemplateError
from shoal.runtime.structured.spec import GrammarSpec

from .errors import bad_request
from .generation import Choice, ChoiceDelta, Generation, PromptInput
from .logprobs_format import chat_logprobs
from .protocol import ChatCompletionRequest, ChatMessageIn
from .serving_common import (
    check_prompt_text,
    first_delta,
    now_s,
    parse_body,
    run_to_completion,
    sampling_params,
    start_generation,
    stream_response,
)
from .serving_completion import usage
from .state import ServerState
from .structured_request import grammar_for
from .tool_calls import ToolPolicy, calls_from_constrained, tool_grammar, tool_policy
from .tool_parsers import parse_tool_calls
from .tool_stream import ToolDeltaStream


def render_chat(state: ServerState, messages: list[ChatMessageIn],
                add_generation_prompt: bool) -> PromptInput:
    if state.chat_template is None:
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        text = state.chat_template.render([ChatMessage(m.role, m.text()) for m in messages],
                                          add_generation_prompt)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc
    check_prompt_text(state, text, "messages")
    return PromptInput(state.tokenizer.encode(text), text)


def output_grammar(body: ChatCompletionRequest, policy: ToolPolicy) -> GrammarSpec | None:
    grammar = grammar_for(body)
    if policy.constrained:
        if grammar is not None:
            raise bad_request(f"tool_choice {policy.mode} constrains the output itself; it "
                              "cannot be combined with response_format", "tool_choice")
        assert body.tools is not None
        return tool_grammar(body.tools, policy, body.parallel_tool_calls)
    return grammar


def assistant_message(text: str, policy: ToolPolicy, finish: str | None
                      ) -> tuple[dict[str, Any], str | None]:
    """The message for a finished choice and its finish_reason."""
    if policy.mode == "none":
        return {"role": "assistant", "content": text}, finish
    if policy.constrained:
        content, calls = None, calls_from_constrained(text, policy)
        if not calls:
            content = text  # cut short by max_tokens: what there is
    else:
        content, calls = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_json() for c in calls]
    return message, tool_finish(policy, finish, bool(calls))


def tool_finish(policy: ToolPolicy, finish: str | None, has_calls: bool) -> str | None:
    # as vLLM: a forced named call ends with "stop", calls the model chose with "tool_calls"
    return "tool_calls" if has_calls and finish == "stop" and policy.mode != "named" else finish


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, state, ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    top_k = body.top_logprobs or 0
    policy = tool_policy(body.tools, body.tool_choice)
    grammar = output_grammar(body, policy)
    params = sampling_params(body, state, max_tokens, top_k if body.logprobs else None, grammar)
    prompt = render_chat(state, body.messages, body.add_generation_prompt)
    generation = start_generation(request, state, "chatcmpl", [prompt], params, body)
    created, model = now_s(), state.settings.model_name

    def choice_json(choice: Choice) -> dict:
        message, finish = assistant_message(choice.text, policy, choice.finish_reason)
        out = {"index": choice.index, "message": message,
               "logprobs": chat_logprobs(state.tokenizer, choice.token_ids, choice.logprobs,
                                         top_k) if body.logprobs else None,
               "finish_reason": finish, "stop_reason": choice.stop_reason}
        if body.return_token_ids:
            out["token_ids"] = choice.token_ids
        return out

    def respond(gen: Generation) -> dict:
        out = {"id": gen.request_id, "object": "chat.completion", "created": created,
               "model": model, "choices": [choice_json(c) for c in gen.choices],
               "usage": usage(gen)}
        if body.return_token_ids:
            out["prompt_token_ids"] = prompt.token_ids
        return out

    if not body.stream:
        return await run_to_completion(request, state, generation, respond)

    # before the headers: an engine-side rejection (invalid grammar) is still a 4xx
    first = await first_delta(state, generation) if grammar is not None else None
    started: set[int] = set()
    tool_streams: dict[int, ToolDeltaStream] = {}

    def chunk(choice: dict) -> dict:
        return {"id": generation.request_id, "object": "chat.completion.chunk",
                "created": created, "model": model, "choices": [choice]}

    def chunks(delta: ChoiceDelta) -> list[dict]:
        out = []
        if delta.index not in started:  # the role comes first, once per choice
            started.add(delta.index)
            tool_streams[delta.index] = ToolDeltaStream(policy)
            first = chunk({"index": delta.index,
                           "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None})
            if body.return_token_ids:
                first["prompt_token_ids"] = prompt.token_ids
            out.append(first)
        tools = tool_streams[delta.index]
        fields = tools.feed(delta.text)
        finish = delta.finish_reason
        if finish is not None:
            fields = _merge(fields, tools.finish())
            finish = tool_finish(policy, finish, tools.num_calls > 0)
        if not fields and finish is None and not (body.return_token_ids or body.logprobs):
            return out
        choice: dict = {"index": delta.index, "delta": fields,
                        "logprobs": chat_logprobs(state.tokenizer, delta.token_ids,
                                                  delta.logprobs, top_k)
                        if body.logprobs and delta.logprobs else None,
                        "finish_reason": finish, "stop_reason": delta.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        out.append(chunk(choice))
        return out

    def usage_chunk() -> dict:
        return {"id": generation.request_id, "object": "chat.completion.chunk",
                "created": created, "model": model, "choices": [], "usage": usage(generation)}

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return stream_response(state, generation, chunks, usage_chunk if include_usage else None,
                           first)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    if "content" in b:
        out["content"] = out.get("content", "") + b["content"]
    if "tool_calls" in b:
        out["tool_calls"] = out.get("tool_calls", []) + b["tool_calls"]
    return out
