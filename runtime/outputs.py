"""What the offline API returns: one RequestOutput per prompt, one CompletionOutput per
sample (``n``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.runtime.wire.messages import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # per generated token, when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # prompt_logprobs: None for the first prompt token, then one entry per prompt token
    prompt_logprobs: list[TokenLogprobs | None] | None = None
