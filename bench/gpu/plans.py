"""Step plans for driving a Worker directly, without the scheduler (decode timing).

Each request owns a fixed run of blocks; prompts are prefilled in chunks under a token
budget, then every step decodes one token for every request.
"""

from __future__ import annotations

import numpy as np
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.plan import NewRequestData, StepPlan


class DirectBatch:
    def __init__(self, req_ids: list[str], prompts: list[list[int]], max_len: int, block_size: int,
                 first_block: int = 0) -> None:
        self.req_ids = req_ids
        self.prompts = prompts
        self.block_size = block_size
        per_req = -(-max_len // block_size)
        starts = first_block + per_req * np.arange(len(req_ids))
        self.block_tables = (starts[:, None] + np.arange(per_req)[None, :]).astype(np.int32)
        self.lengths = [0] * len(req_ids)  # tokens in the cache per request
        self.last_tokens = [p[-1] for p in prompts]
        self.step_id = 0
        self.params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=None)

    @property
    def blocks_used(self) -> int:
        return int(self.block_tables.max()) + 1

    def _slots(self, row: int, positions: np.ndarray) -> np.ndarray:
        blocks = self.block_tables[row, positions // self.block_size].astype(np.int64)
        return blocks * self.block_size + positions % self.block_size

    def _plan(self, rows: list[tuple[int, list[int], bool]], new: list[NewRequestData],
              finished: list[str]) -> StepPlan:
        ids, positions, slots, starts, seq_lens, sample = [], [], [], [0], [], []
        for row, tokens, sample_row in rows:
            pos = np.arange(self.lengths[row], self.lengths[row] + len(tokens))
            ids.append(np.asarray(tokens, dtype=np.int64))
            positions.append(pos)
            slots.append(self._slots(row, pos))
            starts.append(starts[-1] + len(tokens))
            self.lengths[row] += len(tokens)
            seq_lens.append(self.lengths[row])
            sample.append(sample_row)
        self.step_id += 1
        return StepPlan(
            step_id=self.step_id,
            req_ids=[self.req_ids[row] for row, _, _ in rows],
            input_ids=np.concatenate(ids),
            positions=np.concatenate(positions).astype(np.int64),
            query_start_loc=np.asarray(starts, dtype=np.int32),
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            block_tables=self.block_tables[[row for row, _, _ in rows]],
            slot_mapping=np.concatenate(slots).astype(np.int64),
            sample_rows=np.asarray(sample, dtype=bool),
            new_requests=new,
            finished_req_ids=finished,
        )

    def prefill_plans(self, token_budget: int, finished: list[str] | None = None):
        """Yield plans that prefill every prompt, chunked to ``token_budget`` tokens a step."""
        pending = [(row, 0) for row in range(len(self.req_ids))]
        announced: set[int] = set()
        finished = list(finished or [])
        while pending:
            rows, new, budget = [], [], token_budget
            while pending and budget > 0:
                row, done = pending.pop(0)
                take = min(budget, len(self.prompts[row]) - done)
                complete = done + take == len(self.prompts[row])
                rows.append((row, self.prompts[row][done:done + take], complete))
                if row not in announced:
                    announced.add(row)
                    new.append(NewRequestData(self.req_ids[row], list(self.prompts[row]), [], self.params))
                if not complete:
                    pending.insert(0, (row, done + take))
                    break
                budget -= take
            yield self._plan(rows, new, finished)
            finished = []

    def decode_plan(self) -> StepPlan:
        return self._plan([(row, [self.last_tokens[row]], True) for row in range(len(self.req_ids))], [], [])

    def record(self, sampled: np.ndarray) -> None:
        """Feed a decode step's samples back as the next inputs."""
        self.last_tokens = [int(t) for t in sampled]
