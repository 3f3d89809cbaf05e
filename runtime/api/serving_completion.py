"""POST /v1/completions: prompts as text or token ids, n choices each, streamed or not.

``echo`` prepends each choice's prompt (its text, or the decoded token ids) to the choice's
text: in the first chunk of that choice when streaming. With ``logprobs`` the prompt's
tokens come first in the logprobs too (OpenAI's legacy shape: the first one ``None``), as
the engine computed them (``prompt_logprobs``; such prompts bypass the prefix cache).
vLLM's ``prompt_logprobs`` field gives them in vLLM's shape.
"""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import Request
from fastapi.responses import Response

from .errors import bad_request
from .generation import Choice, ChoiceDelta, Generation, PromptInput
from .logprobs_format import (
    completion_logprobs,
    echo_logprobs,
    joined_logprobs,
    token_names,
    vllm_prompt_logprobs,
)
from .protocol import CompletionRequest
from .serving_common import (
    check_prompt_text,
    first_delta,
    kv_transfer_json,
    now_s,
    parse_body,
    run_to_completion,
    sampling_params,
    start_generation,
    stream_response,
    truncated,
)
from .state import ServerState
from .structured_request import grammar_for


def prompts_of(body: CompletionRequest, state: ServerState) -> list[PromptInput]:
    """Text prompts are measured in bytes before they are tokenized, then encoded as HF
    encodes them (special tokens added unless the request's add_special_tokens is false);
    token-id prompts as given; a batch of prompts times n is bounded by max_n, like n
    alone. Runs in a worker thread."""
    prompt = body.prompt
    if isinstance(prompt, str):
        check_prompt_text(state, prompt, "prompt")
        return [_encoded(state, prompt, body.add_special_tokens)]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [PromptInput(list(prompt))]  # type: ignore[arg-type]
    max_n = state.settings.limits.max_n
    if len(prompt) * body.n > max_n:
        raise bad_request(f"{len(prompt)} prompts x n = {body.n} would be "
                          f"{len(prompt) * body.n} choices; the limit is {max_n}", "prompt")
    if all(isinstance(p, str) for p in prompt):
        for p in prompt:
            check_prompt_text(state, p, "prompt")  # type: ignore[arg-type]
        return [_encoded(state, p, body.add_special_tokens) for p in prompt]  # type: ignore[arg-type]
    return [PromptInput(list(p)) for p in prompt]  # type: ignore[arg-type]


def _encoded(state: ServerState, text: str, add_special_tokens: bool) -> PromptInput:
    rendered = state.renderer.encode_text(text, add_special_tokens)
    return PromptInput(rendered.token_ids, rendered.text)


async def create_completion(request: Request, state: ServerState) -> Response:
    body = await parse_body(request, state, CompletionRequest)
    grammar = grammar_for(body)
    params = sampling_params(body, state, body.max_tokens, body.logprobs, grammar)
    echo_scores = body.echo and body.logprobs is not None
    if echo_scores:  # the echoed prompt's tokens get logprobs too: the engine computes them
        params = msgspec.structs.replace(
            params, prompt_logprobs=max(body.logprobs or 0, body.prompt_logprobs or 0))
    prompts = [truncated(p, body.truncate_prompt_tokens, state)
               for p in await asyncio.to_thread(prompts_of, body, state)]
    generation = start_generation(request, state, "cmpl", prompts, params, body)
    created, model = now_s(), state.response_model(body.model)
    names = token_names(state.tokenizer, body.return_tokens_as_token_ids)
    top_k = body.logprobs or 0

    def echoed(prompt: PromptInput) -> str:
        return prompt.text if prompt.text is not None else state.tokenizer.decode(
            prompt.token_ids)

    def prompt_part(choice: Choice) -> dict:
        return echo_logprobs(names, choice.prompt.token_ids,
                             choice.prompt_logprobs or [], top_k)

    def choice_json(choice: Choice) -> dict:
        text = echoed(choice.prompt) + choice.text if body.echo else choice.text
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(names, choice.token_ids, choice.logprobs,
                                           top_k)
            if echo_scores:
                logprobs = joined_logprobs(prompt_part(choice), logprobs)
        out = {"index": choice.index, "text": text, "logprobs": logprobs,
               "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
        if body.prompt_logprobs is not None:
            out["prompt_logprobs"] = vllm_prompt_logprobs(
                names, choice.prompt.token_ids, choice.prompt_logprobs or [],
                body.prompt_logprobs)
        if body.return_token_ids:
            out["prompt_token_ids"] = choice.prompt.token_ids
            out["token_ids"] = choice.token_ids
        return out

    def respond(gen: Generation) -> dict:
        return {"id": gen.request_id, "object": "text_completion", "created": created,
                "model": model, "choices": [choice_json(c) for c in gen.choices],
                "usage": usage(gen), "kv_transfer_params": kv_transfer_json(gen)}

    if not body.stream:
        return await run_to_completion(request, state, generation, respond)

    offsets: dict[int, int] = {}
    prompt_sent: set[int] = set()
    pending_echo = set(range(len(generation.choices))) if body.echo else set()

    def chunks(delta: ChoiceDelta) -> list[dict]:
        if not delta.text and delta.finish_reason is None and not (
                generation.every_step and delta.token_ids):
            return []  # held back (partial character or possible stop string)
        text = delta.text
        echo_now = delta.index in pending_echo
        if echo_now:
            pending_echo.discard(delta.index)
            text = echoed(generation.choices[delta.index].prompt) + text
        choice: dict = {"index": delta.index, "text": text, "logprobs": None,
                        "finish_reason": delta.finish_reason,
                        "stop_reason": delta.stop_reason}
        first_choice = generation.choices[delta.index]
        if echo_now and echo_scores:
            head = prompt_part(first_choice)
            offsets[delta.index] = head["text_offset"][-1] + len(head["tokens"][-1])
            choice["logprobs"] = head
        if body.logprobs is not None and delta.logprobs:
            part = completion_logprobs(names, delta.token_ids, delta.logprobs,
                                       top_k, offsets.get(delta.index, 0))
            choice["logprobs"] = joined_logprobs(choice["logprobs"], part) \
                if choice["logprobs"] else part
        if body.prompt_logprobs is not None and first_choice.prompt_logprobs is not None \
                and delta.index not in prompt_sent:
            prompt_sent.add(delta.index)
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                names, first_choice.prompt.token_ids, first_choice.prompt_logprobs,
                body.prompt_logprobs)
        offsets[delta.index] = offsets.get(delta.index, 0) + len(delta.text)
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return [{"id": generation.request_id, "object": "text_completion",
                 "created": created, "model": model, "choices": [choice]}]

    def usage_chunk() -> dict:
        return {"id": generation.request_id, "object": "text_completion", "created": created,
                "model": model, "choices": [], "usage": usage(generation)}

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    first = await first_delta(state, generation) if grammar is not None else None
    return stream_response(state, generation, chunks, usage_chunk if include_usage else None,
                           first)


def usage(gen: Generation) -> dict:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI does."""
    prompt_tokens = sum(len(c.prompt.token_ids) for c in gen.choices[::gen.params.n])
    completion_tokens = sum(len(c.token_ids) for c in gen.choices)
    cached = sum(c.num_cached_tokens for c in gen.choices[::gen.params.n])
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
