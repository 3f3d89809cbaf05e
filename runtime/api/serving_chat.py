"""POST /v1/chat/completions: the chat template renders the conversation (frontend/prompts.py,
the one renderer, with the request's tools), then it runs as a completion.

With ``tools``, the choice's text becomes a message with ``tool_calls`` (``tool_calls.py``:
grammar-constrained for ``required`` and named choices, parsed for ``auto``)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from msgspec.structs import replace
from shoal.runtime.frontend.chat_template import ChatTemplateError
from shoal.runtime.frontend.prompts import ChatPrompt
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.structured.spec import GrammarSpec

from .errors import bad_request
from .generation import Choice, ChoiceDelta, Generation, PromptInput
from .harmony import HARMONY_PARSER, HarmonyFormat, harmony_format, reads_harmony
from .logprobs_format import chat_logprobs, token_names, vllm_prompt_logprobs
from .protocol import ChatCompletionRequest, ChatMessageIn
from .reasoning import ReasoningFormat, TextSplitter, reasoning_fields, reasoning_format
from .serving_common import (
    check_template_inputs,
    first_delta,
    kv_transfer_json,
    now_s,
    parse_body,
    run_to_completion,
    sampling_params,
    start_generation,
    stream_response,
    text_byte_limit,
    truncated,
)
from .serving_completion import usage
from .state import ServerState
from .structured_request import grammar_for
from .tool_calls import ToolPolicy, calls_from_constrained, tool_grammar, tool_policy
from .tool_formats import parse_whole
from .tool_parsers import parse_tool_calls
from .tool_stream import ToolDeltaStream


def chat_prompt(messages: list[ChatMessageIn], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, template: str | None = None,
                template_kwargs: dict | None = None, documents: list | None = None,
                tools: list[dict] | None = None, add_special_tokens: bool = False,
                allow_special_tokens_in_content: bool = False) -> ChatPrompt:
    """The request's conversation as the renderer takes it: each message with the fields
    that were sent (tool_calls, tool_call_id, name, content parts)."""
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                          "true", "continue_final_message")
    return ChatPrompt([m.template_data() for m in messages], tools=tools, documents=documents,
                      add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, template=template,
                      template_kwargs=template_kwargs, add_special_tokens=add_special_tokens,
                      special_tokens_in_content=allow_special_tokens_in_content)


async def render_chat(state: ServerState, chat: ChatPrompt) -> PromptInput:
    """Rendered and encoded in a worker thread: a long conversation never stalls the loop.
    Everything the template can see is measured in bytes first, and the rendered text
    again before it is tokenized (a template can write more than it was given)."""
    check_template_inputs(state, {"messages": chat.messages, "tools": chat.tools,
                                  "documents": chat.documents,
                                  "chat_template_kwargs": chat.template_kwargs})
    limit = text_byte_limit(state)
    if limit is not None:
        chat = dataclasses.replace(chat, max_text_bytes=limit - 1)
    try:
        rendered = await asyncio.to_thread(state.renderer.render_chat, chat)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from exc
    return PromptInput(rendered.token_ids, rendered.text)


def output_grammar(body: ChatCompletionRequest, policy: ToolPolicy) -> GrammarSpec | None:
    grammar = grammar_for(body)
    if policy.constrained:
        if grammar is not None:
            raise bad_request(f"tool_choice {policy.mode} constrains the output itself; it "
                              "cannot be combined with response_format", "tool_choice")
        assert body.tools is not None
        return tool_grammar(body.tools, policy, body.parallel_tool_calls)
    return grammar


def output_reading(state: ServerState, prompt_text: str | None,
                   policy: ToolPolicy) -> ReasoningFormat | None:
    """How the request's output splits into reasoning and the rest: gpt-oss's harmony
    channels (``harmony.reads_harmony``), a ``<think>`` span (``--reasoning-parser
    qwen3|deepseek_r1``), or not at all."""
    settings = state.settings
    if reads_harmony(settings.reasoning_parser, settings.tool_call_parser,
                     settings.model_type, state.tokenizer):
        if policy.constrained:  # its grammar would wait for a final channel never written
            raise bad_request(f"tool_choice {policy.mode} is not supported with gpt-oss's "
                              "harmony output (its calls are commentary-channel messages, "
                              "read with tool_choice auto and --tool-call-parser openai)",
                              "tool_choice")
        return harmony_format(prompt_text, settings.reasoning_parser == HARMONY_PARSER,
                              policy.mode == "auto" and policy.format is not None
                              and policy.format.name == "openai")
    return reasoning_format(settings.reasoning_parser, prompt_text)


def with_reasoning(state: ServerState, params: SamplingParams, prompt: PromptInput,
                   policy: ToolPolicy) -> tuple[ReasoningFormat | None, SamplingParams]:
    """The request's reasoning format (``output_reading``), and its params with the grammar
    (structured output, a forced tool) starting after the reasoning's end marker when the
    reasoning may come first: a thinking model is not constrained from its first token.
    Harmony is read with its special tokens in the text."""
    fmt = output_reading(state, prompt.text, policy)
    if isinstance(fmt, HarmonyFormat):
        params = replace(params, skip_special_tokens=False)
    if fmt is None or params.structured is None or not fmt.grammar_deferred:
        return fmt, params
    marker = tuple(state.tokenizer.encode(fmt.end_marker, add_special_tokens=False))
    return fmt, replace(params, structured=replace(params.structured, start_after=marker))


def with_tool_format(params: SamplingParams, policy: ToolPolicy) -> SamplingParams:
    """A format whose markers are special tokens (Mistral's ``[TOOL_CALLS]``) needs them in
    the detokenized text, as vLLM's parser asks of the request."""
    if policy.format is not None and policy.format.keeps_special_tokens:
        return replace(params, skip_special_tokens=False)
    return params


def reasoning_tokens(state: ServerState, choice: Choice, fmt: ReasoningFormat | None) -> int:
    if fmt is None:
        return 0
    return fmt.reasoning_tokens(choice.text, choice.token_ids, state.tokenizer)


def assistant_message(text: str, policy: ToolPolicy, finish: str | None,
                      fmt: ReasoningFormat | None = None) -> tuple[dict[str, Any], str | None]:
    """The message for a finished choice and its finish_reason; with a reasoning format,
    the ``<think>`` span is split off first (tool calls are read from the rest)."""
    if fmt is not None:
        reasoning, text = fmt.split(text)
        plain, finish = assistant_message(text, policy, finish)
        return {**plain, **reasoning_fields(reasoning or "")}, finish
    if policy.mode == "none":
        return {"role": "assistant", "content": text}, finish
    if policy.constrained:
        content, calls = None, calls_from_constrained(text, policy)
        if not calls:
            content = text or None  # cut short by max_tokens: what there is
    else:
        content, calls = parse_whole(policy.format, text) if policy.format \
            else parse_tool_calls(text)
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
    policy = tool_policy(body.tools, body.tool_choice, state.settings.tool_call_parser)
    grammar = output_grammar(body, policy)
    params = sampling_params(body, state, max_tokens, top_k if body.logprobs else None, grammar)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    prompt = truncated(await render_chat(state, chat_prompt(
        body.messages, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message, template=body.chat_template,
        template_kwargs=body.template_kwargs(), documents=body.documents, tools=tools,
        add_special_tokens=body.add_special_tokens,
        allow_special_tokens_in_content=body.allow_special_tokens_in_content)),
        body.truncate_prompt_tokens, state)
    fmt, params = with_reasoning(state, params, prompt, policy)
    params = with_tool_format(params, policy)
    generation = start_generation(request, state, "chatcmpl", [prompt], params, body)
    created, model = now_s(), state.response_model(body.model)
    names = token_names(state.tokenizer, body.return_tokens_as_token_ids)

    def chat_usage(gen: Generation) -> dict:
        out = usage(gen)
        if fmt is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": sum(
                reasoning_tokens(state, c, fmt) for c in gen.choices)}
        return out

    def choice_json(choice: Choice) -> dict:
        message, finish = assistant_message(choice.text, policy, choice.finish_reason, fmt)
        out = {"index": choice.index, "message": message,
               "logprobs": chat_logprobs(names, choice.token_ids, choice.logprobs,
                                         top_k) if body.logprobs else None,
               "finish_reason": finish, "stop_reason": choice.stop_reason}
        if body.return_token_ids:
            out["token_ids"] = choice.token_ids
        return out

    def respond(gen: Generation) -> dict:
        out = {"id": gen.request_id, "object": "chat.completion", "created": created,
               "model": model, "choices": [choice_json(c) for c in gen.choices],
               "usage": chat_usage(gen), "kv_transfer_params": kv_transfer_json(gen)}
        if body.return_token_ids:
            out["prompt_token_ids"] = prompt.token_ids
        if body.prompt_logprobs is not None:  # vLLM: once per response, the prompt's
            out["prompt_logprobs"] = vllm_prompt_logprobs(
                names, prompt.token_ids, gen.choices[0].prompt_logprobs or [],
                body.prompt_logprobs)
        return out

    if not body.stream:
        return await run_to_completion(request, state, generation, respond)

    # before the headers: an engine-side rejection (invalid grammar) is still a 4xx
    first = await first_delta(state, generation) if grammar is not None else None
    started: set[int] = set()
    tool_streams: dict[int, ToolDeltaStream] = {}
    reasoning_streams: dict[int, TextSplitter] = {}

    def chunk(choice: dict) -> dict:
        return {"id": generation.request_id, "object": "chat.completion.chunk",
                "created": created, "model": model, "choices": [choice]}

    def chunks(delta: ChoiceDelta) -> list[dict]:
        out = []
        if delta.index not in started:  # the role comes first, once per choice
            started.add(delta.index)
            tool_streams[delta.index] = ToolDeltaStream(policy)
            if fmt is not None:
                reasoning_streams[delta.index] = fmt.stream()
            first = chunk({"index": delta.index,
                           "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None})
            if body.return_token_ids:
                first["prompt_token_ids"] = prompt.token_ids
            out.append(first)
        tools = tool_streams[delta.index]
        fields = stream_fields(tools, reasoning_streams.get(delta.index), delta)
        finish = delta.finish_reason
        if finish is not None:
            finish = tool_finish(policy, finish, tools.num_calls > 0)
        if not fields and finish is None and not (body.return_token_ids or body.logprobs):
            return out
        choice: dict = {"index": delta.index, "delta": fields,
                        "logprobs": chat_logprobs(names, delta.token_ids,
                                                  delta.logprobs, top_k)
                        if body.logprobs and delta.logprobs else None,
                        "finish_reason": finish, "stop_reason": delta.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        out.append(chunk(choice))
        return out

    def usage_chunk() -> dict:
        return {"id": generation.request_id, "object": "chat.completion.chunk",
                "created": created, "model": model, "choices": [],
                "usage": chat_usage(generation)}

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return stream_response(state, generation, chunks, usage_chunk if include_usage else None,
                           first)


def stream_fields(tools: ToolDeltaStream, reasoning: TextSplitter | None,
                  delta: ChoiceDelta) -> dict[str, Any]:
    """One delta's message fields: its reasoning (split off first), then the content and
    tool calls read from the rest; at the end, whatever either held back."""
    thought, text = reasoning.feed(delta.text) if reasoning is not None else ("", delta.text)
    fields = tools.feed(text)
    if delta.finish_reason is not None:
        if reasoning is not None:
            more_thought, more_text = reasoning.finish()
            thought += more_thought
            fields = merge_fields(fields, tools.feed(more_text))
        fields = merge_fields(fields, tools.finish())
    return {**reasoning_fields(thought), **fields}


def merge_fields(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    if "content" in b:
        out["content"] = out.get("content", "") + b["content"]
    if "tool_calls" in b:
        out["tool_calls"] = out.get("tool_calls", []) + b["tool_calls"]
    return out
