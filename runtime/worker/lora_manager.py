"""The worker's adapters: which are registered, which are kept parsed in memory (LRU,
``--max-cpu-loras``), which sit in the ``--max-loras`` slots the step computes with.

The scheduler never runs more distinct adapters in one step than there are slots
(``scheduler/lora_admission.py``), so ``prepare`` always finds a slot for each: one already
holding the adapter, a free one, or the one least recently used by a step that this step does
not use. A slot is filled from the parsed copy, or from the adapter's files again when that
copy was evicted. Slots are taken lowest first so that the step computes over few of them.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from shoal.runtime.model.lora import LoraModel
from shoal.runtime.model.lora_adapter import LoraAdapterError, LoraWeights, load_peft_adapter
from shoal.runtime.wire.plan import StepPlan


class LoraManager:
    def __init__(self, lora: LoraModel, num_layers: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.lora = lora
        self.num_layers = num_layers
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = device
        self.paths: dict[str, str] = {}  # registered adapters
        self.parsed: OrderedDict[str, LoraWeights] = OrderedDict()  # LRU, newest last
        self.slots: list[str | None] = [None] * lora.max_loras
        self.slot_last_step = [-1] * lora.max_loras
        self.request_adapter: dict[str, str] = {}  # live request id -> its adapter
        self.slot_loads = 0  # slot fills so far (tests read it)

    # -- registry ---------------------------------------------------------------------
    def add(self, name: str, path: str) -> LoraWeights:
        """Parse and check the adapter (``LoraAdapterError`` naming why) and register it."""
        if name in self.paths:
            raise LoraAdapterError(f"The lora adapter '{name}' has already been loaded.")
        weights = self._parse(name, path)
        self.paths[name] = path
        self._keep(weights)
        return weights

    def remove(self, name: str) -> None:
        """Forget it (the engine core calls this once no request uses it)."""
        if self.paths.pop(name, None) is None:
            raise KeyError(name)
        self.parsed.pop(name, None)
        for slot, held in enumerate(self.slots):
            if held == name:
                self._clear(slot)

    def _parse(self, name: str, path: str) -> LoraWeights:
        return load_peft_adapter(name, path, self.lora, self.num_layers, self.dtype)

    def _keep(self, weights: LoraWeights) -> None:
        self.parsed[weights.name] = weights
        self.parsed.move_to_end(weights.name)
        while len(self.parsed) > self.max_cpu_loras:
            self.parsed.popitem(last=False)

    # -- requests ---------------------------------------------------------------------
    def track(self, req_id: str, adapter: str | None) -> None:
        if adapter is not None:
            if adapter not in self.paths:
                raise RuntimeError(f"request {req_id} names adapter {adapter!r}, which is "
                                   "not loaded")
            self.request_adapter[req_id] = adapter

    def forget(self, req_id: str) -> None:
        self.request_adapter.pop(req_id, None)

    # -- the step ---------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> None:
        """Put the step's adapters in slots and tell the LoRA layers each token's slot."""
        state = self.lora.state
        adapters = self.request_adapter
        row_adapters = [adapters.get(rid) for rid in plan.req_ids] if adapters else []
        if not any(row_adapters):
            state.set_step(None, 0)
            return
        wanted = {a for a in row_adapters if a is not None}
        slot_of = {name: self._slot_for(name, wanted, plan.step_id) for name in wanted}
        row_slots = np.array([slot_of[a] if a is not None else -1 for a in row_adapters],
                             dtype=np.int64)
        counts: np.ndarray = np.diff(np.asarray(plan.query_start_loc, dtype=np.int64))
        token_slots = torch.from_numpy(np.repeat(row_slots, counts)).to(self.device)
        state.set_step(token_slots, max(slot_of.values()) + 1)

    def _slot_for(self, name: str, wanted: set[str], step_id: int) -> int:
        slots = self.slots
        if name in slots:
            slot = slots.index(name)
        else:
            free = [i for i, held in enumerate(slots) if held is None]
            idle = [i for i, held in enumerate(slots) if held not in wanted]
            if not free and not idle:
                raise RuntimeError(f"step {step_id} needs more than {len(slots)} adapter "
                                   "slots (the scheduler admits at most --max-loras)")
            slot = free[0] if free else min(idle, key=lambda i: self.slot_last_step[i])
            self._fill(slot, name)
        self.slot_last_step[slot] = step_id
        return slot

    def _fill(self, slot: int, name: str) -> None:
        weights = self.parsed.get(name)
        if weights is None:  # evicted from memory: read its files again
            weights = self._parse(name, self.paths[name])
        self._keep(weights)
        self._clear(slot)
        for module in weights.modules:
            target = self.lora.targets[(module.layer, module.name)]
            target.layer.set_target(slot, target.blocks, module.lora_a.to(self.device),
                                    module.scaled_b_t.to(self.device))
        self.slots[slot] = name
        self.slot_loads += 1

    def _clear(self, slot: int) -> None:
        for layer in self.lora.layers:
            layer.clear_slot(slot)
        self.slots[slot] = None
