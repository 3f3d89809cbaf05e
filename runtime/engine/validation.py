"""The one validation of an engine request, shared by the API process and the engine core.

The API process runs it on every engine request of an API request (all n choices of every
prompt) before the first is admitted; the engine core runs it again on arrival, so the
offline ``LLM`` gets the same errors and nothing unchecked reaches the scheduler. Pure: it
reads the request and the limits and raises ``InvalidParameter`` naming the field.
"""

from __future__ import annotations

from shoal.runtime.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    InvalidParameter,
    RequestLimits,
    check_text,
)
from shoal.runtime.wire.messages import EngineCoreRequest

MAX_REQUEST_ID_CHARS = 256


def validate_request(request: EngineCoreRequest, limits: RequestLimits) -> None:
    """Raise InvalidParameter naming the first field the engine could not hold."""
    params = request.sampling_params
    params.validate(limits)
    if not 0 < len(request.request_id) <= MAX_REQUEST_ID_CHARS:
        raise InvalidParameter("request_id", f"request ids must have 1 to "
                               f"{MAX_REQUEST_ID_CHARS} characters")
    check_text(request.request_id, "request_id")
    if not INT64_MIN <= request.priority <= INT64_MAX:
        raise InvalidParameter("priority", f"priority must be an int64, in [{INT64_MIN}, "
                               f"{INT64_MAX}], got {request.priority}")
    if request.cache_salt is not None:
        if len(request.cache_salt) > limits.max_cache_salt_chars:
            raise InvalidParameter("cache_salt", f"cache_salt has more than "
                                   f"{limits.max_cache_salt_chars} characters")
        check_text(request.cache_salt, "cache_salt")
    if request.adapter_id is not None:
        check_text(request.adapter_id, "adapter_id")
    _validate_prompt(request, limits)
    vocab = limits.vocab_size
    if any(not 0 <= t < (vocab or INT64_MAX) for t in request.eos_token_ids):
        raise InvalidParameter("eos_token_ids", "eos token ids must be in the vocabulary")


def _validate_prompt(request: EngineCoreRequest, limits: RequestLimits) -> None:
    prompt = request.prompt_token_ids
    n = len(prompt)
    if n == 0:
        raise InvalidParameter("prompt", "the prompt is empty")
    vocab = limits.vocab_size or INT64_MAX
    if min(prompt) < 0 or max(prompt) >= vocab:
        bad = next(t for t in prompt if not 0 <= t < vocab)
        raise InvalidParameter("prompt", f"prompt token id {bad} is outside the vocabulary "
                               f"[0, {vocab})")
    limit = limits.max_model_len
    if not limit:
        return
    if n >= limit:
        raise InvalidParameter("prompt", f"This model's maximum context length is {limit} "
                               f"tokens; the prompt has {n} tokens, which leaves no room to "
                               "generate")
    params = request.sampling_params
    if (limits.max_tokens_within_context and params.max_tokens is not None
            and n + params.max_tokens > limit):
        raise InvalidParameter("max_tokens", f"This model's maximum context length is {limit} "
                               f"tokens; you requested {n + params.max_tokens} tokens ({n} in "
                               f"the prompt, {params.max_tokens} for the completion)")
    if n + params.min_tokens > limit:
        raise InvalidParameter("min_tokens", f"prompt ({n} tokens) + min_tokens "
                               f"({params.min_tokens}) exceeds max_model_len {limit}")
