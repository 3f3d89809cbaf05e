"""The step plan: what the engine core tells every worker rank to run this step.

Flat (varlen) batch: all scheduled tokens of all requests in one array; ``query_start_loc``
marks where each request's tokens start. Allocation is finished when a plan exists: block
tables and slot mappings are final, so every rank runs exactly the same plan. Arrays, never
per-token Python objects, so the plan stays small when it crosses to TP worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import numpy as np
from shoal.runtime.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent the first step a worker sees a request (again after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before a preemption (recompute keeps them)
    sampling_params: SamplingParams
    generator_offset: int = 0  # tokens already sampled: seeded streams resume where they were
    lora_name: str | None = None  # the LoRA adapter it runs with; None: the base model
    # ranks in their own process (TP > 1): the grammar the engine core compiled off its loop,
    # serialized (xgrammar's JSON), so no rank compiles on the step
    compiled_grammar: str | None = None


@dataclass
class StepPlan:
    step_id: int
    req_ids: list[str]  # rows of the batch, in order
    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int32 [B+1]
    seq_lens: np.ndarray  # int32 [B]: context length including this step's tokens
    block_tables: np.ndarray  # int32 [B, max_blocks]: padded with 0 beyond seq_lens
    slot_mapping: np.ndarray  # int64 [T]: block_id * block_size + offset for each new token
    sample_rows: np.ndarray  # bool [B]: the row's prompt is complete after this step
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # drop worker-side state
    # a model with several KV cache groups (``kv/kv_groups.py``): groups 1.. have their own
    # block tables [B, max_blocks] and slot mappings [T] (group 0's are the fields above)
    group_block_tables: list[np.ndarray] = field(default_factory=list)
    group_slot_mappings: list[np.ndarray] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class PromptLogprobsChunk(msgspec.Struct, array_like=True):
    """One row's prompt logprobs for the prompt positions this step computed: entry i is
    the logprob of prompt token ``start + i`` given the tokens before it (start >= 1), and
    that position's top alternatives."""

    start: int
    logprobs: list[float]
    top_token_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class StepResult:
    """Sampled tokens for the rows whose ``sample_rows`` was set, in row order."""

    step_id: int
    req_ids: list[str]
    sampled_token_ids: np.ndarray  # int64 [S]
    logprobs: np.ndarray | None = None  # float32 [S]: of the sampled token
    top_token_ids: np.ndarray | None = None  # int64 [S, K]
    top_logprobs: np.ndarray | None = None  # float32 [S, K]
    # rows whose request asked for prompt logprobs and computed prompt tokens this step
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None
    # the pooling runner: request id -> its prompt's pooled vector (float32 bytes)
    pooled: dict[str, bytes] | None = None
