"""Offline API: ``LLM(model_dir, **engine_args).generate(prompts, sampling_params)``.

Tokenizes with the front end's tokenizer and renderer (frontend/prompts.py: text encoded as
HF encodes it, BOS included; ``chat`` renders the checkpoint's template), validates every prompt before any reaches the
engine (a bad one leaves the engine untouched), and steps the engine until all are done.
Fan-out (``n``), incremental detokenization, stop strings and finish reasons are the API's
own output path (frontend/output_processor.py); the n copies of a prompt enter once the
first has computed it, so the prefix cache serves them. ``lora_request`` (vLLM's
``LoRARequest``, lora_request.py) runs prompts on LoRA adapters, loaded on first use;
``LLM(..., enable_lora=True, max_loras=..., max_lora_rank=...)`` as in vLLM.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore, freeze_gc_after_startup
from shoal.runtime.frontend.output_processor import Choice, OutputProcessor, fan_out
from shoal.runtime.frontend.output_processor import PromptInput as RenderedInput
from shoal.runtime.frontend.prompts import ChatPrompt, PromptRenderer
from shoal.runtime.frontend.tokenizer import Tokenizer
from shoal.runtime.lora_request import LoRARequest, check_pairing, per_prompt
from shoal.runtime.outputs import CompletionOutput, RequestOutput
from shoal.runtime.sampling_params import InvalidParameter, SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest, TokenLogprobs

PromptInput = str | list[int]


class LLM:
    def __init__(self, model_dir: str | Path, **engine_args: object) -> None:
        self.engine = EngineCore(EngineConfig.from_kwargs(str(model_dir), **engine_args))
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.renderer = PromptRenderer(self.tokenizer)
        self._ids = itertools.count()
        self._adapters: dict[str, LoRARequest] = {}  # loaded through lora_request, by name
        freeze_gc_after_startup()

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered by the template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [self.renderer.render_chat(ChatPrompt(
            list(conv), tools=tools, add_generation_prompt=add_generation_prompt))  # type: ignore[arg-type]
            for conv in conversations]
        outputs = self.generate([r.token_ids for r in rendered], sampling_params,
                                lora_request=lora_request)
        for out, r in zip(outputs, rendered, strict=True):
            out.prompt = r.text
        return outputs

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 add_special_tokens: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Text prompts are encoded as HF's ``tokenizer.encode`` (BOS added where the
        checkpoint adds it) unless ``add_special_tokens=False``. ``lora_request``: one
        adapter for all prompts, or one (or None, the base) per prompt."""
        prompt_list = _normalize_prompts(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        adapters = self._adapters_for(per_prompt(lora_request, len(prompt_list)))
        token_lists = [self.renderer.encode_text(p, add_special_tokens).token_ids
                       if isinstance(p, str) else list(p) for p in prompt_list]
        batch = str(next(self._ids))
        choices = fan_out(batch, [RenderedInput(t) for t in token_lists], params_list)
        processors = {c.request_id: OutputProcessor(self.tokenizer, c) for c in choices}
        requests = [EngineCoreRequest(request_id=c.request_id, prompt_token_ids=c.prompt.token_ids,
                                      sampling_params=c.params,
                                      adapter_id=adapters[c.prompt_index])
                    for c in choices]
        for request in requests:  # all valid, or none enters the engine
            self.engine.validate(request)
        # samples 1..n-1 of a prompt enter once sample 0 has computed the prompt, so its
        # full blocks are in the prefix cache and they skip that prefill
        siblings: dict[str, list[EngineCoreRequest]] = {}
        first = ""  # the engine request of the current prompt's sample 0
        for request, choice in zip(requests, choices, strict=True):
            if choice.sample_index == 0:
                first = request.request_id
                self.engine.add_request(request)
            else:
                siblings.setdefault(first, []).append(request)
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
                    processor = processors[out.request_id]
                    processor.add(out)
                    if processor.abort_engine:  # a stop string: the engine does not know
                        self.engine.abort_requests([out.request_id])
                    for request in siblings.pop(out.request_id, ()):
                        self.engine.add_request(request)
        except BaseException:
            self.engine.abort_requests(list(processors))
            raise
        return [self._request_output(f"{batch}-{i}", prompt, token_lists[i],
                                     [c for c in choices if c.prompt_index == i])
                for i, prompt in enumerate(prompt_list)]

    @staticmethod
    def _request_output(request_id: str, prompt: PromptInput, token_ids: list[int],
                        choices: list[Choice]) -> RequestOutput:
        """vLLM's offline shape: the prompt's logprobs with ``None`` for its first token, the
        most cached tokens of any sample, a sample's logprobs ``None`` unless it has some."""
        scored = next((c.prompt_logprobs for c in choices if c.prompt_logprobs is not None),
                      None)
        prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if scored is None else [None, *scored])
        return RequestOutput(
            request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids, num_cached_tokens=max(c.num_cached_tokens for c in choices),
            prompt_logprobs=prompt_logprobs,
            outputs=[CompletionOutput(index=c.sample_index, text=c.text, token_ids=c.token_ids,
                                      logprobs=c.logprobs or None, finish_reason=c.finish_reason,
                                      stop_reason=c.stop_reason) for c in choices])

    def _adapters_for(self, requests: list[LoRARequest | None]) -> list[str | None]:
        """Each prompt's adapter name, loading the adapters not loaded yet (a bad one is a
        ValueError naming why, before any request enters the engine)."""
        wanted = [r for r in requests if r is not None]
        if wanted and not self.engine.config.enable_lora:
            raise ValueError("lora_request needs LoRA enabled: LLM(..., enable_lora=True)")
        for request in wanted:
            if not check_pairing(self._adapters, request):
                self.engine.add_lora(request.lora_name, request.lora_path)
                self._adapters[request.lora_name] = request
        return [None if r is None else r.lora_name for r in requests]

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
