"""Fault injection for the isolation and rank-failure tests, loaded into the engine's
processes as a debug plugin (``SHOAL_DEBUG_PLUGINS``, runtime/debug_plugins.py). Each fault
is armed by its own variable, read when the hook runs, so the plugin is inert elsewhere:

- ``SHOAL_TEST_FAULT_SALT_MARKER``: a request whose cache salt contains it makes every step
  it is in raise (the engine must fail that request alone);
- ``SHOAL_TEST_RANK_FAULT="RANK:PHASE"``: that rank fails while loading (``load``) or on its
  first plan (``step``);
- ``SHOAL_TEST_RANK_SLOW_STEP="RANK:SECONDS"``: that rank computes (a busy loop) for that long
  before its first plan that brings new requests: a step that runs long and is working;
- ``SHOAL_TEST_RANK_POISON_STOP``: a request with this string among its ``stop`` strings makes
  every step it is in raise on every tensor-parallel rank (what a request whose content trips
  the model or the sampler does: the ranks run the same inputs, so they fail alike).
"""

from __future__ import annotations

import os
import time
from typing import Any

from shoal.runtime import debug_plugins

SALT_MARKER_ENV = "SHOAL_TEST_FAULT_SALT_MARKER"
RANK_FAULT_ENV = "SHOAL_TEST_RANK_FAULT"
RANK_POISON_ENV = "SHOAL_TEST_RANK_POISON_STOP"
RANK_SLOW_ENV = "SHOAL_TEST_RANK_SLOW_STEP"


class Faults(debug_plugins.EngineHooks):
    def __init__(self) -> None:
        self.faulty: set[str] = set()
        self.poisoned: set[str] = set()  # on a rank: requests whose stop strings carry it
        self.slowed = False  # on a rank: its slow step has run

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
        self._slow_step(rank, plan)
        self.poisoned.difference_update(plan.finished_req_ids)
        marker = os.environ.get(RANK_POISON_ENV)
        if marker:
            self.poisoned.update(new.req_id for new in plan.new_requests
                                 if marker in new.sampling_params.stop)
        if self.poisoned and not self.poisoned.isdisjoint(plan.req_ids):
            raise RuntimeError(f"injected content fault on rank {rank} (test plugin)")

    def _slow_step(self, rank: int, plan: Any) -> None:
        target, _, seconds = os.environ.get(RANK_SLOW_ENV, "").partition(":")
        if self.slowed or target != str(rank) or not plan.new_requests:
            return
        self.slowed = True
        end = time.process_time() + float(seconds)  # CPU seconds: as long on a busy machine
        while time.process_time() < end:
            pass

    @staticmethod
    def _rank_fault(rank: int, phase: str) -> None:
        spec = os.environ.get(RANK_FAULT_ENV, "")
        if spec == f"{rank}:{phase}":
            raise RuntimeError(f"injected {phase} fault on rank {rank} ({RANK_FAULT_ENV}={spec})")


debug_plugins.register(Faults())
