"""Build a StepPlan's arrays from the scheduled rows: vectorised numpy, no per-token Python
objects beyond collecting the input ids."""

from __future__ import annotations

import numpy as np
from shoal.runtime.plan import NewRequestData, StepPlan
from shoal.runtime.scheduler.request import Request


def build_plan(step_id: int, rows: list[Request], num_scheduled: list[int],
               start_positions: list[int], table_rows: list[int],
               block_table_array: np.ndarray, block_size: int,
               new_requests: list[NewRequestData], finished_req_ids: list[str]) -> StepPlan:
    """``start_positions[i]``: tokens of row i already computed before this step."""
    num_reqs = len(rows)
    input_ids: list[int] = []
    for req, start, count in zip(rows, start_positions, num_scheduled, strict=True):
        if count == 1:
            input_ids.append(req.all_token_ids[start])
        else:
            input_ids.extend(req.all_token_ids[start:start + count])
    counts = np.asarray(num_scheduled, dtype=np.int32)
    starts = np.asarray(start_positions, dtype=np.int64)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start_loc[1:])
    seq_lens = (starts + counts).astype(np.int32)
    num_tokens = int(query_start_loc[-1])
    if num_tokens == num_reqs:  # pure decode: one token per row
        positions = starts.copy()
        token_rows = np.arange(num_reqs)
    else:
        token_rows = np.repeat(np.arange(num_reqs), counts)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            query_start_loc[:-1].astype(np.int64) - starts, counts)
    max_blocks = -(-int(seq_lens.max()) // block_size) if num_reqs else 0
    block_tables = block_table_array[np.asarray(table_rows, dtype=np.int64), :max_blocks]
    slot_mapping = (block_tables[token_rows, positions // block_size].astype(np.int64)
                    * block_size + positions % block_size)
    sample_rows = np.fromiter(
        (start + count >= req.num_tokens
         for req, start, count in zip(rows, start_positions, num_scheduled, strict=True)),
        dtype=bool, count=num_reqs)
    return StepPlan(
        step_id=step_id,
        req_ids=[req.req_id for req in rows],
        input_ids=np.asarray(input_ids, dtype=np.int64),
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        sample_rows=sample_rows,
        new_requests=new_requests,
        finished_req_ids=finished_req_ids,
    )
