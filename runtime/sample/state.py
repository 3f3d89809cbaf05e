"""Per-request sampling state kept by the worker, and the per-step SamplingMetadata builder.

A request's state is created when a plan first lists it in ``new_requests`` (again after a
preemption, when the output so far and the generator offset come with it) and dropped when
the plan lists it in ``finished_req_ids``. Penalty bookkeeping (prompt mask, output counts)
exists only for requests that use a penalty, so plain requests cost nothing per token. A
request with a grammar (``params.structured``) holds its matcher here: rebuilt by replaying
the output so far whenever the state is rebuilt, advanced by every token ``append``s; a
grammar with ``start_after`` (reasoning models) starts once the output has written it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from shoal.runtime.sample.metadata import SamplingMetadata
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.structured.backend import GrammarBackend, GrammarMatcher
from shoal.runtime.structured.spec import grammar_start


@dataclass
class RequestSamplingState:
    params: SamplingParams
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    prompt_mask: torch.Tensor | None = None  # bool [V]
    output_counts: torch.Tensor | None = None  # float [V]
    banned_on_min: list[int] = field(default_factory=list)  # EOS + stop ids while < min_tokens
    # the prompt, while its tokens' logprobs are still to be computed (prompt_logprobs)
    prompt_for_logprobs: list[int] | None = None
    grammar: GrammarMatcher | None = None
    # a grammar that starts after a marker (reasoning models), until the output writes it
    pending_grammar: GrammarBackend | None = None

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        if self.grammar is not None and not self.grammar.accept(token_id):
            # only possible when every allowed token was also banned (min_tokens vs a
            # grammar that must end now): the sampler had nothing legal left to pick
            self.grammar = None
        elif self.pending_grammar is not None:
            self._start_grammar(self.pending_grammar)

    def _start_grammar(self, grammars: GrammarBackend) -> None:
        """The matcher, once the output has reached where the grammar begins (replaying
        what came after it); until then the tokens are free (the reasoning span)."""
        spec = self.params.structured
        assert spec is not None
        start = grammar_start(spec, self.output_token_ids)
        if start is None:
            self.pending_grammar = grammars
            return
        self.pending_grammar = None
        self.grammar = grammars.matcher(spec, self.output_token_ids[start:])


def new_request_state(params: SamplingParams, prompt_token_ids: Sequence[int],
                      output_token_ids: Sequence[int], generator_offset: int,
                      eos_token_ids: Sequence[int], vocab_size: int,
                      device: torch.device,
                      grammars: GrammarBackend | None = None) -> RequestSamplingState:
    state = RequestSamplingState(params, list(output_token_ids))
    if params.prompt_logprobs is not None and not output_token_ids:
        state.prompt_for_logprobs = list(prompt_token_ids)
    if params.structured is not None:
        if grammars is None:
            raise ValueError("a request with structured output needs a grammar backend")
        state._start_grammar(grammars)
    if params.seed is not None and not params.greedy:
        state.generator = torch.Generator(device=device).manual_seed(params.seed)
        # resume the stream where it was before a preemption: replay each earlier draw of
        # V numbers as its own call, as the sampler made it (generators may round per call)
        scratch = torch.empty(vocab_size, device=device) if generator_offset else None
        for _ in range(generator_offset):
            scratch.exponential_(generator=state.generator)  # type: ignore[union-attr]
    if state.has_penalties:
        mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        mask[_valid_ids(prompt_token_ids, vocab_size, device)] = True
        state.prompt_mask = mask
        counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        counts.index_add_(0, _valid_ids(output_token_ids, vocab_size, device),
                          torch.ones(len(output_token_ids), device=device))
        state.output_counts = counts
    if params.min_tokens:
        state.banned_on_min = sorted({*eos_token_ids, *params.stop_token_ids} & set(range(vocab_size)))
    return state


def _valid_ids(ids: Sequence[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    t = torch.tensor(list(ids), dtype=torch.long, device=device)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise ValueError(f"token id outside the vocabulary (size {vocab_size})")
    return t


def build_sampling_metadata(states: Sequence[RequestSamplingState], vocab_size: int,
                            device: torch.device) -> SamplingMetadata:
    """One tensor per parameter, built from host lists with one copy each."""
    params = [s.params for s in states]
    greedy = [p.greedy for p in params]
    all_greedy = all(greedy)
    meta = SamplingMetadata(
        all_greedy=all_greedy, greedy=None, temperature=None, top_k=None, top_p=None,
        min_p=None, generators=[s.generator for s in states])
    if not all_greedy:
        if any(greedy):
            meta.greedy = torch.tensor(greedy, dtype=torch.bool, device=device)
        meta.temperature = torch.tensor(
            [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
            dtype=torch.float32, device=device)
        if any(p.top_k > 0 for p in params):
            meta.top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params],
                                      dtype=torch.long, device=device)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32,
                                      device=device)
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32,
                                      device=device)
    if any(s.output_counts is not None for s in states):
        zeros = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        no_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        meta.output_counts = torch.stack(
            [s.output_counts if s.output_counts is not None else zeros for s in states])
        meta.prompt_mask = torch.stack(
            [s.prompt_mask if s.prompt_mask is not None else no_mask for s in states])
        meta.repetition_penalty = torch.tensor([p.repetition_penalty for p in params],
                                               dtype=torch.float32, device=device)
        meta.frequency_penalty = torch.tensor([p.frequency_penalty for p in params],
                                              dtype=torch.float32, device=device)
        meta.presence_penalty = torch.tensor([p.presence_penalty for p in params],
                                             dtype=torch.float32, device=device)
    rows: list[int] = []
    tokens: list[int] = []
    for row, s in enumerate(states):
        if s.banned_on_min and len(s.output_token_ids) < s.params.min_tokens:
            rows.extend([row] * len(s.banned_on_min))
            tokens.extend(s.banned_on_min)
    if rows:
        meta.banned_rows = torch.tensor(rows, dtype=torch.long, device=device)
        meta.banned_tokens = torch.tensor(tokens, dtype=torch.long, device=device)
    grammar_rows = [row for row, s in enumerate(states)
                    if s.grammar is not None and not s.grammar.finished]
    if grammar_rows:
        bitmask = torch.full((len(states), (vocab_size + 31) // 32), -1, dtype=torch.int32)
        for row in grammar_rows:
            states[row].grammar.fill_mask(bitmask, row)  # type: ignore[union-attr]
        meta.token_bitmask, meta.bitmask_rows = bitmask, grammar_rows
    bias = [(row, token, value) for row, p in enumerate(params) if p.logit_bias
            for token, value in p.logit_bias.items()]
    if bias:
        meta.bias_rows = torch.tensor([b[0] for b in bias], dtype=torch.long, device=device)
        meta.bias_tokens = torch.tensor([b[1] for b in bias], dtype=torch.long, device=device)
        meta.bias_values = torch.tensor([b[2] for b in bias], dtype=torch.float32,
                                        device=device)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(asked) if asked else None
    return meta
