"""The router's view of which prefix blocks one replica holds.

Keys are chained (key i stands for the whole prefix up to block i), so a request's match
on a replica is the count of its leading keys present there, stopping at the first miss.

Approximate mode fills the view from the router's own routing history, bounded by an LRU
(the engine evicts too; the router cannot see it). Precise mode fills it from the engine's
KV events (stored / removed / cleared), so it follows the real cache; what the router has
just routed but the engine has not yet reported is kept as *pending* for a few seconds so
that a burst of same-prefix requests does not scatter before the first one's blocks land.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_APPROX_CAPACITY = 50_000
DEFAULT_PENDING_TTL_S = 5.0


class BlockIndex:
    def __init__(self, precise: bool, capacity: int = DEFAULT_APPROX_CAPACITY,
                 pending_ttl_s: float = DEFAULT_PENDING_TTL_S) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.precise = precise
        self.capacity = capacity
        self.pending_ttl_s = pending_ttl_s
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._pending: dict[int, float] = {}  # precise mode: key -> expiry (monotonic seconds)

    def __len__(self) -> int:
        return len(self._blocks)

    def blocks(self) -> frozenset[int]:
        """Blocks the replica is known to hold (events in precise mode; history otherwise)."""
        return frozenset(self._blocks)

    def match_length(self, keys: Sequence[int], now: float) -> int:
        matched = 0
        for key in keys:
            if key in self._blocks:
                matched += 1
                continue
            expiry = self._pending.get(key)
            if expiry is None or expiry < now:
                break
            matched += 1
        return matched

    def record_routed(self, keys: Sequence[int], now: float) -> None:
        """The router just sent a request with these keys to this replica."""
        if self.precise:
            expiry = now + self.pending_ttl_s
            for key in keys:
                if key not in self._blocks:
                    self._pending[key] = expiry
            if len(self._pending) > self.capacity:
                self._pending = {k: e for k, e in self._pending.items() if e >= now}
            return
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def stored(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._blocks[key] = None
            self._pending.pop(key, None)

    def removed(self, keys: Iterable[int]) -> None:
        for key in keys:
            self._blocks.pop(key, None)
            self._pending.pop(key, None)

    def cleared(self) -> None:
        self._blocks.clear()
        self._pending.clear()
