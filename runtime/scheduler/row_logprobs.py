"""One row's logprobs out of a step result, as the row asked for them (sampled tokens, and
the prompt tokens a step scored)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.runtime.engine.messages import TokenLogprobs
from shoal.runtime.plan import PromptLogprobsChunk, StepResult

if TYPE_CHECKING:
    from shoal.runtime.scheduler.request import Request


def row_logprobs(result: StepResult, index: int, top_k: int | None
                 ) -> list[TokenLogprobs] | None:
    """The logprobs of sampled row ``index``, its top-k trimmed to what it asked (the batch
    uses the max)."""
    if top_k is None or result.logprobs is None:
        return None
    top_ids: list[int] = []
    top_lps: list[float] = []
    if top_k and result.top_token_ids is not None and result.top_logprobs is not None:
        top_ids = result.top_token_ids[index, :top_k].tolist()
        top_lps = result.top_logprobs[index, :top_k].tolist()
    return [TokenLogprobs(float(result.logprobs[index]), top_ids, top_lps)]


def store_prompt_logprobs(req: Request, chunk: PromptLogprobsChunk) -> None:
    """Keep a step's prompt logprobs by prompt position (a recomputed chunk overwrites)."""
    if req.prompt_logprobs is None:
        return
    for i, lp in enumerate(chunk.logprobs):
        req.prompt_logprobs[chunk.start - 1 + i] = TokenLogprobs(
            lp, chunk.top_token_ids[i], chunk.top_logprobs[i])
