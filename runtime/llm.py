"""Offline API: ``LLM(model_dir, **engine_args).generate(prompts, sampling_params)``.

Tokenizes with the front end's tokenizer and renderer (frontend/prompts.py: text encoded as
HF encodes it, BOS included; ``chat`` renders the checkpoint's template), validates every prompt before any reaches the
engine (a bad one leaves the engine untouched), fans ``n > 1`` out into n engine requests
sharing the prompt (the copies enter once the first has computed it, so the prefix cache
serves them), steps the engine until all are
done, and detokenizes. Stop strings are found here, as the serving front end does, and end
the request in the engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore, freeze_gc_after_startup
from shoal.runtime.engine.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from shoal.runtime.frontend.prompts import ChatPrompt, PromptRenderer
from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.outputs import CompletionOutput, RequestOutput
from shoal.runtime.sampling_params import InvalidParameter, SamplingParams, child_params

PromptInput = str | list[int]


@dataclass
class _Sample:
    """One engine request: a single sample of one prompt."""

    prompt_index: int
    sample_index: int
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""


class LLM:
    def __init__(self, model_dir: str | Path, **engine_args: object) -> None:
        self.engine = EngineCore(EngineConfig.from_kwargs(str(model_dir), **engine_args))
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.renderer = PromptRenderer(self.tokenizer)
        self._ids = itertools.count()
        freeze_gc_after_startup()

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered by the template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [self.renderer.render_chat(ChatPrompt(
            list(conv), tools=tools, add_generation_prompt=add_generation_prompt))  # type: ignore[arg-type]
            for conv in conversations]
        outputs = self.generate([r.token_ids for r in rendered], sampling_params)
        for out, r in zip(outputs, rendered, strict=True):
            out.prompt = r.text
        return outputs

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 add_special_tokens: bool = True) -> list[RequestOutput]:
        """Text prompts are encoded as HF's ``tokenizer.encode`` (BOS added where the
        checkpoint adds it) unless ``add_special_tokens=False``."""
        prompt_list = _normalize_prompts(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        token_lists = [self.renderer.encode_text(p, add_special_tokens).token_ids
                       if isinstance(p, str) else list(p) for p in prompt_list]
        requests: list[EngineCoreRequest] = []
        samples: dict[str, _Sample] = {}
        batch = next(self._ids)
        for i, (tokens, params) in enumerate(zip(token_lists, params_list, strict=True)):
            for j in range(params.n):
                child = child_params(params, j)
                req_id = f"{batch}-{i}-{j}"
                requests.append(EngineCoreRequest(request_id=req_id, prompt_token_ids=tokens,
                                                  sampling_params=child))
                samples[req_id] = _Sample(i, j, child)
        for request in requests:  # all valid, or none enters the engine
            self.engine.validate(request)
        # samples 1..n-1 of a prompt enter once sample 0 has computed the prompt, so its
        # full blocks are in the prefix cache and they skip that prefill
        siblings: dict[str, list[EngineCoreRequest]] = {}
        for request in requests:
            sample = samples[request.request_id]
            if sample.sample_index == 0:
                self.engine.add_request(request)
            else:
                siblings.setdefault(f"{batch}-{sample.prompt_index}-0", []).append(request)
        cached = [0] * len(prompt_list)
        prompt_lps: list[list[TokenLogprobs | None] | None] = [None] * len(prompt_list)
        try:
            while self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                failures = self.engine.take_failures()
                if failures:
                    if failures[0].param is not None:  # its content: a grammar, say
                        raise InvalidParameter(failures[0].param, failures[0].message)
                    raise RuntimeError(f"request {failures[0].request_id} failed in the "
                                       "engine (see the log)")
                for out in outputs:
                    sample = samples[out.request_id]
                    cached[sample.prompt_index] = max(cached[sample.prompt_index],
                                                      out.num_cached_tokens)
                    if out.prompt_logprobs is not None:
                        prompt_lps[sample.prompt_index] = [None, *out.prompt_logprobs]
                    self._absorb(out, sample)
                    for request in siblings.pop(out.request_id, ()):
                        self.engine.add_request(request)
        except BaseException:
            self.engine.abort_requests(list(samples))
            raise
        results = [RequestOutput(request_id=f"{batch}-{i}",
                                 prompt=p if isinstance(p, str) else None,
                                 prompt_token_ids=token_lists[i], num_cached_tokens=cached[i],
                                 prompt_logprobs=prompt_lps[i])
                   for i, p in enumerate(prompt_list)]
        for sample in samples.values():
            if sample.finish_reason != "stop" or not isinstance(sample.stop_reason, str):
                sample.text = self._decode(sample)
            results[sample.prompt_index].outputs.append(CompletionOutput(
                index=sample.sample_index, text=sample.text, token_ids=sample.token_ids,
                logprobs=sample.logprobs, finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason))
        return results

    def _params_for(self, prompts: list[PromptInput],
                    sampling_params: SamplingParams | Sequence[SamplingParams] | None
                    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        for params in params_list:
            params.validate(self.engine.limits)
        return params_list

    def _absorb(self, out: EngineCoreOutput, sample: _Sample) -> None:
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + list(out.new_logprobs)
        if out.finish_reason is not None:
            sample.finish_reason = out.finish_reason.value
            sample.stop_reason = out.stop_reason
            return
        if sample.params.stop:
            self._check_stop_strings(out.request_id, sample)

    def _check_stop_strings(self, req_id: str, sample: _Sample) -> None:
        text = self._decode(sample)
        hits = [(text.find(s), s) for s in sample.params.stop if s in text]
        if not hits:
            return
        position, stop = min(hits)
        end = position + len(stop) if sample.params.include_stop_str_in_output else position
        sample.text = text[:end]
        sample.finish_reason = "stop"
        sample.stop_reason = stop
        self.engine.abort_requests([req_id])

    def _decode(self, sample: _Sample) -> str:
        return self.tokenizer.decode(sample.token_ids,
                                     skip_special_tokens=sample.params.skip_special_tokens)


def _normalize_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """str | list[str] | list[int] | list[list[int]] -> one entry per prompt."""
    if isinstance(prompts, str):
        return [prompts]
    items: list = list(prompts)
    if not items:
        raise ValueError("no prompts given")
    if all(isinstance(p, int) for p in items):
        return [items]
    for p in items:
        if not isinstance(p, str) and not (isinstance(p, list)
                                           and all(isinstance(t, int) for t in p)):
            raise TypeError("prompts must be a string, a list of strings, a list of token ids "
                            f"or a list of token-id lists; got an element {type(p).__name__}")
    return items
