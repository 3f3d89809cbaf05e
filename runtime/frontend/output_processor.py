"""Engine outputs -> choices: the one output path of the API and of the offline ``LLM``.

``fan_out`` turns a call's prompts and sampling params into its choices (prompts x n), each
its own engine request with the child params (n = 1, seed + its sample index). An
``OutputProcessor`` follows one choice's engine outputs: it accumulates the token ids,
logprobs, cached-token count and prompt logprobs, detokenizes incrementally
(frontend/detokenizer.py: stop strings held back and cut there), and decides how the choice
finished: a stop string the detokenizer found (the engine does not know it, so the caller
aborts the engine request: ``abort_engine``), else the engine's own reason (length, a stop
token, abort). Each ``add`` returns the delta to hand out, or None while all of its text is
held back (its tokens then travel with the next delta) -- unless ``every_step``: a stream whose
client asked for each token's id or logprob gets every step's tokens when they are made, with
empty text where the text is held back or there is none, as vLLM streams them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.runtime.frontend.detokenizer import IncrementalDetokenizer
from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.kv_transfer.params import KVTransferParams
from shoal.runtime.sampling_params import SamplingParams, child_params
from shoal.runtime.wire.messages import EngineCoreOutput, FinishReason, TokenLogprobs


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None = None


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Choice:
    """One sample of one prompt: one engine request, accumulated from its outputs."""

    index: int  # among the call's choices: every sample of prompt 0, then of prompt 1, ...
    prompt: PromptInput
    request_id: str = ""  # of its engine request
    prompt_index: int = 0
    sample_index: int = 0  # among its prompt's n
    params: SamplingParams = field(default_factory=SamplingParams)  # the child's (n = 1)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1..n-1, when asked
    pooled: bytes | None = None  # the pooling runner: the prompt's vector (float32)
    kv_transfer_params: KVTransferParams | None = None  # a prefill's: where its blocks wait

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def fan_out(request_id: str, prompts: list[PromptInput],
            params: list[SamplingParams]) -> list[Choice]:
    """Every prompt's ``n`` samples (its params' n), in order; engine request ids
    ``{request_id}-{index}``."""
    choices: list[Choice] = []
    for p, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
        for i in range(prompt_params.n):
            index = len(choices)
            choices.append(Choice(index, prompt, f"{request_id}-{index}", p, i,
                                  child_params(prompt_params, i)))
    return choices


class OutputProcessor:
    """One choice's engine outputs, in order, turned into its text and deltas."""

    def __init__(self, tokenizer: Tokenizer, choice: Choice, every_step: bool = False) -> None:
        self.choice = choice
        self.every_step = every_step
        self.detokenizer = IncrementalDetokenizer(tokenizer, choice.params)
        self.abort_engine = False  # a stop string ended it while the engine still runs it
        self._carry_ids: list[int] = []
        self._carry_logprobs: list[TokenLogprobs] = []

    def add(self, output: EngineCoreOutput) -> ChoiceDelta | None:
        choice = self.choice
        if choice.finished:
            return None  # e.g. a step that ran before the engine heard of our abort
        choice.token_ids.extend(output.new_token_ids)
        if output.new_logprobs:
            choice.logprobs.extend(output.new_logprobs)
        if output.num_cached_tokens:
            choice.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            choice.prompt_logprobs = output.prompt_logprobs
        if output.pooled is not None:
            choice.pooled = output.pooled
        if output.kv_transfer_params is not None:
            choice.kv_transfer_params = output.kv_transfer_params
        detok = self.detokenizer
        if detok.update(output.new_token_ids) is not None:
            choice.finish_reason, choice.stop_reason = FinishReason.STOP.value, detok.stop_string
            self.abort_engine = output.finish_reason is None
        elif output.finish_reason is not None:
            choice.finish_reason = output.finish_reason.value
            choice.stop_reason = output.stop_reason
            detok.flush()
        text = detok.take_new_text(finished=choice.finished)
        choice.text += text
        self._carry_ids.extend(output.new_token_ids)
        if output.new_logprobs:
            self._carry_logprobs.extend(output.new_logprobs)
        if not text and not choice.finished and not (self.every_step and self._carry_ids):
            return None  # held back: these tokens travel with the next text
        delta = ChoiceDelta(choice.index, text, self._carry_ids, self._carry_logprobs or None,
                            choice.finish_reason, choice.stop_reason)
        self._carry_ids, self._carry_logprobs = [], []
        return delta
