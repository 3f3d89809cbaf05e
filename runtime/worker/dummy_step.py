"""The dummy step a worker runs before it serves: as many tokens as the scheduler may send in
one step, over KV blocks that are then forgotten.

On a GPU it is one sequence of that many tokens: the step whose activations and attention
workspace peak highest, which the memory profile (``memory_profile.py``) must see. On a CPU
nothing is profiled: the step warms the code paths (the linear layers at the step's full row
count, the attention kernels, the sampler). Its tokens are then split into sequences of at
most ``CPU_WARMUP_SEQ_TOKENS``: causal attention over one 2048-token sequence is quadratic
and was the larger part of a CPU start (about 3 of 13 CPU-seconds of a test server on the
5.6M-parameter qwen3, tens of seconds on a 30-layer model) while warming nothing the split
step does not.
"""

from __future__ import annotations

import numpy as np
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.plan import NewRequestData, StepPlan

CPU_WARMUP_SEQ_TOKENS = 256
_REQ_PREFIX = "__warmup__"


def dummy_seq_lens(num_tokens: int, block_size: int, max_seq_tokens: int | None,
                   max_num_seqs: int) -> list[int]:
    """The lengths of the dummy step's sequences: ``num_tokens`` in all, each at most
    ``max_seq_tokens`` rounded up to whole blocks (None: one sequence), and no more
    sequences than a step may hold (longer ones where ``max_num_seqs`` is small)."""
    if max_seq_tokens is None or num_tokens <= max_seq_tokens:
        return [num_tokens]
    per_seq = max(max_seq_tokens, -(-num_tokens // max_num_seqs))
    per_seq = -(-per_seq // block_size) * block_size
    full, rest = divmod(num_tokens, per_seq)
    return [per_seq] * full + ([rest] if rest else [])


def dummy_step_plan(seq_lens: list[int], block_size: int, num_blocks: int) -> StepPlan:
    """A prefill step of fresh sequences laid end to end over the cache's slots (wrapping
    around a cache smaller than the step): sequence i starts at a block boundary, so its
    block table is the run of blocks its slots fall in."""
    num_tokens = sum(seq_lens)
    capacity = num_blocks * block_size
    starts = np.cumsum([0, *seq_lens[:-1]])
    width = max(-(-n // block_size) for n in seq_lens)
    tables = np.zeros((len(seq_lens), width), dtype=np.int32)
    for row, (start, n) in enumerate(zip(starts, seq_lens, strict=True)):
        blocks = -(-n // block_size)
        tables[row, :blocks] = (start // block_size + np.arange(blocks)) % num_blocks
    req_ids = [f"{_REQ_PREFIX}{i}" for i in range(len(seq_lens))]
    return StepPlan(
        step_id=-1, req_ids=req_ids,
        input_ids=np.zeros(num_tokens, dtype=np.int64),
        positions=np.concatenate([np.arange(n, dtype=np.int64) for n in seq_lens]),
        query_start_loc=np.cumsum([0, *seq_lens]).astype(np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        block_tables=tables,
        slot_mapping=np.arange(num_tokens, dtype=np.int64) % capacity,
        sample_rows=np.ones(len(seq_lens), dtype=bool),
        new_requests=[NewRequestData(req_id, [0], [], SamplingParams(temperature=0.0))
                      for req_id in req_ids],
    )
