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


def build_plan(step_id: int, rows: StepRows, block_table_array: np.ndarray, block_size: int,
               new_requests: list[NewRequestData], finished_req_ids: list[str]) -> StepPlan:
    num_reqs = len(rows.reqs)
    starts = np.asarray(rows.starts, dtype=np.int64)
    num_tokens = len(rows.input_ids)
    if num_tokens == num_reqs:  # pure decode: one token per row, every row samples
        query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
        positions = starts
        token_rows = np.arange(num_reqs)
        seq_lens = (starts + 1).astype(np.int32)
        sample_rows = np.asarray(rows.sample, dtype=bool)
    else:
        counts = np.asarray(rows.counts, dtype=np.int32)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        seq_lens = (starts + counts).astype(np.int32)
        token_rows = np.repeat(np.arange(num_reqs), counts)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            query_start_loc[:-1].astype(np.int64) - starts, counts)
        sample_rows = np.asarray(rows.sample, dtype=bool)
    max_blocks = -(-int(seq_lens.max()) // block_size) if num_reqs else 0
    block_tables = block_table_array[np.asarray(rows.table_rows, dtype=np.int64), :max_blocks]
    slot_mapping = (block_tables[token_rows, positions // block_size].astype(np.int64)
                    * block_size + positions % block_size)
    return StepPlan(
        step_id=step_id,
        req_ids=rows.req_ids,
        input_ids=np.asarray(rows.input_ids, dtype=np.int64),
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        sample_rows=sample_rows,
        new_requests=new_requests,
        finished_req_ids=finished_req_ids,
    )


def build_decode_plan(step_id: int, batch: DecodeBatch, block_table_array: np.ndarray,
                      block_size: int, finished_req_ids: list[str]) -> StepPlan:
    """The plan of the decode batch's rows: one token per row, every row samples. Built
    from the batch's arrays before it advances; every array is a fresh copy the plan owns."""
    num_reqs = len(batch)
    positions = batch.positions.copy()
    seq_lens = (positions + 1).astype(np.int32)
    max_blocks = -(-int(seq_lens.max()) // block_size)
    block_tables = block_table_array[batch.table_rows, :max_blocks]
    slot_mapping = (block_table_array[batch.table_rows, positions // block_size].astype(np.int64)
                    * block_size + positions % block_size)
    return StepPlan(
        step_id=step_id,
        req_ids=batch.req_ids,
        input_ids=batch.next_tokens.copy(),
        positions=positions,
        query_start_loc=np.arange(num_reqs + 1, dtype=np.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        sample_rows=np.ones(num_reqs, dtype=bool),
        new_requests=[],
        finished_req_ids=finished_req_ids,
    )


def concat_plans(first: StepPlan, second: StepPlan) -> StepPlan:
    """One plan with ``first``'s rows then ``second``'s (the decode batch's rows, then the
    rows the general path scheduled); block tables padded to the wider one."""
    offset = first.num_tokens
    head, tail = first.block_tables, second.block_tables
    block_tables = np.zeros((head.shape[0] + tail.shape[0], max(head.shape[1], tail.shape[1])),
                            dtype=head.dtype)
    block_tables[:head.shape[0], :head.shape[1]] = head
    block_tables[head.shape[0]:, :tail.shape[1]] = tail
    return StepPlan(
        step_id=second.step_id,
        req_ids=first.req_ids + second.req_ids,
        input_ids=np.concatenate([first.input_ids, second.input_ids]),
        positions=np.concatenate([first.positions, second.positions]),
        query_start_loc=np.concatenate([first.query_start_loc[:-1],
                                        second.query_start_loc + offset]).astype(np.int32),
        seq_lens=np.concatenate([first.seq_lens, second.seq_lens]),
        block_tables=block_tables,
        slot_mapping=np.concatenate([first.slot_mapping, second.slot_mapping]),
        sample_rows=np.concatenate([first.sample_rows, second.sample_rows]),
        new_requests=first.new_requests + second.new_requests,
        finished_req_ids=first.finished_req_ids + second.finished_req_ids,
    )
