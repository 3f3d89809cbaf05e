"""Scale from zero at the router: requests that find no ready replica wait for one.

With ``--hold-timeout`` > 0, a request arriving while no replica is ready is held (at most
``--hold-queue`` of them holding at most ``--hold-queue-bytes`` of request bodies together;
one more is refused at once with 503 and Retry-After) instead of answered 503. The first
held request asks for capacity (``capacity_request.py``: an annotation on the
InferenceService that the operator watches), again every ``ask_interval_s`` while requests
wait. The moment the replica pool sees a replica pass ``/ready``, every held request is
released into the normal routing path, in arrival order, each exactly once (it is the same
request object the proxy then forwards; nothing is replayed). A request still held at the
timeout gets 503 with ``Retry-After``; a client that leaves while held is simply dropped
from the queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shoal.runtime.router.replicas.capacity_request import CapacityAsker
from shoal.runtime.router.replicas.pool import ReplicaPool

log = logging.getLogger("shoal.router.hold")


@dataclass(frozen=True)
class HoldSettings:
    timeout_s: float = 0.0  # 0: no holding, 503 at once as before
    max_held: int = 256
    max_held_bytes: int = 256 << 20  # request bodies held together (a held request keeps its)
    retry_after_s: int = 5
    ask_interval_s: float = 10.0  # re-ask for capacity this often while requests wait

    def __post_init__(self) -> None:
        if self.timeout_s < 0 or self.max_held < 1 or self.ask_interval_s <= 0 or \
                self.max_held_bytes < 1:
            raise ValueError("hold timeout must be >= 0, the hold queue and its bytes >= 1")


@dataclass(frozen=True)
class HoldRefused:
    message: str
    retry_after_s: int


class CapacityHold:
    def __init__(self, pool: ReplicaPool, settings: HoldSettings,
                 ask_capacity: Callable[[], Awaitable[None]] | None = None) -> None:
        self.pool = pool
        self.settings = settings
        self.asker = CapacityAsker(ask_capacity, settings.ask_interval_s) \
            if ask_capacity is not None else None
        self.held = 0
        self.held_bytes = 0
        self.released = 0
        self.timed_out = 0
        self.first_held_at: float | None = None  # monotonic; for the time-to-capacity figure
        self._wakeup: asyncio.Event | None = None
        pool.on_ready.append(self._replica_ready)

    @property
    def enabled(self) -> bool:
        return self.settings.timeout_s > 0

    def _replica_ready(self, url: str) -> None:
        if self._wakeup is not None:
            self._wakeup.set()  # every waiter of this generation wakes
            self._wakeup = None

    async def wait_for_replica(self, body_bytes: int = 0) -> HoldRefused | None:
        """None once a replica is ready (at once if one already is), else why not.
        ``body_bytes``: what the waiting request keeps in memory while it is held."""
        if self.pool.available():
            return None
        if self.held >= self.settings.max_held:
            return HoldRefused(f"no ready replica and {self.held} requests already wait for "
                               "one", self.settings.retry_after_s)
        if self.held_bytes + body_bytes > self.settings.max_held_bytes:
            return HoldRefused(f"no ready replica and the requests waiting for one already "
                               f"hold {self.held_bytes} bytes", self.settings.retry_after_s)
        deadline = time.monotonic() + self.settings.timeout_s
        self.held += 1
        self.held_bytes += body_bytes
        if self.first_held_at is None:
            self.first_held_at = time.monotonic()
        try:
            while not self.pool.available():
                if self.asker is not None:
                    self.asker.ask()
                left = deadline - time.monotonic()
                if left <= 0:
                    self.timed_out += 1
                    return HoldRefused(f"no replica became ready within "
                                       f"{self.settings.timeout_s:g} s",
                                       self.settings.retry_after_s)
                if self._wakeup is None:
                    self._wakeup = asyncio.Event()
                wakeup = self._wakeup
                try:  # woken by a replica turning ready; re-asks while the wait goes on
                    await asyncio.wait_for(wakeup.wait(),
                                           min(left, self.settings.ask_interval_s))
                except TimeoutError:
                    pass
            self.released += 1
            return None
        finally:
            self.held -= 1
            self.held_bytes -= body_bytes
            if self.held == 0:
                self.first_held_at = None
