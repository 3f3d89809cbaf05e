"""Per-request state of a hybrid model's linear-attention layers: slots, and their tensors.

A Gated DeltaNet layer keeps, per request, a conv window and a recurrent state instead of
KV blocks. ``StateCache`` holds them for every linear layer as ``[max_num_seqs, ...]``
tensors and ``assign`` maps the step's rows to slots:

- a request takes a free slot the first step it runs after admission (a fresh request, or a
  preempted one re-admitted for recompute) and keeps it while it runs;
- it lets go when the plan lists it in ``finished_req_ids``, which the scheduler sends for
  finished, aborted *and preempted* requests, so at most ``max_num_seqs`` (the running
  batch's bound) hold a slot at once;
- a row whose first token this step is position 0 starts from a zeroed state: its slot
  carries nothing over from an earlier holder, and a recompute after preemption starts
  over exactly as the first run did.

Why no prefix caching for these models: a cached prefix's KV blocks exist, but the
recurrent state at the end of that prefix was never kept, so a hit could not resume the
linear layers (the engine turns prefix caching off for them, with a log line).
"""

from __future__ import annotations

import numpy as np
import torch
from shoal.runtime.model.linear_attn_config import STATE_DTYPE, LinearAttnConfig


class StateCache:
    def __init__(self, lin: LinearAttnConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_slots}")
        self.num_slots = num_slots
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            i: (torch.zeros((num_slots, *lin.conv_state_shape()), dtype=dtype, device=device),
                torch.zeros((num_slots, *lin.recurrent_state_shape()), dtype=STATE_DTYPE,
                            device=device))
            for i, linear in enumerate(lin.linear_layers) if linear}
        self.bytes_per_request = lin.state_bytes_per_request(dtype)
        self._slot_of: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_held(self) -> int:
        return len(self._slot_of)

    def release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            slot = self._slot_of.pop(req_id, None)
            if slot is not None:
                self._free.append(slot)

    def assign(self, req_ids: list[str], first_positions: np.ndarray) -> list[int]:
        """Each row's slot (taking free ones for rows new to the cache); rows starting at
        position 0 get their state zeroed."""
        slots = []
        for req_id in req_ids:
            slot = self._slot_of.get(req_id)
            if slot is None:
                if not self._free:
                    raise RuntimeError(f"no free linear-attention state slot for {req_id!r}: "
                                       f"{self.num_slots} slots (max_num_seqs) are all held")
                slot = self._slot_of[req_id] = self._free.pop()
            slots.append(slot)
        fresh = [s for s, p in zip(slots, first_positions.tolist(), strict=True) if p == 0]
        if fresh:
            index = torch.tensor(fresh, dtype=torch.int64)
            for conv, recurrent in self.layers.values():
                conv.index_fill_(0, index.to(conv.device), 0)
                recurrent.index_fill_(0, index.to(recurrent.device), 0)
        return slots
