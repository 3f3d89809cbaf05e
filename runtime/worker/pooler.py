"""The pooling runner's step: each prompt's final hidden states (after the last norm, as
transformers' ``last_hidden_state``) reduced to one vector, LAST, MEAN or CLS.

A prompt may be prefilled in several chunks: MEAN keeps a running sum per request and CLS
the first position's state until the chunk that completes the prompt, whose row then
carries the vector. A request seen again in ``new_requests`` (a preemption recomputes it)
starts over. The vector is raw (float32 bytes); normalising and cutting dimensions are the
API's, per request.
"""

from __future__ import annotations

import numpy as np
import torch
from shoal.runtime.wire.plan import StepPlan


class PromptPooler:
    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}  # MEAN: (sum, tokens) / CLS

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._partial.pop(req_id, None)

    def pool(self, plan: StepPlan, hidden: torch.Tensor) -> dict[str, bytes]:
        """The vectors of the rows whose prompt completes this step (``sample_rows``)."""
        qsl = np.asarray(plan.query_start_loc).tolist()
        done = np.asarray(plan.sample_rows, dtype=bool).tolist()
        positions = plan.positions
        out: dict[str, bytes] = {}
        for row, req_id in enumerate(plan.req_ids):
            start, end = qsl[row], qsl[row + 1]
            if self.pooling_type == "LAST":
                if done[row]:
                    out[req_id] = _bytes(hidden[end - 1])
                continue
            if self.pooling_type == "CLS":
                if end > start and int(positions[start]) == 0:
                    self._partial[req_id] = (hidden[start].float().clone(), 1)
            else:
                total, count = self._partial.get(req_id, (None, 0))
                chunk = hidden[start:end].float().sum(dim=0)
                self._partial[req_id] = (chunk if total is None else total + chunk,
                                         count + end - start)
            if done[row]:
                vector, count = self._partial.pop(req_id)
                out[req_id] = _bytes(vector / count)
        return out


def _bytes(vector: torch.Tensor) -> bytes:
    return vector.float().cpu().numpy().astype(np.float32, copy=False).tobytes()
