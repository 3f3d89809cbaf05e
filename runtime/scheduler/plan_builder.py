"""Build a StepPlan's arrays from the running batch's leading rows: vectorised numpy, Python
only to copy the input ids of rows that compute more than one token (prefill chunks)."""

from __future__ import annotations

import numpy as np
from shoal.runtime.scheduler.running_batch import RunningBatch
from shoal.runtime.wire.plan import NewRequestData, StepPlan


def allot_budget(wanted: np.ndarray, budget: int) -> np.ndarray:
    """Tokens per row when rows take what they want in order until ``budget`` runs out
    (the last row served may get part of it, later rows nothing)."""
    before = np.cumsum(wanted) - wanted
    return np.clip(budget - before, 0, wanted)


def build_plan(step_id: int, batch: RunningBatch, counts: np.ndarray,
               group_arrays: list[np.ndarray], block_size: int,
               new_requests: list[NewRequestData], finished_req_ids: list[str]) -> StepPlan:
    """The plan of the batch's first ``len(counts)`` rows, ``counts[i]`` tokens each from
    where row i has computed to (before ``batch.advance``). Every array is a fresh copy the
    plan owns. ``group_arrays``: the KV manager's block-table array of each KV cache group
    (one for most models); groups past the first travel as ``group_block_tables``."""
    num_reqs = len(counts)
    starts = batch.computed[:num_reqs].copy()
    seq_lens = (starts + counts).astype(np.int32)
    num_tokens = int(counts.sum())
    if num_tokens == num_reqs:  # one token per row (decodes, the odd 1-token chunk)
        query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
        input_ids = batch.next_tokens[:num_reqs].copy()
        positions = starts
        token_rows = np.arange(num_reqs)
    else:
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        row_starts = query_start_loc[:-1]
        token_rows = np.repeat(np.arange(num_reqs), counts)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            row_starts.astype(np.int64) - starts, counts)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        single = counts == 1
        input_ids[row_starts[single]] = batch.next_tokens[:num_reqs][single]
        reqs = batch.reqs
        for i in np.flatnonzero(~single).tolist():
            start, at = int(starts[i]), int(row_starts[i])
            count = int(counts[i])
            input_ids[at:at + count] = reqs[i].all_token_ids[start:start + count]
    max_blocks = -(-int(seq_lens.max()) // block_size) if num_reqs else 0
    rows, column, offset = batch.table_rows[:num_reqs], positions // block_size, \
        positions % block_size
    block_tables = group_arrays[0][rows, :max_blocks]
    slot_mapping = (block_tables[token_rows, column].astype(np.int64) * block_size + offset)
    group_tables = [array[rows, :max_blocks] for array in group_arrays[1:]]
    group_slots = [table[token_rows, column].astype(np.int64) * block_size + offset
                   for table in group_tables]
    return StepPlan(
        step_id=step_id,
        req_ids=batch.req_ids[:num_reqs],
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        sample_rows=seq_lens >= batch.num_tokens[:num_reqs],
        new_requests=new_requests,
        finished_req_ids=finished_req_ids,
        group_block_tables=group_tables,
        group_slot_mappings=group_slots,
    )
