"""The running requests as a persistent batch: one row per running request, in running
order, with numpy arrays of what each step needs, updated by diffs (vLLM v1's InputBatch).

Rows are appended when a request is admitted, compacted away when it finishes, is
preempted or aborted, and otherwise stay put from step to step; each step only moves their
counters (``advance`` when scheduled, ``append_tokens`` when a result arrives). So the
scheduler decides a step, builds its plan and processes its result with array operations
over the rows; per-row Python work is what cannot be vectorised (the sampled token appended
to its request, one output each) and the few rows that cross a block boundary, prefill, or
may have stopped.

The arrays mirror the requests (``check`` verifies it): ``computed[i] ==
reqs[i].num_computed_tokens`` (between steps), ``num_tokens[i] ==
len(reqs[i].all_token_ids)``,
``capacity[i]`` = the tokens its blocks hold, and, while a token is left to compute,
``next_tokens[i] == reqs[i].all_token_ids[computed[i]]``. ``revision`` counts removals, so a
step's result knows whether its rows are still the batch's leading rows.
"""

from __future__ import annotations

import numpy as np
from shoal.runtime.scheduler.request import Request
from shoal.runtime.scheduler.stops import may_stop_ids, steps_left

_INT_ARRAYS = ("table_rows", "computed", "num_tokens", "capacity", "next_tokens", "steps_left")
_BOOL_ARRAYS = ("wants_logprobs", "fresh")


class RunningBatch:
    __slots__ = ("max_model_len", "reqs", "req_ids", "revision", "stop_ids", "_stop_set",
                 "num_fresh", "num_wanting_logprobs", *_INT_ARRAYS, *_BOOL_ARRAYS)

    def __init__(self, max_rows: int, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.reqs: list[Request] = []
        self.req_ids: list[str] = []
        self.revision = 0  # bumped by every removal
        self.table_rows = np.zeros(max_rows, np.int64)  # row of the KV manager's block table
        self.computed = np.zeros(max_rows, np.int64)
        self.num_tokens = np.zeros(max_rows, np.int64)
        self.capacity = np.zeros(max_rows, np.int64)  # tokens the request's blocks hold
        self.next_tokens = np.zeros(max_rows, np.int64)
        self.steps_left = np.zeros(max_rows, np.int64)  # see stops.steps_left
        self.wants_logprobs = np.zeros(max_rows, np.bool_)
        self.fresh = np.zeros(max_rows, np.bool_)  # no output yet: the first carries stamps
        self.stop_ids = np.zeros(0, np.int64)  # union of the rows' stop ids (only grows)
        self._stop_set: set[int] = set()
        self.num_fresh = 0  # rows set in ``fresh`` and ``wants_logprobs``: at 0 (most
        self.num_wanting_logprobs = 0  # steps) no step looks for them

    def __len__(self) -> int:
        return len(self.reqs)

    # -- diffs --------------------------------------------------------------------------
    def append(self, req: Request, table_row: int, capacity: int) -> None:
        """A request admitted this step (its tokens not yet scheduled)."""
        i = len(self.reqs)
        self.reqs.append(req)
        self.req_ids.append(req.req_id)
        self.table_rows[i] = table_row
        self.computed[i] = req.num_computed_tokens
        self.num_tokens[i] = len(req.all_token_ids)
        self.capacity[i] = capacity
        self.next_tokens[i] = req.all_token_ids[req.num_computed_tokens]
        self.steps_left[i] = steps_left(req, self.max_model_len)
        self.wants_logprobs[i] = req.logprobs_k is not None
        self.fresh[i] = not req.output_token_ids
        self.num_wanting_logprobs += req.logprobs_k is not None
        self.num_fresh += not req.output_token_ids
        stops = may_stop_ids(req)
        if not stops <= self._stop_set:
            self._stop_set |= stops
            self.stop_ids = np.asarray(sorted(self._stop_set), np.int64)

    def remove(self, rows: list[int]) -> None:
        """Compact the given rows away (ascending indices); the others keep their order."""
        n = len(self.reqs)
        gone = set(rows)
        self.reqs = [r for i, r in enumerate(self.reqs) if i not in gone]
        self.req_ids = [r.req_id for r in self.reqs]
        keep = np.ones(n, np.bool_)
        keep[rows] = False
        self.num_fresh -= int(self.fresh[rows].sum())
        self.num_wanting_logprobs -= int(self.wants_logprobs[rows].sum())
        m = len(self.reqs)
        for name in (*_INT_ARRAYS, *_BOOL_ARRAYS):
            array = getattr(self, name)
            array[:m] = array[:n][keep]
        self.revision += 1
        if not self.reqs:
            self.stop_ids = np.zeros(0, np.int64)
            self._stop_set = set()

    def index_of(self, req: Request) -> int:
        reqs = self.reqs
        for i in range(len(reqs) - 1, -1, -1):  # from the newest: preemption's usual victim
            if reqs[i] is req:
                return i
        raise ValueError(f"{req!r} is not in the running batch")

    def advance(self, num_rows: int, counts: np.ndarray, decode_only: bool,
                sampled: np.ndarray) -> None:
        """The leading ``num_rows`` rows were scheduled ``counts`` tokens (``decode_only``:
        one each, every row sampled; ``sampled``: the step completes the row's known
        tokens). A sampled row's request learns its progress when its token arrives
        (``step_outputs.append_tokens``: one pass over the rows, not two); the others now,
        with their next input token."""
        computed = self.computed[:num_rows]
        computed += counts
        if decode_only or sampled.all():
            return
        reqs = self.reqs
        for i in np.flatnonzero(~sampled).tolist():
            req = reqs[i]
            req.num_computed_tokens = done = int(computed[i])
            self.next_tokens[i] = req.all_token_ids[done]

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Each of ``rows`` sampled its token (already appended to its request)."""
        self.next_tokens[rows] = tokens
        self.num_tokens[rows] += 1
        self.steps_left[rows] -= 1
        if self.num_fresh:
            self.num_fresh -= int(self.fresh[rows].sum())
            self.fresh[rows] = False

    # -- invariants ---------------------------------------------------------------------
    def check(self, table_rows: dict[str, int], num_blocks: dict[str, int],
              block_size: int) -> None:
        """Raise AssertionError unless the arrays mirror the requests (between steps)."""
        n = len(self.reqs)
        if self.req_ids != [r.req_id for r in self.reqs]:
            raise AssertionError("running batch req_ids are stale")
        want = {
            "table_rows": [table_rows[r.req_id] for r in self.reqs],
            "computed": [r.num_computed_tokens for r in self.reqs],
            "num_tokens": [len(r.all_token_ids) for r in self.reqs],
            "capacity": [num_blocks[r.req_id] * block_size for r in self.reqs],
            "next_tokens": [r.all_token_ids[r.num_computed_tokens] for r in self.reqs],
            "steps_left": [steps_left(r, self.max_model_len) for r in self.reqs],
            "wants_logprobs": [r.logprobs_k is not None for r in self.reqs],
            "fresh": [not r.output_token_ids for r in self.reqs],
        }
        for name, values in want.items():
            if getattr(self, name)[:n].tolist() != values:
                raise AssertionError(f"running batch {name} is stale")
        # a row holds exactly the blocks its computed tokens need: the scheduler finds the
        # rows whose decode fills a block by ``ends == capacity``
        if want["capacity"] != [-(-c // block_size) * block_size for c in want["computed"]]:
            raise AssertionError("a running request holds blocks beyond its tokens")
        if self.num_fresh != sum(want["fresh"]) \
                or self.num_wanting_logprobs != sum(want["wants_logprobs"]):
            raise AssertionError("running batch counts are stale")
        for req in self.reqs:
            if not may_stop_ids(req) <= self._stop_set:
                raise AssertionError(f"running batch misses a stop id of {req.req_id}")
