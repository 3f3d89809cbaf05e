"""POST /v1/chat/completions: the chat template renders the conversation, then as completions."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from shoal.runtime.frontend.chat_template import ChatMessage, ChatTemplateError

from .errors import bad_request
from .generation import Choice, ChoiceDelta, Generation, PromptInput
from .logprobs_format import chat_logprobs
from .protocol import ChatCompletionRequest, ChatMessageIn
from .serving_common import (
    check_prompt_text,
    now_s,
    parse_body,
    run_to_completion,
    sampling_params,
    start_generation,
    stream_response,
)
from .serving_completion import usage
from .state import ServerState


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


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, state, ChatCompletionRequest)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    top_k = body.top_logprobs or 0
    params = sampling_params(body, state, max_tokens, top_k if body.logprobs else None)
    prompt = render_chat(state, body.messages, body.add_generation_prompt)
    generation = start_generation(request, state, "chatcmpl", [prompt], params, body)
    created, model = now_s(), state.settings.model_name

    def choice_json(choice: Choice) -> dict:
        out = {"index": choice.index,
               "message": {"role": "assistant", "content": choice.text},
               "logprobs": chat_logprobs(state.tokenizer, choice.token_ids, choice.logprobs,
                                         top_k) if body.logprobs else None,
               "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
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

    started: set[int] = set()

    def chunk(choice: dict) -> dict:
        return {"id": generation.request_id, "object": "chat.completion.chunk",
                "created": created, "model": model, "choices": [choice]}

    def chunks(delta: ChoiceDelta) -> list[dict]:
        out = []
        if delta.index not in started:  # the role comes first, once per choice
            started.add(delta.index)
            first = chunk({"index": delta.index,
                           "delta": {"role": "assistant", "content": ""},
                           "logprobs": None, "finish_reason": None})
            if body.return_token_ids:
                first["prompt_token_ids"] = prompt.token_ids
            out.append(first)
        if not delta.text and delta.finish_reason is None:
            return out
        choice: dict = {"index": delta.index,
                        "delta": {"content": delta.text} if delta.text else {},
                        "logprobs": chat_logprobs(state.tokenizer, delta.token_ids,
                                                  delta.logprobs, top_k)
                        if body.logprobs and delta.logprobs else None,
                        "finish_reason": delta.finish_reason,
                        "stop_reason": delta.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        out.append(chunk(choice))
        return out

    def usage_chunk() -> dict:
        return {"id": generation.request_id, "object": "chat.completion.chunk",
                "created": created, "model": model, "choices": [], "usage": usage(generation)}

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return stream_response(state, generation, chunks, usage_chunk if include_usage else None)
