"""A step's outputs: the sampled token appended to each row's request, one
``EngineCoreOutput`` each, the logprobs a row asked for, and the first output's extras
(phase stamps, prompt logprobs). The scheduler's only output builder."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.runtime.wire.messages import EngineCoreOutput, TokenLogprobs
from shoal.runtime.wire.plan import PromptLogprobsChunk, StepResult

if TYPE_CHECKING:
    from shoal.runtime.scheduler.request import Request


def append_tokens(reqs: list[Request], tokens: list[int]) -> list[EngineCoreOutput]:
    """Append each row's sampled token to its request, which has now computed every token
    before it; one output per row (the per-row work that cannot be vectorised, so nothing
    else happens here)."""
    outputs: list[EngineCoreOutput] = []
    add = outputs.append
    for req, token in zip(reqs, tokens, strict=True):
        all_ids = req.all_token_ids
        req.num_computed_tokens = len(all_ids)
        all_ids.append(token)
        req.output_token_ids.append(token)
        add(EngineCoreOutput(request_id=req.req_id, version=req.version, new_token_ids=[token],
                             num_cached_tokens=req.num_cached_tokens))
    return outputs


def add_logprobs(output: EngineCoreOutput, result: StepResult, index: int,
                 top_k: int | None) -> None:
    """The logprobs of the result's sampled row ``index``, top-k trimmed to what the row
    asked (the step computes the batch's max)."""
    if top_k is None or result.logprobs is None:
        return
    top_ids: list[int] = []
    top_lps: list[float] = []
    if top_k and result.top_token_ids is not None and result.top_logprobs is not None:
        top_ids = result.top_token_ids[index, :top_k].tolist()
        top_lps = result.top_logprobs[index, :top_k].tolist()
    output.new_logprobs = [TokenLogprobs(float(result.logprobs[index]), top_ids, top_lps)]


def add_first_output_extras(output: EngineCoreOutput, req: Request) -> None:
    """A request's first output carries its phase stamps and its prompt logprobs."""
    output.queued_time = req.queued_time
    output.scheduled_time = req.scheduled_time
    if req.prompt_logprobs is not None:
        output.prompt_logprobs = [lp or TokenLogprobs(float("nan"), [], [])
                                  for lp in req.prompt_logprobs]


def store_prompt_logprobs(req: Request, chunk: PromptLogprobsChunk) -> None:
    """Keep a step's prompt logprobs by prompt position (a recomputed chunk overwrites)."""
    if req.prompt_logprobs is None:
        return
    for i, lp in enumerate(chunk.logprobs):
        req.prompt_logprobs[chunk.start - 1 + i] = TokenLogprobs(
            lp, chunk.top_token_ids[i], chunk.top_logprobs[i])
