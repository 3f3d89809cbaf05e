"""SamplingMetadata: one step's per-row sampling parameters as device tensors.

Built by the worker from its per-request state for the rows that sample this step; the
sampler reads only this. Optional parts are None when no row needs them, so an all-greedy
batch without penalties carries nothing but the flag that selects the argmax fast path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingMetadata:
    all_greedy: bool
    greedy: torch.Tensor | None  # bool [S]
    temperature: torch.Tensor | None  # float [S]; 1.0 on greedy rows
    top_k: torch.Tensor | None  # long [S]; vocab size where disabled; None when no row uses it
    top_p: torch.Tensor | None  # float [S]; None when no row uses it
    min_p: torch.Tensor | None  # float [S]; None when no row uses it
    generators: list[torch.Generator | None]  # per row; None = the worker's shared stream
    # penalties (None when no row has one)
    presence_penalty: torch.Tensor | None = None  # float [S]
    frequency_penalty: torch.Tensor | None = None  # float [S]
    repetition_penalty: torch.Tensor | None = None  # float [S]
    output_counts: torch.Tensor | None = None  # float [S, V]: occurrences in the output so far
    prompt_mask: torch.Tensor | None = None  # bool [S, V]: token occurs in the prompt
    # min_tokens: (row, token id) pairs whose logit is forced to -inf this step
    banned_rows: torch.Tensor | None = None  # long [N]
    banned_tokens: torch.Tensor | None = None  # long [N]
    # logit_bias: (row, token id, bias) triples added to the logits this step
    bias_rows: torch.Tensor | None = None  # long [M]
    bias_tokens: torch.Tensor | None = None  # long [M]
    bias_values: torch.Tensor | None = None  # float [M]
    max_num_logprobs: int | None = None  # None: no row asked for logprobs
    # structured output: int32 [S, ceil(V/32)] allowed-token bits (xgrammar's layout), for
    # the rows listed (the others' bits are all set); applied before anything else
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None

    @property
    def needs_processing(self) -> bool:
        return (self.output_counts is not None or self.banned_rows is not None
                or self.bias_rows is not None or self.max_num_logprobs is not None)
