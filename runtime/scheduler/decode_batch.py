"""The steady decode batch: per-row arrays kept across steps while every running request
decodes one token per step and the running set only shrinks.

In that state a step is predictable: each row feeds the token it sampled last at the next
position, so the scheduler plans it with a few numpy operations on these arrays instead of
a Python pass over the rows; only rows that cross a block boundary touch the KV manager,
and stop conditions are checked on arrays, looking closer only at rows that may be done.
Rows that finish are dropped by compaction. Anything else that changes the running set
(an admission, a preemption, an abort, a prefill chunk) discards the batch; the scheduler's
general path runs until every running request decodes again and a new batch is built.

The arrays mirror the requests: ``positions[i] == reqs[i].num_computed_tokens`` and, between
steps, ``next_tokens[i] == reqs[i].all_token_ids[-1]``. ``check`` verifies it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from shoal.runtime.scheduler.request import Request


class DecodeBatch:
    __slots__ = ("reqs", "req_ids", "versions", "table_rows", "positions", "next_tokens",
                 "steps_left", "stop_ids", "logprob_rows")

    def __init__(self, reqs: list[Request], table_rows: Sequence[int],
                 max_model_len: int) -> None:
        self.reqs = reqs
        self.req_ids = [r.req_id for r in reqs]
        self.versions = [r.version for r in reqs]
        self.table_rows = np.asarray(table_rows, dtype=np.int64)
        self.positions = np.asarray([r.num_computed_tokens for r in reqs], dtype=np.int64)
        self.next_tokens = np.asarray([r.all_token_ids[-1] for r in reqs], dtype=np.int64)
        # steps until max_tokens or max_model_len: a row reaching 0 may be done
        self.steps_left = np.asarray(
            [min(r.max_tokens - len(r.output_token_ids), max_model_len - len(r.all_token_ids))
             for r in reqs], dtype=np.int64)
        # any token that may stop some row; check_stop decides for the row that sampled it
        self.stop_ids = np.asarray(sorted(set().union(*(r.maybe_stop_ids for r in reqs))),
                                   dtype=np.int64)
        self.logprob_rows = [i for i, r in enumerate(reqs) if r.logprobs_k is not None]

    @classmethod
    def of_running(cls, running: list[Request], table_rows: dict[str, int],
                   max_model_len: int) -> DecodeBatch | None:
        """The batch of ``running`` if every request is decoding (every token but the
        last computed), else None."""
        if not running:
            return None
        for req in running:
            if req.num_computed_tokens != len(req.all_token_ids) - 1:
                return None
        return cls(list(running), [table_rows[r.req_id] for r in running], max_model_len)

    def __len__(self) -> int:
        return len(self.reqs)

    def rows_needing_a_block(self, block_size: int) -> list[int]:
        """Rows whose next token starts a new block (the others write into the block their
        previous token is in)."""
        return np.flatnonzero(self.positions % block_size == 0).tolist()

    def advance(self) -> None:
        """Every row was scheduled one token: its requests and positions move on."""
        for req in self.reqs:
            req.num_computed_tokens += 1
        self.positions += 1

    def absorb(self, sampled: np.ndarray) -> list[int]:
        """Record one sampled token per row; the rows that may have finished (a stop id,
        max_tokens or max_model_len), for ``check_stop`` to decide."""
        self.next_tokens = np.array(sampled, dtype=np.int64)
        self.steps_left -= 1
        maybe_done = self.steps_left <= 0
        if self.stop_ids.size:
            maybe_done |= np.isin(self.next_tokens, self.stop_ids)
        return np.flatnonzero(maybe_done).tolist()

    def drop(self, rows: list[int]) -> None:
        """Remove finished rows. Lists are replaced, not mutated: a step still referring to
        the old ones keeps them intact."""
        keep = np.ones(len(self.reqs), dtype=bool)
        keep[rows] = False
        gone = set(rows)
        self.reqs = [r for i, r in enumerate(self.reqs) if i not in gone]
        self.req_ids = [r for i, r in enumerate(self.req_ids) if i not in gone]
        self.versions = [v for i, v in enumerate(self.versions) if i not in gone]
        self.table_rows = self.table_rows[keep]
        self.positions = self.positions[keep]
        self.next_tokens = self.next_tokens[keep]
        self.steps_left = self.steps_left[keep]
        new_index = np.cumsum(keep) - 1
        self.logprob_rows = [int(new_index[i]) for i in self.logprob_rows if i not in gone]

    def check(self, running: list[Request], table_rows: dict[str, int],
              max_model_len: int) -> None:
        """Raise AssertionError unless the arrays mirror the running requests (between
        steps; tests call it after every step through the scheduler's invariant check)."""
        if len(self.reqs) != len(running) or any(
                a is not b for a, b in zip(self.reqs, running, strict=True)):
            raise AssertionError("decode batch rows are not the running requests")
        fresh = DecodeBatch(running, [table_rows[r.req_id] for r in running], max_model_len)
        for name in ("req_ids", "versions", "logprob_rows"):
            if getattr(self, name) != getattr(fresh, name):
                raise AssertionError(f"decode batch {name} is stale")
        for name in ("table_rows", "positions", "next_tokens", "steps_left"):
            if not np.array_equal(getattr(self, name), getattr(fresh, name)):
                raise AssertionError(f"decode batch {name} is stale")
        if not set(fresh.stop_ids.tolist()) <= set(self.stop_ids.tolist()):
            raise AssertionError("decode batch misses a stop id")
        if any(r.num_computed_tokens != len(r.all_token_ids) - 1 for r in running):
            raise AssertionError("decode batch holds a request that is not decoding")
