"""Fault injection for the isolation and rank-failure tests, loaded into the engine's
processes as a debug plugin (``SHOAL_DEBUG_PLUGINS``, runtime/debug_plugins.py). Each fault
is armed by its own variable, read when the hook runs, so the plugin is inert elsewhere:

- ``SHOAL_TEST_FAULT_SALT_MARKER``: a request whose cache salt contains it makes every step
  it is in raise (the engine must fail that request alone);
- ``SHOAL_TEST_RANK_FAULT="RANK:PHASE"``: that rank fails while loading (``load``) or on its
  first plan (``step``).
"""

from __future__ import annotations

import os
from typing import Any

from shoal.runtime import debug_plugins

SALT_MARKER_ENV = "SHOAL_TEST_FAULT_SALT_MARKER"
RANK_FAULT_ENV = "SHOAL_TEST_RANK_FAULT"


class Faults(debug_plugins.EngineHooks):
    def __init__(self) -> None:
        self.faulty: set[str] = set()

    def request_added(self, request: Any) -> None:
        marker = os.environ.get(SALT_MARKER_ENV)
        if marker and marker in (request.cache_salt or ""):
            self.faulty.add(request.request_id)

    def requests_gone(self, request_ids: list[str]) -> None:
        self.faulty.difference_update(request_ids)

    def before_step(self, plan: Any) -> None:
        if self.faulty and not self.faulty.isdisjoint(plan.req_ids):
            raise RuntimeError("injected per-request fault (test plugin)")

    def rank_started(self, rank: int) -> None:
        self._rank_fault(rank, "load")

    def before_rank_step(self, rank: int, plan: Any) -> None:
        self._rank_fault(rank, "step")

    @staticmethod
    def _rank_fault(rank: int, phase: str) -> None:
        spec = os.environ.get(RANK_FAULT_ENV, "")
        if spec == f"{rank}:{phase}":
            raise RuntimeError(f"injected {phase} fault on rank {rank} ({RANK_FAULT_ENV}={spec})")


debug_plugins.register(Faults())
