"""Failure isolation: a step that raises fails the request that caused it, not the engine.

A step runs many requests at once, so an exception does not say whose data tripped it. When
a step with one request fails, that request fails alone (its blocks freed, a 400 to its
stream: run alone, its content is the cause). When a step with several fails, all of them become suspects: they are preempted
(recomputed later, their outputs kept) and the scheduler runs with ``max_num_seqs = 1``
until every suspect has run one step alone, so a second failure names its culprit exactly.
Real engine faults stay fatal: out of memory, a failed rank, an executor whose health check
fails after the error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.runtime.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class RequestFailure:
    """One request failed inside the engine. ``param`` set: its content is the cause (it
    failed alone, or its grammar did not compile), a 400 naming it; None: a generic 500. The
    log has the rest."""

    request_id: str
    message: str
    param: str | None = None


def is_engine_fault(exc: BaseException) -> bool:
    """Faults no request can be blamed for (the caller also checks the executor's health)."""
    if isinstance(exc, MemoryError):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"OutOfMemoryError", "RankFailure"})


@dataclass
class StepIsolation:
    scheduler: Scheduler
    suspects: set[str] = field(default_factory=set)
    saved_max_num_seqs: int | None = None

    def step_failed(self, req_ids: list[str], finished_for_worker: list[str]
                    ) -> list[RequestFailure]:
        """Contain a failed step; returns the requests that are failed now."""
        if len(req_ids) == 1:
            self.suspects.discard(req_ids[0])
            self.scheduler.revoke([], finished_for_worker)
            self.scheduler.abort_requests(req_ids)
            self._restore_if_cleared()
            # it failed alone: its content is the cause, so a 4xx (SDKs retry a 5xx, and
            # through a router the retry would land on, and fail, another replica)
            return [RequestFailure(req_ids[0], f"request {req_ids[0]} failed in the engine "
                                   "when run alone; the details are in the server log",
                                   param="request")]
        self.suspects.update(req_ids)
        self.scheduler.revoke(req_ids, finished_for_worker)
        if self.saved_max_num_seqs is None:
            self.saved_max_num_seqs = self.scheduler.config.max_num_seqs
            self.scheduler.config.max_num_seqs = 1
        return []

    def step_succeeded(self, req_ids: list[str]) -> None:
        if self.suspects:
            self.suspects.difference_update(req_ids)
            self._restore_if_cleared()

    def forget(self, req_ids: list[str]) -> None:
        """Aborted or finished requests are no longer suspects."""
        if self.suspects:
            self.suspects.difference_update(req_ids)
            self._restore_if_cleared()

    def _restore_if_cleared(self) -> None:
        live = {r for r in self.suspects if r in self.scheduler.requests}
        self.suspects = live
        if not live and self.saved_max_num_seqs is not None:
            self.scheduler.config.max_num_seqs = self.saved_max_num_seqs
            self.saved_max_num_seqs = None
