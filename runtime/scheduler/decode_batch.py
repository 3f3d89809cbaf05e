"""The steady decode batch: per-row arrays kept across steps for the leading running
requests that decode one token per step.

A decoding request's step is predictable: it feeds the token it sampled last at the next
position. So the scheduler plans those rows with a few numpy operations on these arrays
instead of a Python pass over them; only rows that cross a block boundary touch the KV
manager, and stop conditions are checked on arrays, looking closer only at rows that may be
done. The batch is always a prefix of the scheduler's running list: requests join at its end
once they decode (a prefill that completes, in running order), finished rows are compacted
away, and whatever else revokes a row's state (preemption, abort, a step without room for
every row) makes the scheduler start a new, empty batch. Lists are replaced, never mutated,
so a step in flight keeps the rows it was planned with.

A row has always produced its first output before it joins (the step that completed its
prompt sampled it), so first-output bookkeeping stays on the general path.

The arrays mirror the requests: ``positions[i] == reqs[i].num_computed_tokens`` and, between
steps, ``next_tokens[i] == reqs[i].all_token_ids[-1]``; ``check`` verifies it.
"""

from __future__ import annotations

from itertools import compress

import numpy as np
from shoal.runtime.engine.messages import EngineCoreOutput
from shoal.runtime.kv.kv_manager import KVCacheManager
from shoal.runtime.plan import StepResult
from shoal.runtime.scheduler.request import Request
from shoal.runtime.scheduler.row_logprobs import row_logprobs

_EMPTY = np.zeros(0, dtype=np.int64)


class DecodeBatch:
    __slots__ = ("max_model_len", "reqs", "req_ids", "versions", "table_rows", "positions",
                 "next_tokens", "steps_left", "stop_ids", "logprob_rows")

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.reqs: list[Request] = []
        self.req_ids: list[str] = []
        self.versions: list[int] = []
        self.table_rows = _EMPTY  # the KV manager's block-table row of each request
        self.positions = _EMPTY
        self.next_tokens = _EMPTY
        self.steps_left = _EMPTY  # steps until max_tokens or max_model_len: at 0 it may be done
        self.stop_ids = _EMPTY  # tokens that may stop some row; check_stop decides per row
        self.logprob_rows: list[int] = []

    def __len__(self) -> int:
        return len(self.reqs)

    @staticmethod
    def is_decoding(req: Request) -> bool:
        return req.num_computed_tokens == len(req.all_token_ids) - 1

    def extend(self, reqs: list[Request], table_rows: list[int]) -> None:
        """Append decoding requests as rows."""
        start = len(self.reqs)
        self.reqs = self.reqs + reqs
        self.req_ids = self.req_ids + [r.req_id for r in reqs]
        self.versions = self.versions + [r.version for r in reqs]
        self.logprob_rows = self.logprob_rows + [
            start + i for i, r in enumerate(reqs) if r.logprobs_k is not None]
        max_len = self.max_model_len
        self.table_rows = _append(self.table_rows, table_rows)
        self.positions = _append(self.positions, [r.num_computed_tokens for r in reqs])
        self.next_tokens = _append(self.next_tokens, [r.all_token_ids[-1] for r in reqs])
        self.steps_left = _append(self.steps_left, [
            min(r.max_tokens - len(r.output_token_ids), max_len - len(r.all_token_ids))
            for r in reqs])
        stops = set().union(*(r.maybe_stop_ids for r in reqs))
        if not stops <= set(self.stop_ids.tolist()):
            self.stop_ids = np.asarray(sorted(stops.union(self.stop_ids.tolist())), np.int64)

    # -- one step -----------------------------------------------------------------------
    def rows_starting_a_block(self, block_size: int) -> list[int]:
        """Rows whose next token starts a block (the others write into the block their
        previous token is in); after ``advance``: rows whose last block just filled."""
        return np.flatnonzero(self.positions % block_size == 0).tolist()

    def reserve_slots(self, kv: KVCacheManager, block_size: int) -> bool:
        """A KV slot for every row's next token, or False with no row given one."""
        rows = self.rows_starting_a_block(block_size)
        return not rows or kv.allocate_decode_slots(
            [self.req_ids[i] for i in rows], [self.reqs[i].num_computed_tokens for i in rows])

    def advance(self) -> None:
        """Every row was scheduled one token: its requests and positions move on."""
        for req in self.reqs:
            req.num_computed_tokens += 1
        self.positions += 1

    def absorb(self, result: StepResult, kv: KVCacheManager, block_size: int
               ) -> tuple[list[EngineCoreOutput], list[int]]:
        """Take the step's sampled tokens (the result's first ``len(self)`` rows): offer
        blocks that filled to the prefix cache, append each token to its request, and
        return one output per row plus the rows that may have finished (a stop id,
        max_tokens or max_model_len), for ``check_stop`` to decide."""
        num_rows = len(self.reqs)
        reqs = self.reqs
        if kv.enable_prefix_caching:
            filled = [reqs[i] for i in self.rows_starting_a_block(block_size)]
            kv.cache_filled_blocks(filled, [r.num_computed_tokens for r in filled])
        sampled = result.sampled_token_ids[:num_rows]
        outputs: list[EngineCoreOutput] = []
        add_output = outputs.append
        for req, version, token in zip(reqs, self.versions, sampled.tolist(), strict=True):
            req.all_token_ids.append(token)
            req.output_token_ids.append(token)
            add_output(EngineCoreOutput(request_id=req.req_id, version=version,
                                        new_token_ids=[token],
                                        num_cached_tokens=req.num_cached_tokens))
        for i in self.logprob_rows:
            outputs[i].new_logprobs = row_logprobs(result, i, reqs[i].logprobs_k)
        self.next_tokens = sampled.astype(np.int64)  # a copy: the result is not ours
        self.steps_left -= 1
        maybe_done = self.steps_left <= 0
        if self.stop_ids.size:
            maybe_done |= np.isin(self.next_tokens, self.stop_ids)
        return outputs, np.flatnonzero(maybe_done).tolist()

    def drop(self, rows: list[int]) -> None:
        """Remove finished rows."""
        keep = np.ones(len(self.reqs), dtype=bool)
        keep[rows] = False
        kept = keep.tolist()
        self.reqs = list(compress(self.reqs, kept))
        self.req_ids = list(compress(self.req_ids, kept))
        self.versions = list(compress(self.versions, kept))
        self.table_rows = self.table_rows[keep]
        self.positions = self.positions[keep]
        self.next_tokens = self.next_tokens[keep]
        self.steps_left = self.steps_left[keep]
        new_index = np.cumsum(keep) - 1
        self.logprob_rows = [int(new_index[i]) for i in self.logprob_rows if kept[i]]

    # -- invariants ---------------------------------------------------------------------
    def check(self, running: list[Request], table_rows: dict[str, int]) -> None:
        """Raise AssertionError unless the rows are a prefix of ``running`` and the arrays
        mirror them (between steps; tests call it after every step)."""
        reqs = running[:len(self.reqs)]
        if len(reqs) != len(self.reqs) or any(
                a is not b for a, b in zip(self.reqs, reqs, strict=True)):
            raise AssertionError("decode batch rows are not a prefix of the running requests")
        if not all(self.is_decoding(r) for r in reqs):
            raise AssertionError("decode batch holds a request that is not decoding")
        fresh = DecodeBatch(self.max_model_len)
        fresh.extend(reqs, [table_rows[r.req_id] for r in reqs])
        for name in ("req_ids", "versions", "logprob_rows"):
            if getattr(self, name) != getattr(fresh, name):
                raise AssertionError(f"decode batch {name} is stale")
        for name in ("table_rows", "positions", "next_tokens", "steps_left"):
            if not np.array_equal(getattr(self, name), getattr(fresh, name)):
                raise AssertionError(f"decode batch {name} is stale")
        if not set(fresh.stop_ids.tolist()) <= set(self.stop_ids.tolist()):
            raise AssertionError("decode batch misses a stop id")


def _append(array: np.ndarray, values: list[int]) -> np.ndarray:
    return np.concatenate([array, np.asarray(values, dtype=np.int64)])
