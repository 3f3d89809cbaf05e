"""Build a StepPlan's arrays from the scheduled rows: vectorised numpy, no per-token Python
objects beyond collecting the input ids."""

from __future__ import annotations

import numpy as np
from shoal.runtime.plan import NewRequestData, StepPlan
from shoal.runtime.scheduler.decode_batch import DecodeBatch
from shoal.runtime.scheduler.request import Request


class StepRows:
    """Per-row facts collected while scheduling, in row order (the scheduler fills these in
    the same loop that decides the step, so no second pass over the batch is needed)."""

    __slots__ = ("reqs", "req_ids", "counts", "starts", "table_rows", "sample", "versions",
                 "input_ids")

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.req_ids: list[str] = []
        self.counts: list[int] = []
        self.starts: list[int] = []  # tokens computed before this step
        self.table_rows: list[int] = []  # row of the KV manager's persistent block table
        self.sample: list[bool] = []  # the row's prompt is complete after this step
        self.versions: list[int] = []
        self.input_ids: list[int] = []

    def add(self, req: Request, count: int, table_row: int) -> None:
        """Record one row and advance the request past this step's tokens."""
        start = req.num_computed_tokens
        tokens = req.all_token_ids
        if count == 1:
            self.input_ids.append(tokens[start])
        else:
            self.input_ids.extend(tokens[start:start + count])
        self.reqs.append(req)
        self.req_ids.append(req.req_id)
        self.counts.append(count)
        self.starts.append(start)
        self.table_rows.append(table_row)
        self.sample.append(start + count >= len(tokens))
        self.versions.append(req.version)
        req.num_computed_tokens = start + count

    @classmethod
    def of_step(cls, batch: DecodeBatch, plan: StepPlan, rest: StepRows) -> StepRows:
        """Every row of a step whose leading rows came from the decode batch, for the
        general update path (taken when the batch was discarded while the step was in
        flight)."""
        rows = cls()
        num_reqs = len(batch.reqs)
        rows.reqs = batch.reqs + rest.reqs
        rows.req_ids = batch.req_ids + rest.req_ids
        rows.counts = [1] * num_reqs + rest.counts
        rows.starts = plan.positions[:num_reqs].tolist() + rest.starts
        rows.table_rows = batch.table_rows.tolist() + rest.table_rows
        rows.sample = [True] * num_reqs + rest.sample
        rows.versions = batch.versions + rest.versions
        rows.input_ids = plan.input_ids[:num_reqs].tolist() + rest.input_ids
        return rows


def build_plan(step_id: int, batch: DecodeBatch, rows: StepRows,
               block_table_array: np.ndarray, block_size: int,
               new_requests: list[NewRequestData], finished_req_ids: list[str]) -> StepPlan:
    """The step's plan: the decode batch's rows (one token each, from its arrays, before it
    advances), then ``rows``. Every array is a fresh copy the plan owns."""
    num_batch = len(batch)
    num_reqs = num_batch + len(rows.reqs)
    starts = _join(batch.positions, rows.starts, np.int64)
    input_ids = _join(batch.next_tokens, rows.input_ids, np.int64)
    num_tokens = len(input_ids)
    if num_tokens == num_reqs:  # pure decode: one token per row
        query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
        positions = starts
        token_rows = np.arange(num_reqs)
        seq_lens = (starts + 1).astype(np.int32)
    else:
        counts = _join(np.ones(num_batch, dtype=np.int32), rows.counts, np.int32)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        seq_lens = (starts + counts).astype(np.int32)
        token_rows = np.repeat(np.arange(num_reqs), counts)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            query_start_loc[:-1].astype(np.int64) - starts, counts)
    max_blocks = -(-int(seq_lens.max()) // block_size) if num_reqs else 0
    block_tables = block_table_array[_join(batch.table_rows, rows.table_rows, np.int64),
                                     :max_blocks]
    slot_mapping = (block_tables[token_rows, positions // block_size].astype(np.int64)
                    * block_size + positions % block_size)
    return StepPlan(
        step_id=step_id,
        req_ids=batch.req_ids + rows.req_ids if rows.req_ids else batch.req_ids,
        input_ids=input_ids,
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        sample_rows=_join(np.ones(num_batch, dtype=bool), rows.sample, np.bool_),
        new_requests=new_requests,
        finished_req_ids=finished_req_ids,
    )


def _join(head: np.ndarray, tail: list, dtype: type) -> np.ndarray:
    """``head`` then ``tail`` as one new array."""
    if not tail:
        return head.astype(dtype)  # a copy
    if not len(head):
        return np.asarray(tail, dtype=dtype)
    return np.concatenate([head, np.asarray(tail, dtype=dtype)])
