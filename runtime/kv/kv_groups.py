"""KV cache groups: how a model whose layers attend differently shares one block pool.

A model whose attention layers all see the same positions (every layer full, or every layer
the same window) has one group: a request's one block table serves every layer. A mixed
model (Gemma 2's 1:1 and Gemma 3's 5:1 local:global layers, gpt-oss, Cohere2) has layers of
each kind: a sliding layer needs only the window's blocks, a full layer every block, so one
table shared by all layers keeps every block for every layer. vLLM's hybrid KV cache manager
splits the layers into groups instead, each with its own block table per request, all
drawing from one pool of equal-sized pages; that is the layout here (its facts, not its
code):

- layers are grouped by window (the full-attention kind first, so group 0 is the kind a
  prefix-cache hit, a KV event and the router speak of), each kind cut into groups of
  ``slots`` layers, where ``slots`` is the smallest kind's layer count (a kind that does not
  divide evenly leaves its last group short: those slots are padding);
- a worker allocates ``slots`` K/V tensor pairs of ``num_blocks`` blocks; layer ``j`` of
  every group uses tensor pair ``j``. Groups hold disjoint block ids from the one pool, so
  layers sharing a tensor never write the same block;
- a block is therefore ``slots`` layers' worth of K/V, and a request holds, per group, the
  blocks that group's layers read: the full group all of them, a sliding group its window's.

Gemma 3 (26 layers, 4 full): slots 4, seven groups; a long request holds its length once
(4 layers) plus six windows (4 layers each), against its length 26 times with one table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window (None: full attention)
    layer_group: tuple[int, ...]  # per model layer: its group (-1: no KV, e.g. linear)
    layer_slot: tuple[int, ...]  # per model layer: its K/V tensor pair (-1: no KV)
    slots: int  # K/V tensor pairs a worker allocates: layers per group

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """More than one group: per-group block tables on the scheduler and the worker."""
        return len(self.windows) > 1

    def layers_of(self, group: int) -> int:
        """Model layers in the group (padding slots excluded)."""
        return sum(1 for g in self.layer_group if g == group)

    def describe(self) -> str:
        kinds: dict[int | None, list[int]] = {}
        for g, window in enumerate(self.windows):
            kinds.setdefault(window, []).append(g)
        parts = [f"{'full attention' if w is None else f'window {w}'}: "
                 f"{sum(self.layers_of(g) for g in gs)} layers in {len(gs)} group(s)"
                 for w, gs in kinds.items()]
        return "; ".join(parts) + f"; {self.slots} layer(s) per block"


def plan_kv_groups(layer_windows: Sequence[int | None],
                   has_kv: Sequence[bool] | None = None, split: bool = True) -> KVGroups:
    """The groups of a model with these per-layer windows; ``has_kv[i]`` False for a layer
    that keeps no paged K/V (linear attention). ``split`` False: one group whatever the
    windows (its window None unless every layer shares one), as before groups existed."""
    kv_layers = [i for i in range(len(layer_windows)) if has_kv is None or has_kv[i]]
    layer_group = [-1] * len(layer_windows)
    layer_slot = [-1] * len(layer_windows)
    kinds: dict[int | None, list[int]] = {}
    for i in kv_layers:
        kinds.setdefault(layer_windows[i], []).append(i)
    if not split or len(kinds) <= 1:
        for slot, i in enumerate(kv_layers):
            layer_group[i], layer_slot[i] = 0, slot
        only = next(iter(kinds)) if len(kinds) == 1 else None
        return KVGroups((only,), tuple(layer_group), tuple(layer_slot), max(len(kv_layers), 1))
    slots = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full first, then by window
    windows: list[int | None] = []
    for window in order:
        layers = kinds[window]
        for start in range(0, len(layers), slots):
            for slot, i in enumerate(layers[start:start + slots]):
                layer_group[i], layer_slot[i] = len(windows), slot
            windows.append(window)
    return KVGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), slots)
